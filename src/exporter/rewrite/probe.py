"""One eager forward pass that lists where attention is computed, before anything is traced.

A ``TorchFunctionMode`` sees every torch call the model's Python code makes (not
the calls inside a fused op), and forward hooks on each submodule give the
module path of each call. Two things are recorded:

- each ``scaled_dot_product_attention`` call (already fused: its module, shapes, mask, causal flag);
- each softmax over a tensor derived from a product of two activations (``q @ kᵀ``, ``bmm``,
  ``einsum``, ``baddbmm``): a candidate for the graph rule. A softmax over a linear layer's
  output (a router, a classifier) is not one, so such models are not traced for nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..modelio import IOModule

PRODUCTS = {"matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum"}
SOFTMAX = {"softmax", "_softmax", "special_softmax"}
SDPA = {"scaled_dot_product_attention"}
SDPA_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def is_sdpa(func) -> bool:
    """``F.scaled_dot_product_attention``, or the ATen op (``….default``) a rewritten graph calls."""
    return getattr(func, "__name__", "").split(".")[0] in SDPA


def sdpa_arguments(args: tuple, kwargs: dict) -> dict[str, Any]:
    """One SDPA call's arguments by name, defaults filled in."""
    return {**SDPA_DEFAULTS, **dict(zip(SDPA_PARAMETERS, args)), **kwargs}


@dataclass
class Call:
    path: str  # module path relative to the user's model ("" for the model itself)
    module_type: str
    function: str
    shapes: tuple[tuple[int, ...], ...]
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Observation:
    sdpa: list[Call] = field(default_factory=list)
    softmax_candidates: list[Call] = field(default_factory=list)
    error: str = ""


class _Recorder(TorchFunctionMode):
    def __init__(self, stack: list[tuple[str, str]], observation: Observation):
        super().__init__()
        self.stack = stack
        self.observation = observation
        self.derived: dict[int, weakref.ref] = {}  # tensors computed from an activation product, by id

    def _is_derived(self, t: torch.Tensor) -> bool:
        ref = self.derived.get(id(t))
        return ref is not None and ref() is t

    def _where(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else ("", "")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        path, kind = self._where()
        if is_sdpa(func):
            call = sdpa_arguments(args, kwargs)
            opts = {"is_causal": bool(call["is_causal"]), "masked": call["attn_mask"] is not None,
                    "enable_gqa": bool(call["enable_gqa"])}
            self.observation.sdpa.append(Call(path, kind, name, tuple(tuple(t.shape) for t in leaves[:3]), opts))
            return out
        derived = any(self._is_derived(t) for t in leaves)
        if name in SOFTMAX and derived:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            self.observation.softmax_candidates.append(
                Call(path, kind, name, tuple(tuple(t.shape) for t in leaves[:1]), {"dim": dim}))
        activations = [t for t in leaves if not isinstance(t, nn.Parameter) and t.dim() >= 2]
        if derived or (name in PRODUCTS and len(activations) >= 2):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.derived[id(t)] = weakref.ref(t)
        return out


def observe(io: IOModule, example: list[torch.Tensor]) -> Observation:
    """Run ``io`` once on ``example`` and record its SDPA calls and softmax-attention candidates."""
    observation = Observation()
    stack: list[tuple[str, str]] = []
    with contextlib.ExitStack() as exit_stack:
        for path, module in io.model.named_modules():
            entry = (path, type(module).__name__)

            def push(_module, _args, entry=entry):
                stack.append(entry)

            def pop(_module, _args, _out, entry=entry):
                if stack and stack[-1] == entry:
                    stack.pop()

            exit_stack.callback(module.register_forward_pre_hook(push).remove)
            exit_stack.callback(module.register_forward_hook(pop, always_call=True).remove)
        try:
            with torch.inference_mode(), _Recorder(stack, observation):
                io(*example)
        except Exception as exc:  # the graph rule reports it; the model may still trace
            observation.error = f"{type(exc).__name__}: {exc}"
    return observation
