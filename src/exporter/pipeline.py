"""One convert run, stage by stage: load -> inputs -> reference -> rewrite -> export -> validate -> benchmark.

``exporter.api.convert`` owns the output folder and the report; this module
owns the order of the stages and what passes between them.
"""

from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path
from typing import Any

import torch

from . import report as report_mod
from .bench import run_benchmark, summarize
from .checkpoint import check_finite, load_model
from .checkpoint.loader import listing
from .errors import CheckpointError
from .grid import onnx_signature, plan_grid, program_signature
from .inputs import DTYPES, plan_inputs
from .modelio import Signature, discover_outputs
from .outdir import os_problem
from .prepare import original_module
from .backend_choice import why_not
from .rewrite import rewrite_attention
from .progress import Progress
from .recipe import Recipe
from .reference import run_reference
from .results import FAILED, NUMERICS_FAILED, OK, VariantResult
from .runners import ModelSource, RunnerFailed
from .targets import BuildContext, build_targets
from .targets.exported_program import first_line
from .validate import Validation


def save_tensors(path: Path, samples: list[list[torch.Tensor]], names: tuple[str, ...]) -> None:
    """Samples as one safetensors file, keys ``<sample>.<name>``."""
    from safetensors.torch import save_file

    flat = {f"{i}.{name}": t.detach().cpu().contiguous() for i, sample in enumerate(samples)
            for name, t in zip(names, sample)}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file(flat, str(path))
    except OSError as exc:
        raise os_problem(exc, path) from None


def stop_compile_workers() -> None:
    """Idle Inductor compile workers must not share the CPU with the benchmark."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:
        return
    with contextlib.suppress(Exception):
        shutdown_compile_workers()


class ConvertRun:
    def __init__(self, checkpoint: Path, recipe: Recipe, staging: Path, inputs_file, allow_drift: bool,
                 allow_pickle: bool, progress: Progress):
        self.checkpoint = checkpoint
        self.recipe = recipe
        self.staging = staging
        self.inputs_file = inputs_file
        self.allow_drift = allow_drift
        self.allow_pickle = allow_pickle
        self.progress = progress
        self.warnings: list[str] = []
        self.loaded = None
        self.validation: Validation | None = None
        self.grid = None  # the shape grid's plan (exporter.grid.GridPlan), when there is one

    def close(self) -> None:
        if self.validation is not None:
            self.validation.close()

    def manifest_inputs(self) -> dict[str, Any]:
        return {"checkpoint_files": list(self.loaded.checkpoint.files) if self.loaded else [],
                "recipe": self.recipe.to_dict()}

    def log_path(self, name: str) -> Path:
        logs = self.staging / "logs"
        logs.mkdir(exist_ok=True)
        return logs / f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.log"

    def log(self, name: str, detail: str) -> None:
        if detail:
            with open(self.log_path(name), "a", encoding="utf-8") as handle:
                handle.write(detail)

    def execute(self) -> dict[str, Any]:
        recipe, progress = self.recipe, self.progress
        device, dtype = recipe.runtime.device, recipe.runtime.dtype
        t_start = time.perf_counter()

        with progress.stage("load", str(self.checkpoint)):
            self.loaded = loaded = load_model(self.checkpoint, recipe.model.factory, self.allow_pickle)
            bad = check_finite(loaded.model)
            if bad:
                names = listing(bad)
                if recipe.model.nonfinite_weights == "error":
                    raise CheckpointError(f"checkpoint {self.checkpoint} holds NaN or Inf in {names}",
                                          "fix the weights, or set [model] nonfinite_weights = \"warn\"")
                self.warnings.append(f"weights hold NaN or Inf: {names}")
                progress.warn(self.warnings[-1])

        with progress.stage("inputs"):
            plan = plan_inputs(loaded.model, recipe.inputs, self.inputs_file)
            outputs = discover_outputs(loaded.model, plan.samples[0], recipe.model.outputs)
            signature = Signature(plan.names, outputs)
            samples = [[s[n] for n in plan.names] for s in plan.samples]
            inputs_path = self.staging / "reference" / "inputs.safetensors"
            save_tensors(inputs_path, samples, plan.names)

        original = original_module(loaded, signature)
        with progress.stage("reference", "original model, float64, cpu"):
            reference = run_reference(original, plan.samples)
            save_tensors(self.staging / "reference" / "outputs.safetensors", reference.outputs, signature.outputs)

        with progress.stage("rewrite attention"):
            rewritten, audit = rewrite_attention(original, list(samples[0]), apply=recipe.runtime.rewrite_attention)
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten, "
                          f"{audit.count('skipped')} skipped")

        loaded.model.to(device=device, dtype=DTYPES[dtype])
        rewritten.to(device=device, dtype=DTYPES[dtype])  # a rewritten graph may hold its own buffers
        example = [(t.to(DTYPES[dtype]) if t.is_floating_point() else t).to(device) for t in samples[0]]
        source = ModelSource(str(self.checkpoint.resolve()), recipe.model.factory, self.allow_pickle,
                             signature.inputs, signature.outputs, str(inputs_path), recipe.runtime.rewrite_attention)
        ctx = BuildContext(rewritten, plan, recipe, self.staging, source, example)
        built = build_targets(ctx, progress, self.log)
        stop_compile_workers()

        self.validation = validation = Validation(recipe, signature, reference, samples, original, self.log_path)
        with progress.stage("validate numerics"):
            eager = validation.local("eager", original, device, dtype)
            validation.set_baseline(device, dtype, eager.run(samples))
            rewritten_runner = validation.local("rewritten", rewritten, device, dtype)
            rewritten_result = VariantResult("rewritten", "rewritten", device=device, dtype=dtype)
            if not recipe.runtime.rewrite_attention:
                rewritten_result.notes.append("rewrite off: this is the model as written, the same module as eager")
            validation.judge(rewritten_result, rewritten_runner.run(samples))
            live: dict[str, Any] = {"eager": eager, "rewritten": rewritten_runner}
            for result, spec in built:
                if spec is not None and result.status == OK:
                    runner = validation.remote(result, spec)
                    if runner is not None:
                        live[result.name] = runner

        results = [rewritten_result] + [r for r, _ in built]
        self._grid_and_locate(validation, results, live, plan, ctx.program, rewritten)
        eager_bench = self._benchmark(live, samples[0], results, reference.flops, plan)
        eager_kernels, choice = self._kernels(live, samples[0], results)
        validation.close()

        return report_mod.assemble(
            recipe=recipe, checkpoint=self.checkpoint, loaded=loaded, plan=plan, signature=signature,
            reference=reference, audit=audit, results=results, eager_bench=eager_bench,
            allow_drift=self.allow_drift, warnings=self.warnings, timings=progress.timings,
            staging=self.staging, total_s=time.perf_counter() - t_start, grid=self.grid, eager_kernels=eager_kernels,
            backend_choice=choice)

    def _kernels(self, live: dict[str, Any], sample, results: list[VariantResult]):
        """Which attention kernels each variant actually ran (one profiled call each), and why: PyTorch's own
        verdict on each SDPA call of the rewritten model (``backend_choice``). Returns (eager's kernels, verdict)."""
        by_name = {r.name: r for r in results}
        preferred = self.recipe.runtime.attention_backend
        eager, choice = None, None
        with self.progress.stage("attention kernels"):
            try:
                choice = live["rewritten"].call("sdpa_choice", sample)
            except Exception as exc:  # the audit explains; it never fails a variant
                choice = {"error": first_line(exc), "calls": []}
            for name, runner in live.items():
                try:
                    found = runner.call("kernels", sample)
                except Exception as exc:  # the audit explains; it never fails a variant
                    found = {"source": "error", "note": exc.reason if isinstance(exc, RunnerFailed) else first_line(exc)}
                if name == "eager":
                    eager = found
                    continue
                result = by_name.get(name)
                if result is None:
                    continue
                result.info["kernels"] = found
                ran = set(found.get("backends") or {})
                if preferred != "auto" and ran and preferred not in ran:
                    why = why_not(choice, preferred)
                    result.notes.append(f"attention backend: {preferred} was preferred, {', '.join(sorted(ran))} ran"
                                        + (f" ({why})" if why else ""))
                elif "math" in ran:
                    why = "; ".join(f"{b}: {w}" for b in ("flash", "cudnn", "efficient") if (w := why_not(choice, b)))
                    result.notes.append("attention ran on the math backend" + (f" ({why})" if why else ""))
        return eager, choice

    def _grid_and_locate(self, validation: Validation, results: list[VariantResult], live: dict[str, Any], plan,
                         program, rewritten) -> None:
        """The shape grid for every loaded candidate but the compile variants, then localisation of each failure."""
        recipe, progress = self.recipe, self.progress
        self.grid = grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
        why_not = ("numerics.grid = false" if not recipe.numerics.grid
                   else "the recipe declares no dynamic dim" if grid is None else "")
        candidates, signatures = [], {}
        for result in results:
            if result.name not in live or result.numerics is None:
                continue
            if result.target == "compile":
                result.numerics.grid = {"checked": False, "passed": True, "points": [],
                                        "reason": "a benchmark variant (static shapes, no artifact): not on the grid"}
                continue
            candidates.append((result, live[result.name]))
            try:
                signatures[result.name] = self._signature(result, plan, program)
            except Exception as exc:  # reading a signature must not fail the run: the grid still runs the shapes
                signatures[result.name] = {"signature_source": f"unreadable ({first_line(exc)})"}
        detail = f"{len(grid.points)} points x {len(candidates)} candidates" if grid else f"skipped: {why_not}"
        with progress.stage("shape grid", detail):
            validation.check_grid(grid, plan, candidates, signatures, why_not)
        for warning in validation.warnings:
            self.warnings.append(warning)
            progress.warn(warning)
        for result, runner in candidates:
            process = getattr(runner, "process", None)
            if process is not None and process.poll() is not None:
                live.pop(result.name, None)
        failing = [r for r in results if r.status == NUMERICS_FAILED]
        if recipe.numerics.locate and failing:
            with progress.stage("locate divergence", ", ".join(r.name for r in failing)):
                for result in failing:
                    try:
                        validation.locate(result, rewritten, plan, grid, program)
                    except Exception as exc:  # localisation explains a failure; it never hides one
                        self.warnings.append(f"{result.name}: localisation failed: {first_line(exc)}")
                        self.log(result.name, f"localisation failed: {exc!r}\n")

    def _signature(self, result: VariantResult, plan, program) -> dict[str, Any]:
        if result.target in ("exported_program", "aoti") and program is not None:
            source = ("exported program placeholders and range constraints" if result.target == "exported_program"
                      else "the exported program the package was compiled from")
            return {**program_signature(program, plan), "signature_source": source}
        if result.target == "onnx" and result.path is not None:
            return {**onnx_signature(self.staging / result.path, plan), "signature_source": "model.onnx graph inputs"}
        return {}

    def _benchmark(self, live: dict[str, Any], sample, results: list[VariantResult], flops: int, plan):
        settings, device = self.recipe.bench, self.recipe.runtime.device
        by_name = {r.name: r for r in results}

        def describe(exc: BaseException) -> str:
            return exc.reason if isinstance(exc, RunnerFailed) else first_line(exc)

        with self.progress.stage("benchmark", f"{len(live)} variants"):
            timings, failed = run_benchmark(live, sample, settings.warmup, settings.rounds, settings.iterations,
                                            describe)
        for name, reason in failed.items():
            if name in by_name:
                by_name[name].fail(FAILED, f"benchmark: {reason}")
            self.warnings.append(f"{name}: benchmark failed: {reason}")
        first = plan.samples[0][plan.names[0]]
        batch = int(first.shape[0]) if first.dim() else 1
        eager_bench = None
        for name, runner in live.items():
            if name not in timings:
                continue
            entry = summarize(timings[name], batch, flops, settings.peak_tflops)
            with contextlib.suppress(RunnerFailed):
                entry.update(runner.memory())
            entry["load_s"] = runner.load_s
            if name == "eager":
                eager_bench = entry
            else:
                by_name[name].bench = entry
        for result in results:
            if result.bench and eager_bench:
                if result.device == device:
                    result.bench["speedup_vs_eager"] = eager_bench["median_ms"] / result.bench["median_ms"]
                else:
                    result.bench["speedup_vs_eager"] = None
                    result.notes.append(f"timed on {result.device}; the eager baseline ran on {device}: no speedup")
            if result.info.get("compile_s") is not None:
                result.build_s = result.info["compile_s"]
        return eager_bench
