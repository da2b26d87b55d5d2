"""One convert run: the stages in their order, and what passes between them.

    load -> inputs -> reference -> rewrite attention -> export -> validate -> benchmark -> report

Each stage lives in its own place (``checkpoint/``, ``inputs``, ``numerics/reference``, ``rewrite/``,
``targets/``, ``numerics/``, ``measure/``, ``report``); this module only calls them in order.
``exporter.api.convert`` owns the output folder and writes the report.
"""

from __future__ import annotations

import gc
import re
import time
from pathlib import Path
from typing import Any

import torch

from . import report as report_mod
from .checkpoint import LoadedModel, check_finite, load_model
from .checkpoint.loader import listing
from .checkpoint.sentence_pipeline import PipelineMismatch, cross_check
from .dtypes import torch_dtype
from .environment import check_space, space_needs
from .errors import ArchitectureError, CheckpointError
from .inputs import plan_inputs
from .measure.bench import benchmark, slower_than_source
from .measure.kernels import audit_kernels
from .modelio import Signature, discover_outputs
from .numerics.proofs import checkpoint_tensors, prove_built, rounding_proofs
from .numerics.reference import run_reference
from .numerics.validation import Validation, inherit_verdicts, not_on_grid
from .outdir import save_tensors
from .prepare import ModelSource, original_module
from .progress import Progress
from .quantize.stage import Quantization, quantize_stage
from .recipe import Recipe, public_source
from .results import OK, VariantResult
from .rewrite import rewrite_attention
from .runners import RemoteRunner, Spares
from .targets.build import build_targets, spare_children
from .targets.context import BuildContext
from .targets.spec import RunnerSpec


def release_host_copy(model: torch.nn.Module, device: str) -> None:
    """Move ``model`` to ``device`` as stored (no cast) and let the host's copy of the weights go: the
    checkpoint's memory map is released once no tensor refers to it."""
    model.to(device)
    gc.collect()


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
        self.loaded: LoadedModel | None = None
        self.validation: Validation | None = None
        self.spares: Spares | None = None
        self.quantization: Quantization | None = None

    def close(self) -> None:
        if self.validation is not None:
            self.validation.close()
        if self.spares is not None:
            self.spares.close()

    def manifest_inputs(self) -> dict[str, Any]:
        return {"checkpoint_files": list(self.loaded.checkpoint.files) if self.loaded else [],
                "recipe": {**self.recipe.to_dict(), "source": public_source(self.recipe)}}

    def log_path(self, name: str) -> Path:
        logs = self.staging / "logs"
        logs.mkdir(exist_ok=True)
        return logs / f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}.log"

    def log(self, name: str, detail: str) -> None:
        if detail:
            with open(self.log_path(name), "a", encoding="utf-8") as handle:
                handle.write(detail)

    def warn(self, *messages: str) -> None:
        for message in messages:
            self.warnings.append(message)
            self.progress.warn(message)

    def check_pipeline(self, sample: dict[str, torch.Tensor], outputs: list[torch.Tensor],
                       names: tuple[str, ...]) -> None:
        """A sentence-transformers pipeline rebuilt around the model: sentence-transformers' own modules run on
        the reference's token embeddings must give its sentence embedding (else nothing is published)."""
        loaded = self.loaded
        info = loaded.pipeline if loaded else None
        if loaded is None or info is None or not info.included:
            return
        by_name = dict(zip(names, outputs))
        if not {"token_embeddings", "sentence_embedding"} <= set(by_name):
            info.checked = "not run: model.outputs leaves out token_embeddings or sentence_embedding"
            return
        tokens = by_name["token_embeddings"]
        mask = sample.get("attention_mask")
        mask = torch.ones(tokens.shape[:-1], dtype=torch.int64) if mask is None else mask
        try:
            info.checked = cross_check(loaded.checkpoint.root, tokens, mask, by_name["sentence_embedding"])
        except PipelineMismatch as exc:
            raise ArchitectureError(
                f"the sentence-transformers pipeline rebuilt for {loaded.checkpoint.root.name} differs from "
                f"sentence-transformers' own modules ({exc})",
                "set model.pipeline = false (--set model.pipeline=false) to export the transformer alone") from None

    def execute(self) -> dict[str, Any]:
        recipe, progress = self.recipe, self.progress
        device, dtype = recipe.runtime.device, recipe.runtime.dtype
        t_start = time.perf_counter()
        # children import torch (and start CUDA) while this process loads and exports
        self.spares = Spares(spare_children(self.recipe.build_settings()), self.log_path, device)

        with progress.stage("load", str(self.checkpoint)):
            self.loaded = loaded = load_model(self.checkpoint, recipe.model.factory, self.allow_pickle,
                                                 recipe.model.pipeline)
            bad = check_finite(loaded.model)
            if bad:
                names = listing(bad)
                if recipe.model.nonfinite_weights == "error":
                    raise CheckpointError(f"checkpoint {self.checkpoint} holds NaN or Inf in {names}",
                                          "fix the weights, or set [model] nonfinite_weights = \"warn\"")
                self.warn(f"weights hold NaN or Inf: {names}")

        if device != "cpu":  # the weights go to the GPU as stored: the first run and the reference run there
            with progress.stage("to device", device):
                release_host_copy(loaded.model, device)
        with progress.stage("inputs"):
            plan = plan_inputs(loaded.model, recipe.inputs, self.inputs_file)
            outputs = discover_outputs(loaded.model, plan.samples[0], recipe.model.outputs)
            signature = Signature(plan.names, outputs)
            samples = [[s[n] for n in plan.names] for s in plan.samples]
            inputs_path = self.staging / "reference" / "inputs.safetensors"
            save_tensors(inputs_path, samples, plan.names)

        original = original_module(loaded, signature)
        with progress.stage("reference", f"original model, float64, {device}"):
            reference = run_reference(original, plan.samples, device=device)
            self.check_pipeline(plan.samples[0], reference.outputs[0], signature.outputs)
        if recipe.quantize.enabled:
            # the second question (what fp8 cost) against the original's reference; the first (is each artifact
            # faithful to the quantized model) against the quantized model's float64 arithmetic, computed next
            save_tensors(self.staging / "reference" / "original_outputs.safetensors", reference.outputs,
                         signature.outputs)
            with progress.stage("quantize", recipe.quantize.scheme):
                self.quantization = quantize_stage(original, loaded.model, recipe, plan.samples, signature.outputs,
                                                   reference.outputs)
                counts = self.quantization.to_dict()["counts"]
                progress.info(f"linears: {counts['fp8']} fp8, {counts['excluded']} excluded, "
                              f"{counts['fallback']} kept (fp8 cannot take them)")
                if not self.quantization.cost.passed:
                    progress.warn(f"quantization budget: {self.quantization.cost.error()}")
            del reference  # saved above: the original's float64 outputs are not held while the next ones are made
            gc.collect()
            if device.startswith("cuda"):  # the stage's float64 outputs stay cached otherwise, and the artifacts'
                torch.cuda.empty_cache()  # processes (a CUDA-graph capture first) find the GPU full
            with progress.stage("reference (quantized)", f"quantized model, float64, {device}"):
                reference = run_reference(original, plan.samples, device=device)
        save_tensors(self.staging / "reference" / "outputs.safetensors", reference.outputs, signature.outputs)

        with progress.stage("rewrite attention"):
            on_device = [t.to(device) for t in samples[0]]
            rewritten, audit = rewrite_attention(original, on_device, apply=recipe.runtime.rewrite_attention)
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten, "
                          f"{audit.count('skipped')} skipped")

        # before the cast (and after a quantization: each fp8 linear's qweight and scales): what the proofs compare with
        tensors = checkpoint_tensors(loaded.model)
        loaded.model.to(device=device, dtype=torch_dtype(dtype))
        rewritten.to(device=device, dtype=torch_dtype(dtype))  # a rewritten graph may hold its own buffers
        example = [(t.to(torch_dtype(dtype)) if t.is_floating_point() else t).to(device) for t in samples[0]]
        source = ModelSource(str(self.checkpoint.resolve()), recipe.model.factory, self.allow_pickle,
                             signature.inputs, signature.outputs, str(inputs_path), recipe.runtime.rewrite_attention,
                             recipe.model.pipeline)
        ctx = BuildContext(rewritten, plan, recipe.build_settings(), self.staging, source, example)
        self.validation = validation = Validation(recipe, signature, reference, samples, original, self.log_path,
                                                   self.spares)
        loading: dict[str, RemoteRunner] = {}

        def start_loading(result: VariantResult, spec: RunnerSpec | None) -> None:
            """Each variant starts loading in its own process as soon as it is built, while the next builds."""
            if spec is not None and result.status == OK:
                runner = validation.start(result, spec)
                if runner is not None:
                    loading[result.name] = runner

        check_space(space_needs(recipe, rewritten, self.staging))
        built = build_targets(ctx, progress, self.log, start_loading)
        self.spares.close()  # every child this run needs has started: a spare left over would only hold memory
        program = ctx.program if ctx.decomposed is None else ctx.decomposed  # what the artifacts were built from
        # the weights and program proofs read the files and the program, not the outputs: asked while the built
        # variants load in their children (an ONNX session, an AOTInductor package), which they used to wait for
        with progress.stage("proofs", "weights, and the program in float64"):
            prove_built([r for r, _ in built], program, tensors, device, samples, reference.outputs,
                        signature.outputs, original, recipe.quantize.enabled, self.staging, signature.inputs)
            del tensors
        with progress.stage("validate numerics"):
            eager = validation.local("eager", original, device, dtype)
            validation.set_baseline(device, dtype, eager)
            rewritten_runner = validation.local("rewritten", rewritten, device, dtype)
            rewritten_result = VariantResult("rewritten", "rewritten", device=device, dtype=dtype)
            if not recipe.runtime.rewrite_attention:
                rewritten_result.notes.append("rewrite off: this is the model as written, the same module as eager")
            validation.judge(rewritten_result, rewritten_runner)
            live: dict[str, Any] = {"eager": eager, "rewritten": rewritten_runner}
            # a compile variant compiles (a CUDA-graph variant captures) as it loads and is not on the grid: it is
            # judged after the grid, so its compile overlaps the grid's work instead of holding it up
            later = [r for r, _ in built if r.name in loading and r.static_shapes]
            for result, _ in built:
                if result.name in loading and result not in later and validation.finish(result, loading[result.name]):
                    live[result.name] = loading[result.name]

        results = [rewritten_result] + [r for r, _ in built]
        rounding_proofs(results, reference.outputs[0], signature.outputs, len(samples))
        grid = validation.grid(results, live, plan, program, self.staging, progress)
        if later:
            with progress.stage("validate static variants", ", ".join(r.name for r in later)):
                for result in later:
                    if validation.finish(result, loading[result.name]):
                        live[result.name] = loading[result.name]
                        not_on_grid(result)
        validation.locate_failures(results, rewritten, plan, grid, program, progress)
        inherit_verdicts(results)
        self.warn(*validation.warnings)

        first = plan.samples[0][plan.names[0]]
        with progress.stage("benchmark", f"{len(live)} variants"):
            eager_bench, warnings = benchmark(live, samples[0], results, recipe.bench, device, reference.flops,
                                              int(first.shape[0]) if first.dim() else 1)
        self.warnings.extend(warnings)

        with progress.stage("attention kernels"):
            eager_kernels, choice = audit_kernels(live, samples[0], results, recipe.runtime.attention_backend)
        self.warn(*slower_than_source(results))
        validation.close()

        return report_mod.assemble(
            recipe=recipe, checkpoint=self.checkpoint, loaded=loaded, plan=plan, signature=signature,
            reference=reference, audit=audit, results=results, eager_bench=eager_bench,
            allow_drift=self.allow_drift, warnings=self.warnings, timings=progress.timings,
            staging=self.staging, total_s=time.perf_counter() - t_start, grid=grid, eager_kernels=eager_kernels,
            backend_choice=choice, quantization=self.quantization)
