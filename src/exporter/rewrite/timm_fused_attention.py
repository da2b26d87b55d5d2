"""Rule: timm attention modules with their fused path off take timm's own SDPA path.

Pattern: a module of timm's ``Attention`` class (``timm.layers.Attention``, which
``timm.models.vision_transformer`` uses), or any other timm module with a boolean
``fused_attn`` switch, whose ``fused_attn`` is False (``TIMM_FUSED_ATTN=0``,
``timm.layers.set_fused_attn(False)`` or ``set_exportable(True)`` turn it off).
Its manual branch computes ``(q·scale) @ kᵀ → softmax → attn_drop → @ v``; its fused
branch calls ``F.scaled_dot_product_attention`` with the same mask and causal flag.

Check: the model is run on the example with the switch on; outputs must match the
original's, else nothing is changed and the sites are reported.

Replacement: a copy of each such module (same parameters) with ``fused_attn = True``.

timm is imported only when the model holds a module defined in a ``timm.`` package,
and its real ``Attention`` class is used; without timm the rule does nothing (timm's
unfused attention is still found by ``softmax_attention_graph``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..modelio import IOModule
from .audit import ALREADY_SDPA, REWRITTEN, SKIPPED, AttentionAudit, Site
from .module_tree import compare, replace_submodules, run, shallow_copy, with_model

RULE = "timm_fused_attention"


def _timm_attention_class() -> type | None:
    try:
        from timm.layers import Attention  # noqa: PLC0415 - timm is optional
    except Exception:  # timm missing or not importable here (it needs torchvision)
        return None
    return Attention


def _from_timm(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "timm"


def _switchable(module: nn.Module, attention: type) -> bool:
    switchable = _from_timm(module) and isinstance(getattr(module, "fused_attn", None), bool)
    return isinstance(module, attention) or switchable


def applies(io: IOModule) -> bool:
    if not any(_from_timm(m) for m in io.model.modules()):
        return False
    attention = _timm_attention_class()
    return attention is not None and any(_switchable(m, attention) for m in io.model.modules())


def _site(path: str, module: nn.Module, status: str, reason: str = "") -> Site:
    heads = getattr(module, "num_heads", None)
    head_dim = getattr(module, "head_dim", None)
    return Site(path, f"timm {type(module).__name__}", status, RULE, reason=reason, causal=None, masked=None,
                grouped_query=False, heads=heads, kv_heads=heads, head_dim=head_dim,
                pattern="fused_attn=False → True" if status == REWRITTEN else "")


def rewrite(io: IOModule, example: list[torch.Tensor], audit: AttentionAudit) -> IOModule:
    attention = _timm_attention_class()
    model = io.model
    targets = {}
    for path, module in model.named_modules():
        if attention is not None and _switchable(module, attention):
            if module.fused_attn:
                audit.sites.append(_site(path, module, ALREADY_SDPA))
            else:
                targets[path] = module
    if not targets:
        return io
    expected = run(io, example)
    candidate = with_model(io, replace_submodules(
        model, {p: shallow_copy(m, fused_attn=True) for p, m in targets.items()}))
    try:
        check = compare(expected, run(candidate, example))
    except Exception as exc:
        check = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"}
    if not check["ok"]:
        reason = check.get("reason") or f"outputs changed (rel. L2 error {check['rel_l2_error']:.2e})"
        audit.sites.extend(_site(p, m, SKIPPED, f"timm's fused path gave other outputs: {reason}")
                           for p, m in targets.items())
        return io
    audit.sites.extend(_site(p, m, REWRITTEN) for p, m in targets.items())
    audit.checks.append({"rule": RULE, **check})
    return candidate
