"""``exporter validate OUT_DIR [--locate]``: validate the artifacts of a finished run again, from its checkpoint.

Unlike ``verify`` (which needs only the folder), this rebuilds the original model from the checkpoint the
report names (its hash must still match manifest.json), recomputes the eager baseline, re-runs each
artifact on the stored reference inputs and over the shape grid, and judges it as convert did. With
``--locate`` it finds the first divergent module of every failing candidate (or of every ``--target``,
passing or not). The output folder is not modified: the result is printed (``--json`` for all of it).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from .errors import EXIT_NUMERICS, EXIT_OK, EXIT_TARGET, CheckpointError, UsageError
from .progress import Progress
from .results import FAILED, NUMERICS_FAILED, VariantResult
from .verify import artifact_spec, device_problem, load_reference, out_folder, read_json


def recipe_from_dict(data: dict[str, Any]):
    """The Recipe that ``recipe.json`` (``Recipe.to_dict()``) holds."""
    from .recipe import (BenchSection, Dim, InputsSection, ModelSection, NumericsSection, Recipe, RuntimeSection,
                         TargetsSection, TensorSpec)

    def section(cls, values: dict[str, Any] | None, **special):
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: (tuple(v) if isinstance(v, list) else v) for k, v in (values or {}).items() if k in names}
        kwargs.update({k: v for k, v in special.items() if k in kwargs})
        return cls(**kwargs)

    inputs = data.get("inputs") or {}
    dims = tuple(Dim(**d) for d in inputs.get("dims", []))
    tensors = tuple(TensorSpec(**{**t, "shape": tuple(t["shape"])}) for t in inputs.get("tensors", []))
    return Recipe(name=data.get("name", "recipe"), description=data.get("description", ""),
                  model=section(ModelSection, data.get("model")), runtime=section(RuntimeSection, data.get("runtime")),
                  targets=section(TargetsSection, data.get("targets")),
                  inputs=section(InputsSection, inputs, dims=dims, tensors=tensors),
                  numerics=section(NumericsSection, data.get("numerics")), bench=section(BenchSection, data.get("bench")),
                  source=data.get("source", ""))


def _check_checkpoint(manifest: dict[str, Any], checkpoint: Path) -> None:
    from .checkpoint.files import sha256_file

    for entry in manifest.get("checkpoint", []):
        path = Path(entry["path"])
        if checkpoint.is_dir() and not path.exists():
            path = checkpoint / path.name
        elif checkpoint.is_file() and not path.exists():
            path = checkpoint
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} (read by convert) does not exist",
                                  "pass the checkpoint with --checkpoint")
        if sha256_file(path) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {path} changed since convert (its SHA-256 differs from "
                                  "manifest.json)", "validate with the checkpoint the run was made from")


def validate_folder(out_dir: str | Path, *, locate: bool = False, targets: tuple[str, ...] = (),
                    checkpoint: str | Path | None = None, allow_pickle: bool = False,
                    progress: Progress | None = None) -> dict[str, Any]:
    """Re-validate a finished output folder; a dict with ``exit_code``, ``problems`` and one entry per candidate."""
    import torch

    from .checkpoint import load_model
    from .environment import check_machine
    from .grid import plan_grid
    from .inputs import DTYPES, plan_inputs
    from .modelio import Signature
    from .prepare import original_module
    from .rewrite import rewrite_attention
    from .quiet import quiet_libraries
    from .reference import Reference
    from .runners import RunnerFailed
    from .validate import Validation

    progress = progress or Progress(enabled=False)
    out = out_folder(out_dir)
    if not (out / "manifest.json").is_file():
        raise UsageError(f"{out} has no manifest.json: the convert run never finished", "run exporter convert again")
    manifest, report = read_json(out / "manifest.json"), read_json(out / "report.json")
    recipe = recipe_from_dict(read_json(out / "recipe.json"))
    known = {a["name"] for a in report["artifacts"]} | {"rewritten"}
    unknown = [t for t in targets if t not in known]
    if unknown:
        raise UsageError(f"no variant named {', '.join(unknown)} in {out}", f"choose from {', '.join(sorted(known))}")
    check_machine(recipe)
    source = Path(checkpoint or report["model"]["checkpoint"])
    _check_checkpoint(manifest, source)
    device, dtype = recipe.runtime.device, recipe.runtime.dtype
    with quiet_libraries(), tempfile.TemporaryDirectory(prefix="exporter-validate-") as logs:
        with progress.stage("load", str(source)):
            loaded = load_model(source, recipe.model.factory, allow_pickle)
            samples, reference = load_reference(out, report)
            plan = plan_inputs(loaded.model, recipe.inputs)
            signature = Signature(tuple(report["inputs"]["names"]), tuple(report["outputs"]))
            original = original_module(loaded, signature)
            rewritten, _ = rewrite_attention(original, list(samples[0]), apply=recipe.runtime.rewrite_attention)
            loaded.model.to(device=device, dtype=DTYPES[dtype])
            rewritten.to(device=device, dtype=DTYPES[dtype])
        validation = Validation(recipe, signature, Reference(reference, "float64", 0), samples, original,
                                lambda name: Path(logs) / f"{name.replace(':', '-')}.log")
        results: list[VariantResult] = []
        live: dict[str, Any] = {}
        try:
            with progress.stage("validate numerics"):
                if not targets or "rewritten" in targets:
                    result = VariantResult("rewritten", "rewritten", device=device, dtype=dtype)
                    runner = validation.local("rewritten", rewritten, device, dtype)
                    validation.judge(result, runner.run(samples))
                    results.append(result)
                    live["rewritten"] = runner
                for entry in report["artifacts"]:
                    if (targets and entry["name"] not in targets) or not entry.get("path"):
                        continue
                    result = VariantResult(entry["target"], entry["name"], path=Path(entry["path"]),
                                           device=entry["device"], dtype=entry["dtype"])
                    results.append(result)
                    problem = device_problem(entry["device"])
                    if problem or not (out / entry["path"]).is_file():
                        result.fail(FAILED, problem or f"{entry['path']} is missing")
                        continue
                    runner = validation.remote(result, artifact_spec(entry, out, report))
                    if runner is not None:
                        live[entry["name"]] = runner
            grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
            with progress.stage("shape grid", f"{len(grid.points)} points" if grid else "skipped"):
                candidates = [(r, live[r.name]) for r in results if r.name in live]
                validation.check_grid(grid, plan, candidates, {}, "" if grid else "no dynamic dim, or grid off")
            if locate:
                program = None
                if (out / "model.pt2").is_file():
                    program = torch.export.load(str(out / "model.pt2"))
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
    from .numerics import ratio

    worst = max(result.numerics.checks, key=ratio, default=None)
    return worst.sample if worst is not None else None


def _summarise(out: Path, results: list[VariantResult]) -> dict[str, Any]:
    problems = [f"{r.name}: {'numerics failed: ' if r.status == NUMERICS_FAILED else ''}{r.error}"
                for r in results if r.status in (FAILED, NUMERICS_FAILED)]
    code = (EXIT_NUMERICS if any(r.status == NUMERICS_FAILED for r in results)
            else EXIT_TARGET if any(r.status == FAILED for r in results) else EXIT_OK)
    return {"folder": str(out), "passed": code == EXIT_OK, "exit_code": code, "problems": problems,
            "candidates": [{"name": r.name, "target": r.target, "status": r.status, "error": r.error,
                            "device": r.device, "dtype": r.dtype,
                            "numerics": r.numerics.to_dict() if r.numerics else None} for r in results]}


__all__ = ["validate_folder", "recipe_from_dict"]
