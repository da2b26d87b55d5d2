"""Helpers shared by the rules: new module trees that share the original's weights, and output checks."""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn

from ..modelio import IOModule, make_io_module


def replace_submodules(root: nn.Module, replacements: dict[str, nn.Module]) -> nn.Module:
    """A new tree in which the module at each path of ``replacements`` is swapped; the original is untouched.

    Only the modules on the way from the root to a replaced module are copied, and shallowly: a copy keeps
    the original's ``_parameters`` and ``_buffers`` dicts (the same objects), so both trees hold the same
    tensors, and a ``.to()`` or an in-place cast of either is seen by both.
    """
    if "" in replacements:
        return replacements[""]
    children: dict[str, dict[str, nn.Module]] = {}
    for path, module in replacements.items():
        head, _, rest = path.partition(".")
        children.setdefault(head, {})[rest] = module
    new = copy.copy(root)
    new._modules = dict(root._modules)
    for name, below in children.items():
        child = root._modules[name]
        assert child is not None, name  # the path came from named_modules()
        new._modules[name] = replace_submodules(child, below)
    return new


def shallow_copy(module: nn.Module, cls: type | None = None, **attributes) -> nn.Module:
    """A copy of ``module`` holding the same parameters, buffers and children, optionally of a subclass."""
    new = copy.copy(module)
    if cls is not None:
        new.__class__ = cls
    for key, value in attributes.items():
        setattr(new, key, value)
    return new


def with_model(io: IOModule, model: nn.Module) -> IOModule:
    """The same calling convention as ``io`` over another model."""
    return make_io_module(model, io.signature, getattr(io, "attn_implementation", None))


def module_paths(model: nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules(remove_duplicate=False)}


def run(module: Callable, example: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [t.detach().clone() for t in module(*example)]


def tolerance(dtype: torch.dtype) -> float:
    """Relative L2 error allowed between a rewritten and an original run in ``dtype``."""
    if dtype in (torch.float16, torch.bfloat16):
        return 3e-2
    if dtype == torch.float64:
        return 1e-9
    return 1e-4


def compare(expected: list[torch.Tensor], got: list[torch.Tensor]) -> dict:
    """max abs and relative L2 error over all floating outputs (NaN where both are NaN counts as equal)."""
    if len(expected) != len(got):
        return {"ok": False, "max_abs_error": None, "rel_l2_error": None,
                "reason": f"{len(got)} outputs instead of {len(expected)}"}
    worst_abs, worst_rel, ok = 0.0, 0.0, True
    for a, b in zip(expected, got):
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"ok": False, "max_abs_error": None, "rel_l2_error": None,
                    "reason": f"output {tuple(b.shape)} {b.dtype} instead of {tuple(a.shape)} {a.dtype}"}
        if not a.is_floating_point():
            if not torch.equal(a, b):
                ok = False
                worst_abs = max(worst_abs, float((a.double() - b.double()).abs().max()))
            continue
        a64, b64 = a.double(), b.double()
        both_nan = a64.isnan() & b64.isnan()
        if bool((a64.isnan() ^ b64.isnan()).any()):
            return {"ok": False, "max_abs_error": float("nan"), "rel_l2_error": float("nan"),
                    "reason": "NaN where the original has none (or the reverse)"}
        diff = torch.where(both_nan, 0.0, a64 - b64)
        ref = torch.where(both_nan, 0.0, a64)
        abs_err = float(diff.abs().max()) if diff.numel() else 0.0
        rel = float(diff.norm() / ref.norm().clamp_min(1e-30)) if diff.numel() else 0.0
        worst_abs, worst_rel = max(worst_abs, abs_err), max(worst_rel, rel)
        if rel > tolerance(a.dtype):
            ok = False
    return {"ok": ok, "max_abs_error": worst_abs, "rel_l2_error": worst_rel, "reason": ""}
