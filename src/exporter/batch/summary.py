"""The batch's own report: ``batch.json`` for machines, ``batch.md`` for people, JUnit with a case per cell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import junit as junit_mod
from ..outdir import write_atomic, write_json
from .cell import NOT_RUN, PASSED, SKIPPED, read_report

SCHEMA_VERSION = 1


def cell_figures(root: Path, name: str) -> dict[str, Any] | None:
    """What the summary shows of a cell's own report: verdict, convert time, speedups, memory."""
    report = read_report(root / name)
    if report is None:
        return None
    speedups: dict[str, float | None] = {}
    unsupported = []  # speedups the timings' noise does not support (report.md marks them ⚠)
    for artifact in report.get("artifacts", []):
        bench = artifact.get("bench") or {}
        name = artifact.get("name") or artifact.get("target")
        value = bench.get("speedup_vs_eager")
        if value is None:  # a generation report: decode against eager generate, batch 1
            value = (bench.get("decode_speedup_vs_eager_generate") or {}).get("batch_1")
        elif bench.get("speedup_supported") is False:
            unsupported.append(name)
        speedups[name] = round(value, 3) if value is not None else None
    memory = report.get("memory") or {}
    return {"passed": bool(report.get("passed")), "exit_code": report.get("exit_code"),
            "task": report.get("task", "forward"), "convert_s": (report.get("timings_s") or {}).get("total"),
            "speedups": speedups, "speedups_unsupported": unsupported,
            "tree_peak_pss_bytes": (memory.get("tree") or {}).get("tree_peak_pss_bytes"),
            "created": report.get("created")}


def assemble(plan: dict[str, Any], engine: dict[str, Any], cells: list[dict[str, Any]], wall_s: float,
             exit_code: int, stopped_by: str | None, compile_cache: str) -> dict[str, Any]:
    ran = [c for c in cells if c["status"] not in (SKIPPED, NOT_RUN) and c.get("run_s") is not None]
    busy = sum(c["run_s"] for c in ran) + sum(a.get("run_s") or 0.0 for c in cells for a in c.get("lost_attempts", []))
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell["status"]] = counts.get(cell["status"], 0) + 1
    workers = max(int(engine.get("workers") or 1), 1)
    return {
        "schema_version": SCHEMA_VERSION,
        "command": "batch",
        "plan": plan,
        "engine": engine,
        "compile_cache": compile_cache,
        "passed": exit_code == 0,
        "exit_code": exit_code,
        "stopped_by": stopped_by,
        "counts": counts,
        "timings": {
            "wall_s": round(wall_s, 3),
            "cells_s": round(busy, 3),  # the cells' own processes, one after another
            # worker time not spent inside a cell's process, per cell run: dispatch, start-up, idle workers
            "overhead_per_cell_s": round(max(wall_s * min(workers, len(ran) or 1) - busy, 0.0) / len(ran), 3)
            if ran else None,
            "speedup_vs_cells_in_turn": round(busy / wall_s, 3) if ran and wall_s > 0 else None,
        },
        "cells": cells,
    }


def _gib(value: int | None) -> str:
    return f"{value / 2**30:.1f}" if value else "—"


def _seconds(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "—"


VERDICT = {"passed": "✅ passed", "skipped": "✅ done earlier", "failed": "❌ failed", "lost": "❌ lost",
           "interrupted": "⏹ interrupted", "not run": "— not run"}


def render(summary: dict[str, Any]) -> str:
    t = summary["timings"]
    engine = summary["engine"]
    where = engine["scheduler"] or "this host"
    verdict = "passed" if summary["passed"] else f"FAILED (exit {summary['exit_code']})"
    lines = [f"# exporter batch: {summary['plan']['path']} — {verdict}", "",
             f"- Cells: {len(summary['cells'])} ({', '.join(f'{v} {k}' for k, v in summary['counts'].items())})",
             f"- Engine: {engine['kind']} on {where}, {engine['workers']} worker(s)" +
             (f", GPUs {', '.join(engine['gpus'])}" if engine.get("gpus") else ""),
             f"- Wall time: {t['wall_s']:.1f} s; the cells' own processes: {t['cells_s']:.1f} s"
             + (f" ({t['speedup_vs_cells_in_turn']:.2f}× running them in turn); overhead "
                f"{t['overhead_per_cell_s']:.2f} s per cell" if t["overhead_per_cell_s"] is not None else ""),
             f"- Compile cache shared by the cells: `{summary['compile_cache']}`"]
    if t.get("engine_start_s"):
        lines.insert(-1, f"- Engine start (not in the wall time): {t['engine_start_s']:.1f} s")
    if summary.get("stopped_by"):
        lines.append(f"- Stopped by {summary['stopped_by']}: running cells were stopped, nothing half-written was "
                     "published, cells not started were not run")
    lines += ["", "| cell | recipe | verdict | wall s | convert s | speedups | tree GiB | worker | attempts |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for cell in summary["cells"]:
        figures = cell.get("report") or {}
        noisy = set(figures.get("speedups_unsupported") or ())
        speedups = ", ".join(f"{k} {v:.2f}×{' ⚠' if k in noisy else ''}"
                             for k, v in (figures.get("speedups") or {}).items() if v is not None)
        lines.append(f"| [`{cell['name']}`]({cell['name']}/report.md) | {cell['recipe']} | "
                     f"{VERDICT.get(cell['status'], cell['status'])} | {_seconds(cell.get('run_s'))} | "
                     f"{_seconds(figures.get('convert_s'))} | {speedups or '—'} | "
                     f"{_gib(figures.get('tree_peak_pss_bytes'))} | {cell.get('worker') or '—'} | "
                     f"{cell.get('attempt') or '—'} |")
    if any(c.get("report") and c["report"].get("speedups_unsupported") for c in summary["cells"]):
        lines += ["", "⚠: a speedup its cell's timings do not support (noise; the cell's report.md says how much)."]
    problems = [c for c in summary["cells"] if c["status"] not in (PASSED, SKIPPED)]
    if problems:
        lines += ["", "## Cells that did not pass", ""]
        for cell in problems:
            log = f" (log: `{cell['log']}`)" if cell.get("log") else ""
            lines.append(f"- **{cell['name']}** ({cell['status']}, exit {cell.get('exit_code')}): "
                         f"{cell.get('error') or 'no error line'}{log}")
    return "\n".join(lines) + "\n"


def junit_cases(summary: dict[str, Any]) -> list[junit_mod.Case]:
    cases = []
    for cell in summary["cells"]:
        passed = True if cell["status"] in (PASSED, SKIPPED) else None if cell["status"] == NOT_RUN else False
        message = cell.get("error") or ("finished in an earlier run; not run again" if cell["status"] == SKIPPED
                                        else "")
        cases.append(junit_mod.Case(f"exporter.batch.{cell['recipe']}", cell["name"], passed, message,
                                    cell.get("run_s") or 0.0))
    return cases


def write(root: Path, summary: dict[str, Any], junit: str | Path | None) -> None:
    write_json(root / "batch.json", summary)
    write_atomic(root / "batch.md", render(summary))
    if junit is not None:
        junit_mod.write(junit, "exporter batch", junit_cases(summary), summary["timings"]["wall_s"])


__all__ = ["assemble", "cell_figures", "junit_cases", "render", "write"]
