"""The library verbs: ``convert`` (the whole pipeline) and ``inspect``.

convert: load -> inputs -> float64 reference -> rewrite attention -> export
targets -> validate numerics -> benchmark -> report. Everything the CLI does is
one call here.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import report as report_mod
from .bench import Timing, interleaved
from .checkpoint import check_finite, load_model
from .environment import check_machine
from .errors import CheckpointError, ExporterError, Interrupted, OutputError
from .inputs import DTYPES, plan_inputs
from .modelio import Signature, discover_outputs
from .numerics import judge
from .outdir import OutputFolder, model_name, os_problem
from .prepare import original_module, rewrite
from .progress import Progress
from .quiet import quiet_libraries
from .recipe import Recipe, load_recipe
from .reference import cast_in_place, run_reference
from .results import FAILED, NUMERICS_FAILED, OK, SKIPPED, VariantResult
from .runners import LocalRunner, Loaded, ModelSource, RemoteRunner, RunnerFailed
from .targets import ORDER, BuildContext, get as get_target
from .targets.exported_program import export_program, first_line


@dataclass
class ConvertResult:
    out: Path
    report: dict[str, Any]
    exit_code: int
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.report.get("passed"))


def resolve_recipe(recipe: str | Path | Recipe, factory: str | None = None) -> Recipe:
    loaded = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    return loaded.with_factory(factory)


def default_out(checkpoint: str | Path, recipe: Recipe) -> Path:
    return Path("artifacts") / model_name(Path(checkpoint)) / recipe.name


@contextlib.contextmanager
def _signals():
    """Turn SIGTERM into an Interrupted exception, like SIGINT's KeyboardInterrupt."""
    def on_term(signum, frame):
        raise Interrupted(signum)

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(signal.SIGINT) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_compile_workers() -> None:
    try:
        from torch._inductor.async_compile import shutdown_compile_workers
    except ImportError:
        return
    with contextlib.suppress(Exception):
        shutdown_compile_workers()


def _save_tensors(path: Path, samples: list[list[torch.Tensor]], names: tuple[str, ...]) -> None:
    from safetensors.torch import save_file

    flat = {f"{i}.{name}": t.detach().cpu().contiguous() for i, sample in enumerate(samples)
            for name, t in zip(names, sample)}
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_file(flat, str(path))
    except OSError as exc:
        raise os_problem(exc, path) from None


def convert(checkpoint: str | Path, recipe: str | Path | Recipe = "cpu-fp32", out: str | Path | None = None, *,
            model: str | None = None, inputs: str | Path | None = None, allow_drift: bool = False,
            allow_pickle: bool = False, overwrite: bool = False, progress: Progress | None = None) -> ConvertResult:
    """Run the whole pipeline on ``checkpoint`` and return the report; files land in ``out``.

    Raises ExporterError for user mistakes (before anything is written) and for interrupts; target
    and numerics failures are reported in the result (``exit_code``), not raised.
    """
    progress = progress or Progress(enabled=False)
    recipe_obj = resolve_recipe(recipe, model)
    check_machine(recipe_obj)
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist", "check the path")
    final = Path(out) if out is not None else default_out(checkpoint, recipe_obj)
    with _signals(), quiet_libraries(), OutputFolder(final, overwrite=overwrite) as folder:
        run = _Run(checkpoint, recipe_obj, folder.staging, inputs, allow_drift, allow_pickle, progress)
        try:
            data = run.execute()
            report_mod.write_all(folder.staging, data, run.manifest_inputs())
        except OSError as exc:
            raise os_problem(exc, folder.staging) from None
        finally:
            run.close()
        published = folder.publish()
    return ConvertResult(published, data, data["exit_code"], data.get("problems", []))


class _Run:
    """State of one convert run (kept off the public API)."""

    def __init__(self, checkpoint: Path, recipe: Recipe, staging: Path, inputs_file, allow_drift: bool,
                 allow_pickle: bool, progress: Progress):
        self.checkpoint = checkpoint
        self.recipe = recipe
        self.staging = staging
        self.inputs_file = inputs_file
        self.allow_drift = allow_drift
        self.allow_pickle = allow_pickle
        self.progress = progress
        self.runners: list[Any] = []
        self.warnings: list[str] = []
        self.loaded = None

    def close(self) -> None:
        for runner in self.runners:
            with contextlib.suppress(Exception):
                runner.close()
        self.runners.clear()

    def manifest_inputs(self) -> dict[str, Any]:
        return {"checkpoint_files": list(self.loaded.checkpoint.files) if self.loaded else [],
                "recipe": self.recipe.to_dict()}

    # ------------------------------------------------------------------ stages

    def execute(self) -> dict[str, Any]:
        recipe, progress = self.recipe, self.progress
        device, dtype = recipe.runtime.device, recipe.runtime.dtype
        t_start = time.perf_counter()

        with progress.stage("load", str(self.checkpoint)):
            self.loaded = loaded = load_model(self.checkpoint, recipe.model.factory, self.allow_pickle)
            bad = check_finite(loaded.model)
            if bad:
                self.warnings.append(f"weights hold NaN or Inf: {', '.join(bad[:8])}")
                progress.warn(self.warnings[-1])

        with progress.stage("inputs"):
            plan = plan_inputs(loaded.model, recipe.inputs, self.inputs_file)
            first = plan.samples[0]
            outputs = discover_outputs(loaded.model, first, recipe.model.outputs)
            signature = Signature(plan.names, outputs)
            samples = [[s[n] for n in plan.names] for s in plan.samples]
            inputs_path = self.staging / "reference" / "inputs.safetensors"
            _save_tensors(inputs_path, samples, plan.names)

        original = original_module(loaded, signature)
        with progress.stage("reference", "original model, float64, cpu"):
            reference = run_reference(original, plan.samples)
            _save_tensors(self.staging / "reference" / "outputs.safetensors", reference.outputs, signature.outputs)

        with progress.stage("rewrite attention"):
            rewritten, audit = rewrite(original, [t for t in samples[0]])
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten, "
                          f"{audit.count('skipped')} skipped")

        loaded.model.to(device=device, dtype=DTYPES[dtype])
        example = [(t.to(DTYPES[dtype]) if t.is_floating_point() else t).to(device) for t in samples[0]]
        source = ModelSource(str(self.checkpoint.resolve()), recipe.model.factory, self.allow_pickle,
                             signature.inputs, signature.outputs, str(inputs_path))
        ctx = BuildContext(rewritten, plan, recipe, self.staging, source, example)
        built = self._build_targets(ctx)
        _stop_compile_workers()  # idle compile workers must not share the CPU with the benchmark

        with progress.stage("validate numerics"):
            eager = LocalRunner("eager", Loaded(lambda a: list(original(*a)), device, DTYPES[dtype]))
            rewritten_runner = LocalRunner("rewritten", Loaded(lambda a: list(rewritten(*a)), device, DTYPES[dtype]))
            self.runners += [eager, rewritten_runner]
            baselines = {(device, dtype): eager.run(samples)}
            rewritten_result = VariantResult("rewritten", "rewritten", device=device, dtype=dtype)
            self._judge(rewritten_result, rewritten_runner.run(samples), reference, baselines[(device, dtype)],
                        signature, f"eager ({device}, {dtype})")
            live = {"eager": eager, "rewritten": rewritten_runner}
            for result, spec in built:
                if spec is None or result.status != OK:
                    continue
                try:
                    runner = RemoteRunner(spec, log=self._log_path(result.name))
                    self.runners.append(runner)
                    result.load_s = runner.load_s
                    outs = runner.run(samples)
                except RunnerFailed as exc:
                    result.fail(FAILED, exc.reason)
                    self._log(result.name, exc.detail)
                    continue
                result.info.update(runner.refresh_info())
                key = (result.device, result.dtype)
                if key not in baselines:
                    baselines[key] = self._eager_outputs_at(original, samples, *key)
                self._judge(result, outs, reference, baselines[key], signature, f"eager ({key[0]}, {key[1]})")
                live[result.name] = runner

        results = [rewritten_result] + [r for r, _ in built]
        by_name = {r.name: r for r in results}
        with progress.stage("benchmark", f"{len(live)} variants"):
            timings = self._benchmark(live, samples[0], by_name)

        eager_bench = None
        for name, runner in live.items():
            if name not in timings:
                continue
            bench = self._bench_entry(timings[name], runner, reference.flops, plan)
            if name == "eager":
                eager_bench = bench
            else:
                by_name[name].bench = bench
        for result in results:
            if result.bench and eager_bench:
                if result.device == device:
                    result.bench["speedup_vs_eager"] = eager_bench["median_ms"] / result.bench["median_ms"]
                else:
                    result.bench["speedup_vs_eager"] = None
                    result.notes.append(f"timed on {result.device}; the eager baseline ran on {device}: no speedup")
            compile_s = result.info.get("compile_s")
            if compile_s is not None:
                result.build_s = compile_s
        self.close()

        return report_mod.assemble(
            recipe=recipe, checkpoint=self.checkpoint, loaded=loaded, plan=plan, signature=signature,
            reference=reference, audit=audit, results=results, eager_bench=eager_bench,
            allow_drift=self.allow_drift, warnings=self.warnings, timings=progress.timings,
            staging=self.staging, total_s=time.perf_counter() - t_start)

    # ------------------------------------------------------------------ helpers

    def _log_path(self, name: str) -> Path:
        logs = self.staging / "logs"
        logs.mkdir(exist_ok=True)
        return logs / f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.log"

    def _log(self, name: str, detail: str) -> None:
        if detail:
            with open(self._log_path(name), "a", encoding="utf-8") as handle:
                handle.write(detail)

    def _build_targets(self, ctx: BuildContext):
        recipe, progress = self.recipe, self.progress
        wanted = [t for t in ORDER if t in recipe.targets.build]
        built: list[tuple[VariantResult, Any]] = []
        needs_program = any(get_target(t).needs_program or t == "exported_program" for t in wanted
                            if get_target(t).unavailable() is None)
        if needs_program:
            with progress.stage("torch.export"):
                t0 = time.perf_counter()
                try:
                    ctx.program = export_program(ctx)
                except Exception as exc:
                    ctx.program_error = first_line(exc)
                    self._log("torch.export", traceback.format_exc())
                    progress.warn(f"torch.export failed: {ctx.program_error}")
                ctx.program_export_s = time.perf_counter() - t0
        for name in wanted:
            target = get_target(name)
            reason = target.unavailable()
            if reason is not None:
                result = VariantResult(name, name, status=SKIPPED, error=reason)
                built.append((result, None))
                progress.info(f"{name}: skipped ({reason})")
                continue
            if (target.needs_program or name == "exported_program") and ctx.program is None:
                result = VariantResult(name, name, status=FAILED,
                                       error=f"needs the exported program, which failed: {ctx.program_error}")
                built.append((result, None))
                continue
            try:
                with progress.stage(f"build {name}"):
                    outputs = target.build(ctx)
            except ExporterError:
                raise
            except Exception as exc:
                result = VariantResult(name, name, status=FAILED, error=f"build failed: {first_line(exc)}")
                self._log(name, traceback.format_exc())
                built.append((result, None))
                continue
            for item in outputs:
                files = [report_mod.file_entry(p, self.staging) for p in item.files]
                runner = item.runner
                result = VariantResult(
                    name, item.name, path=item.path.relative_to(self.staging) if item.path else None, files=files,
                    build_s=item.build_s, notes=list(item.notes), graph=dict(item.graph),
                    device=runner.device if runner else None, dtype=runner.dtype if runner else None)
                built.append((result, runner))
        return built

    def _judge(self, result: VariantResult, outs, reference, baseline, signature: Signature, label: str) -> None:
        dtype = result.dtype or self.recipe.runtime.dtype
        verdict = judge(result.name, signature.outputs, reference.outputs, baseline, outs,
                        self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol, label)
        result.numerics = verdict
        if not verdict.passed:
            worst = verdict.failures[0]
            result.fail(NUMERICS_FAILED, f"output {worst.output} (sample {worst.sample}): {worst.reason}")

    def _eager_outputs_at(self, original, samples, device: str, dtype: str):
        """The original model's outputs on another device/dtype (e.g. float32 on the CPU for ONNX)."""
        with cast_in_place(original, DTYPES[dtype], device), torch.inference_mode():
            runner = LocalRunner("eager", Loaded(lambda a: list(original(*a)), device, DTYPES[dtype]))
            return runner.run(samples)

    def _benchmark(self, live: dict[str, Any], sample, by_name: dict[str, VariantResult]) -> dict[str, list[float]]:
        bench = self.recipe.bench
        failed: dict[str, str] = {}
        for name, runner in list(live.items()):
            try:
                runner.set_bench_input(sample)
            except RunnerFailed as exc:
                failed[name] = exc.reason

        def on_error(variant, exc):
            failed[variant.name] = exc.reason if isinstance(exc, RunnerFailed) else first_line(exc)

        variants = [r for n, r in live.items() if n not in failed]
        timings = interleaved(variants, bench.warmup, bench.rounds, bench.iterations, on_error)
        for name, reason in failed.items():
            if name in by_name:
                by_name[name].fail(FAILED, f"benchmark: {reason}")
            self.warnings.append(f"{name}: benchmark failed: {reason}")
        for name, runner in live.items():
            if name in timings:
                with contextlib.suppress(RunnerFailed):
                    runner.memory_cache = runner.memory()
        return timings

    def _bench_entry(self, times, runner, flops: int, plan) -> dict[str, Any]:
        timing = Timing.of(times)
        batch = plan.samples[0][plan.names[0]].shape[0] if plan.samples[0][plan.names[0]].dim() else 1
        entry: dict[str, Any] = dict(vars(timing))
        entry["throughput_per_s"] = batch * 1000.0 / timing.median_ms if timing.median_ms > 0 else None
        entry["batch"] = int(batch)
        if flops:
            tflops = flops / (timing.median_ms / 1000.0) / 1e12
            entry["tflops"] = tflops
            peak = self.recipe.bench.peak_tflops
            entry["utilisation"] = tflops / peak if peak > 0 else None
        memory = getattr(runner, "memory_cache", None) or {}
        entry.update(memory)
        entry["load_s"] = runner.load_s
        return entry


def inspect(checkpoint: str | Path, recipe: str | Path | Recipe = "cpu-fp32", *, model: str | None = None,
            inputs: str | Path | None = None, allow_pickle: bool = False) -> dict[str, Any]:
    """Architecture, parameter count, dtypes and attention sites of a checkpoint, without exporting."""
    recipe_obj = resolve_recipe(recipe, model)
    loaded = load_model(checkpoint, recipe_obj.model.factory, allow_pickle)
    plan = plan_inputs(loaded.model, recipe_obj.inputs, inputs)
    outputs = discover_outputs(loaded.model, plan.samples[0], recipe_obj.model.outputs)
    signature = Signature(plan.names, outputs)
    original = original_module(loaded, signature)
    _, audit = rewrite(original, [plan.samples[0][n] for n in plan.names])
    dtypes: dict[str, int] = {}
    for info in loaded.checkpoint.entries.values():
        key = str(info.dtype).replace("torch.", "")
        dtypes[key] = dtypes.get(key, 0) + 1
    return {
        "checkpoint": str(checkpoint),
        "files": [str(f) for f in loaded.checkpoint.files],
        "format": loaded.checkpoint.format,
        "bytes": loaded.checkpoint.nbytes,
        "architecture": loaded.architecture.name,
        "architecture_source": loaded.architecture.source,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "tensors": len(loaded.checkpoint.entries),
        "dtypes": dtypes,
        "inputs": {n: list(t.shape) for n, t in plan.samples[0].items()},
        "outputs": list(outputs),
        "attention": audit.to_dict(),
    }
