"""The encoder-decoder family (``--task text2text-generation``: T5, BART, Marian; ``automatic-speech-recognition``:
Whisper): the prompt is the encoder's source (token ids right-padded, or a speech model's fixed features); the
prefill runs the encoder and the first decoder step and writes every decoder layer's cross-attention keys and values
once, each decode step reads them from the cache (:mod:`exporter.generation.seq2seq`). See
:mod:`exporter.generation.family` for what a family says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import targets
from ..dtypes import torch_dtype
from ..errors import ArchitectureError
from ..recipe import Recipe
from ..rewrite.audit import AttentionAudit
from ..targets.context import DecoderPrograms
from . import bench
from .attention import eager_sites, recorded_sites
from .family import Family
from .seq2seq import (
    SPEECH,
    TASKS,
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
from .seq2seq_programs import export_seq2seq, max_source, time_seq2seq


class EncoderDecoder(Family):
    def __init__(self) -> None:
        super().__init__(Source, ("source_values", "source_mask"), rows_alone=False,
                         programs="prefill (encoder + first step) and decode programs")

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
        steps = Seq2SeqSteps(Seq2SeqPrefill(model), Seq2SeqDecode(model), layout, 2, dtype, device)
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
                    transformers: bool) -> Seq2SeqSteps:
        return Seq2SeqSteps(Seq2SeqPrefill(model), Seq2SeqDecode(model), layout, recipe.generation.max_cache_len,
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

    def load_steps(self, target: str, folder: Path, setup: dict[str, Any]) -> Seq2SeqSteps:
        loaded = targets.get(target).load_decoder(folder)
        return Seq2SeqSteps(loaded.prefill, loaded.decode, Seq2SeqLayout.from_dict(setup["layout"]),
                            setup["cache_length"], torch_dtype(setup["dtype"]), setup["device"], loaded.fresh_decode)

    def generate(self, steps: Seq2SeqSteps, prompt: Source, new_tokens: int, forced: torch.Tensor | None = None,
                 keep_logits: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return generate(steps, prompt, new_tokens, forced, keep_logits)

    def time(self, steps: Seq2SeqSteps, prompt: Source, timing: dict[str, Any]) -> dict[str, Any]:
        """At batch 1 (the first source row, unpadded) and at the recipe's batch."""
        return bench.time_runs([("batch_1", prompt.row(0), steps), ("batch", prompt, steps)], time_seq2seq,
                               lambda which: steps.layout.bytes(which.batch, steps.cache_length,
                                                                int(which.encoder_mask(steps.layout).shape[1]),
                                                                steps.dtype), timing)


ENCODER_DECODER = EncoderDecoder()
__all__ = ["ENCODER_DECODER", "TASKS", "EncoderDecoder"]
