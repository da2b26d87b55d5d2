"""Rule: switch a transformers model from eager attention to SDPA through the library's attention interface.

transformers dispatches every attention module of a modern architecture through
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``. Setting the
implementation to ``"sdpa"`` (``PreTrainedModel.set_attn_implementation``)
rewrites them all without touching the library's code. The sites are found by
observation: one forward pass with the ``sdpa`` entry of the interface wrapped
by a recorder lists each module that dispatched, with its q/k/v shapes and mask.

The masks transformers builds for these calls under tracing: :mod:`.transformers_masks`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from ..modelio import IOModule, is_transformers_model, make_io_module, transformers_core
from .audit import REWRITTEN, AttentionAudit, Site

KIND = "transformers AttentionInterface"
RULE = "transformers_interface"


def applies(io: IOModule) -> bool:
    return is_transformers_model(io.model)


@contextlib.contextmanager
def _recording(calls: list[dict[str, Any]]):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415 - transformers is optional

    mapping = ALL_ATTENTION_FUNCTIONS._global_mapping
    original = mapping["sdpa"]

    def recorder(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append({
            "module": module,
            "query": tuple(query.shape),
            "key": tuple(key.shape),
            "mask": attention_mask is not None,
            "causal": kwargs.get("is_causal", getattr(module, "is_causal", None)),
        })
        return original(module, query, key, value, attention_mask, *args, **kwargs)

    mapping["sdpa"] = recorder
    try:
        yield
    finally:
        mapping["sdpa"] = original


def rewrite(io: IOModule, example: list[torch.Tensor], audit: AttentionAudit) -> IOModule:
    """Return an IOModule over the same model that runs SDPA; add one Site per attention module."""
    model: Any = io.model  # a transformers PreTrainedModel, or a pipeline around one
    core = transformers_core(model)
    names = {id(m): n for n, m in model.named_modules()}
    if not core._can_set_attn_implementation():  # its eager attention is left to softmax_attention_graph
        audit.notes.append(f"{RULE}: {type(core).__name__} does not dispatch attention through AttentionInterface; "
                           "its attention is left to the graph rule")
        return io
    rewritten = make_io_module(model, io.signature, attn_implementation="sdpa")
    calls: list[dict[str, Any]] = []
    try:
        with _recording(calls), torch.inference_mode():
            rewritten(*example)
    except Exception as exc:  # its eager attention is left to softmax_attention_graph
        audit.notes.append(f"{RULE}: {type(core).__name__} failed under sdpa ({type(exc).__name__}: {exc}); "
                           "kept eager, its attention is left to the graph rule")
        return io
    seen: dict[int, Site] = {}
    for call in calls:
        module: nn.Module = call["module"]
        if id(module) in seen:
            continue
        q, k = call["query"], call["key"]
        heads = q[1] if len(q) == 4 else None
        kv_heads = k[1] if len(k) == 4 else None
        seen[id(module)] = Site(
            location=names.get(id(module), type(module).__name__), kind=KIND, status=REWRITTEN, rule=RULE,
            causal=bool(call["causal"]) if call["causal"] is not None else None, masked=call["mask"],
            grouped_query=(heads is not None and kv_heads is not None and kv_heads != heads),
            heads=heads, kv_heads=kv_heads, head_dim=q[-1] if q else None)
    audit.sites.extend(seen.values())
    if not seen:
        audit.notes.append(f"{type(core).__name__} ran no attention through AttentionInterface")
        return io
    return rewritten
