"""Rule: attention written out by hand, found in the traced graph, becomes ``scaled_dot_product_attention``.

Pattern (torch.export training IR, see graph_capture; a torch.fx graph rewrite)::

    scores = matmul(q, kᵀ) | bmm(q, kᵀ) | baddbmm(bias, q, kᵀ) | einsum("…ld,…sd->…ls", q, k)
    logits = scores, then any of, in any order:  · c   / c   (c a number or a one-element tensor)
                                                 + additive mask    masked_fill(m, -inf)
                                                 where(m, ·, -inf)  float casts
    probs  = softmax(logits, dim=-1), then any of: casts, dropout that is off (eval, or p = 0)
    out    = matmul(probs, v) | bmm(probs, v) | einsum("…ls,…se->…le", probs, v)

    On both sides of the softmax, layout steps are seen through: view, reshape, flatten and unflatten
    that only split or merge the leading (batch, head) dims and keep the last two, (query, key), as they
    are: bmm on (batch·heads, s, d) viewed as (batch, heads, s, s) for a padding mask, softmax, viewed
    back for the product with v.

Check: the softmax is over the last dim; the scores, logits and probs feed only the next
step (attention weights returned or used elsewhere are left alone); every op between
``q·kᵀ`` and ``softmax`` is one SDPA can express; q, k and v share their batch dims (or k and
v have one head, or are grouped-query repeats) and their dtype.

Replacement: ``scaled_dot_product_attention(q, k, v, attn_mask, scale=…, is_causal=…, enable_gqa=…)``
with ``k = (kᵀ)ᵀ`` taken from the matmul's own operand, so no assumption about how kᵀ was made
can change the result. Masks keep their exact meaning: additive terms are summed, boolean
ones combined; a mask becomes ``is_causal=True`` only when it depends on sizes and constants
alone and equals ``tril(ones(n, n))`` at several lengths. Grouped-query repeats of k and v
(``repeat_interleave`` or ``expand``+``reshape``, the transformers ``repeat_kv``) become
``enable_gqa=True`` on the un-repeated tensors. 3-D (``bmm``) inputs get a leading dim of 1, except where a
mask was made per head by expanding one mask over the heads and folding them into the batch
(``mask[:, None].expand(b, h, …).reshape(b·h, …)``, nn.MultiheadAttention's spelling): there SDPA runs on
(batch, heads) with q, k and v unflattened and the mask before its expansion, broadcast over the heads, so no
copy of it per head is built (:func:`_unfold_heads`). Where
layout steps were seen through, SDPA runs in the layout with the most leading dims (batch, heads):
q, k and v flattened over them are unflattened (the dims after the first must be static), and the
output is flattened back to the layout the product with v had. A view that changes the last two dims
(softmax over query·key pairs, say) is not layout: the site is skipped with that reason.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .graph_facts import (
    Program,
    shape,
    text,
)
from .softmax_attention_match import Found, match, softmax_nodes
from .softmax_attention_sites import ASSERTS, Operand, Term

aten = torch.ops.aten

RULE = "softmax_attention_graph"
KIND = "softmax attention"

__all__ = ["KIND", "RULE", "Found", "match", "replace", "softmax_nodes"]


# --------------------------------------------------------------------------- replacement


def _constant(graph: fx.Graph, node: Any, facts: Program) -> Any:
    """A copy of a weight's view. A mask or q/k/v that is a view of a parameter keeps ``requires_grad`` even under
    inference_mode, which sends SDPA to its math kernel at run time, while the export traced the flash kernel's
    output strides (and a decomposed program then fails in a ``view``). A copy made under inference_mode does not
    require grad; ``detach`` would not do, as decomposition turns it into ``alias``, a view again."""
    return graph.call_function(aten.clone.default, (node,)) if facts.is_weight(node) else node


def _build(graph: fx.Graph, operand: Operand, facts: Program) -> fx.Node:
    node = _constant(graph, operand.node, facts)
    if operand.swap_last:
        node = graph.call_function(aten.transpose.int, (node, -2, -1))
    if operand.perm is not None:
        node = graph.call_function(aten.permute.default, (node, list(operand.perm)))
    if operand.unflatten is not None:
        node = graph.call_function(aten.unflatten.int, (node, 0, list(operand.unflatten)))
    return node


def _mask(graph: fx.Graph, found: Found, q: fx.Node, k: fx.Node, facts: Program) -> fx.Node | None:
    """One 4-D SDPA mask from the terms, spelled out over (query, key): onnxruntime's Attention kernel
    does not broadcast a mask over the query length, and the CPU flash kernel takes 4-D masks only."""
    if found.is_causal or not found.terms:
        return None
    mask = _combine(graph, found, q, facts)
    rank = max(len(shape(t.node) or ()) + (t.unflatten is not None) for t in found.terms)
    scores = shape(found.softmax)
    if rank < 2 or not all(text((shape(t.node) or (1, 1))[-2:]) == text(scores[-2:]) for t in found.terms):
        for _ in range(2 - rank):
            mask = graph.call_function(aten.unsqueeze.default, (mask, 0))
        rank = max(rank, 2)
        last = len(found.q.dims) - 2
        rows = graph.call_function(aten.sym_size.int, (q, last))
        cols = graph.call_function(aten.sym_size.int, (k, last))
        mask = graph.call_function(aten.expand.default, (mask, [-1] * (rank - 2) + [rows, cols]))
    for _ in range(4 - rank):
        mask = graph.call_function(aten.unsqueeze.default, (mask, 0))
    return mask


def _unflattened(graph: fx.Graph, term: Term, node: fx.Node) -> fx.Node:
    return node if term.unflatten is None else graph.call_function(aten.unflatten.int, (node, 0, term.unflatten))


def _combine(graph: fx.Graph, found: Found, q: fx.Node, facts: Program) -> fx.Node:
    keep = additive = None
    for t in found.terms:
        if t.kind == "add":
            node = _unflattened(graph, t, _constant(graph, t.node, facts))
            if t.coef != 1.0:
                node = graph.call_function(aten.mul.Tensor, (node, t.coef))
            for op, tensor in t.coef_tensors:
                node = graph.call_function(op, (node, tensor))
            additive = node if additive is None else graph.call_function(aten.add.Tensor, (additive, node))
        else:
            node = _unflattened(graph, t, _constant(graph, t.node, facts))
            node = node if t.kind == "keep" else graph.call_function(aten.logical_not.default, (node,))
            keep = node if keep is None else graph.call_function(aten.logical_and.default, (keep, node))
    fills = {t.fill for t in found.terms if t.kind != "add"}
    fill = fills.pop() if len(fills) == 1 else float("-inf")
    if keep is not None and additive is None and fill != float("-inf"):
        return graph.call_function(aten.type_as.default,
                                   (graph.call_function(aten.where.Scalar, (keep, 0.0, fill)), q))
    if additive is not None:
        additive = graph.call_function(aten.type_as.default, (additive, q))
        if keep is not None:
            return graph.call_function(aten.where.ScalarOther, (keep, additive, fill))
        return additive
    return keep


def _replace(graph: fx.Graph, found: Found, facts: Program) -> fx.Node:
    with graph.inserting_before(found.out):
        q, k, v = (_build(graph, o, facts) for o in (found.q, found.k, found.v))
        for op, tensor in found.scale_tensors:
            q = graph.call_function(op, (q, _constant(graph, tensor, facts)))
        mask = _mask(graph, found, q, k, facts)
        lift = 4 - len(found.q.dims)
        for _ in range(lift):
            q, k, v = (graph.call_function(aten.unsqueeze.default, (t, 0)) for t in (q, k, v))
        kwargs: dict[str, Any] = {"attn_mask": mask, "dropout_p": 0.0, "is_causal": found.is_causal,
                                  "scale": found.scale}
        if found.gqa:
            kwargs["enable_gqa"] = True
        out = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v), kwargs)
        # One output layout whatever kernel runs: SDPA's kernels return different strides, and an exported
        # program bakes the strides of the kernel its trace saw into its views. (batch, query, heads, dim) in
        # memory, the flash kernels' layout, so the usual transpose(1, 2).reshape() after it stays a view.
        out = graph.call_function(aten.transpose.int, (out, 1, 2))
        out = graph.call_function(aten.clone.default, (out,), {"memory_format": torch.contiguous_format})
        out = graph.call_function(aten.transpose.int, (out, 1, 2))
        for _ in range(lift):
            out = graph.call_function(aten.squeeze.dim, (out, 0))
        if found.out_flatten is not None:
            out = graph.call_function(aten.flatten.using_ints, (out, 0, found.out_flatten - 1))
        if found.out_perm is not None:
            out = graph.call_function(aten.permute.default, (out, list(found.out_perm)))
    for key in ("nn_module_stack", "stack_trace", "val"):
        if key in found.out.meta:
            out.meta[key] = found.out.meta[key]
    found.out.replace_all_uses_with(out)
    for node in [found.out, *reversed(found.probs), found.softmax, *reversed(found.path), found.producer]:
        for user in list(node.users):
            if user.target in ASSERTS:
                graph.erase_node(user)
        if not node.users:
            graph.erase_node(node)
    return out


def replace(graph: fx.Graph, found: Found, facts: Program) -> fx.Node:
    """Put one ``scaled_dot_product_attention`` in place of the matched attention."""
    return _replace(graph, found, facts)
