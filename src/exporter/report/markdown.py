"""``report.md``: the report for people, a summary table per variant, the notes, the grid and the sites."""

from __future__ import annotations

from typing import Any

from ..results import FAILED, NUMERICS_FAILED, OK, SKIPPED


def _ms(value) -> str:
    return "—" if value is None else (f"{value:.3f}" if value < 10 else f"{value:.1f}")


def _x(value) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _speedup(bench: dict) -> str:
    """The speedup, marked ⚠ where the timings' spread does not support it (the notes give its range)."""
    text = _x(bench.get("speedup_vs_eager"))
    return text + " ⚠" if bench.get("speedup_supported") is False else text


def _noise(bench: dict) -> str:
    return "—" if bench.get("noise") is None else f"{bench['noise']:.0%}"


def _err(variant: dict) -> str:
    outputs = variant.get("numerics", {}).get("outputs") or []
    if not outputs:
        return "—"
    worst = max(outputs, key=lambda o: o["rel_l2"])
    return f"{worst['rel_l2']:.2e}"


def _verdict(variant: dict) -> str:
    return {OK: "✅ ok", SKIPPED: "⏭️ skipped", FAILED: "❌ failed", NUMERICS_FAILED: "❌ numerics"}.get(
        variant["status"], variant["status"])


def numerics_verdict(report: dict[str, Any]) -> str:
    if report["passed"]:
        return "passed"
    return "FAILED (drift allowed)" if report["allow_drift"] and report["exit_code"] == 0 else "FAILED"


def speed_verdict(report: dict[str, Any]) -> str:
    """What the timings say of the artifacts against eager, in a few words: the best one that is clearly faster,
    else that none is, else that the noise does not let the timings tell."""
    timed = [(a["name"], a["bench"]) for a in report["artifacts"]
             if (a.get("bench") or {}).get("speedup_vs_eager") is not None]
    if not timed:
        return "not timed"
    supported = [(name, b) for name, b in timed if b.get("speedup_supported")]
    faster = [(name, b) for name, b in supported if b["speedup_vs_eager"] > 1]
    if faster:
        name, best = max(faster, key=lambda item: item[1]["speedup_vs_eager"])
        return f"faster ({name} {best['speedup_vs_eager']:.2f}× eager)"
    if supported:
        name, best = max(supported, key=lambda item: item[1]["speedup_vs_eager"])
        return f"not faster than eager (best: {name} {best['speedup_vs_eager']:.2f}×)"
    noise = (report["baseline"].get("bench") or {}).get("noise")
    return "not measurable" + (f" (eager's noise {noise:.0%})" if isinstance(noise, (int, float)) else "")


def headline(report: dict[str, Any]) -> str:
    """Both verdicts: ``numerics: passed · speed: not measurable (eager's noise 30%)``."""
    return f"numerics: {numerics_verdict(report)} · speed: {speed_verdict(report)}"


def _candidates(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The rewritten model (a convert's) and the artifacts."""
    return ([r["rewritten"]] if r.get("rewritten") else []) + r["artifacts"]


def _attention_line(r: dict[str, Any]) -> str:
    if r.get("attention") is None:
        checked = (r.get("check") or {}).get("artifacts") or []
        return "- Checked: " + "; ".join(f"`{a['file']}` ({a['kind']}, made by {a['made_by']})" for a in checked)
    return (f"- Attention: {r['attention']['found']} site(s) found, {r['attention']['rewritten']} rewritten to SDPA, "
            f"{r['attention']['skipped']} skipped"
            + ("" if r["recipe"].get("rewrite_attention", True) else " (rewrite off: attention runs as written)"))


def render_markdown(report: dict[str, Any]) -> str:
    r = report
    title = "exporter check" if r.get("task") == "check" else "exporter report"
    lines = [
        f"# {title}: {r['model']['name']} with `{r['recipe']['name']}` — {headline(r)}",
        "",
        f"- Model: `{r['model']['architecture']}` ({r['model']['architecture_source']}), "
        f"{r['model']['parameters']:,} parameters",
        *_folder_lines(r),
        f"- Recipe: `{r['recipe']['name']}` — {r['recipe']['device']}, {r['recipe']['dtype']}, "
        f"attention backend `{r['recipe']['attention_backend']}`",
        f"- Device: {r['environment']['device'].get('name')}; torch {r['environment']['versions']['torch']}",
        f"- Inputs: {r['inputs']['samples']} sample(s) from {r['inputs']['source']}"
        + (f" (seed {r['inputs']['seed']})" if r['inputs']['seed'] is not None else "")
        + ", shapes " + ", ".join(f"`{k}` {v}" for k, v in r["inputs"]["shapes"].items()),
        _attention_line(r),
        f"- Reference: {'quantized' if r.get('quantization') else 'original'} model in {r['reference']['dtype']} on "
        f"{r['reference']['device']}; tolerance "
        f"`{r['tolerance']['rule']}`",
    ] + _slower_lines(r) + _cost_lines(r) + [
        "",
        "| variant | status | worst rel. L2 | median ms | p90 ms | p99 ms | noise | speedup | TFLOP/s | build s "
        "| size | attention kernels |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = r["baseline"]["bench"] or {}
    lines.append(f"| eager (baseline) | — | — | {_ms(base.get('median_ms'))} | {_ms(base.get('p90_ms'))} | "
                 f"{_ms(base.get('p99_ms'))} | {_noise(base)} | 1.00× | {_tf(base)} | — | — | "
                 f"{kernel_summary(r['baseline'].get('kernels'))} |")
    for v in _candidates(r):
        b = v["bench"] or {}
        size = f"{v['size_bytes'] / 2**20:.1f} MiB" if v.get("size_bytes") else "—"
        build = f"{v['build_s']:.1f}" if v.get("build_s") is not None else "—"
        lines.append(f"| {v['name']} | {_verdict(v)} | {_err(v)} | {_ms(b.get('median_ms'))} | {_ms(b.get('p90_ms'))} "
                     f"| {_ms(b.get('p99_ms'))} | {_noise(b)} | {_speedup(b)} | {_tf(b)} | {build} | {size} "
                     f"| {kernel_summary((v.get('info') or {}).get('kernels'))} |")
    if r.get("chart"):
        lines += ["", f"![Latency and speedup per variant]({r['chart']})"]
    notes = [(v["name"], v["error"]) for v in _candidates(r) if v.get("error")]
    notes += [(v["name"], n) for v in _candidates(r) for n in v.get("notes", [])]
    if notes or r["warnings"]:
        lines += ["", "## Notes", ""]
        lines += [f"- **{name}**: {text}" for name, text in notes]
        lines += [f"- warning: {w}" for w in r["warnings"]]
    lines += quantization_lines(r) + _grid_lines(r) + _locate_lines(r) + _choice_lines(r)
    if (r.get("attention") or {}).get("sites"):
        lines += ["", "## Attention sites", "",
                  "| location | kind | status | causal | masked | GQA | head dim | reason |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in r["attention"]["sites"]:
            lines.append(f"| `{s['location']}` | {s['kind']} | {s['status']} | {_b(s['causal'])} | {_b(s['masked'])} "
                         f"| {_b(s['grouped_query'])} | {s['head_dim'] or '—'} | {s['reason'] or ''} |")
    lines += ["", f"Exit code {r['exit_code']}. Full data: `report.json`; hashes: `manifest.json`.", ""]
    return "\n".join(lines)


def _folder_lines(r: dict[str, Any]) -> list[str]:
    """The pipeline a sentence-transformers folder brought (or why it was left out), and the model-folder files
    copied beside the artifacts."""
    lines = []
    pipeline = r["model"].get("pipeline")
    if pipeline:
        modules = ", ".join(pipeline["modules"])
        lines.append(f"- Pipeline: sentence-transformers {modules} — in the artifacts (outputs "
                     f"{', '.join(f'`{o}`' for o in r['outputs'])}); checked: {pipeline.get('checked') or 'no'}"
                     if pipeline["included"] else
                     f"- Pipeline: sentence-transformers {modules} — left out: {pipeline['reason']}")
    files = r["model"].get("folder_files")
    if files:
        lines.append(f"- Model folder: {', '.join(f'`{f}`' for f in files)} copied beside the artifacts")
    return lines


def _slower_lines(r: dict[str, Any]) -> list[str]:
    """The finding no speedup over eager may hide: an artifact slower than the model it was built from."""
    slower = [v for v in r["artifacts"] if (v.get("bench") or {}).get("slower_than_rewritten")]
    if not slower:
        return []
    return ["- **Slower than the rewritten eager model they were built from**: "
            + ", ".join(f"{v['name']} ({v['bench']['speedup_vs_rewritten']:.2f}×)" for v in slower)
            + " (their notes name the ops that take the time)"]


def _cost_lines(r: dict[str, Any]) -> list[str]:
    """What the run itself cost: time (slowest stages) and host memory of the whole process tree."""
    lines = []
    timings = {k: v for k, v in (r.get("timings_s") or {}).items() if k != "total" and isinstance(v, (int, float))}
    if timings:
        slowest = sorted(timings.items(), key=lambda kv: kv[1], reverse=True)[:4]
        verb = "Check" if r.get("task") == "check" else "Convert"
        lines.append(f"- {verb} took {r['timings_s'].get('total', 0):.0f} s; slowest stages: "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in slowest))
    memory = r.get("memory") or {}
    tree = memory.get("tree") or {}
    if tree:
        text = (f"- Host memory: {tree['tree_peak_pss_bytes'] / 2**30:.1f} GiB for the whole process tree (PSS, "
                f"sampled), {memory['convert_peak_rss_bytes'] / 2**30:.1f} GiB for the convert process")
        if memory.get("tree_bound_bytes"):
            text += (f"; bound {memory['tree_bound_bytes'] / 2**30:.1f} GiB: "
                     + ("within" if memory.get("tree_within_bound") else "**over**"))
        if tree.get("gpu_peak_used_bytes"):
            text += f"; GPU in use at most {tree['gpu_peak_used_bytes'] / 2**30:.1f} GiB"
        stages = [e for e in tree.get("stages") or [] if e["stage"] != "between stages"]
        if stages:
            top = max(stages, key=lambda e: e["tree_peak_pss_bytes"])
            text += (f"; most during `{top['stage']}` (tree {top['tree_peak_pss_bytes'] / 2**30:.1f} GiB, convert "
                     f"process {top['root_peak_rss_bytes'] / 2**30:.1f} GiB; per stage: `report.json` → "
                     "`memory.tree.stages`)")
        lines.append(text)
    return lines


def quantization_lines(r: dict[str, Any]) -> list[str]:
    """The second question of an fp8 run: what the quantization cost, beside the unquantized model's own error."""
    q = r.get("quantization")
    if not q:
        return []
    b, dtype = q["budget"], q["unquantized_dtype"]
    verdict = "✅ within the budget" if q["passed"] else "❌ over the budget"
    lines = ["", "## Quantization", "",
             f"`{q['scheme']}`: {q['counts']['fp8']} linears in {q['weight_dtype']} (scales {q['scales']['dtype']}, "
             f"{q['scales']['granularity']}), {q['counts']['excluded']} excluded"
             + (f" ({', '.join(f'`{n}`' for n in q['excluded'][:6])})" if q["excluded"] else "")
             + f", {q['counts']['fallback']} kept because fp8 cannot take them. What it cost, against the original "
             f"model's float64 reference: {verdict} (every output SQNR ≥ {b['min_sqnr_db']:g} dB or its error ≤ "
             f"{b['max_error_ratio']:g}× {dtype}'s own; every fp8 layer ≥ {b['layer_min_sqnr_db']:g} dB; logits "
             f"top-1 ≥ {b['min_top1']:g} or ≥ {dtype}'s own, KL ≤ {b['max_kl']:g} or ≤ {b['max_error_ratio']:g}² × "
             f"{dtype}'s own). The artifacts are judged against the quantized "
             "model (the table above).", "",
             f"| output | sample | fp8 SQNR dB | {dtype} SQNR dB | fp8 rel. L2 | {dtype} rel. L2 | fp8 error = N × "
             f"{dtype} | within budget |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for o in q["outputs"]:
        lines.append(f"| `{o['output']}` | {o['sample']} | {o['sqnr_db']:.1f} | {o['unquantized_sqnr_db']:.1f} | "
                     f"{o['relative_l2']:.3g} | {o['unquantized_relative_l2']:.3g} | {o['error_ratio']:.1f} | "
                     f"{'✅' if o['passed'] else '❌'} |")
    if q["logits"]:
        lines += ["", f"| logits, sample | top-1 agreement with {dtype} | KL({dtype} ‖ fp8) | {dtype} top-1 vs "
                      f"float64 | KL(float64 ‖ {dtype}) |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {e['sample']} | {e['top1_agreement']:.3f} | {e['kl']:.2e} | "
                  f"{e['unquantized_top1_vs_float64']:.3f} | {e['unquantized_kl_vs_float64']:.2e} |"
                  for e in q["logits"]]
    if q["worst_layers"]:
        lines += ["", "Lowest per-layer SQNR: " + ", ".join(f"`{w['name']}` {w['sqnr_db']:.1f} dB"
                                                           for w in q["worst_layers"])]
    lines += [f"- fallback `{f['name']}`: {f['reason']}" for f in q["fallback"]]
    lines += [f"- problem: {p}" for p in q["problems"]] + [f"- note: {n}" for n in q["notes"]]
    return lines


def _grid_lines(r: dict[str, Any]) -> list[str]:
    grid = r["inputs"].get("grid")
    checked = [v for v in _candidates(r)
               if ((v.get("numerics") or {}).get("grid") or {}).get("checked")]
    if not grid or not checked:
        return []
    points = [p["name"] for p in grid["points"]]
    lines = ["", "## Shape grid", "",
             f"{len(points)} points, each a generated sample with a recorded seed (`report.json` → `inputs.grid`); "
             f"each point holds at most {grid['budget']:g}× the typical point's input elements.", "",
             "| variant | " + " | ".join(f"`{p}`" for p in points) + " | fixed dims |",
             "| --- | " + " | ".join("---" for _ in points) + " | --- |"]
    for v in checked:
        entry = v["numerics"]["grid"]
        cells = {p["name"]: {True: "✅", False: "❌", None: "n/a"}[p["passed"]] for p in entry["points"]}
        fixed = ", ".join(f"{s['input']}[{s['axis']}]={s['size']}" for s in entry.get("specialised", [])) or "none"
        lines.append(f"| {v['name']} | " + " | ".join(cells.get(p, "—") for p in points) + f" | {fixed} |")
    if grid.get("skipped"):
        lines.append("")
    lines += [f"- skipped `{s['name']}` {s['sizes']}: {s['reason']}" for s in grid.get("skipped", [])]
    return lines


def _locate_lines(r: dict[str, Any]) -> list[str]:
    lines = []
    for v in _candidates(r):
        found = (v.get("numerics") or {}).get("locate")
        if not found:
            continue
        where = f"sample {found['sample']}" if "sample" in found else f"grid point {found.get('grid_point')}"
        lines.append(f"- **{v['name']}** ({where}, {found['dtype']} on {found['device']}): {found['summary']}")
        for method in ("replay", "graph"):
            entry = found.get(method)
            if entry:
                lines.append(f"  - {method}: {entry['replayed']}; {entry['modules_checked']} module calls checked")
    return (["", "## Divergence localisation", ""] + lines) if lines else []


def _choice_lines(r: dict[str, Any]) -> list[str]:
    """PyTorch's verdict on each distinct SDPA call: the backend it picks and why the others cannot run."""
    choice = (r.get("attention") or {}).get("backend_choice") or {}
    if choice.get("error"):
        return ["", "## SDPA backend choice", "", f"Not determined: {choice['error']}"]
    if not choice.get("calls"):
        return []
    lines = ["", "## SDPA backend choice", "",
             f"Preference `{choice['preference']}`. Per distinct SDPA call of the rewritten model, the backend "
             "PyTorch picks and, for each fused backend it cannot use, its own reason "
             "(`torch.backends.cuda.can_use_*` in debug mode).", "",
             "| q / k / v | mask | causal | GQA | calls | picked | flash | cuDNN | efficient |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in choice["calls"]:
        cells = []
        for name in ("flash", "cudnn", "efficient"):
            verdict = c["backends"][name]
            why = ("; ".join(verdict["reasons"]) or "no reason given").replace("|", "/")
            cells.append("usable" if verdict["usable"] else f"no: {why}")
        shapes = " / ".join(dict.fromkeys((c["query"], c["key"], c["value"])))
        lines.append(f"| {shapes} | {c['mask']} | {_b(c['is_causal'])} | {_b(c['enable_gqa'])} | {c['calls']} "
                     f"| **{c['picked']}** | " + " | ".join(cells) + " |")
    return lines


def kernel_summary(found: dict | None) -> str:
    """'flash ×2', 'math ×2, softmax ×2', 'softmax ×12' (unfused), or '—' when nothing was recorded."""
    if not found or found.get("source") in (None, "error"):
        return "—"
    parts = [f"{name} ×{count}" for name, count in (found.get("backends") or {}).items()]
    if found.get("softmax_kernels"):
        parts.append(f"softmax ×{found['softmax_kernels']}")
    if found.get("source") == "none" and not parts:
        return "not recorded"
    return ", ".join(parts) or "—"


def _tf(bench: dict) -> str:
    value = bench.get("tflops") if bench else None
    if value is None:
        return "—"
    util = bench.get("utilisation")
    return f"{value:.2f}" + (f" ({util:.0%})" if util is not None else "")


def _b(value) -> str:
    return "—" if value is None else ("yes" if value else "no")
