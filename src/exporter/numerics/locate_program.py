"""Localisation through the exported program itself: ``torch.export.unflatten``, run end to end.

Export does not preserve module call signatures, so an unflattened submodule cannot take the inputs
recorded from the eager model (its placeholders are whatever graph values flow into it). Instead the
program runs end to end in the candidate's dtype with hooks on its submodules, and each submodule's
output is compared with the reference module's output (from :func:`exporter.numerics.locate.record_reference`),
against the eager model's own error at that module. See docs/numerics.md.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from ..attention_backend import backend_context
from ..modelio import IOModule, cast_in_place, keyword_names
from .module_checks import (
    Call,
    finding_of,
    floats,
    floor_for,
    hooks_on,
    input_error,
    pair_by_shape,
    paired,
    run_context,
    verdict_of,
)
from .tolerance import check_output


def recorder(store: dict, strip: int):
    """A forward hook that keeps each call's floating inputs and outputs under ``(path[strip:], index)``."""
    counts: dict[str, int] = {}

    def post(path, module, args, kwargs, output):
        index = counts.get(path, 0)
        counts[path] = index + 1
        store[(path[strip:], index)] = ([t.detach().cpu() for t in floats((args, kwargs))],
                                        [t.detach().cpu() for t in floats(output)])
    return post


def baseline_store(original: IOModule, calls: list[Call], args: list[torch.Tensor], device: str,
                   dtype: torch.dtype, backend: str = "auto") -> dict:
    """Every recorded module's inputs and outputs in the eager model run in ``dtype`` (its own error there)."""
    baseline: dict[tuple[str, int], tuple[list, list]] = {}
    with torch.inference_mode(), cast_in_place(original, dtype, device), run_context(original, backend, device), \
            hooks_on(original.model, {c.path for c in calls}, None, recorder(baseline, 0)):
        original(*args)
    return baseline


def in_program(program, calls: list[Call], original: IOModule, sample: list[torch.Tensor], device: str,
               dtype: torch.dtype, k: float, atol, backend: str = "auto", prefix: str = "model.",
               keywords: tuple[str, ...] | None = None, positional: int = 0) -> dict:
    """Run ``program`` unflattened, end to end, and compare each submodule's output with the reference's.

    ``prefix`` maps a path inside the model to the program's (it was exported from the IOModule, whose
    model is its ``model`` attribute; a program another tool exported from the model itself has none).
    ``keywords``: the program takes its inputs after the first ``positional`` by these names. The bar of
    each module is the eager model's own error there.
    """
    args = [(t.to(dtype) if t.is_floating_point() else t).to(device) for t in sample]
    graph = record_modules(program, {prefix + c.path for c in calls}, args, prefix, keywords, positional,
                           backend_context(backend, device))
    return first_divergent(calls, graph, baseline_store(original, calls, args, device, dtype, backend), k, atol)


def record_modules(program, wanted: set[str], args: list[torch.Tensor], prefix: str,
                   keywords: tuple[str, ...] | None, positional: int,
                   context: contextlib.AbstractContextManager | None = None
                   ) -> dict[tuple[str, int], tuple[list, list]]:
    """Run ``program`` unflattened on ``args`` (inside ``context``), recording the inputs and output of every
    submodule in ``wanted``, keyed by its path less ``prefix`` and its call's index. ``keywords``: the program
    takes its inputs after the first ``positional`` by these names (convert's own program: all, by its names)."""
    unflat = torch.export.unflatten(program)
    graph: dict[tuple[str, int], tuple[list, list]] = {}
    if not keywords:  # convert's own program takes its inputs by name
        keywords, positional = keyword_names(program.call_spec.in_spec), 0
    with torch.inference_mode(), hooks_on(unflat, wanted, None, recorder(graph, len(prefix))), \
            context or contextlib.nullcontext():
        if keywords:
            unflat(*args[:positional], **dict(zip(keywords, args[positional:])))
        else:
            unflat(*args)
    return graph


def first_divergent(calls: list[Call], graph: dict, baseline: dict, k: float, atol) -> dict:
    """The first module, in the order the calls finished, whose output in the candidate's run (``graph``) misses
    the bar set by the eager model's own error there (``baseline``); stores map ``(path, index)`` to
    ``(floating inputs, floating outputs)``.

    End to end, an error travels downstream: a module whose inputs already diverged (beyond the eager
    model's own error there) did not start the divergence. When the first failing module is such a one,
    the divergence came from its enclosing module's own code (an attention's ``o_proj`` gets a wrong
    attention result from its parent's body), so the innermost enclosing module whose inputs are clean
    is reported. A candidate that exposes no module inputs (an ONNX graph's values) is taken at its word.
    """

    def output_verdict(call: Call) -> dict[str, Any] | None:
        got, base, ref = graph.get((call.path, call.index)), baseline.get((call.path, call.index)), floats(call.output)
        if got is None or base is None or not ref or len(base[1]) != len(ref):
            return None
        pairs = pair_by_shape(ref, got[1])
        if not pairs:
            return None
        return verdict_of([check_output(f"output {i}", 0, ref[i], base[1][i], g, k, floor_for(atol, ref[i]))
                         for i, g in pairs])

    def inputs_clean(call: Call) -> bool:
        ref = floats((call.args, call.kwargs))
        got, base = graph[(call.path, call.index)][0], baseline[(call.path, call.index)][0]
        pairs = pair_by_shape(ref, got)
        if not pairs or len(base) != len(ref):
            return True  # nothing to tell: take the module at its word
        r, g = paired(ref, pairs)
        b = torch.cat([base[i].detach().reshape(-1).to("cpu", torch.float64) for i, _ in pairs])
        return check_output("inputs", 0, r, b, g, k, floor_for(atol, r)).passed

    checked = 0
    for position, call in enumerate(calls):
        verdict = output_verdict(call)
        if verdict is None:
            continue
        checked += 1
        if verdict["passed"]:
            continue
        note = ""
        culprit = call
        while not inputs_clean(culprit):
            parent = next((c for c in calls[position + 1:] if culprit.path.startswith(c.path + ".")), None)
            parent_verdict = output_verdict(parent) if parent is not None else None
            if parent is None or parent_verdict is None or parent_verdict["passed"]:
                note = (f"the inputs of {culprit.path} had already diverged, in code outside any checked module "
                        "(the model's own forward)")
                break
            culprit, verdict = parent, parent_verdict
            position = calls.index(parent)
        ref_inputs = floats((culprit.args, culprit.kwargs))
        error = input_error(ref_inputs, graph[(culprit.path, culprit.index)][0])
        own = input_error(ref_inputs, baseline[(culprit.path, culprit.index)][0])
        if error is not None:
            error["baseline_rmse"] = own["rmse"] if own else None
        finding = finding_of(culprit, verdict, error)
        if note:
            finding["note"] = note
        return {"modules_recorded": len(calls), "modules_checked": checked, "first_divergent": finding}
    return {"modules_recorded": len(calls), "modules_checked": checked, "first_divergent": None}


__all__ = ["in_program", "first_divergent", "baseline_store", "recorder"]
