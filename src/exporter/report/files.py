"""Writing the output folder's records: ``recipe.json``, ``report.json``, ``report.md``, the chart, and
``manifest.json`` last, so its presence means the run finished."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..outdir import sha256_file, write_atomic, write_json
from .assemble import MANIFEST_SCHEMA_VERSION
from .chart import write_chart, write_generation_chart
from .generation import TASKS, render_generation
from .markdown import render_markdown


def build_manifest(staging: Path, report: dict[str, Any], checkpoint_files: list[Path], recipe_dict) -> dict:
    """Every file of the output folder and of the checkpoint with its SHA-256 (hashed in parallel; an
    artifact's hash, taken when it was built, is reused while its size is unchanged)."""
    known = {f["path"]: f for a in report["artifacts"] for f in (a.get("files") or [])}
    paths = [p for p in sorted(staging.rglob("*")) if p.is_file() and p.name != "manifest.json"]
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
        "quantization": _quantization_record(report.get("quantization")),
        "versions": report["environment"]["versions"],
        "device": report["environment"]["device"],
    }


def _quantization_record(q: dict[str, Any] | None) -> dict[str, Any] | None:
    """What a release records of the weight transform: the scheme, what stayed unquantized, the scales' dtype
    and the budget the second question was judged against."""
    if not q:
        return None
    return {"scheme": q["scheme"], "weight_dtype": q["weight_dtype"], "scales_dtype": q["scales"]["dtype"],
            "excluded": q["excluded"], "fallback": [f["name"] for f in q["fallback"]], "budget": q["budget"],
            "passed": q["passed"]}


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
    """recipe.json, report.png, report.json, report.md, then manifest.json last."""
    _drop_empty_logs(staging)
    recipe_dict = extra.get("recipe")
    write_json(staging / "recipe.json", recipe_dict)
    if report.get("task") in TASKS:
        report["chart"] = write_generation_chart(report, staging)
        write_json(staging / "report.json", report)
        write_atomic(staging / "report.md", render_generation(report))
    else:
        report["chart"] = write_chart(report, staging)
        write_json(staging / "report.json", report)
        write_atomic(staging / "report.md", render_markdown(report))
    manifest = build_manifest(staging, report, extra.get("checkpoint_files", []), recipe_dict)
    write_json(staging / "manifest.json", manifest)
