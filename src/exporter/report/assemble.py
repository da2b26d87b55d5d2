"""The report's data: one dict for ``report.json`` (its JSON Schema: ``schema.json`` beside this module;
the fields in docs/report-schema.md), from everything the stages found.

The sections every report has (the verdict, the model, the recipe, the run's timings and environment) are
made here, once, for the forward report (:func:`assemble`) and the generation report
(:mod:`exporter.report.generation`) alike; both carry :data:`REPORT_SCHEMA_VERSION`."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import Any

from ..dtypes import K_DEFAULTS, name_of
from ..environment import device_info, versions
from ..numerics.tolerance import RULE
from ..outdir import model_name, public_path
from ..quantize.fp8 import fp8_weights
from ..recipe import public_source
from ..results import NUMERICS_FAILED, OK, VariantResult, exit_code, passed, problem_lines

REPORT_SCHEMA_VERSION = 1
MANIFEST_SCHEMA_VERSION = 1
SCHEMA_FILE = Path(__file__).with_name("schema.json")  # shipped in the wheel beside this module


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) every ``report.json`` of this schema version validates against."""
    return json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def verdict_section(rows: list[tuple[str, str, str | None]], allow_drift: bool, warnings: list[str],
                    task: str | None = None) -> dict[str, Any]:
    """The report's head: schema version, when, passed, the exit code and its problems, from each candidate's
    ``(name, status, error)``."""
    head: dict[str, Any] = {"schema_version": REPORT_SCHEMA_VERSION}
    if task is not None:
        head["task"] = task
    return {**head, "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "passed": passed([status for _, status, _ in rows]),
            "exit_code": exit_code((status for _, status, _ in rows), allow_drift), "problems": problem_lines(rows),
            "allow_drift": allow_drift, "warnings": list(warnings)}


def head_sections(rows: list[tuple[str, str, str | None]], quantization, allow_drift: bool, warnings: list[str],
                  task: str, checkpoint: Path, loaded, recipe) -> dict[str, Any]:
    """What every report opens with: the verdict over each candidate's ``(name, status, error)`` and, for a
    quantized run, the second question (what the quantization cost; the first is each candidate's), then the
    model, the recipe and the quantization."""
    if quantization is not None:
        rows = [*rows, ("quantization", OK if quantization.cost.passed else NUMERICS_FAILED, quantization.cost.error())]
    return {**verdict_section(rows, allow_drift, warnings, task=task), "model": model_section(checkpoint, loaded),
            "recipe": recipe_section(recipe),
            "quantization": quantization.to_dict() if quantization is not None else None}


def checkpoint_dtypes(checkpoint) -> dict[str, int]:
    """How many tensors of each dtype a checkpoint holds."""
    dtypes: dict[str, int] = {}
    for info in checkpoint.entries.values():
        key = name_of(info.dtype)
        dtypes[key] = dtypes.get(key, 0) + 1
    return dtypes


def model_section(checkpoint: Path, loaded) -> dict[str, Any]:
    return {
        "name": model_name(Path(checkpoint)),
        "checkpoint": public_path(checkpoint),  # made relative to the output folder once it is known
        "format": loaded.checkpoint.format,
        "architecture": loaded.architecture.name,
        "architecture_source": loaded.architecture.source,
        "parameters": sum(p.numel() for p in loaded.model.parameters()) + fp8_weights(loaded.model),
        "checkpoint_bytes": loaded.checkpoint.nbytes,
        "checkpoint_dtypes": checkpoint_dtypes(loaded.checkpoint),
        "pipeline": loaded.pipeline.to_dict() if loaded.pipeline is not None else None,
        "folder_files": [],  # the checkpoint's config and tokenizer files copied beside the artifacts
    }


def recipe_section(recipe) -> dict[str, Any]:
    return {"name": recipe.name, "source": public_source(recipe), "device": recipe.runtime.device,
            "dtype": recipe.runtime.dtype, "attention_backend": recipe.runtime.attention_backend,
            "rewrite_attention": recipe.runtime.rewrite_attention, "targets": list(recipe.targets.build)}


def run_section(recipe, timings: dict[str, float], total_s: float) -> dict[str, Any]:
    """Each stage's seconds and the whole run's, the software versions and the device."""
    return {"timings_s": {**{k: round(v, 3) for k, v in timings.items()}, "total": round(total_s, 3)},
            "environment": {"versions": versions(), "device": device_info(recipe.runtime.device,
                                                                        host=recipe.report.host)}}


def command_schema(command: str) -> dict[str, Any]:
    """The JSON Schema of ``exporter COMMAND --json`` (verify, validate, inspect, recipes), shipped beside this
    module."""
    return json.loads(SCHEMA_FILE.with_name(f"{command}.schema.json").read_text(encoding="utf-8"))


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
        **({"proofs": result.proofs} if result.proofs else {}),
    }


def assemble(*, recipe, checkpoint, loaded, plan, signature, reference, audit, results, eager_bench, allow_drift,
             warnings, timings, staging, total_s, grid=None, eager_kernels=None, backend_choice=None,
             quantization=None) -> dict[str, Any]:
    dynamic = {name: {str(axis): {"dim": d.name, "min": d.min, "max": d.max} for axis, d in axes.items()}
               for name, axes in plan.dynamic_axes().items()}
    return {
        **head_sections([(r.name, r.status, r.error) for r in results], quantization, allow_drift, warnings, "forward",
                        checkpoint, loaded, recipe),
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
                      "model": "original (eager attention, not rewritten)" if quantization is None else
                      "quantized (its fp8 roundings, every product in float64; eager attention, not rewritten); "
                      "the original model's float64 outputs are reference/original_outputs.safetensors"},
        "tolerance": {"rule": RULE, "k": recipe.numerics.k,
                      "k_default": ", ".join(f"{k:g} for {dtype}" for dtype, k in K_DEFAULTS.items()),
                      "atol": recipe.numerics.atol, "floor": recipe.numerics.floor, "grid": recipe.numerics.grid,
                      "grid_budget": recipe.numerics.grid_budget, "locate": recipe.numerics.locate},
        "attention": {**audit.to_dict(), "backend_choice": backend_choice},
        "baseline": {"name": "eager", "device": recipe.runtime.device, "dtype": recipe.runtime.dtype,
                     "kernels": eager_kernels,
                     "bench": eager_bench},
        "rewritten": _variant_dict(results[0]),
        "artifacts": [_variant_dict(r) for r in results[1:]],
        **run_section(recipe, timings, total_s),
    }


def assemble_check(*, recipe, checkpoint, loaded, plan, signature, reference, results, eager_bench, warnings,
                   timings, total_s, grid, checked, source) -> dict[str, Any]:
    """``exporter check``'s report: the forward report's sections, with what was checked (``check``) in place of
    the attention audit and the rewritten model (nothing is built or rewritten)."""
    dynamic = {name: {str(axis): {"dim": d.name, "min": d.min, "max": d.max} for axis, d in axes.items()}
               for name, axes in plan.dynamic_axes().items()}
    return {
        **verdict_section([(r.name, r.status, r.error) for r in results], False, warnings, task="check"),
        "check": {"artifact": public_path(source), "artifacts": checked},
        "model": model_section(checkpoint, loaded),
        "recipe": recipe_section(recipe),
        "inputs": {
            "source": plan.source, "seed": plan.seed, "seeds": plan.seeds, "samples": len(plan.samples),
            "names": list(signature.inputs),
            "shapes": {n: list(t.shape) for n, t in plan.samples[0].items()},
            "dtypes": {n: str(t.dtype).replace("torch.", "") for n, t in plan.samples[0].items()},
            "dynamic": dynamic, "notes": plan.notes, "grid": grid.to_dict() if grid is not None else None,
        },
        "outputs": list(signature.outputs),
        "reference": {"device": reference.device, "dtype": reference.dtype, "flops": reference.flops,
                      "note": reference.note, "model": "the checkpoint's model (eager attention)"},
        "tolerance": {"rule": RULE, "k": recipe.numerics.k,
                      "k_default": ", ".join(f"{k:g} for {dtype}" for dtype, k in K_DEFAULTS.items()),
                      "atol": recipe.numerics.atol, "floor": recipe.numerics.floor, "grid": recipe.numerics.grid,
                      "grid_budget": recipe.numerics.grid_budget, "locate": recipe.numerics.locate},
        "attention": None,
        "baseline": {"name": "eager", "device": recipe.runtime.device, "dtype": recipe.runtime.dtype,
                     "kernels": None, "bench": eager_bench},
        "rewritten": None,
        "artifacts": [_variant_dict(r) for r in results],
        **run_section(recipe, timings, total_s),
        "memory": None,
    }
