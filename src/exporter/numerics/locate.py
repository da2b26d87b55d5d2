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
checked through ``torch.export.unflatten`` (exporter.numerics.locate_program): its submodules run end to end in
the candidate's dtype, and each one's output is compared with the reference
module's output, against the eager baseline's error at the same module (the
"graph" method; module signatures are not preserved by export, so unflattened
modules cannot take the recorded inputs). AOTInductor packages and ONNX
models are monolithic: their localisation replays the rewritten eager model
(and the exported program they were compiled from), and the report says so.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psutil
import torch

from ..attention_backend import backend_context
from ..dtypes import torch_dtype
from ..errors import describe
from ..modelio import IOModule, cast_in_place
from .locate_program import in_program
from .module_checks import (
    Call,
    ModuleFloor,
    cast,
    clone,
    compare,
    finding_of,
    floats,
    hooks_on,
    input_error,
    nbytes,
    run_context,
)
from .reference import promoted

DEFAULT_MEMORY_FRACTION = 0.25  # of free host memory, for the recorded float64 activations


def memory_limit() -> int:
    try:
        return int(psutil.virtual_memory().available * DEFAULT_MEMORY_FRACTION)
    except Exception:
        return 8 * 2**30


# --------------------------------------------------------------------------- recording


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
        pending.setdefault(path, []).append((clone(args), clone(kwargs)))

    def post(path, module, args, kwargs, output):
        if not pending.get(path):
            return
        args_c, kwargs_c = pending[path].pop()
        index = counts.get(path, 0)
        counts[path] = index + 1
        out = clone(output)
        used[0] += nbytes(args_c) + nbytes(kwargs_c) + nbytes(out)
        if used[0] > limit and not stopped[0]:
            stopped[0] = (f"recording stopped after {len(calls)} module calls: their float64 activations passed "
                          f"{limit / 2**30:.1f} GiB")
            return
        calls.append(Call(path, index, type(module).__name__, args_c, kwargs_c, out))

    args64 = [(t.to(torch.float64) if t.is_floating_point() else t).cpu() for t in sample]
    with cast_in_place(original, torch.float64, "cpu"), torch.inference_mode(), promoted(torch.float64):
        with hooks_on(original.model, None, pre, post), run_context(original, "auto", "cpu"):
            result = original(*args64)
    if outputs is not None:
        outputs.extend(floats(result))
    return calls, stopped[0]


def _inputs_in_run(io: IOModule, sample: list[torch.Tensor], call: Call, device: str, dtype: torch.dtype,
                   backend: str) -> list[torch.Tensor] | None:
    """The floating inputs ``call``'s module receives in an end-to-end run of ``io`` in ``dtype``."""
    seen: dict[str, Any] = {"count": 0, "inputs": None}

    def pre(path, module, args, kwargs):
        if seen["count"] == call.index:
            seen["inputs"] = [t.detach().to("cpu") for t in floats((args, kwargs))]
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
            args, kwargs = cast(call.args, dtype, device), cast(call.kwargs, dtype, device)
            with run_context(original, backend, device):
                base = original.model.get_submodule(call.path)(*args, **kwargs)
            with run_context(counterpart, backend, device):
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
            ref_inputs = floats((call.args, call.kwargs))
            cand_in = _inputs_in_run(counterpart, sample, call, device, dtype, backend)
            base_in = _inputs_in_run(original, sample, call, device, dtype, backend)
            error = input_error(ref_inputs, cand_in or [])
            base_error = input_error(ref_inputs, base_in or [])
            if error is not None:
                error["baseline_rmse"] = base_error["rmse"] if base_error else None
            result["first_divergent"] = finding_of(call, verdict, error)
    return result


# --------------------------------------------------------------------------- the verb


def locate(original: IOModule, counterpart: IOModule, sample: list[torch.Tensor], device: str, dtype: str,
           k: float, atol: float, *, label: str, program=None, program_label: str = "", backend: str = "auto",
           max_bytes: int | None = None, failing: bool = True, relative: float = 0.0) -> dict[str, Any]:
    """Localise a failing candidate on one sample; a dict for the report (see docs/numerics.md). ``relative``
    is the rule's floor per unit of a module's reference RMS (:func:`~exporter.numerics.tolerance.relative_floor`)."""
    cast = torch_dtype(dtype)
    outputs: list[torch.Tensor] = []
    calls, note = record_reference(original, sample, max_bytes, outputs)
    floor = ModuleFloor(atol, outputs, relative)
    result: dict[str, Any] = {"device": device, "dtype": dtype, "module": None, "found_by": None,
                              "replay": None, "graph": None, "notes": [note] if note else []}
    try:
        result["replay"] = {"replayed": label, **replay(calls, original, counterpart, sample, device, cast,
                                                        k, floor, backend)}
    except Exception as exc:  # a module that cannot be called on its own: say so, keep the graph method
        result["notes"].append(f"replay failed: {describe(exc, 300)}")
    if program is not None:
        try:
            result["graph"] = {"replayed": program_label, **in_program(program, calls, original, sample, device,
                                                                       cast, k, floor, backend)}
        except Exception as exc:
            result["notes"].append(f"unflattening the exported program failed: {describe(exc, 300)}")
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
