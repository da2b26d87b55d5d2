"""The encoder-decoder family (``--task text2text-generation``: T5, BART, Marian; ``automatic-speech-recognition``:
Whisper): the prompt is the encoder's source (token ids right-padded, or a speech model's fixed features); the
prefill runs the encoder and the first decoder step and writes every decoder layer's cross-attention keys and values
once, each decode step reads them from the cache (:mod:`exporter.generation.seq2seq`). See
:mod:`exporter.generation.family` for what a family says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .. import targets
from ..dtypes import torch_dtype
from ..errors import ArchitectureError, InputsError, describe
from ..recipe import Recipe
from ..rewrite.audit import AttentionAudit
from ..targets.context import DecoderPrograms
from . import bench
from .attention import eager_sites, recorded_sites
from .driver import Steps, check_ids, generate
from .family import Family
from .seq2seq import (
    SPEECH,
    TASKS,
    Seq2SeqDecode,
    Seq2SeqLayout,
    Seq2SeqPrefill,
    Source,
    forced_logits,
    is_encoder_decoder,
    make_source,
    probe_layout,
    reference_generation,
    source_name,
)
from .seq2seq_programs import export_seq2seq, max_source


class EncoderDecoder(Family):
    def __init__(self) -> None:
        super().__init__(Source, Seq2SeqLayout, ("source_values", "source_mask"), rows_alone=False,
                         programs="prefill (encoder + first step) and decode programs", rows="sources")

    def probe(self, model: torch.nn.Module, recipe: Recipe, transformers: bool) -> Seq2SeqLayout:
        """Only a transformers encoder-decoder generates here, text from ids or speech from features as the task
        says, with the start token and the new tokens within the cache, the cache within the decoder's positions
        and a text source within the encoder's."""
        task, gen = recipe.model.task, recipe.generation
        if not transformers or not is_encoder_decoder(model):
            raise ArchitectureError(f"--task {task} needs a transformers encoder-decoder (T5, BART, Marian, "
                                    f"Whisper); {type(model).__name__} is not one",
                                    "use --task text-generation for a decoder-only model, or leave --task out")
        speech = source_name(model) == "input_features"
        if speech != (task == SPEECH):
            raise ArchitectureError(f"{type(model).__name__} reads {'speech features' if speech else 'token ids'}, "
                                    f"not what --task {task} generates from", "convert with --task "
                                    f"{'automatic-speech-recognition' if speech else 'text2text-generation'}")
        layout = probe_layout(model, recipe.runtime.device)
        if gen.new_tokens + 1 > gen.max_cache_len:
            raise ArchitectureError(f"the start token plus {gen.new_tokens} new tokens do not fit the "
                                    f"{gen.max_cache_len}-slot cache",
                                    "raise generation.max_cache_len or lower generation.new_tokens")
        config = model.config
        limit = getattr(config, "max_target_positions", None) or (
            getattr(config, "max_position_embeddings", None) if not hasattr(config, "relative_attention_num_buckets")
            else None)
        if limit and gen.max_cache_len > limit:
            raise ArchitectureError(f"the decoder has {limit} positions but the cache holds {gen.max_cache_len}",
                                    f"convert with --set generation.max_cache_len={limit} or less")
        if not layout.speech and gen.prompt_length > max_source(model, layout, 0):
            raise ArchitectureError(f"a {gen.prompt_length}-token source is longer than the model's "
                                    f"{max_source(model, layout, 0)} positions", "lower generation.prompt_length")
        return layout

    def prompt(self, layout: Seq2SeqLayout, recipe: Recipe) -> Source:
        gen = recipe.generation
        return make_source(layout, gen.batch, gen.prompt_length, recipe.inputs.seed, torch.float64)

    def reference(self, model: torch.nn.Module, prompt: Source, layout: Seq2SeqLayout, new_tokens: int, device: str,
                  transformers: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_generation(model, prompt, layout, new_tokens)

    def forced(self, model: torch.nn.Module, prompt: Source, layout: Seq2SeqLayout, tokens: torch.Tensor,
               device: str, transformers: bool) -> torch.Tensor:
        return forced_logits(model, prompt, layout, tokens)

    def audit(self, model: torch.nn.Module, layout: Seq2SeqLayout, device: str,
              transformers: bool) -> AttentionAudit:
        """Every attention the prefill dispatches through transformers' SDPA entry: the encoder's, the decoder's
        self-attention and its cross-attention."""
        dtype = next(model.parameters()).dtype
        steps = Steps(Seq2SeqPrefill(model), Seq2SeqDecode(model), layout, 2, dtype, device)
        audit = recorded_sites(model, lambda: generate(steps, make_source(layout, 1, 4, 0, dtype), 1,
                                                        keep_logits=False), decoder_only=False)
        if audit.sites:
            return audit
        import transformers as hf  # noqa: PLC0415 - transformers took the switch and still runs the model's own
        # attention (T5 before 5.24)
        return eager_sites(model, f"transformers {hf.__version__} runs {type(model).__name__}'s attention as written "
                                  "even with SDPA selected (no call reached its SDPA entry); the programs' softmax "
                                  "nodes are counted under each target")

    def local_steps(self, model: torch.nn.Module, layout: Seq2SeqLayout, recipe: Recipe,
                    transformers: bool) -> Steps:
        return Steps(Seq2SeqPrefill(model), Seq2SeqDecode(model), layout, recipe.generation.max_cache_len,
                            torch_dtype(recipe.runtime.dtype), recipe.runtime.device)

    def refusal(self, target: str, device: str, dtype: str) -> str | None:
        why = targets.get(target).decoder_refusal(device, dtype)
        if why is None and not targets.get(target).encoder_decoder:
            built = [t.name for t in targets.TARGETS if t.encoder_decoder]
            why = (f"not built for encoder-decoder generation: {target} has no writer for the prefill/decode pair "
                   f"with cross-attention keys and values ({', '.join(built[:-1])} and {built[-1]} do)")
        return why

    def export(self, model: torch.nn.Module, layout: Seq2SeqLayout, recipe: Recipe, transformers: bool, past: bool,
               one: bool) -> DecoderPrograms:
        gen = recipe.generation
        return export_seq2seq(model, layout, gen.batch, gen.prompt_length, gen.max_cache_len,
                              torch_dtype(recipe.runtime.dtype), recipe.runtime.device, past=past)

    def eager_generate(self, model: torch.nn.Module, prompt: Source, layout: Seq2SeqLayout,
                       recipe: Recipe) -> dict[str, Any]:
        device, name = recipe.runtime.device, source_name(model)
        values = prompt.values.to(device)
        values = values.to(next(model.parameters()).dtype) if values.is_floating_point() else values
        inputs = {name: values, "decoder_start_token_id": layout.start_token,
                  **({"attention_mask": prompt.mask.to(device)} if name == "input_ids" else {})}
        return bench.time_eager_generate(model, inputs, recipe.generation.bench_tokens, device, recipe.bench.rounds,
                                         recipe.bench.max_seconds / 2)

    def weight_bytes(self, model: torch.nn.Module) -> int:
        """A decode step never runs the encoder (its keys and values are in the cache)."""
        get = getattr(model, "get_encoder", None)
        encoder = get() if callable(get) else None
        return bench.weight_bytes(model, encoder if isinstance(encoder, torch.nn.Module) else None)

    def setup(self, model: torch.nn.Module, layout: Seq2SeqLayout, recipe: Recipe) -> dict[str, Any]:
        return {"max_source": max_source(model, layout, recipe.generation.prompt_length)}

    def section(self, layout: Seq2SeqLayout, prompt: Source, setup: dict[str, Any],
                recipe: Recipe) -> dict[str, Any]:
        gen = recipe.generation
        return {
            "layout": layout.own.to_dict(), "prompt_length": prompt.length,
            "padded_rows": [] if layout.speech else [r for r in range(gen.batch) if r % 2 == 1],
            "pad_tokens": 0 if layout.speech else max(1, gen.prompt_length // 4),
            "encoder_decoder": {
                "source": "features " + "x".join(map(str, layout.source_shape)) if layout.speech else
                f"token ids, odd rows right-padded (2 to {setup['max_source']} tokens)",
                "encoder_length": int(prompt.encoder_mask(layout).shape[1]),
                "cross_layout": layout.cross.to_dict(), "start_token": layout.start_token,
            },
        }

    def user_prompt(self, prompts: list[list[int]], features: str | Path | None, setup: dict[str, Any]) -> Source:
        """Token ids right-padded into one batch, or a speech model's features."""
        layout = Seq2SeqLayout.from_dict(setup["layout"])
        if layout.speech:
            return _features_source(features, layout, prompts)
        if features is not None:
            raise InputsError("--input-features given to a text encoder-decoder", "pass the source as --input-ids")
        return _ids_source(prompts, layout, setup)


def _ids_source(prompts: list[list[int]], layout: Seq2SeqLayout, setup: dict) -> Source:
    check_ids(prompts, layout.vocab, "source")
    length = max(len(p) for p in prompts)
    if length < 2 or length > setup["max_source"]:
        raise InputsError(f"a {length}-token source; the programs take 2 to {setup['max_source']} tokens",
                          "pass a source of that length")
    ids = torch.zeros(len(prompts), length, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, tokens in enumerate(prompts):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return Source(ids, mask)


def _features_source(features: str | Path | None, layout: Seq2SeqLayout, prompts: list[list[int]]) -> Source:
    want = "x".join(map(str, layout.source_shape))
    if prompts:
        raise InputsError("--input-ids given to a speech model", f"pass --input-features FILE.safetensors with one "
                          f"tensor [batch, {want}]")
    if features is None:
        raise InputsError("no source features given", f"pass --input-features FILE.safetensors with one tensor "
                          f"[batch, {want}]")
    try:
        tensors = load_file(str(features))
    except Exception as exc:
        raise InputsError(f"--input-features {features} is not a readable safetensors file ({describe(exc, 120)})",
                          "pass a file written by safetensors.torch.save_file") from None
    if len(tensors) != 1:
        raise InputsError(f"--input-features {features} holds {len(tensors)} tensors", "save exactly one tensor")
    (values,) = tensors.values()
    if values.dim() == 2:
        values = values[None]
    if tuple(values.shape[1:]) != tuple(layout.source_shape) or not values.is_floating_point():
        raise InputsError(f"--input-features holds {values.dtype} {list(values.shape)}; the programs take float "
                          f"[batch, {want}]", f"pass log-mel features of shape [batch, {want}]")
    return Source(values.float(), torch.ones(values.shape[0], layout.source_shape[1], dtype=torch.long))


ENCODER_DECODER = EncoderDecoder()
__all__ = ["ENCODER_DECODER", "TASKS", "EncoderDecoder"]
