"""The validate stage: run every candidate on every sample and judge it against the float64 reference.

Artifacts run in their own processes (``RemoteRunner``); the eager models run
here. Each candidate is judged against the eager model at the candidate's own
device and dtype (the "baseline"), so an ONNX model validated in float32 on the
CPU meets a float32 bar, not the recipe's bf16 one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..dtypes import torch_dtype
from ..errors import describe
from ..inputs import InputPlan
from ..measure import backend_choice
from ..measure.kernels import hook
from ..modelio import IOModule, Signature, cast_in_place
from ..recipe import Recipe
from ..results import FAILED, NUMERICS_FAILED, OK, OutputCheck, VariantResult, ratio
from ..rewrite.graph_capture import TracedModule
from ..runners import LocalRunner, RemoteRunner, RunnerFailed, Spares
from ..targets.spec import Loaded, RunnerSpec
from .compare import InMemory, read_stream, rmse_of
from .grid import GridPlan, artifact_signature, describe_signature, plan_grid, point_sample
from .locate import locate
from .reference import Reference, full_float32, run_reference
from .tolerance import explain_bar, relative_floor, verdict_of_checks, widened

# What localisation replays for each kind of candidate (the report quotes these).
REPLAYED = {
    "rewritten": "the rewritten model's submodules, eager",
    "exported_program": "the rewritten eager model's submodules (the model the program was exported from)",
    "aoti": "the rewritten eager model's submodules: an AOTInductor package is monolithic",
    "onnx": "the rewritten eager model's submodules: an ONNX model is monolithic",
    "compile": "the rewritten eager model's submodules: torch.compile's kernels cannot be replayed one module at a "
               "time",
}
PROGRAM_REPLAYED = {
    "rewritten": "the submodules of the exported program of the rewritten model (torch.export.unflatten), run end "
                 "to end: its attention was rewritten in a graph, so its eager submodules are the original ones",
    "exported_program": "the exported program's submodules (torch.export.unflatten), run end to end",
    "aoti": "the submodules of the exported program the package was compiled from (torch.export.unflatten), "
            "run end to end",
    "onnx": "the submodules of the exported program the ONNX model was exported from (torch.export.unflatten), "
            "run end to end",
}


def not_on_grid(result: VariantResult) -> None:
    if result.numerics is not None:
        result.numerics.grid = {"checked": False, "passed": True, "points": [],
                                "reason": "a benchmark variant (static shapes): not on the grid"}


def inherit_verdicts(results: list[VariantResult]) -> None:
    """A variant that runs another variant's artifact (the AOTI package replayed from a CUDA graph) fails where
    that artifact failed: it is judged at the samples only, but it is the same compiled code, so a failure the
    artifact showed anywhere (a grid point, a sample) is its failure too, localised the same way. One that failed
    on its own (a proof of the program it runs) and was not localised takes the artifact's localisation too: the
    replay cannot be run module by module, and it is the same compiled code."""
    by_name = {r.name: r for r in results}
    for result in results:
        parent = by_name.get(result.replays or "")
        if parent is None or parent.status != NUMERICS_FAILED or result.numerics is None or parent.numerics is None:
            continue
        if result.status == OK:
            result.fail(NUMERICS_FAILED, f"runs the {parent.name} artifact, which failed numerics: {parent.error}")
            result.numerics.passed = False
            result.numerics.locate = parent.numerics.locate
            result.numerics.grid = {"checked": False, "passed": (parent.numerics.grid or {}).get("passed", True),
                                    "points": [], "reason": f"not on the grid itself; {parent.name}'s verdict "
                                                            "applies (the same artifact)"}
        elif result.status == NUMERICS_FAILED and result.numerics.locate is None:
            result.numerics.locate = parent.numerics.locate


class Validation:
    """Judges candidates against the float64 reference, on the device the reference lives on.

    Only the eager baseline's error (its RMSE against the reference, per sample and output) is kept, never
    its outputs; candidates' outputs are compared chunk by chunk as they arrive (:mod:`.compare`).
    """

    def __init__(self, recipe: Recipe, signature: Signature, reference: Reference, samples: list[list[torch.Tensor]],
                 original: IOModule, log_path: Callable[[str], Path], spares: Spares | None = None):
        self.recipe = recipe
        self.spares = spares  # children started ahead of need (runners.Spares), taken by start()
        self.signature = signature
        self.reference = reference
        self.samples = samples
        self.original = original
        self.log_path = log_path
        self.base_rmse: dict[tuple[str, str], list[list[float]]] = {}
        self.warnings: list[str] = []  # for the run's warnings (e.g. grid points the model itself cannot take)
        self.runners: list[Any] = []

    def local(self, name: str, module: torch.nn.Module, device: str, dtype: str) -> LocalRunner:
        hooks = {"kernels": hook(device),
                 "sdpa_choice": backend_choice.hook(device, self.recipe.runtime.attention_backend)}
        runner = LocalRunner(name, Loaded(lambda args: list(module(*args)), device, torch_dtype(dtype), hooks=hooks))
        self.runners.append(runner)
        return runner

    def baseline_place(self, device: str, dtype: str) -> tuple[str, str]:
        """Where the eager baseline for a candidate at (device, dtype) runs: there, except that a candidate on
        the CPU of a GPU recipe (ONNX without onnxruntime's CUDA provider) gets its dtype's baseline on the GPU
        (TF32 off): the same precision, without a CPU copy of a large model."""
        if device == "cpu" and self.recipe.runtime.device != "cpu":
            return self.recipe.runtime.device, dtype
        return device, dtype

    def baseline_label(self, device: str, dtype: str) -> str:
        return "eager ({}, {})".format(*self.baseline_place(device, dtype))

    def set_baseline(self, device: str, dtype: str, runner: LocalRunner) -> None:
        """The eager model as it stands (the recipe's device and dtype), run through ``runner``."""
        self.base_rmse[(device, dtype)] = [self._rmse(runner.session.outputs(sample), refs)
                                           for sample, refs in zip(self.samples, self.reference.outputs)]

    def baseline_rmse(self, device: str, dtype: str) -> list[list[float]]:
        """Per sample and output, the RMSE of the original model at ``device``/``dtype`` against the reference."""
        key = self.baseline_place(device, dtype)
        if key not in self.base_rmse:
            self.base_rmse[key] = self.eager_rmse(self.samples, self.reference.outputs, *key)
        return self.base_rmse[key]

    def eager_rmse(self, samples: list[list[torch.Tensor]], references: list[list[torch.Tensor]], device: str,
                   dtype: str) -> list[list[float]]:
        """The original model cast in place to ``device``/``dtype`` (restored afterwards), run on ``samples``."""
        cast = torch_dtype(dtype)
        with cast_in_place(self.original, cast, device), torch.inference_mode(), full_float32():
            runner = LocalRunner("eager", Loaded(lambda a: list(self.original(*a)), device, cast))
            return [self._rmse(runner.session.outputs(sample), refs) for sample, refs in zip(samples, references)]

    @staticmethod
    def _rmse(outputs: list[torch.Tensor], references: list[torch.Tensor]) -> list[float]:
        return [rmse_of(ref, out) if ref.is_floating_point() and tuple(out.shape) == tuple(ref.shape) else 0.0
                for out, ref in zip(outputs, references)]

    def where(self, result: VariantResult) -> tuple[str, str]:
        return result.device or self.recipe.runtime.device, result.dtype or self.recipe.runtime.dtype

    def compare(self, stream: Iterator[tuple], references: list[torch.Tensor], base: list[float], dtype: str,
                sample: int) -> list[OutputCheck]:
        """Read one sample's output stream and judge every output against its reference and bar."""
        names = self.signature.outputs
        k, atol = self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol
        relative = relative_floor(self.recipe.numerics.floor, dtype)
        items = read_stream(stream, names, [InMemory(ref) for ref in references], sample)
        return [item if isinstance(item, OutputCheck) else
                item.check(name, sample, widened(k, references[i].numel()) * base[i] + atol, base[i],
                           explain_bar(k, base[i], None, atol, references[i].numel()), relative=relative)
                for i, (name, item) in enumerate(zip(names, items))]

    def judge(self, result: VariantResult, runner) -> None:
        """Run every sample through ``runner`` and judge the candidate (``result.numerics``; failed on a miss)."""
        device, dtype = self.where(result)
        base = self.baseline_rmse(device, dtype)
        checks = []
        for index, (sample, references) in enumerate(zip(self.samples, self.reference.outputs)):
            checks += self.compare(runner.begin_stream(sample), references, base[index], dtype, index)
        verdict = verdict_of_checks(result.name, self.signature.outputs, checks,
                                    self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol,
                                    self.baseline_label(device, dtype))
        result.numerics = verdict
        if not verdict.passed:
            worst = verdict.failures[0]
            why = f"output {worst.output} (sample {worst.sample}): {worst.reason}"
            # a proof that failed before the outputs were judged (a CUDA-graph variant's) keeps its name first
            earlier = result.error if result.status == NUMERICS_FAILED and result.error else ""
            result.fail(NUMERICS_FAILED, f"{earlier}; {why}" if earlier else why)

    # ----------------------------------------------------------------------- the shape grid

    def check_grid(self, grid: GridPlan | None, plan: InputPlan, candidates: list[tuple[VariantResult, Any]],
                   signatures: dict[str, dict[str, Any]], why_not: str = "") -> None:
        """Run every candidate at every grid point, point by point (one point's tensors in memory at a time)."""
        entries: dict[str, dict[str, Any]] = {}
        for result, _ in candidates:
            entry: dict[str, Any] = {"checked": grid is not None, "reason": None if grid else why_not,
                                     "passed": True, "points": [], "specialised": [], "narrowed": [],
                                     "signature_source": None}
            entry.update(signatures.get(result.name, {}))
            result.notes.extend(describe_signature(entry))
            entries[result.name] = entry
            if result.numerics is not None:
                result.numerics.grid = entry
        if grid is None:
            return
        dead: dict[str, str] = {}
        for point in grid.points:
            sample = point_sample(plan, point)
            ordered = [sample[n] for n in self.signature.inputs]
            # candidates that run on the CPU (in their own process) start now and compute while the reference does
            early: dict[str, Any] = {}
            for result, runner in candidates:
                if result.name not in dead and self.where(result)[0] == "cpu" and hasattr(runner, "process"):
                    try:
                        early[result.name] = runner.begin_stream(ordered)
                    except RunnerFailed as exc:  # it died at an earlier point: this one fails with that reason
                        dead[result.name] = exc.reason
            base: dict[tuple[str, str], list[float]] = {}
            try:
                reference = run_reference(self.original, [sample], count_flops=False,
                                          device=self.reference.device).outputs
                for result, _ in candidates:
                    key = self.baseline_place(*self.where(result))
                    if key not in base:
                        base[key] = self.eager_rmse([ordered], reference, *key)[0]
            except Exception as exc:  # the recipe declares sizes the model itself cannot take
                for name, stream in early.items():  # the children are answering already: read to the end
                    try:
                        for _ in stream:
                            pass
                    except RunnerFailed as crash:  # one died there: the points after it cannot be run
                        runner = dict((r.name, c) for r, c in candidates)[name]
                        if runner.process.poll() is not None or "child process" in crash.reason:
                            dead[name] = (f"{crash.reason}, at grid point {point.name} {point.sizes} (where the "
                                          "original model fails too)")
                if isinstance(exc, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                    why = "its float64 reference does not fit in GPU memory"
                    self.warnings.append(f"shape grid: {point.name} {point.sizes} is not checked: {why} "
                                         "(lower numerics.grid_budget)")
                else:
                    why = f"the original model fails here ({describe(exc, 300)})"
                    self.warnings.append(f"shape grid: the original model fails at {point.name} {point.sizes} "
                                         f"({describe(exc, 300)}); that point is not checked: narrow inputs.dims "
                                         "to what the model supports")
                for result, _ in candidates:
                    entries[result.name]["points"].append({"name": point.name, "sizes": point.sizes, "passed": None,
                                                           "error": f"not checked: {why}"})
                continue
            for result, runner in candidates:
                entry = entries[result.name]
                record: dict[str, Any] = {"name": point.name, "sizes": point.sizes, "passed": False, "error": None}
                entry["points"].append(record)
                if result.name in dead:
                    record["error"] = f"not run: {dead[result.name]}"
                    continue
                device, dtype = self.where(result)
                try:
                    stream = early.pop(result.name, None) or runner.begin_stream(ordered)
                    checks = self.compare(stream, reference[0], base[self.baseline_place(device, dtype)], dtype, 0)
                except RunnerFailed as exc:
                    record["error"] = exc.reason
                    self._detail(result.name, exc.detail)
                    process = getattr(runner, "process", None)
                    if process is not None and (process.poll() is not None or "child process" in exc.reason):
                        dead[result.name] = f"the process stopped at grid point {point.name}"
                    continue
                verdict = verdict_of_checks(result.name, self.signature.outputs, checks,
                                            self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol,
                                            self.baseline_label(device, dtype))
                worst = max(verdict.checks, key=ratio) if verdict.checks else None
                record.update({"passed": verdict.passed, "worst_output": worst.output if worst else None,
                               "rmse": worst.rmse if worst else None,
                               "allowed_rmse": worst.allowed_rmse if worst else None,
                               "ratio": ratio(worst) if worst else None})
                if not verdict.passed:
                    failure = verdict.failures[0]
                    record["error"] = f"output {failure.output}: {failure.reason}"
            del reference
        for result, _ in candidates:
            entry = entries[result.name]
            failed = [p for p in entry["points"] if p["passed"] is False]
            entry["passed"] = not failed
            if not failed or result.status != OK:
                continue
            first = failed[0]
            crashed = any(p.get("ratio") is None for p in failed)
            if result.numerics is not None and not crashed:
                result.numerics.passed = False
            result.fail(FAILED if crashed else NUMERICS_FAILED,
                        f"shape grid: {len(failed)} of {len(entry['points'])} points failed; "
                        f"first {first['name']} {first['sizes']}: {first['error']}")

    def grid(self, results: list[VariantResult], live: dict[str, Any], plan: InputPlan, program, staging: Path,
             progress) -> GridPlan | None:
        """The shape grid for every loaded candidate but the static-shape benchmark variants (compile modes, the
        AOTI package in a CUDA graph). Returns the grid's plan (None without one); the run's warnings land in
        ``self.warnings``."""
        recipe = self.recipe
        grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
        why_not = ("numerics.grid = false" if not recipe.numerics.grid
                   else "the recipe declares no dynamic dim" if grid is None else "")
        candidates, signatures = [], {}
        for result in results:
            if result.name not in live or result.numerics is None:
                continue
            if result.static_shapes:
                not_on_grid(result)
                continue
            candidates.append((result, live[result.name]))
            try:
                signatures[result.name] = artifact_signature(result, plan, program, staging)
            except Exception as exc:  # reading a signature must not fail the run: the grid still runs the shapes
                signatures[result.name] = {"signature_source": f"unreadable ({describe(exc)})"}
        detail = f"{len(grid.points)} points x {len(candidates)} candidates" if grid else f"skipped: {why_not}"
        with progress.stage("shape grid", detail):
            self.check_grid(grid, plan, candidates, signatures, why_not)
        for result, runner in candidates:
            process = getattr(runner, "process", None)
            if process is not None and process.poll() is not None:
                live.pop(result.name, None)
        return grid

    def locate_failures(self, results: list[VariantResult], rewritten: IOModule, plan: InputPlan,
                        grid: GridPlan | None, program, progress) -> None:
        """Name the first divergent module of every candidate that failed numerics (``numerics.locate``)."""
        failing = [r for r in results if r.status == NUMERICS_FAILED]
        if not self.recipe.numerics.locate or not failing:
            return
        with progress.stage("locate divergence", ", ".join(r.name for r in failing)):
            for result in failing:
                try:
                    self.locate(result, rewritten, plan, grid, program)
                except Exception as exc:  # localisation explains a failure; it never hides one
                    self.warnings.append(f"{result.name}: localisation failed: {describe(exc)}")
                    self._detail(result.name, f"localisation failed: {exc!r}\n")

    # ----------------------------------------------------------------------- localisation

    def locate(self, result: VariantResult, counterpart: IOModule, plan: InputPlan, grid: GridPlan | None = None,
               program=None, sample_index: int | None = None) -> None:
        """Find the first divergent module of a candidate that failed numerics: on ``sample_index``, else on its
        worst failing sample, else on its worst failing grid point."""
        if result.numerics is None:
            return
        device, dtype = self.where(result)
        if sample_index is None and result.numerics.failures:
            sample_index = result.numerics.failures[0].sample
        if sample_index is not None:
            if sample_index < 0 or sample_index >= len(self.samples):
                return
            sample = self.samples[sample_index]
            where: dict[str, Any] = {"sample": sample_index}
        else:
            failed = [p for p in (result.numerics.grid or {}).get("points", [])
                      if p["passed"] is False and p.get("ratio")]
            point = next((p for p in (grid.points if grid else []) if failed and p.name == failed[0]["name"]), None)
            if point is None:
                return
            generated = point_sample(plan, point)
            sample = [generated[n] for n in self.signature.inputs]
            where = {"grid_point": point.name}
        same_program = program is not None and (device, dtype) == (self.recipe.runtime.device,
                                                                   self.recipe.runtime.dtype)
        graph_rewritten = result.target == "rewritten" and isinstance(counterpart, TracedModule)
        use_program = same_program and result.target in PROGRAM_REPLAYED and (
            result.target != "rewritten" or graph_rewritten)
        found = locate(self.original, counterpart, sample, device, dtype, self.recipe.numerics.multiplier(dtype),
                       self.recipe.numerics.atol, label=REPLAYED.get(result.target, REPLAYED["compile"]),
                       program=program if use_program else None,
                       program_label=PROGRAM_REPLAYED.get(result.target, ""),
                       backend=self.recipe.runtime.attention_backend, failing=result.status != OK,
                       relative=relative_floor(self.recipe.numerics.floor, dtype))
        result.numerics.locate = {**where, **found}
        if result.error:
            result.error = f"{result.error}; {found['summary']}"

    def start(self, result: VariantResult, spec: RunnerSpec) -> RemoteRunner | None:
        """Start loading ``spec`` in its own process (or in the process of the variant its spec names as
        ``host``: one process per artifact kind) and return at once; None (and ``result`` failed) when the
        process cannot even start."""
        host = next((r for r in self.runners if isinstance(r, RemoteRunner) and r.name == spec.option("host")
                     and r.host is None and r.process.poll() is None), None)
        try:
            runner = RemoteRunner(spec, log=self.log_path(result.name), wait=False, spares=self.spares, host=host)
        except RunnerFailed as exc:
            result.fail(FAILED, exc.reason)
            self._detail(result.name, exc.detail)
            return None
        self.runners.append(runner)
        return runner

    def finish(self, result: VariantResult, runner: RemoteRunner) -> RemoteRunner | None:
        """Wait for a started runner to load, run every sample, judge; None when it could not run."""
        try:
            runner.ready()
            result.load_s = runner.load_s
            self.judge(result, runner)
            result.info.update(runner.refresh_info())
        except RunnerFailed as exc:
            result.load_s = runner.load_s
            result.fail(FAILED, exc.reason)
            self._detail(result.name, exc.detail)
            return None
        return runner

    def remote(self, result: VariantResult, spec: RunnerSpec) -> RemoteRunner | None:
        """Load ``spec`` in its own process, run every sample, judge; None when it could not run."""
        runner = self.start(result, spec)
        return self.finish(result, runner) if runner is not None else None

    def _detail(self, name: str, detail: str) -> None:
        if detail:
            with open(self.log_path(name), "a", encoding="utf-8") as handle:
                handle.write(detail)

    def close(self) -> None:
        for runner in self.runners:
            with contextlib.suppress(Exception):
                runner.close()
        self.runners.clear()
