"""Rule: ``nn.MultiheadAttention`` called for its attention weights takes PyTorch's own SDPA path instead.

Pattern: an ``nn.MultiheadAttention`` (alone, or inside ``nn.TransformerEncoderLayer`` /
``nn.TransformerDecoderLayer``, as in torchvision's ViT) and how it is called, seen by a
forward pre-hook during one eager pass. ``need_weights=False`` already runs
``scaled_dot_product_attention``; ``need_weights=True`` (the default) runs
``bmm → softmax → bmm`` to return the weights.

Check: the caller must not use the weights. The rewritten model is run on the example with
the weights gone (``None``); a module whose caller fails without them, or whose outputs
change, is left alone and reported.

Replacement: a copy of the module (same parameters) whose ``forward`` passes
``need_weights=False`` to ``nn.MultiheadAttention.forward`` and returns ``(output, None)``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from ..modelio import IOModule
from .audit import ALREADY_SDPA, REWRITTEN, SKIPPED, AttentionAudit, Site
from .module_tree import compare, replace_submodules, run, shallow_copy, with_model

RULE = "torch_multihead_attention"
KIND = "nn.MultiheadAttention"
LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class SDPAMultiheadAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` that always takes its ``scaled_dot_product_attention`` path."""

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        output, _ = super().forward(query, key, value, key_padding_mask=key_padding_mask, need_weights=False,
                                    attn_mask=attn_mask, average_attn_weights=average_attn_weights,
                                    is_causal=is_causal)
        return output, None


def applies(io: IOModule) -> bool:
    return any(type(m) is nn.MultiheadAttention for m in io.model.modules())


def _calls(io: IOModule, example: list[torch.Tensor]) -> dict[str, dict]:
    """Each MultiheadAttention called during one pass: whether it was asked for weights, masks, causal."""
    calls: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        for path, module in io.model.named_modules():
            if type(module) is not nn.MultiheadAttention:
                continue

            def hook(_module, args, kwargs, path=path):
                names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask",
                         "average_attn_weights", "is_causal")
                bound = dict(zip(names, args)) | kwargs
                seen = calls.setdefault(path, {"need_weights": False, "masked": False, "causal": False})
                seen["need_weights"] |= bool(bound.get("need_weights", True))
                seen["masked"] |= bound.get("attn_mask") is not None or bound.get("key_padding_mask") is not None
                seen["causal"] |= bool(bound.get("is_causal", False))

            stack.callback(module.register_forward_pre_hook(hook, with_kwargs=True).remove)
        with torch.inference_mode():
            io(*example)
    return calls


def _site(model: nn.Module, path: str, call: dict, status: str, reason: str = "") -> Site:
    module: Any = model.get_submodule(path)  # an nn.MultiheadAttention
    owner_path = path.rpartition(".")[0]
    owner = model.get_submodule(owner_path) if owner_path or path else model
    kind = KIND + (f" in nn.{type(owner).__name__}" if isinstance(owner, LAYERS) else "")
    return Site(path or type(model).__name__, kind, status, RULE, reason=reason, causal=call["causal"],
                masked=call["masked"], grouped_query=False, heads=module.num_heads, kv_heads=module.num_heads,
                head_dim=module.head_dim,
                pattern="need_weights=True → need_weights=False" if status == REWRITTEN else "")


def rewrite(io: IOModule, example: list[torch.Tensor], audit: AttentionAudit) -> IOModule:
    model = io.model
    calls = _calls(io, example)
    wanted = [p for p, c in calls.items() if c["need_weights"]]
    for path, call in calls.items():
        if not call["need_weights"]:
            audit.sites.append(_site(model, path, call, ALREADY_SDPA))
    if not wanted:
        return io
    expected = run(io, example)

    def attempt(paths: list[str]) -> tuple[IOModule | None, dict]:
        replacements = {p: shallow_copy(model.get_submodule(p), SDPAMultiheadAttention) for p in paths}
        candidate = with_model(io, replace_submodules(model, replacements))
        try:
            check = compare(expected, run(candidate, example))
        except Exception as exc:  # the caller needed the weights
            return None, {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
        return (candidate if check["ok"] else None), check

    candidate, check = attempt(wanted)
    kept = list(wanted)
    if candidate is None:  # find the modules whose callers need the weights, one by one
        kept = []
        for path in wanted:
            single, why = attempt([path])
            if single is None:
                reason = why.get("reason") or f"outputs changed (rel. L2 error {why['rel_l2_error']:.2e})"
                audit.sites.append(_site(model, path, calls[path], SKIPPED,
                                         f"the caller uses the attention weights it asks for ({reason})"))
            else:
                kept.append(path)
        candidate, check = attempt(kept) if kept else (None, {})
    for path in kept:
        audit.sites.append(_site(model, path, calls[path], REWRITTEN))
    if candidate is None:
        return io
    audit.checks.append({"rule": RULE, **check})
    return candidate
