"""Divergence localisation: the first module, in execution order, whose output diverges beyond tolerance.

Nothing is marked as an extra output (that would change the graph, its fusions,
and so the bug). Instead:

1. **Record.** The original model runs once in float64 on the CPU, on the
   failing sample, with forward hooks on every submodule: each call's inputs
   (args and kwargs) and output are kept, in the order the calls finish
   (children before their parent, so the first divergent call is the smallest
   module that diverges).
2. **Replay.** Each recorded call is replayed, in that order, on its recorded
   inputs cast to the candidate's dtype and device: once through the
   candidate's counterpart module and once through the original module (the
   eager baseline). The counterpart's output must meet the same rule as the
   model's outputs: ``rmse(counterpart, ref64) <= k * rmse(original in dtype,
   ref64) + atol``, with ``atol`` scaled to the module's own output magnitude
   (:class:`ModuleFloor`), and no NaN/Inf where the reference is finite. The
   first call that fails is the divergent module.
3. **Input error.** For that module, the error already present in its inputs is
   measured in an end-to-end run of the replayed model in the candidate's dtype
   (its inputs against the reference's): small when the divergence starts
   there, large when it was inherited.

The counterpart of the rewritten model is itself. An exported program is also
checked through ``torch.export.unflatten`` (exporter.locate_graph): its submodules run end to end in
the candidate's dtype, and each one's output is compared with the reference
module's output, against the eager baseline's error at the same module (the
"graph" method; module signatures are not preserved by export, so unflattened
modules cannot take the recorded inputs). AOTInductor packages and ONNX
models are monolithic: their localisation replays the rewritten eager model
(and the exported program they were compiled from), and the report says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves, tree_map

from .attention_backend import backend_context
from .modelio import IOModule, attention_implementation
from .numerics import OutputCheck, check_output, metrics, ratio
from .reference import cast_in_place

DEFAULT_MEMORY_FRACTION = 0.25  # of free host memory, for the recorded float64 activations


@dataclass
class Call:
    path: str  # module path inside the model (as in the attention audit)
    index: int  # n-th call of this module in the forward pass
    kind: str  # the module's class name
    args: tuple
    kwargs: dict
    output: Any


# --------------------------------------------------------------------------- tensors


def _clone(tree):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def _cast(tree, dtype: torch.dtype, device: str):
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


def _floats(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _nbytes(tree) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def memory_limit() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available * DEFAULT_MEMORY_FRACTION)
    except Exception:
        return 8 * 2**30


def _pair_by_shape(ref: list[torch.Tensor], got: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(index into ``ref``, tensor of ``got``) for each reference tensor that has a same-shaped partner."""
    if len(got) == len(ref) and all(r.shape == g.shape for r, g in zip(ref, got)):
        return list(enumerate(got))
    pairs, used = [], set()
    for index, r in enumerate(ref):
        same = [i for i, g in enumerate(got) if i not in used and tuple(g.shape) == tuple(r.shape)]
        if not same:
            continue
        # several of one shape (a rotary embedding's cos and sin): the nearest in value is the partner
        best = min(same, key=lambda i: _distance(r, got[i])) if len(same) > 1 else same[0]
        used.add(best)
        pairs.append((index, got[best]))
    return pairs


def _distance(ref: torch.Tensor, got: torch.Tensor) -> float:
    info = torch.finfo(got.dtype) if got.is_floating_point() else torch.finfo(torch.float64)
    r = ref.detach().to("cpu", torch.float64).clamp(info.min, info.max)
    value = float((r - got.detach().to("cpu", torch.float64)).pow(2).mean())
    return value if value == value else float("inf")


def _paired(ref: list[torch.Tensor], pairs: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The paired tensors, flattened into one float64 vector each. A float64 mask of finfo(float64).min is
    finfo(dtype).min in a lower-precision run, not an error: the reference is clamped to the other's range."""
    r = torch.cat([ref[i].detach().reshape(-1).to("cpu", torch.float64).clamp(torch.finfo(t.dtype).min,
                                                                               torch.finfo(t.dtype).max)
                   for i, t in pairs])
    g = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for _, t in pairs])
    return r, g


def _error(ref: list[torch.Tensor], got: list[torch.Tensor]) -> dict[str, Any] | None:
    """Error of ``got`` against ``ref`` over all the elements of the tensors that pair up by shape (float64).

    Two implementations may take different extra inputs (eager attention an additive float mask, SDPA a
    boolean one), so tensors are paired by shape and the report says how many paired.
    """
    pairs = _pair_by_shape(ref, got)
    if not pairs:
        return None
    r, g = _paired(ref, pairs)
    nonfinite = int((torch.isfinite(r) & ~torch.isfinite(g)).sum())
    m = metrics(r, g)
    return {"rmse": m["rmse"], "rel_l2": m["rel_l2"], "max_abs": m["max_abs"], "nonfinite": nonfinite,
            "matched": f"{len(pairs)} of {len(ref)} floating inputs (paired by shape)"}


def _positions(tree) -> list[Any]:
    """The leaves of a module's output with their positions kept: None stays a slot (an SDPA attention returns
    None where eager attention returns its weights), so the outputs of two implementations line up."""
    if isinstance(tree, torch.Tensor) or tree is None:
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _positions(item)]
    if isinstance(tree, dict) or hasattr(tree, "keys"):
        try:
            return [leaf for key in tree.keys() for leaf in _positions(tree[key])]
        except Exception:
            return []
    return [None]


class ModuleFloor:
    """The ``atol`` of a module's check, in that module's own units.

    The recipe's ``atol`` is in the units of the model's outputs. A module's output can be far smaller
    (an attention's output before the residual) or larger, so its floor is ``atol`` scaled by the RMS of its
    reference output over the RMS of the model's reference outputs. With an unscaled floor a defect whose
    absolute error stays under ``atol`` where it happens would only be seen downstream, after a norm
    layer has amplified it, and the wrong module would be named.
    """

    def __init__(self, atol: float, outputs: list[torch.Tensor]):
        self.atol = atol
        floats = [t.detach().reshape(-1).to(torch.float64) for t in outputs
                  if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        self.scale = float(torch.cat(floats).square().mean().sqrt()) if floats else 0.0

    def __call__(self, ref: torch.Tensor) -> float:
        if not self.scale > 0 or not ref.numel():
            return self.atol
        finite = ref[torch.isfinite(ref)].to(torch.float64)
        rms = float(finite.square().mean().sqrt()) if finite.numel() else 0.0
        return self.atol * rms / self.scale


def floor_for(atol: float | Callable[[torch.Tensor], float], ref: torch.Tensor) -> float:
    return atol(ref) if callable(atol) else atol


def compare(ref_tree, base_tree, cand_tree, k: float, atol) -> dict[str, Any] | None:
    """The module-level verdict over the floating outputs both sides produced: each must pass; the worst is reported.

    None when there is nothing to compare (no floating output, or a structure that does not line up).
    """
    ref, base, cand = _positions(ref_tree), _positions(base_tree), _positions(cand_tree)
    if len(cand) != len(ref) or len(base) != len(ref):
        return None
    checks = [check_output(f"output {i}", 0, r, b, c, k, floor_for(atol, r))
              for i, (r, b, c) in enumerate(zip(ref, base, cand))
              if all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (r, b, c))]
    return _verdict(checks) if checks else None


def _verdict(checks: list[OutputCheck]) -> dict[str, Any]:
    worst = max(checks, key=ratio)
    return {"passed": all(c.passed for c in checks), "rmse": worst.rmse, "allowed_rmse": worst.allowed_rmse,
            "baseline_rmse": worst.baseline_rmse, "rel_l2": worst.rel_l2, "max_abs": worst.max_abs,
            "reason": worst.reason}


# --------------------------------------------------------------------------- recording


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


def record_reference(original: IOModule, sample: list[torch.Tensor], max_bytes: int | None = None,
                     outputs: list | None = None) -> tuple[list[Call], str]:
    """Every submodule call of ``original`` in float64 on the CPU, in the order the calls finish
    (and the model's own outputs appended to ``outputs`` when a list is given)."""
    limit = memory_limit() if max_bytes is None else max_bytes
    calls: list[Call] = []
    pending: dict[str, list[tuple]] = {}
    counts: dict[str, int] = {}
    used = [0]
    stopped = [""]

    def pre(path, module, args, kwargs):
        if stopped[0]:
            return
        pending.setdefault(path, []).append((_clone(args), _clone(kwargs)))

    def post(path, module, args, kwargs, output):
        if not pending.get(path):
            return
        args_c, kwargs_c = pending[path].pop()
        index = counts.get(path, 0)
        counts[path] = index + 1
        out = _clone(output)
        used[0] += _nbytes(args_c) + _nbytes(kwargs_c) + _nbytes(out)
        if used[0] > limit and not stopped[0]:
            stopped[0] = (f"recording stopped after {len(calls)} module calls: their float64 activations passed "
                          f"{limit / 2**30:.1f} GiB")
            return
        calls.append(Call(path, index, type(module).__name__, args_c, kwargs_c, out))

    args64 = [(t.to(torch.float64) if t.is_floating_point() else t).cpu() for t in sample]
    with cast_in_place(original, torch.float64, "cpu"), torch.inference_mode():
        with hooks_on(original.model, None, pre, post), _context(original, "auto", "cpu"):
            result = original(*args64)
    if outputs is not None:
        outputs.extend(_floats(result))
    return calls, stopped[0]


def _context(io: IOModule, backend: str, device: str):
    stack = contextlib.ExitStack()
    stack.enter_context(attention_implementation(io.model, io.attn_implementation))
    stack.enter_context(backend_context(backend, device))
    return stack


def _inputs_in_run(io: IOModule, sample: list[torch.Tensor], call: Call, device: str, dtype: torch.dtype,
                   backend: str) -> list[torch.Tensor] | None:
    """The floating inputs ``call``'s module receives in an end-to-end run of ``io`` in ``dtype``."""
    seen: dict[str, Any] = {"count": 0, "inputs": None}

    def pre(path, module, args, kwargs):
        if seen["count"] == call.index:
            seen["inputs"] = [t.detach().to("cpu") for t in _floats((args, kwargs))]
        seen["count"] += 1

    args = [(t.to(dtype) if t.is_floating_point() else t).to(device) for t in sample]
    with torch.inference_mode(), hooks_on(io.model, {call.path}, pre, None), backend_context(backend, device):
        io(*args)
    return seen["inputs"]


# --------------------------------------------------------------------------- replay


def replay(calls: list[Call], original: IOModule, counterpart: IOModule, sample: list[torch.Tensor], device: str,
           dtype: torch.dtype, k: float, atol, backend: str = "auto") -> dict[str, Any]:
    """Replay each recorded call through ``counterpart`` and ``original`` in ``dtype``; stop at the first failure."""
    checked = 0
    found = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(cast_in_place(original, dtype, device))
        if counterpart is not original:
            stack.enter_context(cast_in_place(counterpart, dtype, device))
        stack.enter_context(torch.inference_mode())
        modules = dict(counterpart.model.named_modules())
        for call in calls:
            mine = modules.get(call.path)
            if mine is None:
                continue
            args, kwargs = _cast(call.args, dtype, device), _cast(call.kwargs, dtype, device)
            with _context(original, backend, device):
                base = original.model.get_submodule(call.path)(*args, **kwargs)
            with _context(counterpart, backend, device):
                cand = mine(*args, **kwargs)
            verdict = compare(call.output, base, cand, k, atol)
            if verdict is None:
                continue
            checked += 1
            if not verdict["passed"]:
                found = (call, verdict)
                break
        result: dict[str, Any] = {"modules_recorded": len(calls), "modules_checked": checked, "first_divergent": None}
        if found is not None:
            call, verdict = found
            ref_inputs = _floats((call.args, call.kwargs))
            cand_in = _inputs_in_run(counterpart, sample, call, device, dtype, backend)
            base_in = _inputs_in_run(original, sample, call, device, dtype, backend)
            error = _error(ref_inputs, cand_in or [])
            base_error = _error(ref_inputs, base_in or [])
            if error is not None:
                error["baseline_rmse"] = base_error["rmse"] if base_error else None
            result["first_divergent"] = _finding(call, verdict, error)
    return result


def _finding(call: Call, verdict: dict[str, Any], input_error: dict[str, Any] | None) -> dict[str, Any]:
    return {"module": call.path, "call": call.index, "class": call.kind,
            "output_error": {k: verdict[k] for k in ("rmse", "allowed_rmse", "baseline_rmse", "rel_l2", "max_abs",
                                                     "reason")},
            "input_error": input_error}


# --------------------------------------------------------------------------- the verb


def locate(original: IOModule, counterpart: IOModule, sample: list[torch.Tensor], device: str, dtype: str,
           k: float, atol: float, *, label: str, program=None, program_label: str = "", backend: str = "auto",
           max_bytes: int | None = None, failing: bool = True) -> dict[str, Any]:
    """Localise a failing candidate on one sample; a dict for the report (see docs/numerics.md)."""
    from .inputs import DTYPES

    torch_dtype = DTYPES[dtype]
    outputs: list[torch.Tensor] = []
    calls, note = record_reference(original, sample, max_bytes, outputs)
    floor = ModuleFloor(atol, outputs)
    result: dict[str, Any] = {"device": device, "dtype": dtype, "module": None, "found_by": None,
                              "replay": None, "graph": None, "notes": [note] if note else []}
    try:
        result["replay"] = {"replayed": label, **replay(calls, original, counterpart, sample, device, torch_dtype,
                                                        k, floor, backend)}
    except Exception as exc:  # a module that cannot be called on its own: say so, keep the graph method
        result["notes"].append(f"replay failed: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
    if program is not None:
        from .locate_graph import in_program

        try:
            result["graph"] = {"replayed": program_label, **in_program(program, calls, original, sample, device,
                                                                       torch_dtype, k, floor, backend)}
        except Exception as exc:
            result["notes"].append(f"unflattening the exported program failed: {type(exc).__name__}: "
                                   f"{' '.join(str(exc).split())[:300]}")
    for method in ("graph", "replay") if program is not None else ("replay",):
        entry = result.get(method)
        if entry and entry["first_divergent"]:
            result["module"] = entry["first_divergent"]["module"]
            result["found_by"] = method
            break
    result["summary"] = summary(result, failing)
    return result


def summary(result: dict[str, Any], failing: bool = True) -> str:
    """One line for the report's problems and report.md (``failing``: the candidate failed numerics)."""
    if result["module"] is None:
        checked = sum((result.get(m) or {}).get("modules_checked", 0) for m in ("replay", "graph"))
        text = f"no module diverges on its own ({checked} module calls checked)"
        return text + (": the divergence is in what the artifact's compiler or runtime did, not in any module's "
                       "computation" if failing else "")
    found = result[result["found_by"]]["first_divergent"]
    out = found["output_error"]
    text = (f"first divergent module {found['module']} ({found['class']}): rmse {out['rmse']:.3g} > allowed "
            f"{out['allowed_rmse']:.3g}" if not out["reason"] or "rmse" in out["reason"] else
            f"first divergent module {found['module']} ({found['class']}): {out['reason']}")
    inputs = found.get("input_error")
    if inputs:
        own = inputs.get("baseline_rmse")
        text += (f"; error already in its inputs: rmse {inputs['rmse']:.3g} (rel. L2 {inputs['rel_l2']:.2e}"
                 + (f"; the eager model's own there: rmse {own:.3g})" if own is not None else ")"))
    return text


__all__ = ["Call", "ModuleFloor", "record_reference", "replay", "locate", "compare", "summary"]
