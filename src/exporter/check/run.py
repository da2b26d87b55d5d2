"""``exporter check ARTIFACT --against CHECKPOINT``: the release gate for artifacts any tool made.

    describe the artifact -> load the checkpoint -> map inputs and outputs by name -> float64 reference
    -> eager baseline -> run the artifact in its own process -> shape grid -> locate -> benchmark -> report

Nothing is built, and nothing it is handed runs without the user's opt-in (``check/untrusted.py``: no pickle,
no package's native code, no module the artifact names, no file from outside the judged folder). The artifact's
files are copied into the output folder first (never hard-linked), so what was judged is exactly what
``manifest.json`` hashes and ``exporter verify`` re-runs later. The gate is convert's (``numerics/``): a float64
run of the checkpoint's model on the recipe's device,
``rmse <= k * s(n) * rmse(eager in the artifact's dtype) + floor`` per sample and output, the shape grid within the
artifact's own dynamic dims, the first divergent module (ONNX: its intermediate values, by module scope;
``.pt2``: its unflattened submodules). A decoder with past (Optimum's ``text-generation-with-past``) is judged
step by step (:mod:`exporter.check.past`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

from .. import interrupts
from ..checkpoint import load_model
from ..dtypes import torch_dtype
from ..environment import check_machine
from ..errors import CheckpointError, ExporterError, UsageError
from ..inputs import plan_inputs
from ..measure.bench import benchmark
from ..modelio import Signature, discover_outputs
from ..numerics.proofs import checkpoint_tensors, record, rounding_proof
from ..numerics.reference import run_reference
from ..numerics.validation import Validation
from ..outdir import OutputFolder, disk_full, model_name, os_problem, path_from, public_command, sha256_file
from ..prepare import original_module
from ..progress import Progress
from ..quiet import quiet_libraries
from ..recipe import GENERATION_TASKS, Recipe, public_source, resolve_recipe
from ..results import FAILED, NUMERICS_FAILED, RunResult, VariantResult, ratio
from ..targets.program_file import PickleRefused, pickled
from ..targets.spec import RunnerSpec
from .artifacts import Artifact, find_artifacts
from .locating import locate_artifact
from .mapping import check_output_sizes, map_inputs, map_outputs
from .past import INPUTS, PastSteps, output_names, past_recipe
from .proofs import prove_artifact, prove_program
from .untrusted import Folder, copy_in, refuse_native_code

FOLDER = "artifact"  # where the judged files are kept in the output folder


CheckResult = RunResult  # convert's result: the folder, its report, the exit code and its lines


def default_out(artifact: Path, recipe: Recipe) -> Path:
    return Path("artifacts") / model_name(artifact) / f"check-{recipe.name}"


def keep(artifact: Artifact, staging: Path, folder: Folder) -> tuple[Path, list[Path]]:
    """Copy the artifact's files into ``staging/artifact``, under the names they have beside it (a symlinked file,
    as in a hub cache's snapshot, is copied as what it points to; never hard-linked): its path there (relative to
    ``staging``) and every file it reads there. A file outside the judged folder is refused (``folder``)."""
    kept = []
    for file in dict.fromkeys(artifact.files + ([artifact.past.prefill] if artifact.past else [])):
        target = staging / FOLDER / folder.inside(file)
        kept.append(target)
        if not target.exists():
            copy_in(file, target, folder)
    return (staging / FOLDER / folder.inside(artifact.path)).relative_to(staging), kept


def refuse_what_would_run(artifacts: list[Artifact], recipe: Recipe) -> None:
    """Before anything is copied or run: a package's native code and a program's pickles need the user's opt-in
    (``[trust]``); the opt-in a program was loaded with is recorded on it, for ``exporter verify``."""
    refuse_native_code([a.path.name for a in artifacts if a.target == "aoti"], recipe.trust.native_code)
    for artifact in artifacts:
        if artifact.target == "exported_program":
            what = pickled(artifact.path)
            if what and not recipe.trust.artifact_pickle:
                raise PickleRefused(artifact.path, what)
            artifact.pickle = bool(what)


def runner_spec(artifact: Artifact, path: Path, device: str, dtype: str, signature: Signature,
                backend: str) -> RunnerSpec:
    options: list[tuple[str, Any]] = [("named", True), ("outputs", tuple(signature.outputs))]
    if artifact.call == "keyword":
        options += [("keywords", tuple(signature.inputs[artifact.positional:])), ("positional", artifact.positional)]
    if artifact.imports:
        options.append(("imports", artifact.imports))
    if artifact.pickle:
        options.append(("pickle", True))
    if artifact.past is not None:
        options.append(("past", (artifact.past.layers, artifact.past.prefill.name, artifact.past.merged)))
    if artifact.target == "onnx":
        from ..targets.onnx import choose_provider  # noqa: PLC0415 - onnxruntime only where ONNX is checked

        options.append(("provider", choose_provider(device)))
    if artifact.target == "aoti":
        from ..targets.toolchain import aoti_preload  # noqa: PLC0415

        options.append(("ld_preload", aoti_preload()))
    return RunnerSpec(artifact.name, artifact.target, device, dtype, path=str(path), options=tuple(options),
                      attention_backend=backend)


def _one_mapping(artifacts: list[Artifact], model, recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The inputs every artifact takes: one mapping for all (a folder's artifacts are of one model), each dim
    within what every artifact accepts."""
    mapped = [map_inputs(a, model, recipe) for a in artifacts]
    first, notes = mapped[0]
    for artifact, (other, more) in zip(artifacts[1:], mapped[1:]):
        if other.inputs.tensors != first.inputs.tensors:
            raise UsageError(f"{artifacts[0].name} and {artifact.name} take different inputs "
                             f"({', '.join(s.name for s in first.inputs.tensors)} vs "
                             f"{', '.join(s.name for s in other.inputs.tensors)})",
                             "check them one at a time (pass each file)")
        notes += [n for n in more if n not in notes]
    dims = []
    for dim in first.inputs.dims:
        every = [next(d for d in m.inputs.dims if d.name == dim.name) for m, _ in mapped]
        low, high = max(d.min for d in every), min(d.max for d in every)
        dims.append(dataclasses.replace(dim, min=low, max=high, size=min(max(dim.size, low), high)))
    return dataclasses.replace(first, inputs=dataclasses.replace(first.inputs, dims=tuple(dims))), notes


def check(artifact: str | Path, against: str | Path, recipe: str | Path | Recipe = "cpu-fp32",
          out: str | Path | None = None, *, model: str | None = None, dims: tuple[str, ...] = (),
          tensors: tuple[str, ...] = (), settings: tuple[str, ...] = (), allow_pickle: bool = False,
          overwrite: bool = False, progress: Progress | None = None, command: list[str] | None = None) -> CheckResult:
    """Judge ``artifact`` (a file or folder another tool made) against ``against`` (the checkpoint it came
    from) with convert's gate; the report lands in ``out``. User mistakes raise ExporterError before anything
    is written; a numerics failure is the result's ``exit_code`` (3), not raised."""
    progress = progress or Progress(enabled=False)
    recipe_obj = resolve_recipe(recipe, model, dims, tensors, settings=settings, combination=False)
    if recipe_obj.model.task in GENERATION_TASKS:
        raise UsageError("exporter check judges an artifact's forward; a decoder with past inputs is judged step "
                         "by step without --task", "leave out --task (and [model] task in the recipe)")
    if recipe_obj.quantize.enabled:
        raise UsageError(f"exporter check judges an artifact against the checkpoint's own model; the recipe's "
                         f"[quantize] scheme {recipe_obj.quantize.scheme} would judge it against a model exporter "
                         "quantized itself, which another tool's artifact was not built from",
                         "check with a recipe without [quantize] (e.g. --recipe h100-bf16), or convert the checkpoint "
                         "with --recipe h100-fp8")
    check_machine(recipe_obj)
    artifact_path, checkpoint = Path(artifact), Path(against)
    if not checkpoint.exists():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist", "check the path given to --against")
    final = Path(out) if out is not None else default_out(artifact_path, recipe_obj)
    resolved = final.resolve()
    source = Path(os.path.abspath(artifact_path))  # as given: a symlinked file keeps its own name
    if resolved == source.resolve() or source.resolve().is_relative_to(resolved) or source.is_relative_to(resolved):
        raise UsageError(f"--out {final} holds the artifact being checked", "write the check to another folder")
    judged = Folder(artifact_path)
    judged.check_described()
    artifacts = find_artifacts(artifact_path)
    for found in artifacts:  # every file it reads lies in the judged folder, before anything is read whole
        for file in [*found.files, *([found.past.prefill] if found.past else [])]:
            judged.check(file)
    refuse_what_would_run(artifacts, recipe_obj)
    with interrupts.watch(), quiet_libraries(), OutputFolder(final, overwrite=overwrite,
                                                             keep_clear=checkpoint) as folder:
        run = CheckRun(artifacts, judged, checkpoint, recipe_obj, folder.staged, allow_pickle, progress)
        try:
            data, files = run.execute()
            data["run"] = {"command": public_command(command) if command else None, "settings": list(settings)}
            data["model"]["checkpoint"] = path_from(folder.final, checkpoint)
            from .. import report as report_mod  # noqa: PLC0415

            report_mod.write_all(folder.staged, data, {"checkpoint_files": files,
                                                       "recipe": {**run.recipe.to_dict(),
                                                                  "source": public_source(recipe_obj)}})
        except ExporterError:
            raise
        except Exception as exc:
            full = disk_full(exc)
            if full is not None:
                raise os_problem(full, final) from None
            raise
        finally:
            run.close()
        published = folder.publish()
    return CheckResult(published, data, data["exit_code"], data.get("problems", []))


class CheckRun:
    def __init__(self, artifacts: list[Artifact], judged: Folder, checkpoint: Path, recipe: Recipe, staging: Path,
                 allow_pickle: bool, progress: Progress):
        self.artifacts = artifacts
        self.judged = judged
        self.source = judged.given
        self.checkpoint = checkpoint
        self.recipe = recipe
        self.staging = staging
        self.allow_pickle = allow_pickle
        self.progress = progress
        self.validation: Validation | None = None
        self.warnings: list[str] = []

    def close(self) -> None:
        if self.validation is not None:
            self.validation.close()

    def log_path(self, name: str) -> Path:
        logs = self.staging / "logs"
        logs.mkdir(exist_ok=True)
        return logs / f"{name.replace(':', '-').replace('/', '-')}.log"

    def execute(self) -> tuple[dict[str, Any], list[Path]]:
        from ..outdir import save_tensors  # noqa: PLC0415
        from ..report.assemble import assemble_check  # noqa: PLC0415

        progress, t_start = self.progress, time.perf_counter()
        named = {port.name for a in self.artifacts for port in a.outputs}
        # an export of the bare transformer of a sentence-transformers folder is judged against the bare transformer
        bare = "last_hidden_state" in named and "sentence_embedding" not in named
        with progress.stage("load", str(self.checkpoint)):
            loaded = load_model(self.checkpoint, self.recipe.model.factory, self.allow_pickle,
                                self.recipe.model.pipeline and not bare)
            # the checkpoint's tensors as built (and the buffers the model computes, RoPE's frequencies), before the
            # model is cast to the recipe's dtype: the proofs' side (the cast replaces each tensor; these keep theirs)
            weights = checkpoint_tensors(loaded.model)
        past = next((a for a in self.artifacts if a.past is not None), None)
        if past is not None and len(self.artifacts) > 1:
            raise UsageError(f"{self.source} holds a decoder with past and other models "
                             f"({', '.join(a.name for a in self.artifacts)})", "check them one at a time")
        with progress.stage("inputs", ", ".join(a.name for a in self.artifacts)):
            if past is not None:
                self.recipe, notes = past_recipe(past, loaded.model, self.recipe)
            else:
                self.recipe, notes = _one_mapping(self.artifacts, loaded.model, self.recipe)
            recipe = self.recipe
            plan = plan_inputs(loaded.model, recipe.inputs)
            plan.notes += notes
            if bare and loaded.pipeline is None and self.recipe.model.pipeline and \
                    (Path(loaded.checkpoint.root) / "modules.json").is_file():
                plan.notes.append("the artifact outputs last_hidden_state, not sentence_embedding: it is judged "
                                  "against the transformer alone, without the folder's sentence-transformers "
                                  "pipeline")
            if past is not None and past.past is not None:
                signature = Signature(INPUTS, output_names(past.past.layers))
            else:
                produced = discover_outputs(loaded.model, plan.samples[0], recipe.model.outputs)
                outputs, out_notes = map_outputs(self.artifacts[0], produced)
                plan.notes += out_notes
                signature = Signature(plan.names, outputs)
            samples = [[s[n] for n in plan.names] for s in plan.samples]
            save_tensors(self.staging / "reference" / "inputs.safetensors", samples, plan.names)
        device, dtype = recipe.runtime.device, recipe.runtime.dtype
        original = (PastSteps(loaded.model, past.past.layers) if past is not None and past.past is not None
                    else original_module(loaded, signature))
        if device != "cpu":
            loaded.model.to(device)
        with progress.stage("reference", f"the checkpoint's model, float64, {device}"):
            reference = run_reference(original, plan.samples, device=device)
            if past is None:  # a width the artifact fixes and the model does not have: another model
                for artifact in self.artifacts:
                    check_output_sizes(artifact, signature.outputs, reference.outputs[0], loaded.model)
            save_tensors(self.staging / "reference" / "outputs.safetensors", reference.outputs, signature.outputs)
        loaded.model.to(device=device, dtype=torch_dtype(dtype))
        self.validation = validation = Validation(recipe, signature, reference, samples, original, self.log_path)
        results: list[VariantResult] = []
        live: dict[str, Any] = {}
        sizes = {name: int(t.numel()) for name, t in zip(signature.outputs, reference.outputs[0])
                 if t.is_floating_point()}
        with progress.stage("validate numerics"):
            eager = validation.local("eager", original, device, dtype)
            validation.set_baseline(device, dtype, eager)
            live["eager"] = eager
            for artifact in self.artifacts:
                path, kept = keep(artifact, self.staging, self.judged)
                own = artifact.dtype or dtype
                result = VariantResult(artifact.target, artifact.name, path=path, device=device, dtype=own)
                result.notes += artifact.notes
                if artifact.dtype and artifact.dtype != dtype:
                    result.notes.append(f"the artifact computes in {artifact.dtype} (the recipe's dtype is {dtype}): "
                                        f"judged against the eager model's own error in {artifact.dtype}")
                result.files = [{"path": str(p.relative_to(self.staging)), "sha256": sha256_file(p),
                                 "bytes": p.stat().st_size} for p in kept]
                spec = runner_spec(artifact, self.staging / path, device, own, signature,
                                   recipe.runtime.attention_backend)
                if artifact.target == "onnx":
                    result.graph = {"provider": spec.option("provider")}
                    if spec.option("provider") == "CPUExecutionProvider":
                        result.device = "cpu"
                result.info["made_by"] = artifact.made_by
                # how verify loads it again: by name, as here
                result.info["load"] = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.options
                                       if k in ("named", "keywords", "positional", "outputs", "imports", "past",
                                                  "provider", "pickle")}
                results.append(result)
                proof = prove_artifact(artifact, kept, weights)
                runner = validation.remote(result, spec)
                if runner is not None:
                    live[artifact.name] = runner
                record(result, "weights", proof)
                if result.status != FAILED:
                    record(result, "program", prove_program(artifact, self.staging / path, spec, weights, samples,
                                                            reference.outputs, signature.outputs, original, device,
                                                            signature.inputs))
                rounding_proof(result, sizes, len(samples))
        grid = validation.grid(results, live, plan, None, self.staging, progress)
        # a weight or a program the proofs named is where the divergence is: nothing to locate (nor any compiler
        # to blame)
        failing = [r for r in results if r.status == NUMERICS_FAILED and all(
            (r.proofs.get(p) or {}).get("passed") is not False for p in ("weights", "program"))]
        if failing and recipe.numerics.locate:
            with progress.stage("locate divergence", ", ".join(r.name for r in failing)):
                for result in failing:
                    artifact = next(a for a in self.artifacts if a.name == result.name)
                    sample = _worst_sample(result)
                    locate_artifact(result, artifact, self.staging / str(result.path), original,
                                    samples[sample], recipe, signature.outputs if artifact.past else signature.inputs,
                                    sample)
        self.warnings += validation.warnings
        first = plan.samples[0][plan.names[0]]
        with progress.stage("benchmark", f"{len(live)} variants"):
            eager_bench, warnings = benchmark(live, samples[0], results, recipe.bench, device, reference.flops,
                                              int(first.shape[0]) if first.dim() else 1)
        self.warnings += warnings
        validation.close()
        data = assemble_check(recipe=recipe, checkpoint=self.checkpoint, loaded=loaded, plan=plan,
                              signature=signature, reference=reference, results=results, eager_bench=eager_bench,
                              warnings=self.warnings, timings=progress.timings,
                              total_s=time.perf_counter() - t_start, grid=grid,
                              checked=self.described(), source=self.source)
        return data, list(loaded.checkpoint.files)

    def described(self) -> list[dict[str, Any]]:
        return [{"name": a.name, "kind": a.target, "made_by": a.made_by, "file": a.path.name,
                 "inputs": [p.name for p in a.inputs], "outputs": [p.name for p in a.outputs],
                 "call": a.call, "past_layers": a.past.layers if a.past else None} for a in self.artifacts]


def _worst_sample(result: VariantResult) -> int:
    """The failing sample furthest over its bar (localisation runs on it)."""
    failures = result.numerics.failures if result.numerics is not None else []
    return max(failures, key=ratio).sample if failures else 0




__all__ = ["check", "CheckResult"]
