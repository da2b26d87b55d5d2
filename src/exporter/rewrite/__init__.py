"""Stage 2, rewrite: route every attention through torch's scaled_dot_product_attention, and audit it.

Rules run in order; each returns a new module (never patching library code) and
adds what it found to the audit.
"""

from __future__ import annotations

import torch

from ..modelio import IOModule
from . import transformers_interface
from .audit import ALREADY_SDPA, REWRITTEN, SKIPPED, AttentionAudit, Site

RULES = (transformers_interface,)


def rewrite_attention(io: IOModule, example: list[torch.Tensor]) -> tuple[IOModule, AttentionAudit]:
    audit = AttentionAudit()
    current = io
    for rule in RULES:
        if rule.applies(current):
            current = rule.rewrite(current, example, audit)
    return current, audit


__all__ = ["rewrite_attention", "AttentionAudit", "Site", "REWRITTEN", "SKIPPED", "ALREADY_SDPA"]
