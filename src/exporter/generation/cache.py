"""A decoder as two exportable steps over a static KV cache that the caller owns.

``DecoderStep(model)`` is one forward of a decoder over a fixed-size cache:

    forward(input_ids [B, q], padding_mask [B, C], cache_position [q], kv: list of 2 x layers [B, H, C, D])
        -> logits of the last position [B, vocab]

The cache tensors are inputs, written in place (``index_copy_`` at ``cache_position``), so the exported
prefill program (q = the prompt's length) and the decode program (q = 1) share one cache the caller
allocates: nothing about the cache lives inside an artifact. ``padding_mask`` covers every slot of the
cache: 0 for a prompt's left padding, 1 for every other slot (slots after the current position are hidden
by causality), so it stays the same for a whole generation and a decode step's inputs are fixed-address
buffers a CUDA graph can replay.

The step builds the attention mask itself (4-D, additive: 0 where a query may look, the dtype's lowest
value elsewhere — never ``-inf``, so a query row that sees only padding gives finite garbage at a padded
position in every kernel, a plain softmax included, instead of NaN that would reach every later token
through the cache) and the position ids
(``cumsum(padding_mask) - 1``: a left-padded row starts at position 0, as ``generate`` counts them).

The model contract, which transformers decoders meet as they are and a factory model must meet to be
converted with ``--task text-generation``: ``forward(input_ids=, attention_mask=, position_ids=,
past_key_values=, use_cache=True)`` accepts a prepared 4-D additive mask ``[B, 1, q, kv]`` and a cache
object, calls ``past_key_values.update(key, value, layer_idx)`` once per attention layer with this step's
keys and values ``[B, kv_heads, q, head_dim]``, attends over the ``(keys, values)`` it returns, and returns
the logits (a tensor, or an object with ``.logits``) ``[B, q, vocab]``. transformers 5.24 renamed the cache
argument to ``cache``; either name is used, whichever ``forward`` declares.

One exception, for transformers models only: a model whose forward cannot take a prepared 4-D mask because it
builds more than the mask from the 2-D one (BLOOM makes its ALiBi biases from the padding mask's cumulative
sum) gets ``padding_mask`` itself, the 2-D mask over every cache slot that transformers' own static-cache
generation passes, and builds its causal mask with transformers' mask helpers over the ``Cache`` it is given
(``CacheLayout.padding_mask_2d``, found by :func:`probe_layout`).
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import ArchitectureError, describe
from ..kernels import decode_attention


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its cache object."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def keeps_last_logits(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def logits_of(result: Any) -> torch.Tensor:
    logits = result if isinstance(result, torch.Tensor) else getattr(result, "logits", None)
    if logits is None and isinstance(result, (tuple, list)) and result and isinstance(result[0], torch.Tensor):
        logits = result[0]
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        raise ArchitectureError(f"the model returned {type(result).__name__}, not logits [batch, tokens, vocab]",
                                "return the logits (or an object with .logits) from forward(); see "
                                "docs/generation.md for the decoder contract")
    return logits


class _Slots:
    """The cache object a model sees inside a step: its ``update`` writes this step's keys and values into the
    caller's tensors at the step's positions and returns the whole cache of that layer."""

    def __init__(self, kv: list[torch.Tensor], positions: torch.Tensor):
        self.kv = kv
        self.positions = positions

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        keys, values = self.kv[2 * layer_idx], self.kv[2 * layer_idx + 1]
        keys.index_copy_(2, self.positions, key_states.to(keys.dtype))
        values.index_copy_(2, self.positions, value_states.to(values.dtype))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        return self.positions[0]


def transformers_cache(kv: list[torch.Tensor], positions: torch.Tensor) -> Any:
    """A transformers ``Cache`` whose layers are the caller's tensors (transformers' own ``StaticLayer``,
    with ``update`` writing at the step's positions), so the library's code paths see the cache type they
    know: ``is_compileable``, the mask helpers and ``get_seq_length`` behave as for a ``StaticCache``."""
    from transformers.cache_utils import Cache  # noqa: PLC0415 - transformers is optional

    Slot = slot_class(positions)
    return Cache(layers=[Slot(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)])


def slot_class(positions: torch.Tensor) -> type:
    """transformers' ``StaticLayer`` over a caller's key and value tensors: a self-attention layer writes the step's
    keys and values at ``positions``; a cross-attention layer (``cross``) is written whole by the prefill and then
    only read, and its length is the encoder's, known from the shape."""
    from transformers.cache_utils import StaticLayer  # noqa: PLC0415 - transformers is optional

    class Slot(StaticLayer):
        def __init__(self, keys: torch.Tensor, values: torch.Tensor, cross: bool = False):
            super().__init__(max_cache_len=keys.shape[2])
            self.keys, self.values, self.cross = keys, values, cross
            self.encoder_length = keys.shape[2]
            self.device, self.dtype = keys.device, keys.dtype
            self.batch_size, self.num_heads = keys.shape[0], keys.shape[1]
            self.k_head_dim, self.v_head_dim = keys.shape[3], values.shape[3]
            self.cumulative_length = positions[0]
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if self.cross:
                self.keys.copy_(key_states.to(self.keys.dtype))
                self.values.copy_(value_states.to(self.values.dtype))
            else:
                self.keys.index_copy_(2, positions, key_states.to(self.keys.dtype))
                self.values.index_copy_(2, positions, value_states.to(self.values.dtype))
            return self.keys, self.values

        def get_seq_length(self) -> Any:
            return self.encoder_length if self.cross else positions[0]

    return Slot


def step_mask(padding_mask: torch.Tensor, cache_position: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[B, 1, q, C]``: query i sees slot j when j <= cache_position[i] and slot j is not
    padding; elsewhere the dtype's lowest finite value. Inside ``kernels.decode_attention.routed`` (the decode
    program of batch 1 with ``generation.decode_attention_kernel``) one kernel builds it, read by every layer."""
    if decode_attention.mask_in_kernel(padding_mask):
        return torch.ops.exporter.step_mask(padding_mask, cache_position, dtype)
    slots = torch.arange(padding_mask.shape[1], device=padding_mask.device)
    allowed = (padding_mask[:, None, None, :] != 0) & \
        (slots[None, None, None, :] <= cache_position[None, None, :, None])
    return torch.zeros(allowed.shape, dtype=dtype, device=padding_mask.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def step_positions(padding_mask: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
    """Position ids ``[B, q]`` of the step's tokens: their slot counted over the row's real tokens."""
    counted = (padding_mask.cumsum(-1) - 1).clamp(min=0)
    return counted.index_select(1, cache_position)


class DecoderStep(nn.Module):
    """One decoder forward over the caller's static cache; see the module's docstring."""

    def __init__(self, model: nn.Module, uses_transformers_cache: bool, padding_mask_2d: bool = False):
        super().__init__()
        self.model = model
        self.uses_transformers_cache = uses_transformers_cache
        self.padding_mask_2d = padding_mask_2d  # pass padding_mask itself (CacheLayout.padding_mask_2d)
        self.cache_name = cache_argument(model)
        self.keep_last = keeps_last_logits(model)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor, cache_position: torch.Tensor,
                kv: list[torch.Tensor]) -> torch.Tensor:
        mask = padding_mask if self.padding_mask_2d else step_mask(padding_mask, cache_position, kv[0].dtype)
        positions = step_positions(padding_mask, cache_position)
        cache = transformers_cache(kv, cache_position) if self.uses_transformers_cache else _Slots(kv, cache_position)
        extra: dict[str, Any] = {"logits_to_keep": 1} if self.keep_last else {}
        result = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            **{self.cache_name: cache}, use_cache=True, **extra)
        return logits_of(result)[:, -1]


@dataclass(frozen=True)
class CacheLayout:
    """The shape of a model's KV cache: per attention layer, key heads and key/value head dims."""

    heads: tuple[int, ...]
    key_dims: tuple[int, ...]
    value_dims: tuple[int, ...]
    vocab: int
    # the model takes the 2-D padding mask, not a prepared 4-D one (a transformers model that builds more than its
    # mask from it: BLOOM's ALiBi); DecoderStep(padding_mask_2d=...)
    padding_mask_2d: bool = False

    @property
    def layers(self) -> int:
        return len(self.heads)

    def allocate(self, batch: int, length: int, dtype: torch.dtype, device: str | torch.device) -> list[torch.Tensor]:
        """Zeroed key and value tensors ``[batch, heads, length, dim]``, layer by layer (keys first)."""
        out = []
        for heads, kd, vd in zip(self.heads, self.key_dims, self.value_dims):
            out.append(torch.zeros(batch, heads, length, kd, dtype=dtype, device=device))
            out.append(torch.zeros(batch, heads, length, vd, dtype=dtype, device=device))
        return out

    def bytes(self, batch: int, length: int, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        dims = zip(self.heads, self.key_dims, self.value_dims)
        return sum(batch * h * length * (kd + vd) * size for h, kd, vd in dims)

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CacheLayout":
        return cls(tuple(data["heads"]), tuple(data["key_dims"]), tuple(data["value_dims"]), int(data["vocab"]),
                   bool(data.get("padding_mask_2d", False)))


class _Recorder:
    """A cache that records what each layer's ``update`` is given (and returns it: the step attends to itself)."""

    def __init__(self):
        self.seen: dict[int, tuple[torch.Size, torch.Size]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.seen[layer_idx] = (key_states.shape, value_states.shape)
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def _probe(model: nn.Module, uses_transformers_cache: bool, device: str | torch.device,
           padding_mask_2d: bool) -> tuple[Any, Any]:
    """One two-token forward with a recording cache: (its result, the cache)."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    if padding_mask_2d:
        mask = torch.ones(1, 2, dtype=torch.long, device=device)
    else:
        mask = torch.zeros(1, 1, 2, 2, dtype=next(model.parameters()).dtype, device=device)
        mask[..., 0, 1] = torch.finfo(mask.dtype).min
    positions = torch.arange(2, device=device)[None]
    if uses_transformers_cache:
        from transformers.cache_utils import DynamicCache  # noqa: PLC0415 - transformers is optional

        recorder: Any = DynamicCache()
    else:
        recorder = _Recorder()
    with torch.inference_mode():
        result = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                       **{cache_argument(model): recorder}, use_cache=True)
    return result, recorder


def probe_layout(model: nn.Module, uses_transformers_cache: bool, device: str | torch.device) -> CacheLayout:
    """Run one two-token forward with a recording cache and read each layer's key/value shapes from it. A
    transformers model that cannot take the prepared 4-D mask is tried once more with the 2-D padding mask
    (``CacheLayout.padding_mask_2d``)."""
    def refused(exc: Exception) -> ArchitectureError:
        return ArchitectureError(f"the model cannot run one step with a KV cache ({describe(exc)})",
                                 "a --task text-generation model must follow the decoder contract in "
                                 "docs/generation.md")

    padding_mask_2d = False
    try:
        result, recorder = _probe(model, uses_transformers_cache, device, False)
    except Exception as exc:
        if not uses_transformers_cache:
            raise refused(exc) from None
        try:
            result, recorder = _probe(model, True, device, True)
        except Exception:
            raise refused(exc) from None
        padding_mask_2d = True
    logits = logits_of(result)
    if uses_transformers_cache:
        shapes = [(layer.keys.shape, layer.values.shape) for layer in recorder.layers if layer.keys is not None]
    else:
        shapes = [recorder.seen[i] for i in sorted(recorder.seen)]
    if not shapes:
        raise ArchitectureError("the model never wrote to its KV cache during a forward",
                                "call past_key_values.update(key, value, layer_idx) in every attention layer "
                                "(docs/generation.md)")
    return CacheLayout(tuple(int(k[1]) for k, _ in shapes), tuple(int(k[-1]) for k, _ in shapes),
                       tuple(int(v[-1]) for _, v in shapes), int(logits.shape[-1]), padding_mask_2d)
