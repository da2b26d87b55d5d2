"""Stage 5, report: ``report.json`` (schema in docs/report-schema.md), ``report.md``, and ``manifest.json``.

Every file is written atomically; ``manifest.json`` is written last, so its
presence means the run finished. The manifest holds the SHA-256 of the
checkpoint and of every file in the output folder, the resolved recipe, the
software versions and the device, so a release can be verified later.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .environment import device_info, versions
from .errors import EXIT_NUMERICS, EXIT_OK, EXIT_TARGET
from .numerics.tolerance import RULE
from .outdir import model_name, public_path, sha256_file, write_atomic, write_json
from .recipe import K_DEFAULTS, public_source
from .results import FAILED, NUMERICS_FAILED, OK, SKIPPED, VariantResult

REPORT_SCHEMA_VERSION = 1
MANIFEST_SCHEMA_VERSION = 1


SCHEMA_FILE = Path(__file__).with_name("report.schema.json")  # shipped in the wheel beside this module


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) every ``report.json`` of this schema version validates against."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def _variant_dict(result: VariantResult) -> dict[str, Any]:
    return {
        "target": result.target,
        "name": result.name,
        "status": result.status,
        "error": result.error,
        "path": str(result.path) if result.path else None,
        "sha256": result.sha256,
        "size_bytes": result.size_bytes,
        "files": result.files,
        "device": result.device,
        "dtype": result.dtype,
        "build_s": result.build_s,
        "load_s": result.load_s,
        "graph": result.graph,
        "notes": result.notes,
        "info": {k: v for k, v in result.info.items() if not k.startswith("_")},
        "numerics": result.numerics.to_dict() if result.numerics else {"passed": None},
        "bench": result.bench or {"median_ms": None, "speedup_vs_eager": None},
    }


def _exit_code(results: list[VariantResult], allow_drift: bool) -> tuple[int, list[str]]:
    problems = []
    numerics_failed = [r for r in results if r.status == NUMERICS_FAILED]
    failed = [r for r in results if r.status == FAILED]
    for r in numerics_failed:
        problems.append(f"{r.name}: numerics failed: {r.error}")
    for r in failed:
        problems.append(f"{r.name}: {r.error}")
    if numerics_failed and not allow_drift:
        return EXIT_NUMERICS, problems
    if failed:
        return EXIT_TARGET, problems
    return EXIT_OK, problems


def assemble(*, recipe, checkpoint, loaded, plan, signature, reference, audit, results, eager_bench, allow_drift,
             warnings, timings, staging, total_s, grid=None, eager_kernels=None, backend_choice=None) -> dict[str, Any]:
    exit_code, problems = _exit_code(results, allow_drift)
    model = loaded.model
    params = sum(p.numel() for p in model.parameters())
    dtypes: dict[str, int] = {}
    for info in loaded.checkpoint.entries.values():
        key = str(info.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + 1
    passed = all(r.status in (OK, SKIPPED) for r in results)
    dynamic = {name: {str(axis): {"dim": d.name, "min": d.min, "max": d.max} for axis, d in axes.items()}
               for name, axes in plan.dynamic_axes().items()}
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "passed": passed,
        "exit_code": exit_code,
        "problems": problems,
        "allow_drift": allow_drift,
        "warnings": list(warnings),
        "model": {
            "name": model_name(Path(checkpoint)),
            "checkpoint": public_path(checkpoint),
            "format": loaded.checkpoint.format,
            "architecture": loaded.architecture.name,
            "architecture_source": loaded.architecture.source,
            "parameters": params,
            "checkpoint_bytes": loaded.checkpoint.nbytes,
            "checkpoint_dtypes": dtypes,
        },
        "recipe": {"name": recipe.name, "source": public_source(recipe), "device": recipe.runtime.device,
                   "dtype": recipe.runtime.dtype, "attention_backend": recipe.runtime.attention_backend,
                   "rewrite_attention": recipe.runtime.rewrite_attention, "targets": list(recipe.targets.build)},
        "inputs": {
            "source": plan.source,
            "seed": plan.seed,
            "seeds": plan.seeds,
            "samples": len(plan.samples),
            "names": list(signature.inputs),
            "shapes": {n: list(t.shape) for n, t in plan.samples[0].items()},
            "dtypes": {n: str(t.dtype).replace("torch.", "") for n, t in plan.samples[0].items()},
            "dynamic": dynamic,
            "notes": plan.notes,
            "grid": grid.to_dict() if grid is not None else None,
        },
        "outputs": list(signature.outputs),
        "reference": {"device": reference.device, "dtype": reference.dtype, "flops": reference.flops,
                      "note": reference.note,
                      "model": "original (eager attention, not rewritten)"},
        "tolerance": {"rule": RULE, "k": recipe.numerics.k,
                      "k_default": ", ".join(f"{k:g} for {dtype}" for dtype, k in K_DEFAULTS.items()),
                      "atol": recipe.numerics.atol, "grid": recipe.numerics.grid,
                      "grid_budget": recipe.numerics.grid_budget, "locate": recipe.numerics.locate},
        "attention": {**audit.to_dict(), "backend_choice": backend_choice},
        "baseline": {"name": "eager", "device": recipe.runtime.device, "dtype": recipe.runtime.dtype,
                     "kernels": eager_kernels,
                     "bench": eager_bench},
        "rewritten": _variant_dict(results[0]),
        "artifacts": [_variant_dict(r) for r in results[1:]],
        "timings_s": {**{k: round(v, 3) for k, v in timings.items()}, "total": round(total_s, 3)},
        "environment": {"versions": versions(), "device": device_info(recipe.runtime.device, host=recipe.report.host)},
    }


# --------------------------------------------------------------------------- markdown


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


def render_markdown(report: dict[str, Any]) -> str:
    r = report
    verdict = "PASSED" if r["passed"] else ("FAILED (drift allowed)" if r["allow_drift"] and r["exit_code"] == 0
                                            else "FAILED")
    lines = [
        f"# exporter report: {r['model']['name']} with `{r['recipe']['name']}` — {verdict}",
        "",
        f"- Model: `{r['model']['architecture']}` ({r['model']['architecture_source']}), "
        f"{r['model']['parameters']:,} parameters",
        f"- Recipe: `{r['recipe']['name']}` — {r['recipe']['device']}, {r['recipe']['dtype']}, "
        f"attention backend `{r['recipe']['attention_backend']}`",
        f"- Device: {r['environment']['device'].get('name')}; torch {r['environment']['versions']['torch']}",
        f"- Inputs: {r['inputs']['samples']} sample(s) from {r['inputs']['source']}"
        + (f" (seed {r['inputs']['seed']})" if r['inputs']['seed'] is not None else "")
        + ", shapes " + ", ".join(f"`{k}` {v}" for k, v in r["inputs"]["shapes"].items()),
        f"- Attention: {r['attention']['found']} site(s) found, {r['attention']['rewritten']} rewritten to SDPA, "
        f"{r['attention']['skipped']} skipped"
        + ("" if r["recipe"].get("rewrite_attention", True) else " (rewrite off: attention runs as written)"),
        f"- Reference: original model in {r['reference']['dtype']} on {r['reference']['device']}; tolerance "
        f"`{r['tolerance']['rule']}`",
    ] + _cost_lines(r) + [
        "",
        "| variant | status | worst rel. L2 | median ms | p90 ms | p99 ms | noise | speedup | TFLOP/s | build s "
        "| size | attention kernels |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base = r["baseline"]["bench"] or {}
    lines.append(f"| eager (baseline) | — | — | {_ms(base.get('median_ms'))} | {_ms(base.get('p90_ms'))} | "
                 f"{_ms(base.get('p99_ms'))} | {_noise(base)} | 1.00× | {_tf(base)} | — | — | "
                 f"{kernel_summary(r['baseline'].get('kernels'))} |")
    for v in [r["rewritten"]] + r["artifacts"]:
        b = v["bench"] or {}
        size = f"{v['size_bytes'] / 2**20:.1f} MiB" if v.get("size_bytes") else "—"
        build = f"{v['build_s']:.1f}" if v.get("build_s") is not None else "—"
        lines.append(f"| {v['name']} | {_verdict(v)} | {_err(v)} | {_ms(b.get('median_ms'))} | {_ms(b.get('p90_ms'))} "
                     f"| {_ms(b.get('p99_ms'))} | {_noise(b)} | {_speedup(b)} | {_tf(b)} | {build} | {size} "
                     f"| {kernel_summary((v.get('info') or {}).get('kernels'))} |")
    notes = [(v["name"], v["error"]) for v in [r["rewritten"]] + r["artifacts"] if v.get("error")]
    notes += [(v["name"], n) for v in [r["rewritten"]] + r["artifacts"] for n in v.get("notes", [])]
    if notes or r["warnings"]:
        lines += ["", "## Notes", ""]
        lines += [f"- **{name}**: {text}" for name, text in notes]
        lines += [f"- warning: {w}" for w in r["warnings"]]
    lines += _grid_lines(r) + _locate_lines(r) + _choice_lines(r)
    if r["attention"]["sites"]:
        lines += ["", "## Attention sites", "",
                  "| location | kind | status | causal | masked | GQA | head dim | reason |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for s in r["attention"]["sites"]:
            lines.append(f"| `{s['location']}` | {s['kind']} | {s['status']} | {_b(s['causal'])} | {_b(s['masked'])} "
                         f"| {_b(s['grouped_query'])} | {s['head_dim'] or '—'} | {s['reason'] or ''} |")
    lines += ["", f"Exit code {r['exit_code']}. Full data: `report.json`; hashes: `manifest.json`.", ""]
    return "\n".join(lines)


def _cost_lines(r: dict[str, Any]) -> list[str]:
    """What the run itself cost: time (slowest stages) and host memory of the whole process tree."""
    lines = []
    timings = {k: v for k, v in (r.get("timings_s") or {}).items() if k != "total" and isinstance(v, (int, float))}
    if timings:
        slowest = sorted(timings.items(), key=lambda kv: kv[1], reverse=True)[:4]
        lines.append(f"- Convert took {r['timings_s'].get('total', 0):.0f} s; slowest stages: "
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
        lines.append(text)
    return lines


def _grid_lines(r: dict[str, Any]) -> list[str]:
    grid = r["inputs"].get("grid")
    checked = [v for v in [r["rewritten"]] + r["artifacts"]
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
    for v in [r["rewritten"]] + r["artifacts"]:
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
    choice = r["attention"].get("backend_choice") or {}
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


# --------------------------------------------------------------------------- writing


def build_manifest(staging: Path, report: dict[str, Any], checkpoint_files: list[Path], recipe_dict) -> dict:
    """Every file of the output folder and of the checkpoint with its SHA-256 (hashed in parallel; an
    artifact's hash, taken when it was built, is reused while its size is unchanged)."""
    known = {f["path"]: f for a in report["artifacts"] for f in (a.get("files") or [])}
    paths = [p for p in sorted(staging.rglob("*")) if p.is_file() and p.name != "manifest.json"
             and not p.name.startswith(".")]
    fresh = [p for p in paths if not _still(known.get(str(p.relative_to(staging))), p)]
    checkpoints = [Path(p) for p in checkpoint_files]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        digests = dict(zip(fresh + checkpoints, pool.map(sha256_file, fresh + checkpoints)))
    files = [known[str(p.relative_to(staging))] if p not in digests else
             {"path": str(p.relative_to(staging)), "sha256": digests[p], "bytes": p.stat().st_size} for p in paths]
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "created": report["created"],
        "passed": report["passed"],
        "exit_code": report["exit_code"],
        "checkpoint": [{"path": p.name, "sha256": digests[p], "bytes": p.stat().st_size}  # within the checkpoint
                       for p in checkpoints],
        "files": files,
        "artifacts": [{"target": a["name"], "path": a["path"], "sha256": a["sha256"]}
                      for a in report["artifacts"] if a["path"]],
        "recipe": recipe_dict,
        "versions": report["environment"]["versions"],
        "device": report["environment"]["device"],
    }


def _still(entry: dict[str, Any] | None, path: Path) -> bool:
    return entry is not None and entry.get("bytes") == path.stat().st_size


def _drop_empty_logs(staging: Path) -> None:
    logs = staging / "logs"
    if logs.is_dir():
        for log in logs.iterdir():
            if log.is_file() and log.stat().st_size == 0:
                log.unlink()
        if not any(logs.iterdir()):
            logs.rmdir()


def write_all(staging: Path, report: dict[str, Any], extra: dict[str, Any]) -> None:
    """report.json, report.md, recipe.json, then manifest.json last."""
    _drop_empty_logs(staging)
    recipe_dict = extra.get("recipe")
    write_json(staging / "recipe.json", recipe_dict)
    write_json(staging / "report.json", report)
    write_atomic(staging / "report.md", render_markdown(report))
    manifest = build_manifest(staging, report, extra.get("checkpoint_files", []), recipe_dict)
    write_json(staging / "manifest.json", manifest)


__all__ = ["assemble", "render_markdown", "write_all", "kernel_summary", "report_schema", "REPORT_SCHEMA_VERSION"]
