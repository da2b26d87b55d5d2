"""The validate stage: run every candidate on every sample and judge it against the float64 reference.

Artifacts run in their own processes (``RemoteRunner``); the eager models run
here. Each candidate is judged against the eager model at the candidate's own
device and dtype (the "baseline"), so an ONNX model validated in float32 on the
CPU meets a float32 bar, not the recipe's bf16 one.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import describe
from ..inputs import TORCH_DTYPES, InputPlan
from ..measure import backend_choice
from ..measure.kernels import hook
from ..modelio import IOModule, Signature
from ..recipe import Recipe
from ..results import FAILED, NUMERICS_FAILED, OK, VariantResult
from ..rewrite.graph_capture import TracedModule
from ..runners import LocalRunner, RemoteRunner, RunnerFailed
from ..targets.spec import Loaded, RunnerSpec
from .grid import GridPlan, artifact_signature, describe_signature, plan_grid, point_sample
from .locate import locate
from .reference import Reference, cast_in_place, run_reference
from .tolerance import judge, ratio

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


class Validation:
    def __init__(self, recipe: Recipe, signature: Signature, reference: Reference, samples: list[list[torch.Tensor]],
                 original: IOModule, log_path: Callable[[str], Path]):
        self.recipe = recipe
        self.signature = signature
        self.reference = reference
        self.samples = samples
        self.original = original
        self.log_path = log_path
        self.baselines: dict[tuple[str, str], list[list[torch.Tensor]]] = {}
        self.warnings: list[str] = []  # for the run's warnings (e.g. grid points the model itself cannot take)
        self.runners: list[Any] = []

    def local(self, name: str, module: torch.nn.Module, device: str, dtype: str) -> LocalRunner:
        hooks = {"kernels": hook(device),
                 "sdpa_choice": backend_choice.hook(device, self.recipe.runtime.attention_backend)}
        runner = LocalRunner(name, Loaded(lambda args: list(module(*args)), device, TORCH_DTYPES[dtype], hooks=hooks))
        self.runners.append(runner)
        return runner

    def set_baseline(self, device: str, dtype: str, outputs) -> None:
        self.baselines[(device, dtype)] = outputs

    def baseline(self, device: str, dtype: str):
        """The original model's outputs at ``device``/``dtype`` (cast in place for another pair)."""
        key = (device, dtype)
        if key not in self.baselines:
            self.baselines[key] = self.eager_outputs(self.samples, device, dtype)
        return self.baselines[key]

    def eager_outputs(self, samples: list[list[torch.Tensor]], device: str, dtype: str):
        with cast_in_place(self.original, TORCH_DTYPES[dtype], device), torch.inference_mode():
            runner = LocalRunner("eager", Loaded(lambda a: list(self.original(*a)), device, TORCH_DTYPES[dtype]))
            return runner.run(samples)

    def where(self, result: VariantResult) -> tuple[str, str]:
        return result.device or self.recipe.runtime.device, result.dtype or self.recipe.runtime.dtype

    def judge(self, result: VariantResult, outputs) -> None:
        device, dtype = self.where(result)
        verdict = judge(result.name, self.signature.outputs, self.reference.outputs, self.baseline(device, dtype),
                        outputs, self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol,
                        f"eager ({device}, {dtype})")
        result.numerics = verdict
        if not verdict.passed:
            worst = verdict.failures[0]
            result.fail(NUMERICS_FAILED, f"output {worst.output} (sample {worst.sample}): {worst.reason}")

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
            baselines: dict[tuple[str, str], Any] = {}
            try:
                with cast_in_place(self.original, None, "cpu"):  # back on the recipe's device afterwards
                    reference = run_reference(self.original, [sample], count_flops=False).outputs
                for result, _ in candidates:
                    if self.where(result) not in baselines:
                        baselines[self.where(result)] = self.eager_outputs([ordered], *self.where(result))
            except Exception as exc:  # the recipe declares sizes the model itself cannot take
                reason = describe(exc, 300)
                self.warnings.append(f"shape grid: the original model fails at {point.name} {point.sizes} "
                                     f"({reason}); that point is not checked: narrow inputs.dims to what the "
                                     "model supports")
                for result, _ in candidates:
                    entries[result.name]["points"].append({"name": point.name, "sizes": point.sizes, "passed": None,
                                                           "error": f"not checked: the original model fails here "
                                                                    f"({reason})"})
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
                    outputs = runner.run([ordered])
                except RunnerFailed as exc:
                    record["error"] = exc.reason
                    self._detail(result.name, exc.detail)
                    process = getattr(runner, "process", None)
                    if process is not None and process.poll() is not None:
                        dead[result.name] = f"the process stopped at grid point {point.name}"
                    continue
                verdict = judge(result.name, self.signature.outputs, reference, baselines[(device, dtype)], outputs,
                                self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol,
                                f"eager ({device}, {dtype})")
                worst = max(verdict.checks, key=ratio) if verdict.checks else None
                record.update({"passed": verdict.passed, "worst_output": worst.output if worst else None,
                               "rmse": worst.rmse if worst else None,
                               "allowed_rmse": worst.allowed_rmse if worst else None,
                               "ratio": ratio(worst) if worst else None})
                if not verdict.passed:
                    failure = verdict.failures[0]
                    record["error"] = f"output {failure.output}: {failure.reason}"
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

    def grid_and_locate(self, results: list[VariantResult], live: dict[str, Any], plan: InputPlan, program,
                        rewritten: IOModule, staging: Path, progress) -> GridPlan | None:
        """The shape grid for every loaded candidate but the compile variants, then localisation of each failure.

        Returns the grid's plan (None without one); the run's warnings land in ``self.warnings``.
        """
        recipe = self.recipe
        grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
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
        failing = [r for r in results if r.status == NUMERICS_FAILED]
        if recipe.numerics.locate and failing:
            with progress.stage("locate divergence", ", ".join(r.name for r in failing)):
                for result in failing:
                    try:
                        self.locate(result, rewritten, plan, grid, program)
                    except Exception as exc:  # localisation explains a failure; it never hides one
                        self.warnings.append(f"{result.name}: localisation failed: {describe(exc)}")
                        self._detail(result.name, f"localisation failed: {exc!r}\n")
        return grid

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
                       backend=self.recipe.runtime.attention_backend, failing=result.status != OK)
        result.numerics.locate = {**where, **found}
        if result.error:
            result.error = f"{result.error}; {found['summary']}"

    def remote(self, result: VariantResult, spec: RunnerSpec) -> RemoteRunner | None:
        """Load ``spec`` in its own process, run every sample, judge; None when it could not run."""
        try:
            runner = RemoteRunner(spec, log=self.log_path(result.name))
        except RunnerFailed as exc:
            result.fail(FAILED, exc.reason)
            self._detail(result.name, exc.detail)
            return None
        self.runners.append(runner)
        result.load_s = runner.load_s
        try:
            outputs = runner.run(self.samples)
            result.info.update(runner.refresh_info())
        except RunnerFailed as exc:
            result.fail(FAILED, exc.reason)
            self._detail(result.name, exc.detail)
            return None
        self.judge(result, outputs)
        return runner

    def _detail(self, name: str, detail: str) -> None:
        if detail:
            with open(self.log_path(name), "a", encoding="utf-8") as handle:
                handle.write(detail)

    def close(self) -> None:
        for runner in self.runners:
            with contextlib.suppress(Exception):
                runner.close()
        self.runners.clear()
