"""An encoder-decoder's two programs (``seq2seq``: the prefill with the encoder, one decode step), exported.

``export_seq2seq`` exports ``Seq2SeqPrefill`` and ``Seq2SeqDecode`` with the batch dynamic (1 to the recipe's
batch) and, for text, the source length dynamic (2 to what the model's positions allow); the self-attention
cache length is fixed and a speech model's features keep their one shape. Both programs are decomposed to core
ATen with SDPA kept, as the decoder-only programs are, so every target that writes ``DecoderPrograms``
(``exported_program``, ``aoti``) builds them unchanged; ``programs.export_pair`` exports both, as it does a
decoder's.
"""

from __future__ import annotations

import time

import torch

from ..errors import describe
from ..targets.context import DecoderPrograms
from ..targets.exported_program import decomposition_table
from .programs import export_pair
from .seq2seq import Seq2SeqDecode, Seq2SeqLayout, Seq2SeqPrefill

DEFAULT_MAX_SOURCE = 1024  # the longest text source the programs take where the model sets no limit


def max_source(model: torch.nn.Module, layout: Seq2SeqLayout, length: int) -> int:
    """The longest source the exported programs take: the model's learned positions where it has them (BART,
    Marian), else ``DEFAULT_MAX_SOURCE``; at least ``length``. A speech model's source is fixed."""
    if layout.speech:
        return layout.source_shape[-1]
    limit = getattr(model.config, "max_position_embeddings", None) or DEFAULT_MAX_SOURCE
    return max(int(length), int(limit))


def _examples(layout: Seq2SeqLayout, batch: int, source_length: int, cache_length: int, dtype, device):
    if layout.speech:
        source = torch.zeros(batch, *layout.source_shape, dtype=dtype, device=device)
    else:
        source = torch.ones(batch, source_length, dtype=torch.long, device=device)
    encoder = layout.encoder_length(source.shape[-1])
    mask = torch.ones(batch, encoder, dtype=torch.long, device=device)
    ids = torch.full((batch, 1), layout.start_token, dtype=torch.long, device=device)
    prefill = (source, mask, ids, torch.zeros(1, dtype=torch.long, device=device),
               layout.allocate(batch, cache_length, encoder, dtype, device))
    decode = (mask, ids, torch.ones(1, dtype=torch.long, device=device),
              layout.allocate(batch, cache_length, encoder, dtype, device))
    return prefill, decode


class PrefillPast(torch.nn.Module):
    """``Seq2SeqPrefill`` without in-place inputs (the form ONNX can express): the self-attention cache in, and
    out updated (``present.{layer}.decoder.*``) with the cross-attention keys and values the encoder's output
    gave (``present.{layer}.encoder.*``), after the logits."""

    def __init__(self, model: torch.nn.Module, layout: Seq2SeqLayout):
        super().__init__()
        self.step, self.layout = Seq2SeqPrefill(model), layout

    def forward(self, source: torch.Tensor, source_mask: torch.Tensor, decoder_ids: torch.Tensor,
                cache_position: torch.Tensor, kv: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        own = [t.clone() for t in kv]
        batch, encoder = source_mask.shape
        cross = [own[0].new_zeros(batch, heads, encoder, dim) for heads, kd, vd in
                 zip(self.layout.cross.heads, self.layout.cross.key_dims, self.layout.cross.value_dims)
                 for dim in (kd, vd)]
        logits = self.step(source, source_mask, decoder_ids, cache_position, own + cross)
        return (logits, *own, *cross)


class DecodePast(torch.nn.Module):
    """``Seq2SeqDecode`` without in-place inputs: both caches in, the self-attention cache out updated."""

    def __init__(self, model: torch.nn.Module, layers: int):
        super().__init__()
        self.step, self.layers = Seq2SeqDecode(model), layers

    def forward(self, source_mask: torch.Tensor, decoder_ids: torch.Tensor, cache_position: torch.Tensor,
                kv: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        own = [t.clone() for t in kv[:2 * self.layers]]
        logits = self.step(source_mask, decoder_ids, cache_position, own + list(kv[2 * self.layers:]))
        return (logits, *own)


def past_names(layout: Seq2SeqLayout) -> tuple[list[str], list[str], list[str], list[str]]:
    """The ONNX programs' input and output names (prefill, then decode), as Optimum names an encoder-decoder's
    caches: ``past_key_values.{layer}.decoder.key`` in, ``present.{layer}.encoder.value`` out."""
    def cache(prefix: str, part: str) -> list[str]:
        return [f"{prefix}.{layer}.{part}.{kind}" for layer in range(layout.layers) for kind in ("key", "value")]

    source = "input_features" if layout.speech else "input_ids"
    steps = ["encoder_attention_mask", "decoder_input_ids", "cache_position"]
    return ([source, *steps, *cache("past_key_values", "decoder")],
            ["logits", *cache("present", "decoder"), *cache("present", "encoder")],
            [*steps, *cache("past_key_values", "decoder"), *cache("past_key_values", "encoder")],
            ["logits", *cache("present", "decoder")])


def export_seq2seq(model: torch.nn.Module, layout: Seq2SeqLayout, batch: int, source_length: int,
                   cache_length: int, dtype: torch.dtype, device: str, past: bool = False) -> DecoderPrograms:
    """Both programs (see the module's docstring); with ``past`` also both in the form ONNX can express
    (``PrefillPast``, ``DecodePast``), a failure there recorded (``past_error``) for the ONNX target alone."""
    t0 = time.perf_counter()
    prefill_args, decode_args = _examples(layout, batch, source_length, cache_length, dtype, device)
    longest = max_source(model, layout, source_length)
    notes: list[str] = []

    def shapes(make, drop_cross: bool = False):
        b = make("batch", 1, batch) if batch > 1 else None
        s = None if layout.speech else make("source", 2, longest)
        row = {0: b} if b is not None else None
        mask = {k: v for k, v in ((0, b), (1, s)) if v is not None} or None
        own = [row for _ in range(2 * layout.layers)]
        kv = own + [{k: v for k, v in ((0, b), (2, s)) if v is not None} or None for _ in range(2 * layout.layers)]
        source = mask if not layout.speech else row
        return (source, mask, row, None, own if drop_cross else kv), (mask, row, None, kv)

    def pair(first, second, drop_cross: bool = False):
        """``drop_cross``: the programs ONNX runs (the cache in and out), left as exported (``export_pair``)."""
        first_args = (*prefill_args[:4], prefill_args[4][:2 * layout.layers]) if drop_cross else prefill_args
        return export_pair((first, second), (first_args, decode_args), lambda make: shapes(make, drop_cross),
                           None if drop_cross else decomposition_table(), notes, "source")

    prefill, decode = pair(Seq2SeqPrefill(model), Seq2SeqDecode(model))
    past_pair = None
    past_error = None
    if past:
        try:
            past_pair = pair(PrefillPast(model, layout), DecodePast(model, layout.layers), drop_cross=True)
        except Exception as exc:  # the ONNX target fails with it; the others are built
            past_error = describe(exc)
    source = f"fixed {'x'.join(map(str, layout.source_shape))} features" if layout.speech else f"2 to {longest} tokens"
    notes.append(f"source: {source}; "
                 f"batch 1 to {batch}; self-attention cache {cache_length} slots, cross-attention keys and values "
                 "written once by the prefill")
    programs = DecoderPrograms(prefill, decode, time.perf_counter() - t0, notes, past=past_pair, past_error=past_error)
    programs.layers = layout.layers
    programs.past_names = past_names(layout)
    return programs
