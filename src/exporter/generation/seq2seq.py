"""An encoder-decoder (T5, BART, Marian, Whisper) as two exportable steps over caches the caller owns.

``Seq2SeqStep(model, first=True)`` is the prefill: the encoder over the source, then the decoder's first step

    forward(source [B, S] ids or [B, mel, frames] features, source_mask [B, S_enc], decoder_ids [B, 1],
            cache_position [1], kv: 2 x layers self-attention [B, H, C, D] then 2 x layers cross-attention
            [B, H, S_enc, D]) -> logits [B, vocab]

and writes every layer's cross-attention keys and values (computed once, from the encoder's output) into the
cross half of ``kv``. ``Seq2SeqStep(model, first=False)`` is one decode step, the same without ``source``: it
reads the cross-attention keys and values from ``kv`` and never runs the encoder. Both write this step's
self-attention keys and values in place at ``cache_position`` (as the decoder-only ``DecoderStep`` does), so
the exported programs share whatever cache the caller allocates. ``source_mask`` covers the encoder's
positions: 1 for a real token, 0 for the right padding of a shorter source (all ones for speech, whose
features are fixed-length frames).

The decoder's tokens are never padded (every row starts at ``decoder_start_token_id``), so its positions are
the cache positions: transformers' decoders read them from the cache's ``get_seq_length``. The decoder's own
mask is 4-D additive (``cache.step_mask``: causal over the cache's slots).

The reference (:func:`reference_generation`) is the original model reading the whole source and the whole
decoded prefix at every step, without a cache, each source row alone and without its padding.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import ArchitectureError, InputsError, describe
from .cache import CacheLayout, cache_argument, logits_of, slot_class, step_mask
from .driver import Feed

SPEECH = "automatic-speech-recognition"
TEXT = "text2text-generation"
TASKS = (TEXT, SPEECH)


def source_name(model: nn.Module) -> str:
    """What the model's forward calls its source: ``input_ids`` (text) or ``input_features`` (speech)."""
    return "input_features" if "input_features" in inspect.signature(model.forward).parameters else "input_ids"


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


def start_token(model: nn.Module) -> int:
    config = model.config
    token = getattr(config, "decoder_start_token_id", None)
    if token is None:
        token = getattr(getattr(model, "generation_config", None), "decoder_start_token_id", None)
    if token is None:
        raise ArchitectureError(f"{type(model).__name__}'s config has no decoder_start_token_id",
                                "set decoder_start_token_id in config.json (the token every decoded row starts with)")
    return int(token)


def encoder_decoder_cache(kv: list[torch.Tensor], positions: torch.Tensor, first: bool) -> Any:
    """transformers' ``EncoderDecoderCache`` over the caller's tensors: the self-attention half written at
    ``positions``, the cross-attention half written whole (prefill) or only read (``first`` False: every layer
    marked updated, so the attention takes its keys and values from the cache)."""
    from transformers.cache_utils import Cache, EncoderDecoderCache  # noqa: PLC0415

    layers = len(kv) // 4

    Slot = slot_class(positions)
    own = Cache(layers=[Slot(kv[2 * i], kv[2 * i + 1], False) for i in range(layers)])
    cross = Cache(layers=[Slot(kv[2 * (layers + i)], kv[2 * (layers + i) + 1], True) for i in range(layers)])
    cache = EncoderDecoderCache(own, cross)
    cache.is_updated = {i: not first for i in range(layers)}
    return cache


class Seq2SeqStep(nn.Module):
    """One decode step (``first`` False) or the prefill (``first``: encoder and the first decoder step); see the
    module's docstring. ``Seq2SeqPrefill`` and ``Seq2SeqDecode`` are the two with explicit signatures, as export
    needs."""

    def __init__(self, model: nn.Module, first: bool):
        super().__init__()
        self.model = model
        self.first = first
        self.source = source_name(model)
        self.speech = self.source == "input_features"
        self.cache_name = cache_argument(model)  # transformers 5.24 calls it cache, earlier releases past_key_values
        config: Any = model.config
        self.d_model = int(getattr(config, "d_model", 0) or config.hidden_size)

    def run(self, source: torch.Tensor | None, source_mask: torch.Tensor, decoder_ids: torch.Tensor,
            cache_position: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        padding = torch.ones(decoder_ids.shape[0], kv[0].shape[2], dtype=torch.long, device=decoder_ids.device)
        mask = step_mask(padding, cache_position, kv[0].dtype)
        cache = encoder_decoder_cache(kv, cache_position, self.first)
        kwargs: dict[str, Any] = {"decoder_input_ids": decoder_ids, "decoder_attention_mask": mask,
                                  self.cache_name: cache, "use_cache": True}
        if not self.speech:
            kwargs["attention_mask"] = source_mask
        if source is not None:
            kwargs[self.source] = source
        else:  # the encoder's output is not needed: cross-attention reads its keys and values from the cache
            dummy = torch.zeros(decoder_ids.shape[0], kv[-1].shape[2], self.d_model, dtype=kv[0].dtype,
                                device=decoder_ids.device)
            kwargs["encoder_outputs"] = (dummy,)
        return logits_of(self.model(**kwargs))[:, -1]


class Seq2SeqPrefill(Seq2SeqStep):
    def __init__(self, model: nn.Module):
        super().__init__(model, True)

    def forward(self, source: torch.Tensor, source_mask: torch.Tensor, decoder_ids: torch.Tensor,
                cache_position: torch.Tensor, kv: list[torch.Tensor]) -> torch.Tensor:
        return self.run(source, source_mask, decoder_ids, cache_position, kv)


class Seq2SeqDecode(Seq2SeqStep):
    def __init__(self, model: nn.Module):
        super().__init__(model, False)

    def forward(self, source_mask: torch.Tensor, decoder_ids: torch.Tensor, cache_position: torch.Tensor,
                kv: list[torch.Tensor]) -> torch.Tensor:
        return self.run(None, source_mask, decoder_ids, cache_position, kv)


@dataclass(frozen=True)
class Seq2SeqLayout:
    """The decoder's self-attention cache and its cross-attention cache (one per decoder layer each), the
    vocabulary, how the encoder's length follows from the source's, and the decoder's start token."""

    own: CacheLayout
    cross: CacheLayout
    start_token: int
    speech: bool
    source_shape: tuple[int, ...]  # speech: the fixed features' [mel, frames]; text: ()
    encoder_ratio: int  # encoder positions = source length // ratio (Whisper's convolutions halve the frames)

    @property
    def vocab(self) -> int:
        return self.own.vocab

    @property
    def layers(self) -> int:
        return self.own.layers

    def encoder_length(self, source_length: int) -> int:
        return source_length // self.encoder_ratio

    def allocate(self, batch: int, cache_length: int, encoder_length: int, dtype: torch.dtype,
                 device: str | torch.device) -> list[torch.Tensor]:
        return [*self.own.allocate(batch, cache_length, dtype, device),
                *self.cross.allocate(batch, encoder_length, dtype, device)]

    def bytes(self, batch: int, cache_length: int, encoder_length: int, dtype: torch.dtype) -> int:
        return self.own.bytes(batch, cache_length, dtype) + self.cross.bytes(batch, encoder_length, dtype)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["own"], data["cross"] = self.own.to_dict(), self.cross.to_dict()
        data["source_shape"] = list(self.source_shape)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Seq2SeqLayout":
        return cls(CacheLayout.from_dict(data["own"]), CacheLayout.from_dict(data["cross"]), int(data["start_token"]),
                   bool(data["speech"]), tuple(data["source_shape"]), int(data["encoder_ratio"]))


def speech_shape(model: nn.Module) -> tuple[int, int]:
    """Whisper's fixed input: ``[num_mel_bins, 2 * max_source_positions]`` frames."""
    config: Any = model.config
    return int(config.num_mel_bins), 2 * int(config.max_source_positions)


def probe_layout(model: nn.Module, device: str | torch.device) -> Seq2SeqLayout:
    """One forward of the model with transformers' own cache, each layer's self- and cross-attention key/value
    shapes read from it."""
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache  # noqa: PLC0415

    source = source_name(model)
    speech = source == "input_features"
    start = start_token(model)
    dtype = next(model.parameters()).dtype
    if speech:
        shape: tuple[int, ...] = speech_shape(model)
        src = torch.zeros(1, *shape, dtype=dtype, device=device)
        source_length = shape[1]
    else:
        shape = ()
        src = torch.full((1, 4), start, dtype=torch.long, device=device)
        source_length = 4
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    try:
        with torch.inference_mode():
            result = model(**{source: src}, decoder_input_ids=torch.full((1, 1), start, device=device),
                           **{cache_argument(model): cache}, use_cache=True)
    except Exception as exc:
        raise ArchitectureError(f"the encoder-decoder cannot run one step with a cache ({describe(exc)})",
                                "a seq2seq generation model must be a transformers encoder-decoder (T5, BART, Marian, "
                                "Whisper: docs/generation.md)") from None
    logits = logits_of(result)

    def layout(part) -> CacheLayout:
        shapes = [(layer.keys.shape, layer.values.shape) for layer in part.layers if layer.keys is not None]
        return CacheLayout(tuple(int(k[1]) for k, _ in shapes), tuple(int(k[-1]) for k, _ in shapes),
                           tuple(int(v[-1]) for _, v in shapes), int(logits.shape[-1]))

    own, cross = layout(cache.self_attention_cache), layout(cache.cross_attention_cache)
    if not own.layers or own.layers != cross.layers:
        raise ArchitectureError(f"the decoder wrote {own.layers} self-attention and {cross.layers} cross-attention "
                                "caches in one step", "only encoder-decoders with cross-attention in every decoder "
                                "layer generate here")
    first: Any = cache.cross_attention_cache.layers[0]
    encoder_length = int(first.keys.shape[2])
    return Seq2SeqLayout(own, cross, start, speech, shape, max(1, source_length // encoder_length))


@dataclass
class Source:
    """What the encoder reads: token ids right-padded with their mask (text), or fixed-length features."""

    values: torch.Tensor  # [B, S] int64 or [B, mel, frames] float
    mask: torch.Tensor  # [B, S] int64 over the source's tokens (text); [B, frames] all ones (speech)

    @property
    def batch(self) -> int:
        return int(self.values.shape[0])

    @property
    def length(self) -> int:
        return int(self.values.shape[-1])

    def row(self, index: int) -> "Source":
        """Row ``index`` alone, its padding removed."""
        if self.values.dim() == 3:
            return Source(self.values[index:index + 1], self.mask[index:index + 1])
        keep = self.mask[index].bool()
        return Source(self.values[index:index + 1, keep], self.mask[index:index + 1, keep])

    def encoder_mask(self, layout: Seq2SeqLayout) -> torch.Tensor:
        """The mask over the encoder's positions (the cross-attention's keys)."""
        if layout.speech:
            return torch.ones(self.batch, layout.encoder_length(self.length), dtype=torch.long)
        return self.mask.long().contiguous()

    def check_fits(self, new_tokens: int, cache_length: int) -> None:
        if 1 + new_tokens > cache_length:
            raise InputsError(f"the start token plus {new_tokens} new tokens do not fit the {cache_length}-slot "
                              "cache the artifact was built for",
                              "lower --max-new-tokens, or convert with a larger generation.max_cache_len")

    def feed(self, steps: Any) -> Feed:
        """The prefill (the encoder over the source and the start token's step), then each token at the slot after
        the last, the cross-attention keys and values read from the cache."""
        device, layout = steps.device, steps.layout
        values = self.values.to(device)
        values = (values.to(steps.dtype) if values.is_floating_point() else values).contiguous()
        mask = self.encoder_mask(layout).to(device)
        kv = layout.allocate(self.batch, steps.cache_length, int(mask.shape[1]), steps.dtype, device)
        start = torch.full((self.batch, 1), layout.start_token, dtype=torch.long, device=device)
        return Feed(lambda: steps.prefill(values, mask, start, torch.zeros(1, dtype=torch.long, device=device), kv),
                    lambda token, where: (mask, token, where, kv), 1,
                    layout.bytes(self.batch, steps.cache_length, int(mask.shape[1]), steps.dtype))


def make_source(layout: Seq2SeqLayout, batch: int, length: int, seed: int, dtype: torch.dtype) -> Source:
    """Seeded random source rows: token ids with odd rows right-padded by a quarter of the length (text), or
    features drawn from a normal distribution at the model's fixed shape (speech)."""
    generator = torch.Generator().manual_seed(seed)
    if layout.speech:
        features = torch.randn(batch, *layout.source_shape, generator=generator).to(dtype)
        return Source(features, torch.ones(batch, layout.source_shape[1], dtype=torch.long))
    ids = torch.randint(0, layout.vocab, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    pad = max(1, length // 4)
    mask[1::2, length - pad:] = 0
    ids[mask == 0] = 0
    return Source(ids, mask)


# --------------------------------------------------------------------------- the reference, without any cache


def full_logits(model: nn.Module, source: Source, decoded: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits ``[B, keep, vocab]`` of the last ``keep`` decoder positions, the source and ``decoded`` (the start
    token first) read whole, no cache."""
    name = source_name(model)
    values = source.values.to(next(model.parameters()).device)
    if values.is_floating_point():
        values = values.to(next(model.parameters()).dtype)
    kwargs: dict[str, Any] = {name: values, "decoder_input_ids": decoded.to(values.device), "use_cache": False}
    if name == "input_ids":
        kwargs["attention_mask"] = source.mask.to(values.device)
    return logits_of(model(**kwargs))[:, -keep:]


def reference_generation(model: nn.Module, source: Source, layout: Seq2SeqLayout,
                         new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[B, N]`` and each step's logits ``[N, B, vocab]`` (CPU), each row alone without padding."""
    tokens, logits = [], []
    for row in range(source.batch):
        alone = source.row(row)
        decoded = torch.tensor([[layout.start_token]])
        row_logits = []
        with torch.inference_mode():
            for _ in range(new_tokens):
                last = full_logits(model, alone, decoded, 1)[:, -1].cpu()
                pick = last.argmax(-1)
                row_logits.append(last)
                decoded = torch.cat([decoded, pick[:, None]], dim=1)
        tokens.append(decoded[:, 1:])
        logits.append(torch.stack(row_logits))
    return torch.cat(tokens, dim=0), torch.cat(logits, dim=1)


def forced_logits(model: nn.Module, source: Source, layout: Seq2SeqLayout, tokens: torch.Tensor) -> torch.Tensor:
    """Each step's logits ``[N, B, vocab]`` when the model reads the source and the reference's tokens (one
    forward per row, without its padding)."""
    out = []
    steps = tokens.shape[1]
    for row in range(source.batch):
        decoded = torch.cat([torch.tensor([[layout.start_token]]), tokens[row:row + 1, :-1]], dim=1)
        with torch.inference_mode():
            out.append(full_logits(model, source.row(row), decoded, steps).cpu())
    return torch.cat(out, dim=0).transpose(0, 1)


__all__ = ["Seq2SeqStep", "Seq2SeqLayout", "Source", "TASKS", "encoder_decoder_cache", "make_source", "probe_layout",
           "reference_generation", "forced_logits"]
