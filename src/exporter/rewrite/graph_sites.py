"""Audit entries of the graph rule: where a site is, the SDPA calls already in the model, and what was skipped."""

from __future__ import annotations

import torch.fx as fx

from . import probe
from .audit import ALREADY_SDPA, SKIPPED, AttentionAudit, Site

RULE = "softmax_attention_graph"
KIND = "softmax attention"


def location(node: fx.Node, root: str) -> tuple[str, str]:
    """(module path relative to the user's model, class name) of a graph node; the root is ``root``."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    path, kind = stack[-1] if stack else ("", "")
    kind = kind if isinstance(kind, str) else getattr(kind, "__qualname__", str(kind))
    path = path[len("model."):] if path.startswith("model.") else ("" if path == "model" else path)
    return path or root, kind.rsplit(".", 1)[-1]


def unique_locations(sites: list[Site]) -> None:
    """Name the softmax node where one module holds several sites."""
    seen: dict[str, int] = {}
    for s in sites:
        seen[s.location] = seen.get(s.location, 0) + 1
    for s in sites:
        if seen[s.location] > 1:
            s.location = f"{s.location} [{s.node}]"


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def skip_candidates(observation: probe.Observation, audit: AttentionAudit, root: str, reason: str) -> None:
    """One skipped site per module where the eager pass saw softmax attention, when the graph could not be used."""
    for call in observation.softmax_candidates:
        where = call.path or root
        if not audit.has_site_at(call.path) and not any(s.location == where for s in audit.sites):
            audit.sites.append(Site(where, f"{KIND} in {call.module_type}", SKIPPED, RULE, reason=reason))


def record_sdpa_calls(observation: probe.Observation, audit: AttentionAudit) -> None:
    """``scaled_dot_product_attention`` calls the model already makes, one site per module not listed yet."""
    for call in observation.sdpa:
        if audit.has_site_at(call.path):
            continue
        q, k = (call.shapes + ((), ()))[:2]
        heads = q[-3] if len(q) == 4 else None
        kv_heads = k[-3] if len(k) == 4 else None
        audit.sites.append(Site(call.path or call.module_type, f"F.scaled_dot_product_attention in {call.module_type}",
                                ALREADY_SDPA, RULE, causal=call.options["is_causal"], masked=call.options["masked"],
                                grouped_query=heads is not None and kv_heads is not None and heads != kv_heads,
                                heads=heads, kv_heads=kv_heads, head_dim=q[-1] if q else None))
