"""What a generation model's attention runs as: SDPA through transformers' attention entry, each site recorded as
one step runs, or the model's own attention where transformers refuses SDPA for it (each site saying why)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..modelio import attention_implementation
from ..rewrite.audit import REWRITTEN, SKIPPED, AttentionAudit, Site
from ..rewrite.transformers_interface import KIND, RULE, _recording


def recorded_sites(model: torch.nn.Module, run: Callable[[], Any], decoder_only: bool) -> AttentionAudit:
    """One site per attention module that ``run()`` dispatched through transformers' SDPA entry. A decoder-only
    model's sites are causal and masked (its step always passes the cache's mask); an encoder-decoder's say what
    each call was (the encoder's are not causal, cross-attention's are not)."""
    audit = AttentionAudit()
    names = {id(m): n for n, m in model.named_modules()}
    calls: list[dict[str, Any]] = []
    with _recording(calls):
        run()
    seen: set[int] = set()
    for call in calls:
        if id(call["module"]) in seen:
            continue
        seen.add(id(call["module"]))
        q, k = call["query"], call["key"]
        audit.sites.append(Site(location=names.get(id(call["module"]), "attention"), kind=KIND, status=REWRITTEN,
                                rule=RULE, causal=True if decoder_only else bool(call["causal"]),
                                masked=True if decoder_only else call["mask"],
                                grouped_query=len(q) == 4 and len(k) == 4 and q[1] != k[1],
                                heads=q[1] if len(q) == 4 else None, kv_heads=k[1] if len(k) == 4 else None,
                                head_dim=q[-1] if q else None))
    return audit


def sdpa_refusal(model: torch.nn.Module, transformers: bool) -> str | None:
    """Why transformers will not run this model's attention through SDPA (Gemma2: its scores are soft-capped);
    None when it will. The model then keeps its eager attention, and each site says why."""
    if not transformers:
        return None
    hf: Any = model  # a transformers PreTrainedModel
    if not hf._can_set_attn_implementation():  # BLOOM: set_attn_implementation would only warn
        return (f"transformers cannot switch {type(model).__name__} to SDPA once it is built (it does not dispatch "
                "attention through AttentionInterface); the forward convert's graph rule rewrites it, the decode "
                "programs keep it as written")
    try:
        with attention_implementation(model, "sdpa"):
            pass
    except (ValueError, ImportError) as exc:
        first = str(exc).split(". ")[0].strip()
        softcap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
        if softcap:
            return (f"its scores are soft-capped (tanh, attn_logit_softcapping = {softcap:g}), which SDPA has no "
                    f"equivalent for; transformers refuses SDPA for it ({first})")
        return f"transformers refuses SDPA for it ({first})"
    return None


def eager_sites(model: torch.nn.Module, reason: str) -> AttentionAudit:
    """Each attention module of a model kept on eager attention, left as written with ``reason``."""
    audit = AttentionAudit()
    outer: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and not any(name.startswith(o + ".") for o in outer):
            outer.append(name)
            audit.sites.append(Site(location=name, kind=f"{type(module).__name__} (eager)", status=SKIPPED,
                                    rule=RULE, reason=reason, causal=True))
    return audit
