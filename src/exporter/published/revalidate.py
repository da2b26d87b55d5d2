"""``exporter validate OUT_DIR [--locate]``: validate the artifacts of a finished run again, from its checkpoint.

Unlike ``verify`` (which needs only the folder), this rebuilds the original model from the checkpoint the
report names (its hash must still match manifest.json), recomputes the eager baseline, re-runs each
artifact on the stored reference inputs and over the shape grid, and judges it as convert did. With
``--locate`` it finds the first divergent module of every failing candidate (or of every ``--target``,
passing or not). The output folder is not modified: the result is printed (``--json`` for all of it).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from ..checkpoint import load_model
from ..dtypes import torch_dtype
from ..environment import check_machine
from ..errors import EXIT_OK, CheckpointError, RunnerFailed, UsageError
from ..inputs import plan_inputs
from ..modelio import Signature
from ..numerics.grid import plan_grid
from ..numerics.reference import Reference
from ..numerics.validation import Validation
from ..outdir import sha256_file
from ..prepare import original_module
from ..progress import Progress
from ..quantize.transform import quantize_model
from ..quiet import quiet_libraries
from ..recipe import GENERATION_TASKS, recipe_from_dict
from ..results import FAILED, NUMERICS_FAILED, VariantResult, exit_code, problem_lines, ratio
from ..rewrite import rewrite_attention
from ..targets.program_file import load_program
from .reading import artifact_spec, device_problem, load_reference, out_folder, read_json, untrusted_entry


def _check_checkpoint(manifest: dict[str, Any], checkpoint: Path) -> None:
    """Every checkpoint file convert read (``manifest.json`` names them within the checkpoint) is here, unchanged."""
    for entry in manifest.get("checkpoint", []):
        path = checkpoint / Path(entry["path"]).name if checkpoint.is_dir() else checkpoint
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} (read by convert) does not exist",
                                  "pass the checkpoint with --checkpoint")
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} changed since convert (its SHA-256 differs from "
                                  "manifest.json)", "validate with the checkpoint the run was made from")


def recorded_checkpoint(out: Path, recorded: str) -> Path:
    """The checkpoint a report names: relative to the output folder (as convert writes it), else to the
    working folder (an older report, or a name only)."""
    beside = out / recorded
    return beside if beside.exists() else Path(recorded)


def validate_folder(out_dir: str | Path, *, locate: bool = False, targets: tuple[str, ...] = (),
                    checkpoint: str | Path | None = None, allow_pickle: bool = False,
                    progress: Progress | None = None) -> dict[str, Any]:
    """Re-validate a finished output folder; a dict with ``exit_code``, ``problems`` and one entry per candidate."""
    progress = progress or Progress(enabled=False)
    out = out_folder(out_dir)
    if not (out / "manifest.json").is_file():
        raise UsageError(f"{out} has no manifest.json: the convert run never finished", "run exporter convert again")
    manifest, report = read_json(out / "manifest.json"), read_json(out / "report.json")
    listed = {str(f.get("path")) for f in manifest.get("files") or []}
    if report.get("task") in GENERATION_TASKS:
        raise UsageError(f"{out} holds generation programs; exporter validate re-checks forward artifacts only",
                         f"run exporter verify {out} (it re-runs a short generation against the stored reference), "
                         "or convert again with --task text-generation")
    recipe = recipe_from_dict(read_json(out / "recipe.json"), source=str(out / "recipe.json"))
    known = {a["name"] for a in report["artifacts"]} | {"rewritten"}
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise UsageError(f"no variant named {', '.join(unknown)} in {out}", f"choose from {', '.join(sorted(known))}")
    check_machine(recipe)
    source = Path(checkpoint) if checkpoint else recorded_checkpoint(out, report["model"]["checkpoint"])
    _check_checkpoint(manifest, source)
    device, dtype = recipe.runtime.device, recipe.runtime.dtype
    with quiet_libraries(), tempfile.TemporaryDirectory(prefix="exporter-validate-") as logs:
        with progress.stage("load", str(source)):
            loaded = load_model(source, recipe.model.factory, allow_pickle, recipe.model.pipeline)
            if recipe.quantize.enabled:  # the artifacts were judged against the quantized model: rebuild it
                q = recipe.quantize
                quantize_model(loaded.model, q.scheme, q.exclude, q.include_head, keep_originals=False)
            samples, reference = load_reference(out, report)
            plan = plan_inputs(loaded.model, recipe.inputs)
            signature = Signature(tuple(report["inputs"]["names"]), tuple(report["outputs"]))
            original = original_module(loaded, signature)
            rewritten, _ = rewrite_attention(original, list(samples[0]), apply=recipe.runtime.rewrite_attention)
            loaded.model.to(device=device, dtype=torch_dtype(dtype))
            rewritten.to(device=device, dtype=torch_dtype(dtype))
        reference = [[t.to(device) for t in outputs] for outputs in reference]  # compared where it runs
        validation = Validation(recipe, signature, Reference(reference, "float64", 0, device=device), samples,
                                original, lambda name: Path(logs) / f"{name.replace(':', '-')}.log")
        results: list[VariantResult] = []
        live: dict[str, Any] = {}
        try:
            with progress.stage("validate numerics"):
                if not targets or "rewritten" in targets:
                    result = VariantResult("rewritten", "rewritten", device=device, dtype=dtype)
                    runner = validation.local("rewritten", rewritten, device, dtype)
                    validation.judge(result, runner)
                    results.append(result)
                    live["rewritten"] = runner
                for entry in report["artifacts"]:
                    if (targets and entry["name"] not in targets) or not entry.get("path"):
                        continue
                    result = VariantResult(entry["target"], entry["name"], path=Path(entry["path"]),
                                           device=entry["device"], dtype=entry["dtype"])
                    results.append(result)
                    refused = untrusted_entry(out, report, entry, listed, {"native_code": False,
                                                                           "artifact_pickle": False})
                    if refused is not None:  # what verify would not load, validate does not either
                        result.fail(FAILED, refused.line())
                        continue
                    problem = device_problem(entry["device"])
                    if problem or not (out / entry["path"]).is_file():
                        result.fail(FAILED, problem or f"{entry['path']} is missing")
                        continue
                    remote = validation.remote(result, artifact_spec(entry, out, report))
                    if remote is not None:
                        live[entry["name"]] = remote
            grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
            with progress.stage("shape grid", f"{len(grid.points)} points" if grid else "skipped"):
                candidates = [(r, live[r.name]) for r in results if r.name in live]
                validation.check_grid(grid, plan, candidates, {}, "" if grid else "no dynamic dim, or grid off")
            if locate:
                program = None
                if (out / "model.pt2").is_file():
                    program = load_program(out / "model.pt2")
                chosen = [r for r in results if r.numerics is not None and
                          (r.status == NUMERICS_FAILED or (targets and r.name in targets))]
                with progress.stage("locate divergence", ", ".join(r.name for r in chosen) or "nothing failed"):
                    for result in chosen:
                        index = None if result.status == NUMERICS_FAILED else _worst_sample(result)
                        validation.locate(result, rewritten, plan, grid, program, sample_index=index)
        except RunnerFailed as exc:  # a runner that broke outside the per-artifact handling
            raise UsageError(f"validation stopped: {exc.reason}", "run exporter verify on the folder") from None
        finally:
            validation.close()
    return _summarise(out, results)


def _worst_sample(result: VariantResult) -> int | None:
    """The sample a candidate asked for by name is localised on: its worst (the one nearest its bar)."""
    if result.numerics is None:
        return None
    worst = max(result.numerics.checks, key=ratio, default=None)
    return worst.sample if worst is not None else None


def _summarise(out: Path, results: list[VariantResult]) -> dict[str, Any]:
    problems = problem_lines((r.name, r.status, r.error) for r in results)
    code = exit_code(r.status for r in results)
    return {"schema_version": 1, "command": "validate", "folder": str(out), "passed": code == EXIT_OK,
            "exit_code": code, "problems": problems,
            "candidates": [{"name": r.name, "target": r.target, "status": r.status, "error": r.error,
                            "device": r.device, "dtype": r.dtype,
                            "numerics": r.numerics.to_dict() if r.numerics else None} for r in results]}


__all__ = ["validate_folder"]
