"""``exporter convert --task text-generation`` (and the encoder-decoders' ``text2text-generation``,
``automatic-speech-recognition``): a model's prefill and decode programs, judged step by step and timed.

    load -> cache layout -> prompts -> reference generation (float64, no cache) -> eager baseline (teacher-forced)
         -> [quantize -> reference again] -> attention to SDPA -> export prefill + decode -> build targets
         -> judge and time each -> report

This module is the order of those stages, for every family (:mod:`exporter.generation.family`: a decoder's or an
encoder-decoder's); each does its work where the forward convert's does (``checkpoint``, ``rewrite``,
``targets``: ``build_decoder``, ``runners.run_session``, ``measure``, ``report.generation``). Everything a target
is judged on is computed here once and stored in the output folder (``generation.json``: cache layout, sizes and
each step's bar; ``reference/generation.safetensors``: the prompts, the reference's tokens and its float64 logits
per step), so ``exporter verify`` re-judges a target with the same bars. Each target is judged and timed in a
process of its own (``generation.session``).
"""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .. import targets
from ..checkpoint import LoadedModel, load_model
from ..checkpoint.files import Checkpoint
from ..dtypes import torch_dtype
from ..environment import check_space, space_needs
from ..errors import describe
from ..modelio import attention_implementation
from ..numerics.tolerance import relative_floor
from ..outdir import file_entry, sha256_file, write_json
from ..progress import Progress
from ..quantize.stage import quantize_decoder
from ..recipe import Recipe
from ..report.generation import assemble_generation
from ..results import FAILED, NUMERICS_FAILED, OK, SKIPPED
from ..rewrite.audit import AttentionAudit
from ..runners import run_session
from ..targets.context import DecoderPrograms, build_decoder, decoder_attention
from . import bench
from .attention import eager_sites, sdpa_refusal
from .family import Family
from .judge import judge_steps, step_bars
from .session import MANIFEST, REFERENCE, family_for, finite


@dataclass
class Reference:
    """What every candidate is judged against: the prompts (a decoder's token ids, an encoder-decoder's sources),
    the float64 reference's tokens and logits, the eager model's teacher-forced logits in the recipe's dtype, and
    the per-step bars made from them."""

    prompt: Any
    tokens: torch.Tensor
    logits: torch.Tensor
    baseline: torch.Tensor
    bars: list[dict[str, Any]]
    k: float


def prompt_tensors(prompt: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``Prompt``'s or a ``Source``'s two tensors: the values and their mask."""
    values, mask = (getattr(prompt, f.name) for f in fields(prompt))
    return values, mask


def reference(family: Family, model: torch.nn.Module, layout: Any, recipe: Recipe, transformers: bool) -> Reference:
    """The original model generating greedily in float64 without a cache, then teacher-forced in the recipe's
    dtype (the eager error each step's bar is made from); the model is left in the recipe's dtype, and so is a
    prompt of floats (a speech model's features)."""
    gen, device, dtype = recipe.generation, recipe.runtime.device, torch_dtype(recipe.runtime.dtype)
    with attention_implementation(model, "eager"):
        model.to(torch.float64)
        prompt = family.prompt(layout, recipe)
        tokens, logits = family.reference(model, prompt, layout, gen.new_tokens, device, transformers)
        model.to(dtype)
        values, mask = prompt_tensors(prompt)
        if values.is_floating_point():
            prompt = type(prompt)(values.to(dtype), mask)
        baseline = family.forced(model, prompt, layout, tokens, device, transformers)
    k = recipe.numerics.multiplier(recipe.runtime.dtype)
    bars = step_bars(logits, baseline, k, relative_floor(recipe.numerics.floor, recipe.runtime.dtype),
                     recipe.numerics.atol)
    return Reference(prompt, tokens, logits, baseline, bars, k)


def write_setup(family: Family, staging: Path, recipe: Recipe, ref: Reference, layout: Any,
                model: torch.nn.Module) -> dict[str, Any]:
    """``generation.json`` and ``reference/generation.safetensors``: what a target's session is judged and timed
    with, here and in ``exporter verify``."""
    gen, device = recipe.generation, recipe.runtime.device
    setup: dict[str, Any] = {
        "task": recipe.model.task, "device": device, "dtype": recipe.runtime.dtype,
        "attention_backend": recipe.runtime.attention_backend, "cache_length": gen.max_cache_len,
        "batch": gen.batch, "prompt_length": gen.prompt_length, "new_tokens": gen.new_tokens,
        **family.setup(model, layout, recipe), "layout": layout.to_dict(),
        "numerics": {"k": ref.k, "atol": recipe.numerics.atol, "floor": recipe.numerics.floor, "bars": ref.bars},
        "timing": {"tokens": gen.bench_tokens, "warmup": recipe.bench.warmup, "rounds": recipe.bench.rounds,
                   "cuda_graph": gen.cuda_graph, "weight_bytes": family.weight_bytes(model),
                   "copy_bytes_per_s": bench.copy_bandwidth(device)},
    }
    (staging / "reference").mkdir(exist_ok=True)
    stored = dict(zip(family.stored, (t.contiguous() for t in prompt_tensors(ref.prompt))))
    save_file({**stored, "tokens": ref.tokens.contiguous(), "logits": ref.logits.double().contiguous()},
              str(staging / REFERENCE))
    write_json(staging / MANIFEST, setup)
    return setup


def artifact_entry(target: str, device: str, dtype: str) -> dict[str, Any]:
    return {"target": target, "name": target, "status": SKIPPED, "error": None, "path": None, "sha256": None,
            "size_bytes": None, "files": [], "device": device, "dtype": dtype, "build_s": None, "load_s": None,
            "notes": [], "numerics": {"passed": None}, "bench": None, "programs": None}


def build_and_judge(entry: dict[str, Any], programs: DecoderPrograms, recipe: Recipe, staging: Path,
                    progress: Progress) -> None:
    """Build one target's decoder programs into ``staging``, then judge and time them in a process of their own;
    the outcome goes into ``entry``."""
    name = entry["target"]
    target = targets.get(name)
    with progress.stage(f"build {name}"):
        t0 = time.perf_counter()
        try:
            files = build_decoder(target, programs, recipe.build_settings(), staging)
        except Exception as exc:
            # the whole message (a compiler's output is longer than the report's line) and the traceback
            log = staging / "logs" / f"{name}.build.log"
            log.write_text(f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}", encoding="utf-8")
            entry.update(status=FAILED, error=f"build failed (logs/{log.name}): {describe(exc)}")
            for partial in (*target.decoder, target.decoder_one):  # no half-built program is published: a
                if partial:  # package without its weights file would load and read unset memory
                    (staging / partial).unlink(missing_ok=True)
            return
        main = staging / target.decoder[-1]
        notes = list(programs.notes) + programs.build_notes.get(name, [])
        if programs.decode_one is not None and target.decoder_one:
            notes.append(f"{target.decoder_one}: the decode program again with the batch fixed at 1, compiled with "
                         "coordinate-descent tuning (generation.decode_batch_1); a batch of one row decodes with it, "
                         "judged with each prompt row alone")
        entry.update(build_s=time.perf_counter() - t0 + programs.export_s, path=target.decoder[-1],
                     files=[file_entry(f, staging) for f in files], sha256=sha256_file(main),
                     size_bytes=sum(f.stat().st_size for f in files), notes=notes,
                     programs=decoder_attention(target, programs, staging), fused_projections=programs.fused)
    with progress.stage(f"validate and time {name}"):
        result = run_session(staging, name, staging / "logs" / f"{name}.log", time_it=True)
    if "error" in result:
        entry.update(status=FAILED, error=result["error"])
        return
    entry.update(load_s=result["load_s"], numerics=result["numerics"], bench=result.get("bench"))
    entry["status"] = OK if result["numerics"]["passed"] else NUMERICS_FAILED
    if not result["numerics"]["passed"]:
        entry["error"] = "; ".join(result["numerics"]["failures"][:2]) or "NaN/Inf in the logits"


def decode_speedups(artifacts: list[dict[str, Any]], eager: dict[str, Any]) -> None:
    """Each artifact's decode against eager ``generate()`` at the same batch."""
    for entry in artifacts:
        if not entry.get("bench"):
            continue
        speedups = {}
        for label in ("batch_1", "batch"):
            eager_ms = (eager.get(label) or {}).get("decode_best_ms")
            mine = (entry["bench"].get(label) or {}).get("decode_best_ms")
            if eager_ms and mine:
                speedups[label] = eager_ms / mine
        entry["bench"]["decode_speedup_vs_eager_generate"] = speedups


def benchmark_eager(family: Family, model: torch.nn.Module, ref: Reference, layout: Any, recipe: Recipe,
                    transformers: bool, timing: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """transformers' own ``generate()`` at batch 1 and at the recipe's batch (a factory model has none); where it
    cannot run on this model (Whisper's needs a generation config with its task tokens), the reason is a warning
    and there is no baseline."""
    eager: dict[str, Any] = {}
    if not transformers:
        return eager
    for label, which in (("batch_1", ref.prompt.row(0)), ("batch", ref.prompt)):
        try:
            eager[label] = family.eager_generate(model, which, layout, recipe)
        except Exception as exc:
            warnings.append(f"eager generate() could not be timed: {describe(exc, 200)}")
            return {}
        eager[label]["bandwidth"] = bench.bandwidth(eager[label], timing["weight_bytes"], timing["copy_bytes_per_s"])
    return eager


def generation_section(family: Family, recipe: Recipe, ref: Reference, layout: Any, setup: dict[str, Any],
                       eager_verdict: dict[str, Any]) -> dict[str, Any]:
    gen = recipe.generation
    return {
        "batch": gen.batch, "prompt_length": gen.prompt_length, "cache_length": gen.max_cache_len,
        "new_tokens": gen.new_tokens, "bench_tokens": gen.bench_tokens,
        **family.section(layout, ref.prompt, setup, recipe),
        "reference_tokens": ref.tokens.tolist(),
        "eager": {"tokens_identical": bool(torch.equal(ref.baseline.argmax(-1).T, ref.tokens)),
                  "numerics": eager_verdict},
        "copy_bytes_per_s": setup["timing"]["copy_bytes_per_s"],
        "weight_bytes": setup["timing"]["weight_bytes"],
    }


def convert_generation(checkpoint: Path, recipe: Recipe, staging: Path, allow_drift: bool, allow_pickle: bool,
                       progress: Progress) -> tuple[dict[str, Any], Checkpoint]:
    t_start = time.perf_counter()
    family = family_for(recipe.model.task)
    gen, device, dtype = recipe.generation, recipe.runtime.device, recipe.runtime.dtype
    warnings: list[str] = []
    (staging / "logs").mkdir(exist_ok=True)

    with progress.stage("load", str(checkpoint)):
        loaded: LoadedModel = load_model(checkpoint, recipe.model.factory, allow_pickle, pipeline=False)
        model = loaded.model.eval()
        transformers = loaded.architecture.is_transformers
    if device != "cpu":
        with progress.stage("to device", device):
            model.to(device)
            gc.collect()
    refused = sdpa_refusal(model, transformers) if recipe.runtime.rewrite_attention else None
    implementation = "sdpa" if recipe.runtime.rewrite_attention and refused is None else "eager"
    with attention_implementation(model, implementation):  # the cache as the rewritten model's step writes it
        layout = family.probe(model, recipe, transformers)

    with progress.stage("reference", f"original model, float64, greedy {gen.new_tokens} tokens, no cache"):
        ref = reference(family, model, layout, recipe, transformers)
    quantization = None
    if recipe.quantize.enabled:  # the second question against the original's steps; the first against the quantized
        with progress.stage("quantize", recipe.quantize.scheme):
            original = ref  # teacher-forced on the original's tokens
            quantization = quantize_decoder(
                model, recipe,
                lambda: family.forced(model, original.prompt, layout, original.tokens, device, transformers),
                ref.logits, ref.baseline)
            if not quantization.cost.passed:
                progress.warn(f"quantization budget: {quantization.cost.error()}")
        with progress.stage("reference (quantized)",
                            f"quantized model, float64, greedy {gen.new_tokens} tokens, no cache"):
            ref = reference(family, model, layout, recipe, transformers)
        gc.collect()
        if device.startswith("cuda"):  # cached float64 blocks would crowd the targets' own processes
            torch.cuda.empty_cache()
    eager_verdict = judge_steps("eager", ref.logits, ref.tokens, list(ref.baseline.float()), None, ref.bars, ref.k,
                                recipe.numerics.atol)

    with attention_implementation(model, implementation):  # the rewrite: transformers' SDPA attention
        with progress.stage("rewrite attention"):
            if refused is not None:
                audit = eager_sites(model, refused)
            elif recipe.runtime.rewrite_attention:
                audit = family.audit(model, layout, device, transformers)
            else:
                audit = AttentionAudit(notes=["rewrite off (--no-rewrite): attention runs as written"])
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten")
        setup = write_setup(family, staging, recipe, ref, layout, model)

        local = family.local_steps(model, layout, recipe, transformers)
        with progress.stage("validate rewritten", "the rewritten model on the static cache, not exported"):
            _, logits = family.generate(local, ref.prompt, gen.new_tokens, forced=ref.tokens)
            free, _ = family.generate(local, ref.prompt, gen.new_tokens, keep_logits=False)
            verdict = judge_steps("rewritten", ref.logits, ref.tokens, logits, free, ref.bars, ref.k,
                                  recipe.numerics.atol)
            rewritten: dict[str, Any] = {"name": "rewritten", "status": OK if verdict["passed"] else NUMERICS_FAILED,
                                         "error": None if verdict["passed"] else "; ".join(verdict["failures"][:2]),
                                         "numerics": verdict}

        artifacts = [artifact_entry(name, device, dtype) for name in recipe.targets.build]
        refusals = {entry["target"]: family.refusal(entry["target"], device, dtype) for entry in artifacts}
        wanted = [entry["target"] for entry in artifacts if refusals[entry["target"]] is None]
        programs = None
        if wanted:
            check_space(space_needs(recipe, model, staging, decoder=True))
            with progress.stage("export", family.programs):
                try:
                    programs = family.export(model, layout, recipe, transformers, past="onnx" in wanted,
                                             one=gen.decode_batch_1 and any(targets.get(t).decoder_one
                                                                            for t in wanted))
                except Exception as exc:
                    warnings.append(f"export failed: {describe(exc)}")
                    (staging / "logs" / "export.log").write_text(repr(exc), encoding="utf-8")
        for entry in artifacts:
            if refusals[entry["target"]] is not None:
                entry["error"] = refusals[entry["target"]]
            elif programs is None:
                entry.update(status=FAILED,
                             error="the prefill and decode programs could not be exported (logs/export.log)")
            else:
                build_and_judge(entry, programs, recipe, staging, progress)

    with progress.stage("benchmark eager"):
        eager_bench = benchmark_eager(family, model, ref, layout, recipe, transformers, setup["timing"], warnings)
        with attention_implementation(model, implementation):
            rewritten["bench"] = family.time(local, ref.prompt, setup["timing"])
    decode_speedups(artifacts, eager_bench)

    report = assemble_generation(
        recipe=recipe, checkpoint=checkpoint, loaded=loaded, audit=audit, rewritten=rewritten, artifacts=artifacts,
        generation=generation_section(family, recipe, ref, layout, setup, eager_verdict), eager_bench=eager_bench,
        k=ref.k, allow_drift=allow_drift, warnings=warnings, timings=progress.timings,
        total_s=time.perf_counter() - t_start, transformers=transformers, quantization=quantization,
        task=recipe.model.task)
    return finite(report), loaded.checkpoint
