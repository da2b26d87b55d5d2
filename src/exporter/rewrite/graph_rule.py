"""The graph rules' driver: trace the model, run each rule over the graph, check the result, audit every site.

A rule (``softmax_attention_graph``: its match in ``softmax_attention_match``, what a site is in
``softmax_attention_sites``) holds its pattern, check and replacement; this module finds the
candidate nodes, asks the rule to ``match`` each, ``replace``s what matched, records every site (rewritten,
skipped with the reason, or already SDPA) in the audit, and runs the rewritten graph as a module
(:mod:`exporter.rewrite.graph_capture`) only when its outputs match the original model's.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import describe
from ..modelio import IOModule
from . import probe
from . import softmax_attention_graph as rule
from .audit import ALREADY_SDPA, REWRITTEN, SKIPPED, AttentionAudit, Site
from .graph_capture import GraphProgram, capture, program_from_export, traced_module
from .graph_facts import Program, static_int
from .module_tree import compare, run

RULE = rule.RULE
KIND = rule.KIND


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


def applies(io: IOModule) -> bool:
    return True  # rewrite() decides from one eager pass whether there is anything to trace


def audit_site(found: rule.Found | None, node: fx.Node, root: str, status: str, reason: str = "") -> Site:
    where, owner = location(node, root)
    q = found.q.dims if found is not None and found.q is not None else ()
    heads = static_int(q[-3]) if len(q) == 4 else None
    kv_heads = found.kv_heads if found is not None and found.kv_heads is not None else heads
    return Site(where, f"{KIND} in {owner}" if owner else KIND, status, RULE, reason=reason,
                causal=any(t.causal for t in found.terms) if found else None,
                masked=(any(not t.causal for t in found.terms) if found else None),
                grouped_query=(found.grouped_query if found else None), heads=heads, kv_heads=kv_heads,
                head_dim=static_int(q[-1]) if q else None, node=node.name,
                pattern=" → ".join(found.ops) if found else "")


def rewrite_program(ep, root: str, example: list[torch.Tensor]) -> tuple[list[Site], GraphProgram | None]:
    """Find and rewrite every softmax attention of an exported program; the sites and the rewritten graph."""
    facts = Program(ep)
    graph = ep.graph_module.graph
    graph.eliminate_dead_code()  # e.g. attention weights computed but never used
    sites: list[Site] = []
    for softmax in rule.softmax_nodes(graph):
        found, reason = rule.match(softmax, facts, example)
        if reason is not None:
            sites.append(audit_site(found, softmax, root, SKIPPED, reason))
            continue
        if found is None:
            continue  # not attention
        sites.append(audit_site(found, softmax, root, REWRITTEN))
        rule.replace(graph, found, facts)
    unique_locations(sites)
    if not any(s.status == REWRITTEN for s in sites):
        return sites, None
    graph.eliminate_dead_code()
    graph.lint()
    ep.graph_module.recompile()
    return sites, program_from_export(ep)


def rewrite(io: IOModule, example: list[torch.Tensor], audit: AttentionAudit) -> IOModule:
    observation = probe.observe(io, example)
    record_sdpa_calls(observation, audit)
    if not observation.softmax_candidates:
        return io
    root = type(io.model).__name__
    locations: list[str] = []
    sites: list[Site] = []

    def unrewritten(reason: str) -> None:
        for site in sites:
            if site.status == REWRITTEN:
                site.status, site.reason = SKIPPED, reason
        audit.notes.append(f"{RULE}: {reason}; the model runs unrewritten")

    def build(source: IOModule, sample: list[torch.Tensor]) -> GraphProgram | None:
        """Trace and rewrite again (after a dtype or device change); the same sites must come out."""
        where = f"{sample[0].dtype} on {sample[0].device}" if sample else "the new dtype/device"
        try:
            again, program = rewrite_program(capture(source, sample), root, sample)
        except Exception as exc:
            unrewritten(f"tracing again at {where} failed ({describe(exc, 200)})")
            return None
        now = sorted(s.location for s in again if s.status == REWRITTEN)
        if program is None:
            unrewritten(f"tracing again at {where} found no attention to rewrite")
            return None
        if now != locations:
            audit.notes.append(f"{RULE}: tracing again at {where} rewrote {', '.join(now)} "
                               f"instead of {', '.join(locations)}")
        return program

    try:
        ep = capture(io, example)
    except Exception as exc:
        skip_candidates(observation, audit, root, f"the model could not be traced ({describe(exc, 200)})")
        return io
    try:
        sites[:], program = rewrite_program(ep, root, example)
    except Exception as exc:  # a graph this rule cannot handle must not stop the conversion: report it
        skip_candidates(observation, audit, root, f"the graph rule failed on the traced graph ({describe(exc, 200)})")
        return io
    if program is None:
        audit.sites.extend(sites)
        if not sites:
            audit.notes.append(f"{len(observation.softmax_candidates)} softmax call(s) follow a product of "
                               "activations but none is attention (no softmax(q·kᵀ)·v in the graph)")
        return io
    expected = run(io, example)
    locations[:] = sorted(s.location for s in sites if s.status == REWRITTEN)
    module = traced_module(io, example, build, program)
    try:
        check = compare(expected, run(module, example))
    except Exception as exc:
        check = {"ok": False, "max_abs_error": None, "rel_l2_error": None,
                 "reason": f"the rewritten graph failed: {describe(exc, 200)}"}
    audit.checks.append({"rule": RULE, **check})
    if not check["ok"]:
        for s in sites:
            if s.status == REWRITTEN:
                s.status, s.reason = SKIPPED, (f"outputs differed after the rewrite "
                                               f"({check['reason'] or 'rel. L2 error %.2e' % check['rel_l2_error']})")
        audit.sites.extend(sites)
        return io
    audit.sites.extend(sites)
    return module
