"""``exporter convert --task text2text-generation`` (T5, BART, Marian) and ``--task automatic-speech-recognition``
(Whisper): an encoder-decoder's prefill and decode programs, judged step by step and timed.

    load -> sources -> reference generation (float64, no cache) -> eager baseline (teacher-forced)
         -> attention to SDPA -> export prefill (encoder + first step) + decode -> build targets
         -> judge and time each -> report

The stages, the stored reference and the per-step judgement are the decoder-only convert's
(:mod:`exporter.generation.run`); what differs is the step (:mod:`exporter.generation.seq2seq`): the prefill
reads a source (token ids, or a speech model's features) and writes every decoder layer's cross-attention keys
and values once, and each decode step reads them from the cache.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..checkpoint import LoadedModel, load_model
from ..checkpoint.files import Checkpoint
from ..dtypes import torch_dtype
from ..environment import check_space, space_needs
from ..errors import ArchitectureError, describe
from ..modelio import attention_implementation
from ..numerics.tolerance import relative_floor
from ..outdir import write_json
from ..progress import Progress
from ..recipe import Recipe
from ..report.generation import assemble_generation
from ..results import FAILED, NUMERICS_FAILED, OK
from ..rewrite.audit import REWRITTEN, AttentionAudit, Site
from ..rewrite.transformers_interface import KIND, _recording
from ..rewrite.transformers_interface import RULE as SITE_RULE
from . import bench
from .judge import judge_steps, step_bars
from .run import artifact_entry, build_and_judge, decode_speedups, eager_sites, sdpa_refusal
from .seq2seq import (
    SPEECH,
    Seq2SeqDecode,
    Seq2SeqLayout,
    Seq2SeqPrefill,
    Seq2SeqSteps,
    Source,
    forced_logits,
    generate,
    is_encoder_decoder,
    make_source,
    probe_layout,
    reference_generation,
    source_name,
)
from .seq2seq_programs import export_seq2seq, max_source, time_eager_generate
from .session import MANIFEST, REFERENCE, finite, time_seq2seq_target


def check_model(model: torch.nn.Module, task: str, transformers: bool) -> None:
    """Only a transformers encoder-decoder generates here, text from ids or speech from features as ``task`` says."""
    if not transformers or not is_encoder_decoder(model):
        raise ArchitectureError(f"--task {task} needs a transformers encoder-decoder (T5, BART, Marian, Whisper); "
                                f"{type(model).__name__} is not one",
                                "use --task text-generation for a decoder-only model, or leave --task out")
    speech = source_name(model) == "input_features"
    if speech != (task == SPEECH):
        wanted = "automatic-speech-recognition" if speech else "text2text-generation"
        raise ArchitectureError(f"{type(model).__name__} reads {'speech features' if speech else 'token ids'}, "
                                f"not what --task {task} generates from", f"convert with --task {wanted}")


def check_lengths(model: torch.nn.Module, layout: Seq2SeqLayout, recipe: Recipe) -> None:
    gen = recipe.generation
    if gen.new_tokens + 1 > gen.max_cache_len:
        raise ArchitectureError(f"the start token plus {gen.new_tokens} new tokens do not fit the {gen.max_cache_len}"
                                "-slot cache", "raise generation.max_cache_len or lower generation.new_tokens")
    config = model.config
    limit = getattr(config, "max_target_positions", None) or (
        getattr(config, "max_position_embeddings", None) if not hasattr(config, "relative_attention_num_buckets")
        else None)
    if limit and gen.max_cache_len > limit:
        raise ArchitectureError(f"the decoder has {limit} positions but the cache holds {gen.max_cache_len}",
                                f"convert with --set generation.max_cache_len={limit} or less")
    if not layout.speech and gen.prompt_length > max_source(model, layout, 0):
        raise ArchitectureError(f"a {gen.prompt_length}-token source is longer than the model's "
                                f"{max_source(model, layout, 0)} positions",
                                "lower generation.prompt_length")


def audit_sites(model: torch.nn.Module, layout: Seq2SeqLayout, device: str) -> AttentionAudit:
    """Every attention the prefill dispatches through transformers' SDPA entry: the encoder's, the decoder's
    self-attention and its cross-attention."""
    audit = AttentionAudit()
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[dict[str, Any]] = []
    dtype = next(model.parameters()).dtype
    source = make_source(layout, 1, 4, 0, dtype)
    steps = Seq2SeqSteps(Seq2SeqPrefill(model), Seq2SeqDecode(model), layout, 2, dtype, device)
    with _recording(calls):
        generate(steps, source, 1, keep_logits=False)
    if not calls:  # transformers took the switch and still runs the model's own attention (T5 before 5.24)
        import transformers  # noqa: PLC0415

        return eager_sites(model, f"transformers {transformers.__version__} runs {type(model).__name__}'s attention "
                                  "as written even with SDPA selected (no call reached its SDPA entry); the programs' "
                                  "softmax nodes are counted under each target")
    seen: set[int] = set()
    for call in calls:
        if id(call["module"]) in seen:
            continue
        seen.add(id(call["module"]))
        q, k = call["query"], call["key"]
        audit.sites.append(Site(location=names.get(id(call["module"]), "attention"), kind=KIND, status=REWRITTEN,
                                rule=SITE_RULE, causal=bool(call["causal"]), masked=call["mask"],
                                grouped_query=len(q) == 4 and len(k) == 4 and q[1] != k[1],
                                heads=q[1] if len(q) == 4 else None, kv_heads=k[1] if len(k) == 4 else None,
                                head_dim=q[-1] if q else None))
    return audit


class Reference:
    """The sources, the float64 reference's tokens and logits, the eager teacher-forced logits in the recipe's
    dtype and the per-step bars."""

    def __init__(self, model: torch.nn.Module, layout: Seq2SeqLayout, recipe: Recipe):
        gen, dtype = recipe.generation, recipe.runtime.dtype
        with attention_implementation(model, "eager"):
            model.to(torch.float64)
            self.source = make_source(layout, gen.batch, gen.prompt_length, recipe.inputs.seed, torch.float64)
            self.tokens, self.logits = reference_generation(model, self.source, layout, gen.new_tokens)
            model.to(torch_dtype(dtype))
            if self.source.values.is_floating_point():
                self.source = Source(self.source.values.to(torch_dtype(dtype)), self.source.mask)
            self.baseline = forced_logits(model, self.source, layout, self.tokens)
        self.k = recipe.numerics.multiplier(dtype)
        self.bars = step_bars(self.logits, self.baseline, self.k, relative_floor(recipe.numerics.floor, dtype),
                              recipe.numerics.atol)


def write_setup(staging: Path, recipe: Recipe, ref: Reference, layout: Seq2SeqLayout,
                model: torch.nn.Module) -> dict[str, Any]:
    gen, device = recipe.generation, recipe.runtime.device
    setup: dict[str, Any] = {
        "task": recipe.model.task, "device": device, "dtype": recipe.runtime.dtype,
        "attention_backend": recipe.runtime.attention_backend, "cache_length": gen.max_cache_len,
        "batch": gen.batch, "prompt_length": gen.prompt_length, "new_tokens": gen.new_tokens,
        "max_source": max_source(model, layout, gen.prompt_length), "layout": layout.to_dict(),
        "numerics": {"k": ref.k, "atol": recipe.numerics.atol, "floor": recipe.numerics.floor, "bars": ref.bars},
        "timing": {"tokens": gen.bench_tokens, "warmup": recipe.bench.warmup, "rounds": recipe.bench.rounds,
                   "cuda_graph": gen.cuda_graph, "weight_bytes": bench.weight_bytes(model, _encoder(model)),
                   "copy_bytes_per_s": bench.copy_bandwidth(device)},
    }
    (staging / "reference").mkdir(exist_ok=True)
    save_file({"source_values": ref.source.values.contiguous(), "source_mask": ref.source.mask.contiguous(),
               "tokens": ref.tokens.contiguous(), "logits": ref.logits.double().contiguous()},
              str(staging / REFERENCE))
    write_json(staging / MANIFEST, setup)
    return setup


def benchmark_eager(model: torch.nn.Module, ref: Reference, layout: Seq2SeqLayout, recipe: Recipe,
                    timing: dict[str, Any], warnings: list[str]) -> dict[str, Any]:
    """transformers' own ``generate()`` at batch 1 and at the recipe's batch; where it cannot run on this model
    (Whisper's needs a generation config with its task tokens), the reason is a warning and there is no baseline."""
    eager: dict[str, Any] = {}
    for label, which in (("batch_1", ref.source.row(0)), ("batch", ref.source)):
        try:
            eager[label] = time_eager_generate(model, which, layout, recipe.generation.bench_tokens,
                                               recipe.runtime.device, recipe.bench.rounds,
                                               recipe.bench.max_seconds / 2)
        except Exception as exc:
            warnings.append(f"eager generate() could not be timed: {describe(exc, 200)}")
            return {}
        eager[label]["bandwidth"] = bench.bandwidth(eager[label], timing["weight_bytes"], timing["copy_bytes_per_s"])
    return eager


def generation_section(recipe: Recipe, ref: Reference, layout: Seq2SeqLayout, setup: dict[str, Any],
                       eager_verdict: dict[str, Any]) -> dict[str, Any]:
    gen = recipe.generation
    return {
        "batch": gen.batch, "prompt_length": ref.source.length, "cache_length": gen.max_cache_len,
        "new_tokens": gen.new_tokens, "bench_tokens": gen.bench_tokens, "layout": layout.own.to_dict(),
        "padded_rows": [] if layout.speech else [r for r in range(gen.batch) if r % 2 == 1],
        "pad_tokens": 0 if layout.speech else max(1, gen.prompt_length // 4),
        "reference_tokens": ref.tokens.tolist(),
        "eager": {"tokens_identical": bool(torch.equal(ref.baseline.argmax(-1).T, ref.tokens)),
                  "numerics": eager_verdict},
        "copy_bytes_per_s": setup["timing"]["copy_bytes_per_s"],
        "weight_bytes": setup["timing"]["weight_bytes"],
        "encoder_decoder": {
            "source": "features " + "x".join(map(str, layout.source_shape)) if layout.speech else
            f"token ids, odd rows right-padded (2 to {setup['max_source']} tokens)",
            "encoder_length": int(ref.source.encoder_mask(layout).shape[1]),
            "cross_layout": layout.cross.to_dict(), "start_token": layout.start_token,
        },
    }


def convert_seq2seq(checkpoint: Path, recipe: Recipe, staging: Path, allow_drift: bool, allow_pickle: bool,
                    progress: Progress) -> tuple[dict[str, Any], Checkpoint]:
    t_start = time.perf_counter()
    gen, device, dtype = recipe.generation, recipe.runtime.device, recipe.runtime.dtype
    task = recipe.model.task
    warnings: list[str] = []
    (staging / "logs").mkdir(exist_ok=True)

    with progress.stage("load", str(checkpoint)):
        loaded: LoadedModel = load_model(checkpoint, recipe.model.factory, allow_pickle, pipeline=False)
        model = loaded.model.eval()
        transformers = loaded.architecture.is_transformers
        check_model(model, task, transformers)
    if device != "cpu":
        with progress.stage("to device", device):
            model.to(device)
            gc.collect()
    layout = probe_layout(model, device)
    check_lengths(model, layout, recipe)

    with progress.stage("reference", f"original model, float64, greedy {gen.new_tokens} tokens, no cache"):
        ref = Reference(model, layout, recipe)
    eager_verdict = judge_steps("eager", ref.logits, ref.tokens, list(ref.baseline.float()), None, ref.bars, ref.k,
                                recipe.numerics.atol)

    refused = sdpa_refusal(model, transformers) if recipe.runtime.rewrite_attention else None
    implementation = "sdpa" if recipe.runtime.rewrite_attention and refused is None else "eager"
    with attention_implementation(model, implementation):
        with progress.stage("rewrite attention"):
            if refused is not None:
                audit = eager_sites(model, refused)
            elif recipe.runtime.rewrite_attention:
                audit = audit_sites(model, layout, device)
            else:
                audit = AttentionAudit(notes=["rewrite off (--no-rewrite): attention runs as written"])
            progress.info(f"attention sites: {audit.found} found, {audit.count('rewritten')} rewritten")
        setup = write_setup(staging, recipe, ref, layout, model)

        local = Seq2SeqSteps(Seq2SeqPrefill(model), Seq2SeqDecode(model), layout, gen.max_cache_len,
                             torch_dtype(dtype), device)
        with progress.stage("validate rewritten", "the rewritten model on the static cache, not exported"):
            _, logits = generate(local, ref.source, gen.new_tokens, forced=ref.tokens)
            free, _ = generate(local, ref.source, gen.new_tokens, keep_logits=False)
            verdict = judge_steps("rewritten", ref.logits, ref.tokens, logits, free, ref.bars, ref.k,
                                  recipe.numerics.atol)
            rewritten: dict[str, Any] = {"name": "rewritten", "status": OK if verdict["passed"] else NUMERICS_FAILED,
                                         "error": None if verdict["passed"] else "; ".join(verdict["failures"][:2]),
                                         "numerics": verdict}

        artifacts = [artifact_entry(name, device, dtype) for name in recipe.targets.build]
        refusals = {entry["target"]: seq2seq_refusal(entry["target"], device, dtype) for entry in artifacts}
        wanted = [entry for entry in artifacts if refusals[entry["target"]] is None]
        programs = None
        if wanted:
            check_space(space_needs(recipe, model, staging, decoder=True))
            with progress.stage("export", "prefill (encoder + first step) and decode programs"):
                try:
                    programs = export_seq2seq(model, layout, gen.batch, gen.prompt_length, gen.max_cache_len,
                                              torch_dtype(dtype), device,
                                              past=any(entry["target"] == "onnx" for entry in wanted))
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
        eager_bench = benchmark_eager(model, ref, layout, recipe, setup["timing"], warnings)
        with attention_implementation(model, implementation):
            rewritten["bench"] = time_seq2seq_target(local, ref.source, setup["timing"])
    decode_speedups(artifacts, eager_bench)

    report = assemble_generation(
        recipe=recipe, checkpoint=checkpoint, loaded=loaded, audit=audit, rewritten=rewritten, artifacts=artifacts,
        generation=generation_section(recipe, ref, layout, setup, eager_verdict), eager_bench=eager_bench, k=ref.k,
        allow_drift=allow_drift, warnings=warnings, timings=progress.timings,
        total_s=time.perf_counter() - t_start, transformers=transformers, task=task)
    return finite(report), loaded.checkpoint


def _encoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The encoder a decode step never runs (its keys and values are in the cache), for the bytes a step reads."""
    get = getattr(model, "get_encoder", None)
    encoder = get() if callable(get) else None
    return encoder if isinstance(encoder, torch.nn.Module) else None


SEQ2SEQ_TARGETS = ("exported_program", "aoti", "onnx")


def seq2seq_refusal(name: str, device: str, dtype: str) -> str | None:
    """Why ``name`` builds no encoder-decoder programs here (None: it does)."""
    from .. import targets  # noqa: PLC0415

    why = targets.get(name).decoder_refusal(device, dtype)
    if why is None and name not in SEQ2SEQ_TARGETS:
        why = (f"not built for encoder-decoder generation: {name} has no writer for the prefill/decode pair with "
               "cross-attention keys and values (exported_program, aoti and onnx do)")
    return why
