"""Stage 6, validate numerics: run every candidate on every sample and judge it against the float64 reference.

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

from .inputs import DTYPES
from .modelio import IOModule, Signature
from .numerics import judge
from .recipe import Recipe
from .reference import Reference, cast_in_place
from .results import FAILED, NUMERICS_FAILED, VariantResult
from .runners import LocalRunner, Loaded, RemoteRunner, RunnerFailed, RunnerSpec


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
        self.runners: list[Any] = []

    def local(self, name: str, module: torch.nn.Module, device: str, dtype: str) -> LocalRunner:
        runner = LocalRunner(name, Loaded(lambda args: list(module(*args)), device, DTYPES[dtype]))
        self.runners.append(runner)
        return runner

    def set_baseline(self, device: str, dtype: str, outputs) -> None:
        self.baselines[(device, dtype)] = outputs

    def baseline(self, device: str, dtype: str):
        """The original model's outputs at ``device``/``dtype`` (cast in place for another pair)."""
        key = (device, dtype)
        if key not in self.baselines:
            with cast_in_place(self.original, DTYPES[dtype], device), torch.inference_mode():
                runner = LocalRunner("eager", Loaded(lambda a: list(self.original(*a)), device, DTYPES[dtype]))
                self.baselines[key] = runner.run(self.samples)
        return self.baselines[key]

    def judge(self, result: VariantResult, outputs) -> None:
        device = result.device or self.recipe.runtime.device
        dtype = result.dtype or self.recipe.runtime.dtype
        verdict = judge(result.name, self.signature.outputs, self.reference.outputs, self.baseline(device, dtype),
                        outputs, self.recipe.numerics.multiplier(dtype), self.recipe.numerics.atol,
                        f"eager ({device}, {dtype})")
        result.numerics = verdict
        if not verdict.passed:
            worst = verdict.failures[0]
            result.fail(NUMERICS_FAILED, f"output {worst.output} (sample {worst.sample}): {worst.reason}")

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
