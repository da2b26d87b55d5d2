"""The report of a ``--task text-generation`` run: ``report.json`` (:func:`assemble_generation`, validated by
``generation.schema.json`` beside this module) and ``report.md`` (:func:`render_generation`).

The verdict, model, recipe and run sections are the forward report's own (:mod:`exporter.report.assemble`), with
the same schema version; what is the task's (the cache, the prompts, the per-step verdicts, decode timings and
bandwidth) comes from :mod:`exporter.generation.run`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..measure.bench import NOISY  # the forward report's mark: a spread above a tenth of the median
from ..numerics.tolerance import RULE
from ..recipe import GENERATION_TASKS
from .assemble import head_sections, run_section
from .markdown import quantization_lines

TASK = "text-generation"
TASKS = GENERATION_TASKS  # each writes this report
SCHEMA_FILE = Path(__file__).with_name("generation.schema.json")  # shipped in the wheel beside this module


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a ``--task text-generation`` run's ``report.json``."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def assemble_generation(*, recipe, checkpoint, loaded, audit, rewritten: dict[str, Any],
                        artifacts: list[dict[str, Any]], generation: dict[str, Any], eager_bench: dict[str, Any],
                        k: float, allow_drift: bool, warnings: list[str], timings: dict[str, float], total_s: float,
                        transformers: bool, task: str = TASK, quantization=None) -> dict[str, Any]:
    """The generation report's dict, from the rewritten model's and each target's entries and the task's
    ``generation`` section."""
    return {
        **head_sections([(row["name"], row["status"], row["error"]) for row in [rewritten, *artifacts]], quantization,
                        allow_drift, warnings, task, checkpoint, loaded, recipe),
        "generation": generation,
        "reference": {"device": recipe.runtime.device, "dtype": "float64", "model": (
                      "original (eager attention)" if quantization is None else
                      "quantized (its fp8 roundings, every product in float64; eager attention)")
                      + ", no KV cache: the whole sequence re-read at every step"},
        "tolerance": {"rule": RULE, "k": k, "atol": recipe.numerics.atol, "floor": recipe.numerics.floor,
                      "per_step": "each step's logits, teacher-forced on the reference's tokens"},
        "attention": audit.to_dict(),
        "baseline": {"name": "eager generate", "bench": eager_bench or None,
                     "note": "transformers generate(), greedy, its default cache and attention" if transformers
                     else "a factory model has no generate(); the rewritten row is the eager reference for timing"},
        "rewritten": rewritten,
        "artifacts": artifacts,
        **run_section(recipe, timings, total_s),
    }


def _ms(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) else "—"




def _times(value: Any) -> str:
    """A speedup at three significant figures: 1.24×, 10.7×, 719×."""
    return f"{value:.3g}×" if isinstance(value, (int, float)) else "—"


def _rate(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) else "—"


def _status(row: dict[str, Any]) -> str:
    """One cell: the status and, for a judged row, its verdict."""
    numerics = row.get("numerics") or {}
    if row.get("status") == "skipped":
        return "⏭️ skipped"
    if row.get("status") == "failed" and numerics.get("passed") is None:
        return "❌ failed"
    return _verdict(numerics)


def _noisy(timing: dict[str, Any] | None) -> bool:
    noise = (timing or {}).get("noise")
    return isinstance(noise, (int, float)) and noise > NOISY


def speed_verdict(report: dict[str, Any]) -> str:
    """The best artifact's batch-1 decode against eager ``generate()``, marked where its timing is noisy."""
    best = None
    for row in report["artifacts"]:
        value = ((row.get("bench") or {}).get("decode_speedup_vs_eager_generate") or {}).get("batch_1")
        if isinstance(value, (int, float)) and (best is None or value > best[1]):
            best = (row["name"], value, row)
    if best is None:
        return "not timed against eager generate()"
    name, value, row = best
    timing = (row["bench"].get("batch_1") or {})
    noisy = _noisy(timing.get("decode_graph") or timing.get("decode"))
    word = "faster" if value > 1 else "not faster"
    return f"decode {word} ({name} {_times(value)} eager generate() at batch 1{', noisy ⚠' if noisy else ''})"


def _verdict(numerics: dict[str, Any] | None) -> str:
    if not numerics or numerics.get("passed") is None:
        return "—"
    mark = "✅ ok" if numerics["passed"] else "❌ numerics"
    worst = numerics.get("worst_ratio")
    tokens = "tokens identical" if numerics.get("tokens_identical") else \
        f"{len(numerics.get('token_differences') or [])} row(s) differ"
    alone = numerics.get("batch_1")
    if alone:  # batch 1: each row alone (with the decode program of batch 1 where built)
        tokens += "; each row alone at batch 1 " + ("passed" if alone.get("passed") else "FAILED") + (
            ", tokens identical" if alone.get("tokens_identical") else
            f", {len(alone.get('token_differences') or [])} row(s) differ")
    return f"{mark} (worst {worst:.2f} of its bar; {tokens})" if isinstance(worst, float) else f"{mark} ({tokens})"


def _timing_cells(bench: dict[str, Any] | None, label: str) -> list[str]:
    row = (bench or {}).get(label) or {}
    graph = row.get("decode_graph") or {}
    band = row.get("bandwidth") or {}
    frac = band.get("fraction_of_copy")
    def timed(part: dict[str, Any]) -> str:
        return _ms(part.get("median_ms")) + (" ⚠" if _noisy(part) else "")

    return [timed(row.get("prefill") or {}), timed(row.get("decode") or {}),
            timed(graph) if graph.get("cuda_graph") else ("failed" if graph else "—"),
            _rate(row.get("tokens_per_s")), f"{frac:.0%}" if isinstance(frac, float) else "—"]


def _launches(bench: dict[str, Any] | None) -> str | None:
    """What one decode step launches on the GPU (``measure/launches.py``), at batch 1 and at the recipe's batch."""
    said = []
    for label in ("batch_1", "batch"):
        counted = ((bench or {}).get(label) or {}).get("kernels")
        if not counted:
            continue
        layer = f" ({counted['per_layer']:.2f} a layer)" if counted.get("per_layer") else ""
        top = ", ".join(f"{k['name'].split('(')[0][:48]} ×{k['per_step']:g} {k['ms']:.3f} ms"
                        for k in counted["top"][:3])
        said.append(f"{'batch 1' if label == 'batch_1' else 'the batch'}: {counted['per_step']:g} kernels{layer}, "
                    f"{counted['device_ms']:.3f} ms on the GPU (most: {top})")
    return "a decode step launches, at " + "; at ".join(said) if said else None


def render_generation(report: dict[str, Any]) -> str:
    """``report.md`` of a ``--task text-generation`` run."""
    gen = report["generation"]
    model = report["model"]
    numerics = "passed" if report["passed"] else f"FAILED (exit {report['exit_code']})"
    seq2seq = gen.get("encoder_decoder")
    titles = {"text2text-generation": "text-to-text generation",
              "automatic-speech-recognition": "speech-to-text generation"}
    title = titles.get(str(report.get("task")), "text generation")
    lines = [f"# {model['name']}: {title} ({report['recipe']['name']}) — numerics: {numerics} · speed: "
             f"{speed_verdict(report)}", ""]
    lines += [f"{model['architecture']}, {model['parameters']:,} parameters, "
              f"{report['recipe']['dtype']} on {report['recipe']['device']}; static KV cache of "
              f"{gen['cache_length']} slots, batch 1 to {gen['batch']}"
              + (f"; an encoder-decoder: the prefill runs the encoder over the source ({seq2seq['source']}) and "
                 f"writes each decoder layer's cross-attention keys and values ({seq2seq['encoder_length']} "
                 "positions) once, every decode step reads them." if seq2seq else "."), ""]
    for problem in report.get("problems") or []:
        lines.append(f"- ❌ {problem}")
    if seq2seq and not gen["padded_rows"]:
        prompts = f"{gen['batch']} sources of {gen['prompt_length']} frames, from decoder_start_token_id"
    elif seq2seq:
        prompts = (f"{gen['batch']} sources of {gen['prompt_length']} tokens (rows {gen['padded_rows']} right-padded "
                   f"by {gen['pad_tokens']}), from decoder_start_token_id")
    else:
        prompts = (f"{gen['batch']} prompts of {gen['prompt_length']} tokens (rows {gen['padded_rows']} left-padded "
                   f"by {gen['pad_tokens']})")
    lines += ["## Numerics", "",
              f"Reference: {report['reference']['model']}, float64, greedy {gen['new_tokens']} tokens from "
              f"{prompts}. Each step's logits are judged teacher-forced by the rule "
              f"`{report['tolerance']['rule']}` (k = {report['tolerance']['k']:g}).", "",
              "| variant | status | free-running tokens |", "| --- | --- | --- |"]
    eager = gen["eager"]
    lines.append(f"| eager ({report['recipe']['dtype']}, no cache) | "
                 f"{'tokens identical' if eager['tokens_identical'] else 'tokens differ'} (the bars' baseline) | — |")
    rows = [report["rewritten"]] + report["artifacts"]
    for row in rows:
        free = (row.get("numerics") or {}).get("free_running") or {}
        free_text = ("identical" if free.get("identical") else "differ") if free else "—"
        lines.append(f"| {row['name']} | {_status(row)} | {free_text} |")
    for row in rows:
        for diff in (row.get("numerics") or {}).get("token_differences") or []:
            kind = "near-tie" if diff["near_tie"] else "defect"
            lines.append(f"- {row['name']}: row {diff['row']} differs at step {diff['step']} ({kind}: reference margin "
                         f"{diff['reference_margin']:.3g}, largest logit error {diff['max_logit_error']:.3g})")
    skipped = [a for a in report["artifacts"] if a["status"] == "skipped"]
    for entry in skipped:
        lines.append(f"- {entry['name']}: skipped — {entry['error']}")
    lines += ["", "## Timing", "",
              "Decode per token; the CUDA-graph column replays the decode step from a graph; bandwidth: the weights "
              "a step runs (an embedding table only where a tied head reads it whole, an encoder not at all) and "
              "the whole static cache read once per token, as a fraction of the measured copy bandwidth.", "",
              "A time marked ⚠ is noisy: the interquartile range of its rounds exceeds a tenth of the median.", ""]
    if any("batch_1_dynamic" in (row.get("bench") or {}) for row in report["artifacts"]):
        lines += ["A target with a decode program of batch 1 (generation.decode_batch_1) decodes one row with it; the "
                  "row \"1, the any-batch decode program\" times the same row with the program every other batch "
                  "runs, for comparison.", ""]
    lines += [
              "| variant | batch | prefill ms | decode ms/token | graph ms/token | tokens/s | of copy bandwidth |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    baseline = report["baseline"].get("bench") or {}
    sizes = {"batch_1": "1", "batch_1_dynamic": "1, the any-batch decode program", "batch": str(gen["batch"])}
    for label, size in sizes.items():
        if baseline and label in baseline:
            lines.append(f"| eager generate | {size} | " + " | ".join(_timing_cells(baseline, label)) + " |")
        for row in rows:
            if row.get("bench") and (label != "batch_1_dynamic" or label in row["bench"]):
                lines.append(f"| {row['name']} | {size} | " + " | ".join(_timing_cells(row["bench"], label)) + " |")
    if report.get("chart"):
        lines += ["", f"![Decode time per token per variant]({report['chart']})", ""]
    for row in report["artifacts"]:
        speedups = (row.get("bench") or {}).get("decode_speedup_vs_eager_generate") or {}
        if speedups:
            lines.append(f"- {row['name']}: decode " + ", ".join(
                f"{_times(v)} eager generate at {'batch 1' if k == 'batch_1' else 'batch ' + str(gen['batch'])}"
                for k, v in speedups.items()))
        graph = (((row.get("bench") or {}).get("batch_1") or {}).get("decode_graph") or {})
        launched = _launches(row.get("bench"))
        if launched:
            lines.append(f"- {row['name']}: {launched}")
        if graph and not graph.get("cuda_graph"):
            lines.append(f"- {row['name']}: CUDA-graph capture failed: {graph.get('error')}")
        programs = row.get("programs")
        if programs:
            attend = "Attention" if row["name"] == "onnx" else "sdpa"  # what SDPA is in an ONNX graph
            lines.append(f"- {row['name']} programs: " + "; ".join(
                f"{name}: {attend} ×{ops['sdpa']}, softmax ×{ops['softmax']}"
                + "".join(f", exporter::{kernel} ×{ops[kernel]}" for kernel in
                          ("decode_attention", "decode_step_attention", "gemv") if ops.get(kernel))
                for name, ops in programs.items())
                + (f"; {len(row['fused_projections'])} groups of linears fused into one product each"
                   if row.get("fused_projections") else ""))
    attention = report["attention"]
    sites = attention.get("sites") or []
    rewritten = sum(1 for site in sites if site.get("status") == "rewritten")
    lines += ["", "## Attention", "", f"{len(sites)} site(s) found, {rewritten} rewritten to SDPA."]
    kept = sorted({site.get("reason") or "" for site in sites if site.get("status") == "skipped"})
    lines += [f"- left as written ({sum(1 for s in sites if s.get('reason') == why)} site(s)): {why}"
              for why in kept if why]
    lines += [f"- {note}" for note in attention.get("notes") or []]
    for warning in report.get("warnings") or []:
        lines.append(f"- ⚠ {warning}")
    lines += quantization_lines(report)
    timings = report.get("timings_s") or {}
    lines += ["", "Stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()), ""]
    return "\n".join(lines)
