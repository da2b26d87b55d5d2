"""``exporter convert --task text-generation``: a decoder's prefill and decode programs, judged and timed.

    load -> prompts -> reference generation (float64, no cache) -> eager baseline (teacher-forced)
         -> attention to SDPA -> export prefill + decode -> build targets -> judge and time each -> report

This module is the order of those stages; each does its work where the forward convert's does (``checkpoint``,
``rewrite``, ``targets``: ``build_decoder``, ``runners.run_session``, ``measure``, ``report.generation``).
Everything a target is judged on is computed here once and stored in the output folder (``generation.json``:
cache layout, sizes and each step's bar; ``reference/generation.safetensors``: the prompts, the reference's
tokens and its float64 logits per step), so ``exporter verify`` re-judges a target with the same bars. Each
target is judged and timed in a process of its own (``generation.session``).
"""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .. import targets
from ..checkpoint import LoadedModel, load_model
from ..checkpoint.files import Checkpoint
from ..dtypes import torch_dtype
from ..environment import check_space, space_needs
from ..errors import ArchitectureError, describe
from ..modelio import attention_implementation
from ..numerics.tolerance import relative_floor
from ..outdir import file_entry, sha256_file, write_json
from ..progress import Progress
from ..quantize.stage import quantize_decoder
from ..recipe import Recipe
from ..report.generation import assemble_generation
from ..results import FAILED, NUMERICS_FAILED, OK, SKIPPED
from ..rewrite.audit import REWRITTEN, AttentionAudit, Site
from ..rewrite.audit import SKIPPED as SITE_SKIPPED
from ..rewrite.transformers_interface import KIND, _recording
from ..rewrite.transformers_interface import RULE as SITE_RULE
from ..runners import run_session
from ..targets.context import DecoderPrograms, build_decoder, decoder_attention
from . import bench
from .cache import CacheLayout, DecoderStep, probe_layout
from .driver import Prompt, Steps, generate
from .judge import judge_steps, step_bars
from .programs import export_steps
from .reference import forced_logits, reference_generation
from .session import MANIFEST, REFERENCE, finite, time_target


def make_prompt(vocab: int, batch: int, length: int, seed: int) -> Prompt:
    """Random token ids (seeded); odd rows left-padded by a quarter of the length (at least one token)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    pad = max(1, length // 4)
    mask[1::2, :pad] = 0
    ids[mask == 0] = 0
    return Prompt(ids, mask)


def audit_sites(model: torch.nn.Module, device: str, transformers: bool) -> AttentionAudit:
    """The attention sites one decode step dispatched through transformers' SDPA entry (transformers models);
    a factory model's attention is read from the exported programs' graphs (``decoder_attention``)."""
    audit = AttentionAudit()
    if not transformers:
        audit.notes.append("factory decoder: its attention runs as written; the programs' SDPA and softmax nodes "
                           "are counted below")
        return audit
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[dict[str, Any]] = []
    with _recording(calls):  # one step of the model, each attention's SDPA call recorded
        probe_layout(model, True, device)
    seen: set[int] = set()
    for call in calls:
        if id(call["module"]) in seen:
            continue
        seen.add(id(call["module"]))
        q, k = call["query"], call["key"]
        audit.sites.append(Site(location=names.get(id(call["module"]), "attention"), kind=KIND, status=REWRITTEN,
                                rule=SITE_RULE, causal=True, masked=True,
                                grouped_query=len(q) == 4 and len(k) == 4 and q[1] != k[1],
                                heads=q[1] if len(q) == 4 else None, kv_heads=k[1] if len(k) == 4 else None,
                                head_dim=q[-1] if q else None))
    return audit


def sdpa_refusal(model: torch.nn.Module, transformers: bool) -> str | None:
    """Why transformers will not run this model's attention through SDPA (Gemma2: its scores are soft-capped);
    None when it will. The model then keeps its eager attention, and each site says why."""
    if not transformers:
        return None
    hf: Any = model  # a transformers PreTrainedModel
    if not hf._can_set_attn_implementation():  # BLOOM: set_attn_implementation would only warn
        return (f"transformers cannot switch {type(model).__name__} to SDPA once it is built (it does not dispatch "
                "attention through AttentionInterface); the forward convert's graph rule rewrites it, the decode "
                "programs keep it as written")
    try:
        with attention_implementation(model, "sdpa"):
            pass
    except (ValueError, ImportError) as exc:
        first = str(exc).split(". ")[0].strip()
        softcap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
        if softcap:
            return (f"its scores are soft-capped (tanh, attn_logit_softcapping = {softcap:g}), which SDPA has no "
                    f"equivalent for; transformers refuses SDPA for it ({first})")
        return f"transformers refuses SDPA for it ({first})"
    return None


def eager_sites(model: torch.nn.Module, reason: str) -> AttentionAudit:
    """Each attention module of a model kept on eager attention, left as written with ``reason``."""
    audit = AttentionAudit()
    outer: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and not any(name.startswith(o + ".") for o in outer):
            outer.append(name)
            audit.sites.append(Site(location=name, kind=f"{type(module).__name__} (eager)", status=SITE_SKIPPED,
                                    rule=SITE_RULE, reason=reason, causal=True))
    return audit


def check_window(config: Any, cache_length: int) -> None:
    """A sliding-window attention narrower than the cache would see keys the step's mask shows it: refused."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    uses = getattr(config, "use_sliding_window", True) and (not layer_types or "sliding_attention" in layer_types)
    if isinstance(window, int) and uses and window < cache_length:
        raise ArchitectureError(f"the model's attention looks back at most {window} tokens (sliding_window) but the "
                                f"cache holds {cache_length}: the static cache does not implement sliding windows",
                                f"convert with --set generation.max_cache_len={window} or less")


def check_positions(model: Any, cache_length: int) -> None:
    """A cache longer than the model has positions: a step past them reads a position embedding out of bounds
    (generate would die there, at run time): refused before anything is built."""
    from ..inputs import position_limit  # noqa: PLC0415

    found = position_limit(model, "input_ids")
    if found is not None and cache_length > found[0]:
        limit, source = found
        raise ArchitectureError(f"the model has {limit} positions ({source}) but the cache holds {cache_length}",
                                f"convert with --set generation.max_cache_len={limit} or less")


@dataclass
class Reference:
    """What every candidate is judged against: the prompts, the float64 reference's tokens and logits, the eager
    model's teacher-forced logits in the recipe's dtype, and the per-step bars made from them."""

    prompt: Prompt
    tokens: torch.Tensor
    logits: torch.Tensor
    baseline: torch.Tensor
    bars: list[dict[str, Any]]
    k: float
    vocab: int


def reference(model: torch.nn.Module, recipe: Recipe, transformers: bool) -> Reference:
    """The original model generating greedily in float64 without a cache, then teacher-forced in the recipe's
    dtype (the eager error each step's bar is made from); the model is left in the recipe's dtype."""
    gen, device, dtype = recipe.generation, recipe.runtime.device, recipe.runtime.dtype
    with attention_implementation(model, "eager"):
        model.to(torch.float64)
        vocab = probe_layout(model, transformers, device).vocab
        prompt = make_prompt(vocab, gen.batch, gen.prompt_length, recipe.inputs.seed)
        tokens, logits = reference_generation(model, prompt, gen.new_tokens, device, transformers)
        model.to(torch_dtype(dtype))
        baseline = forced_logits(model, prompt, tokens, device, transformers)
    k = recipe.numerics.multiplier(dtype)
    bars = step_bars(logits, baseline, k, relative_floor(recipe.numerics.floor, dtype), recipe.numerics.atol)
    return Reference(prompt, tokens, logits, baseline, bars, k, vocab)


def write_setup(staging: Path, recipe: Recipe, ref: Reference, layout: CacheLayout, model: torch.nn.Module) -> dict:
    """``generation.json`` and ``reference/generation.safetensors``: what a target's session is judged and timed
    with, here and in ``exporter verify``."""
    gen, device = recipe.generation, recipe.runtime.device
    setup: dict[str, Any] = {
        "task": "text-generation", "device": device, "dtype": recipe.runtime.dtype,
        "attention_backend": recipe.runtime.attention_backend, "cache_length": gen.max_cache_len,
        "batch": gen.batch, "prompt_length": gen.prompt_length, "new_tokens": gen.new_tokens,
        "layout": layout.to_dict(),
        "numerics": {"k": ref.k, "atol": recipe.numerics.atol, "floor": recipe.numerics.floor, "bars": ref.bars},
        "timing": {"tokens": gen.bench_tokens, "warmup": recipe.bench.warmup, "rounds": recipe.bench.rounds,
                   "cuda_graph": gen.cuda_graph, "weight_bytes": bench.weight_bytes(model),
                   "copy_bytes_per_s": bench.copy_bandwidth(device)},
    }
    (staging / "reference").mkdir(exist_ok=True)
    save_file({"prompt_ids": ref.prompt.input_ids.contiguous(), "prompt_mask": ref.prompt.mask.contiguous(),
               "tokens": ref.tokens.contiguous(), "logits": ref.logits.double().contiguous()},
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
        notes = list(programs.notes)
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


def benchmark_eager(model: torch.nn.Module, prompt: Prompt, recipe: Recipe, transformers: bool,
                    timing: dict[str, Any]) -> dict[str, Any]:
    """transformers' own ``generate()`` at batch 1 and at the recipe's batch (a factory model has none)."""
    eager: dict[str, Any] = {}
    if transformers:
        for label, which in (("batch_1", prompt.row(0)), ("batch", prompt)):
            eager[label] = bench.time_eager_generate(model, which, recipe.generation.bench_tokens,
                                                     recipe.runtime.device, recipe.bench.rounds,
                                                     recipe.bench.max_seconds / 2)  # two batch sizes
            eager[label]["bandwidth"] = bench.bandwidth(eager[label], timing["weight_bytes"],
                                                        timing["copy_bytes_per_s"])
    return eager


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


def generation_section(recipe: Recipe, ref: Reference, layout: CacheLayout, setup: dict[str, Any],
                       eager_verdict: dict[str, Any]) -> dict[str, Any]:
    gen = recipe.generation
    return {
        "batch": gen.batch, "prompt_length": gen.prompt_length, "cache_length": gen.max_cache_len,
        "new_tokens": gen.new_tokens, "bench_tokens": gen.bench_tokens, "layout": layout.to_dict(),
        "padded_rows": [r for r in range(gen.batch) if r % 2 == 1], "pad_tokens": max(1, gen.prompt_length // 4),
        "reference_tokens": ref.tokens.tolist(),
        "eager": {"tokens_identical": bool(torch.equal(ref.baseline.argmax(-1).T, ref.tokens)),
                  "numerics": eager_verdict},
        "copy_bytes_per_s": setup["timing"]["copy_bytes_per_s"],
        "weight_bytes": setup["timing"]["weight_bytes"],
    }


def convert_generation(checkpoint: Path, recipe: Recipe, staging: Path, allow_drift: bool, allow_pickle: bool,
                       progress: Progress) -> tuple[dict[str, Any], Checkpoint]:
    t_start = time.perf_counter()
    gen, device, dtype = recipe.generation, recipe.runtime.device, recipe.runtime.dtype
    warnings: list[str] = []
    (staging / "logs").mkdir(exist_ok=True)

    with progress.stage("load", str(checkpoint)):
        loaded: LoadedModel = load_model(checkpoint, recipe.model.factory, allow_pickle,
                                               pipeline=False)
        model = loaded.model.eval()
        transformers = loaded.architecture.is_transformers
        check_window(getattr(model, "config", None), gen.max_cache_len)
        check_positions(model, gen.max_cache_len)
    if device != "cpu":
        with progress.stage("to device", device):
            model.to(device)
            gc.collect()

    with progress.stage("reference", f"original model, float64, greedy {gen.new_tokens} tokens, no cache"):
        ref = reference(model, recipe, transformers)
    quantization = None
    if recipe.quantize.enabled:  # the second question against the original's steps; the first against the quantized
        with progress.stage("quantize", recipe.quantize.scheme):
            original = ref  # teacher-forced on the original's tokens
            quantization = quantize_decoder(
                model, recipe, lambda: forced_logits(model, original.prompt, original.tokens, device, transformers),
                ref.logits, ref.baseline)
            if not quantization.cost.passed:
                progress.warn(f"quantization budget: {quantization.cost.error()}")
        with progress.stage("reference (quantized)",
                            f"quantized model, float64, greedy {gen.new_tokens} tokens, no cache"):
            ref = reference(model, recipe, transformers)
        gc.collect()
        if device.startswith("cuda"):  # cached float64 blocks would crowd the targets' own processes
            torch.cuda.empty_cache()
    eager_verdict = judge_steps("eager", ref.logits, ref.tokens, list(ref.baseline.float()), None, ref.bars, ref.k,
                                recipe.numerics.atol)

    refused = sdpa_refusal(model, transformers) if recipe.runtime.rewrite_attention else None
    implementation = "sdpa" if recipe.runtime.rewrite_attention and refused is None else "eager"
    with attention_implementation(model, implementation):  # the rewrite: transformers' SDPA attention
        with progress.stage("rewrite attention"):
            layout = probe_layout(model, transformers, device)
            step = DecoderStep(model, transformers, layout.padding_mask_2d)
            if refused is not None:
                audit = eager_sites(model, refused)
            elif recipe.runtime.rewrite_attention:
                audit = audit_sites(model, device, transformers)
            else:
                audit = AttentionAudit(notes=["rewrite off (--no-rewrite): attention runs as written"])
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten")
        setup = write_setup(staging, recipe, ref, layout, model)

        steps_local = Steps(step, step, layout, gen.max_cache_len, torch_dtype(dtype), device)
        with progress.stage("validate rewritten", "the rewritten model on the static cache, not exported"):
            _, logits = generate(steps_local, ref.prompt, gen.new_tokens, forced=ref.tokens)
            free, _ = generate(steps_local, ref.prompt, gen.new_tokens, keep_logits=False)
            verdict = judge_steps("rewritten", ref.logits, ref.tokens, logits, free, ref.bars, ref.k,
                                  recipe.numerics.atol)
            rewritten: dict[str, Any] = {"name": "rewritten", "status": OK if verdict["passed"] else NUMERICS_FAILED,
                                         "error": None, "numerics": verdict}
            if not verdict["passed"]:
                rewritten["error"] = "; ".join(verdict["failures"][:2])

        artifacts = [artifact_entry(name, device, dtype) for name in recipe.targets.build]
        refusals = {entry["target"]: targets.get(entry["target"]).decoder_refusal(device, dtype)
                    for entry in artifacts}
        wanted = [entry for entry in artifacts if refusals[entry["target"]] is None]
        programs = None
        if wanted:
            check_space(space_needs(recipe, model, staging, decoder=True))
            with progress.stage("export", "prefill and decode programs"):
                try:
                    programs = export_steps(step, layout, gen.batch, gen.prompt_length, gen.max_cache_len,
                                            torch_dtype(dtype), device, fuse=gen.fuse_projections,
                                            past=any(entry["target"] == "onnx" for entry in wanted),
                                            one=gen.decode_batch_1 and any(targets.get(entry["target"]).decoder_one
                                                                           for entry in wanted))
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
        eager_bench = benchmark_eager(model, ref.prompt, recipe, transformers, setup["timing"])
        with attention_implementation(model, implementation):
            rewritten["bench"] = time_target(steps_local, ref.prompt, setup["timing"])
    decode_speedups(artifacts, eager_bench)

    report = assemble_generation(
        recipe=recipe, checkpoint=checkpoint, loaded=loaded, audit=audit, rewritten=rewritten, artifacts=artifacts,
        generation=generation_section(recipe, ref, layout, setup, eager_verdict), eager_bench=eager_bench, k=ref.k,
        allow_drift=allow_drift, warnings=warnings, timings=progress.timings,
        total_s=time.perf_counter() - t_start, transformers=transformers, quantization=quantization)
    return finite(report), loaded.checkpoint
