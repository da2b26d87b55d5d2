"""What divergence localisation compares, module by module: tensors of a recorded call, the per-module bar.

Shared by the replay (:mod:`exporter.numerics.locate`) and the run through the exported program
(:mod:`exporter.numerics.locate_program`): a recorded module :class:`Call`, casting and pairing of its
tensors, the module-level verdict (the same rule as the model's outputs, with ``atol`` scaled to the
module's own output magnitude: :class:`ModuleFloor`), and hooks on submodules.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from ..attention_backend import backend_context
from ..modelio import IOModule, attention_implementation
from ..results import OutputCheck, ratio
from .tolerance import check_output, metrics


@dataclass
class Call:
    path: str  # module path inside the model (as in the attention audit)
    index: int  # n-th call of this module in the forward pass
    kind: str  # the module's class name
    args: tuple
    kwargs: dict
    output: Any


# --------------------------------------------------------------------------- tensors


def clone(tree):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def cast(tree, dtype: torch.dtype, device: str):
    """Floating tensors to ``dtype`` (clamped to its finite range: a float64 mask of finfo.min is finfo(dtype).min
    in a real run, not -inf), everything to ``device``."""
    info = torch.finfo(dtype)

    def cast(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_floating_point() and t.dtype != dtype:
            if torch.finfo(t.dtype).max > info.max:
                t = t.clamp(info.min, info.max)
            t = t.to(dtype)
        return t.to(device)

    return tree_map(cast, tree)


def floats(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def pair_by_shape(ref: list[torch.Tensor], got: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(index into ``ref``, tensor of ``got``) for each reference tensor that has a same-shaped partner."""
    if len(got) == len(ref) and all(r.shape == g.shape for r, g in zip(ref, got)):
        return list(enumerate(got))
    pairs, used = [], set()
    for index, r in enumerate(ref):
        same = [i for i, g in enumerate(got) if i not in used and tuple(g.shape) == tuple(r.shape)]
        if not same:
            continue
        # several of one shape (a rotary embedding's cos and sin): the nearest in value is the partner
        best = min(same, key=lambda i: distance(r, got[i])) if len(same) > 1 else same[0]
        used.add(best)
        pairs.append((index, got[best]))
    return pairs


def distance(ref: torch.Tensor, got: torch.Tensor) -> float:
    info = torch.finfo(got.dtype) if got.is_floating_point() else torch.finfo(torch.float64)
    r = ref.detach().to("cpu", torch.float64).clamp(info.min, info.max)
    value = float((r - got.detach().to("cpu", torch.float64)).pow(2).mean())
    return value if value == value else float("inf")


def paired(ref: list[torch.Tensor], pairs: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The paired tensors, flattened into one float64 vector each. A float64 mask of finfo(float64).min is
    finfo(dtype).min in a lower-precision run, not an error: the reference is clamped to the other's range."""
    r = torch.cat([ref[i].detach().reshape(-1).to("cpu", torch.float64).clamp(torch.finfo(t.dtype).min,
                                                                               torch.finfo(t.dtype).max)
                   for i, t in pairs])
    g = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for _, t in pairs])
    return r, g


def input_error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any] | None:
    """Error of ``got`` against ``ref`` over all the elements of the tensors that pair up by shape (float64).

    Two implementations may take different extra inputs (eager attention an additive float mask, SDPA a
    boolean one), so tensors are paired by shape and the report says how many paired.
    """
    pairs = pair_by_shape(ref, got)
    if not pairs:
        return None
    r, g = paired(ref, pairs)
    nonfinite = int((torch.isfinite(r) & ~torch.isfinite(g)).sum())
    m = metrics(r, g)
    return {"rmse": m["rmse"], "rel_l2": m["rel_l2"], "max_abs": m["max_abs"], "nonfinite": nonfinite,
            "matched": f"{len(pairs)} of {len(ref)} floating inputs (paired by shape)"}


def positions(tree) -> list[Any]:
    """The leaves of a module's output with their positions kept: None stays a slot (an SDPA attention returns
    None where eager attention returns its weights), so the outputs of two implementations line up."""
    if isinstance(tree, torch.Tensor) or tree is None:
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in positions(item)]
    if isinstance(tree, dict) or hasattr(tree, "keys"):
        try:
            return [leaf for key in tree.keys() for leaf in positions(tree[key])]
        except Exception:
            return []
    return [None]


class ModuleFloor:
    """The ``atol`` of a module's check, in that module's own units.

    The recipe's ``atol`` is in the units of the model's outputs. A module's output can be far smaller
    (an attention's output before the residual) or larger, so its floor is ``atol`` scaled by the RMS of its
    reference output over the RMS of the model's reference outputs. With an unscaled floor a defect whose
    absolute error stays under ``atol`` where it happens would only be seen downstream, after a norm
    layer has amplified it, and the wrong module would be named. The rule's rounding floor (``relative`` times
    the RMS of the reference output) is in each output's own units already.
    """

    def __init__(self, atol: float, outputs: list[torch.Tensor], relative: float = 0.0):
        self.atol = atol
        self.relative = relative
        floats = [t.detach().reshape(-1).to(torch.float64) for t in outputs
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        self.scale = float(torch.cat(floats).square().mean().sqrt()) if floats else 0.0

    def __call__(self, ref: torch.Tensor) -> float:
        if not ref.numel():
            return self.atol
        finite = ref[torch.isfinite(ref)].to(torch.float64)
        rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
        scaled = self.atol * rms / self.scale if self.scale > 0 else self.atol
        return scaled + self.relative * rms


def floor_for(atol: float | Callable[[torch.Tensor], float], ref: torch.Tensor) -> float:
    return atol(ref) if callable(atol) else atol


def compare(ref_tree, base_tree, cand_tree, k: float, atol) -> dict[str, Any] | None:
    """The module-level verdict over the floating outputs both sides produced: each must pass; the worst is reported.

    None when there is nothing to compare (no floating output, or a structure that does not line up).
    """
    ref, base, cand = positions(ref_tree), positions(base_tree), positions(cand_tree)
    if len(cand) != len(ref) or len(base) != len(ref):
        return None
    checks = [check_output(f"output {i}", 0, r, b, c, k, floor_for(atol, r))
              for i, (r, b, c) in enumerate(zip(ref, base, cand))
              if all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (r, b, c))]
    return verdict_of(checks) if checks else None


def verdict_of(checks: list[OutputCheck]) -> dict[str, Any]:
    worst = max(checks, key=ratio)
    return {"passed": all(c.passed for c in checks), "rmse": worst.rmse, "allowed_rmse": worst.allowed_rmse,
            "baseline_rmse": worst.baseline_rmse, "rel_l2": worst.rel_l2, "max_abs": worst.max_abs,
            "reason": worst.reason}


# --------------------------------------------------------------------------- running


@contextlib.contextmanager
def hooks_on(root: nn.Module, paths: set[str] | None, on_pre: Callable | None, on_post: Callable | None):
    """Forward (pre-)hooks on every submodule of ``root`` (or those in ``paths``), removed on exit."""
    handles = []
    try:
        for path, module in root.named_modules():
            if not path or (paths is not None and path not in paths):
                continue
            if on_pre is not None:
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, kw, p=path: on_pre(p, m, a, kw), with_kwargs=True))
            if on_post is not None:
                handles.append(module.register_forward_hook(
                    lambda m, a, kw, out, p=path: on_post(p, m, a, kw, out), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def run_context(io: IOModule, backend: str, device: str):
    stack = contextlib.ExitStack()
    stack.enter_context(attention_implementation(io.model, io.attn_implementation))
    stack.enter_context(backend_context(backend, device))
    return stack


def finding_of(call: Call, verdict: dict[str, Any], input_error: dict[str, Any] | None) -> dict[str, Any]:
    return {"module": call.path, "call": call.index, "class": call.kind,
            "output_error": {k: verdict[k] for k in ("rmse", "allowed_rmse", "baseline_rmse", "rel_l2", "max_abs",
                                                     "reason")},
            "input_error": input_error}


__all__ = ["Call", "ModuleFloor", "clone", "cast", "floats", "nbytes", "pair_by_shape", "paired",
           "input_error", "positions", "floor_for", "compare", "verdict_of", "hooks_on", "run_context", "finding_of"]
