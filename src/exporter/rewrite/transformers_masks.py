"""The attention masks transformers builds while a model is traced, and the ones exporter leaves out.

In eager mode transformers' SDPA path passes no mask where none is needed: nothing padded in an encoder, or
a plain causal mask (SDPA's ``is_causal=True`` says it). Under tracing (torch.export, torch.compile) it cannot
look at a mask's contents, and its skip tests refuse to run at all, even where no padding mask was given:

- a vision encoder's SDPA got an all-true ``[batch, 1, S, S]`` mask; no fused backend took it on an H200,
  and ViT-B/16's attention ran in SDPA's float32 math fallback in every compiled variant (docs/BENCHMARKS.md);
- a decoder traced without an ``attention_mask`` got a materialised causal mask, and with a mask
  transformers also expands grouped K/V heads before SDPA; its ``position_ids`` (made by the model itself)
  are also read as possibly packed sequences, which adds a packed-sequence mask.

Inside :func:`trivial_masks_skipped`, around every trace exporter makes of a model, transformers' SDPA mask
function returns ``None`` for exactly the masks it skips in eager mode without reading data:

- bidirectional, no padding mask, no window, no extra mask function;
- causal, the plain causal function, no padding mask, no window, nothing cached (query and keys start
  together and are as many), more than one query for every size the trace allows (no new guard);

and, where the traced module takes no ``position_ids`` (the model makes them: one sequence per row), the
packed-sequence detection says "not packed". A padding mask given as an input is never touched.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable

_LOCK = threading.Lock()
_PATCHES: dict[tuple[int, str], list[Any]] = {}  # (id(owner), name) -> [depth, original]
_WRAPPERS: dict[int, tuple[Any, Any]] = {}  # id(original mask function) -> (original, wrapper)


def _known(condition) -> bool:
    """True where ``condition`` (a bool or a SymBool) holds for every size the trace allows, adding no guard."""
    if isinstance(condition, bool):
        return condition
    from torch.fx.experimental.symbolic_shapes import statically_known_true  # noqa: PLC0415

    return bool(statically_known_true(condition))


def _plain_causal(kwargs: dict[str, Any]) -> bool:
    from transformers.masking_utils import causal_mask_function  # noqa: PLC0415 - transformers is optional

    q, kv = kwargs.get("q_length"), kwargs.get("kv_length")
    return (kwargs.get("allow_is_causal_skip", False) is True and kwargs.get("mask_function") is causal_mask_function
            and q is not None and kv is not None
            and _known(kwargs.get("q_offset", 0) == 0) and _known(kwargs.get("kv_offset", 0) == 0)
            and (q is kv or _known(q == kv)) and _known(q > 1))


def _wrapper_for(original):
    """One wrapper per mask function, the same object every time (a ``torch.compile`` guard on it holds)."""
    known = _WRAPPERS.get(id(original))
    if known is not None and known[0] is original:
        return known[1]

    @functools.wraps(original)
    def sdpa_mask(*args, **kwargs):
        if not args and "attention_mask" in kwargs and kwargs["attention_mask"] is None \
                and kwargs.get("local_size") is None:
            if kwargs.get("allow_is_bidirectional_skip"):
                return None  # nothing is masked
            if _plain_causal(kwargs):
                return None  # transformers' SDPA path then calls SDPA with is_causal=True
        return original(*args, **kwargs)

    _WRAPPERS[id(original)] = (original, sdpa_mask)
    return sdpa_mask


def _not_packed(position_ids):
    return None


@contextlib.contextmanager
def _patched(owner: Any, name: str, replacement: Callable[[Any], Any]):
    """Set ``owner[name]`` (a dict) or ``owner.name`` to ``replacement(original)`` for the block; nested and
    concurrent blocks share one install, the original comes back when the last one ends."""
    is_dict = isinstance(owner, dict)
    key = (id(owner), name)
    with _LOCK:
        entry = _PATCHES.get(key)
        if entry is None:
            original = owner[name] if is_dict else getattr(owner, name)
            entry = _PATCHES[key] = [0, original]
            if is_dict:
                owner[name] = replacement(original)
            else:
                setattr(owner, name, replacement(original))
        entry[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _PATCHES[key]
                if is_dict:
                    owner[name] = entry[1]
                else:
                    setattr(owner, name, entry[1])


@contextlib.contextmanager
def trivial_masks_skipped(positions_from_model: bool = False):
    """Trace inside this block: transformers builds no mask that SDPA does not need (module docstring).

    ``positions_from_model``: the traced module takes no ``position_ids`` input, so each row is one sequence
    and transformers' packed-sequence detection is told so. A no-op where transformers has no mask interface.
    """
    try:
        from transformers import masking_utils  # noqa: PLC0415 - transformers is optional
    except ImportError:
        yield
        return
    mapping = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    with contextlib.ExitStack() as stack:
        if "sdpa" in mapping:
            stack.enter_context(_patched(mapping, "sdpa", _wrapper_for))
        if positions_from_model and hasattr(masking_utils, "find_packed_sequence_indices"):
            stack.enter_context(_patched(masking_utils, "find_packed_sequence_indices", lambda _: _not_packed))
        yield


def positions_from_model(module: Any) -> bool:
    """Whether a module traced by exporter (an IOModule) leaves ``position_ids`` to the model."""
    signature = getattr(module, "signature", None)
    return signature is not None and "position_ids" not in signature.inputs
