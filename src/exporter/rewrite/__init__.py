"""The rewrite stage: route every attention through torch's scaled_dot_product_attention, and audit it.

Rules run in order; each returns a new module (never patching library code) that
shares the original's weights, and adds what it found to the audit:

- ``transformers_interface``: transformers models switch to their ``sdpa`` attention implementation;
- ``timm_fused_attention``: timm attention modules with ``fused_attn`` off switch it on;
- ``torch_multihead_attention``: ``nn.MultiheadAttention`` asked for weights nobody uses takes its SDPA path;
- ``softmax_attention_graph``: any attention left, written out by hand, found in the traced graph
  (``softmax(q·kᵀ·scale + mask)·v`` and its spellings) and replaced by an SDPA node. Its driver,
  ``graph_rule``, runs last and traces the model only when an eager pass saw a softmax over ``q·kᵀ``.

Not a rule: ``onnx_attention_masks.expand_attention_masks`` spells SDPA masks out over the
query length in an exported program, for onnxruntime's ``Attention`` kernel.
"""

from __future__ import annotations

import torch

from ..modelio import IOModule
from . import (
    graph_rule,
    softmax_attention_graph,
    timm_fused_attention,
    torch_multihead_attention,
    transformers_interface,
)
from .audit import ALREADY_SDPA, REWRITTEN, SKIPPED, AttentionAudit, Site

RULES = (transformers_interface, timm_fused_attention, torch_multihead_attention, graph_rule)


OFF = "rewrite off (recipe runtime.rewrite_attention = false, or --no-rewrite)"


def rewrite_attention(io: IOModule, example: list[torch.Tensor], apply: bool = True) -> tuple[IOModule, AttentionAudit]:
    """The model with every attention it can route through SDPA, and the audit of every site.

    ``apply=False`` audits the same sites and returns ``io`` itself: sites the rules would rewrite are
    listed as skipped, with the reason, and the model runs its attention as written.
    """
    audit = AttentionAudit()
    current = io
    for rule in RULES:
        if rule.applies(current):
            current = rule.rewrite(current, example, audit)
    if apply:
        return current, audit
    for site in audit.sites:
        if site.status == REWRITTEN:
            site.status, site.reason = SKIPPED, OFF
    audit.notes.append(OFF)
    return io, audit


__all__ = ["rewrite_attention", "RULES", "graph_rule", "softmax_attention_graph", "AttentionAudit", "Site", "REWRITTEN",
           "SKIPPED", "ALREADY_SDPA"]
