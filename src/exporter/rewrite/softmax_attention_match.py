"""Finding hand-written attention in a traced graph: from a softmax back to the product of q and kᵀ and forward to
the product with v, reading the scale, the masks and the layout steps on the way (the pattern is described in
``softmax_attention_graph``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .graph_facts import (
    NEGATIVE_ENOUGH,
    Program,
    dtype,
    einsum_operands,
    is_one_element,
    numel_text,
    permutation,
    shape,
    static_int,
    text,
    unrepeated_heads,
)
from .softmax_attention_sites import (
    ABSORBING,
    CASTS,
    IDENTITIES,
    IN_PLACE,
    PRODUCTS,
    SOFTMAXES,
    VIEWS,
    Found,
    Operand,
    Skip,
    Term,
    op_name,
    real_users,
)

aten = torch.ops.aten


def _is_scores_product(node: fx.Node, facts: Program) -> bool:
    if node.target == aten.einsum.default:
        operands = node.args[1]
        return len(operands) == 2 and not any(facts.is_weight(o) for o in operands)
    a, b = (node.args[1], node.args[2]) if node.target == aten.baddbmm.default else node.args[:2]
    return all(isinstance(x, fx.Node) and not facts.is_weight(x) and len(shape(x) or ()) >= 2 for x in (a, b))


def _path_to_scores(node: Any, facts: Program, depth: int = 0) -> list[fx.Node] | None:
    """Nodes from a q·kᵀ product to ``node`` through ops that keep the scores' element count."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or depth > 12:
        return None
    if node.target in PRODUCTS and _is_scores_product(node, facts):
        return [node]
    if node.target in SOFTMAXES:
        return None
    count = numel_text(node)
    for arg in node.args:
        if isinstance(arg, fx.Node) and dtype(arg) not in (None, torch.bool) and numel_text(arg) == count:
            found = _path_to_scores(arg, facts, depth + 1)
            if found:
                return found + [node]
    return None


def _layout_step(node: fx.Node, prev: fx.Node, where: str) -> tuple:
    """A view/reshape/flatten/unflatten that keeps the last two dims: its new leading dims. Else Skip."""
    before, after = shape(prev), shape(node)
    if before is None or after is None or len(before) < 2 or len(after) < 2 \
            or text(before[-2:]) != text(after[-2:]):
        raise Skip(f"{op_name(node)} {where} changes the (query, key) dims "
                   f"{list(before or [])[-2:]} -> {list(after or [])[-2:]}: only views that split or merge the "
                   "batch and head dims are seen through")
    if not 1 <= len(after) - 2 <= 2:
        raise Skip(f"{op_name(node)} {where} leaves {len(after) - 2} leading dims (SDPA takes batch and heads)")
    return tuple(after[:-2])


def _position(node: fx.Node, prev: fx.Node) -> int:
    places = [i for i, a in enumerate(node.args) if a is prev]
    if len(places) != 1 or prev in node.kwargs.values():
        raise Skip(f"{op_name(node)} uses the scores twice")
    return places[0]


def _factor(other: Any, facts: Program) -> tuple[float | None, fx.Node | None]:
    """A scale: a number, or a one-element tensor (applied to q instead)."""
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return float(other), None
    if isinstance(other, fx.Node) and is_one_element(other):
        return None, other
    raise Skip(f"the scores are scaled by a tensor of shape {list(shape(other) or [])}, not by one number")


def _kept_fill(fill: float) -> float:
    """The additive mask's value for a boolean term filled with ``fill``: half of it when it absorbs the scores
    (onnxruntime's Attention reads exactly finfo(float32).min as -inf, and so would give a fully masked row zeros;
    half of it absorbs the scores just as well), else -inf."""
    return fill / 2 if ABSORBING >= fill > float("-inf") else float("-inf")


def _logits(found: Found, facts: Program) -> None:
    """Read the ops between q·kᵀ and softmax as ``scores * scale + mask``."""
    prev = found.producer
    found.lead = tuple(shape(prev)[:-2])
    for node in found.path:
        index = _position(node, prev)
        if node.target in VIEWS:
            if index != 0:
                raise Skip(f"{op_name(node)} takes the scores as its shape")
            found.lead = _layout_step(node, prev, "between q·kᵀ and softmax")
            found.layout_steps += 1
            found.ops.append(op_name(node))
            prev = node
            continue
        target, args = node.target, node.args
        if target in IN_PLACE:
            if index != 0 or len(real_users(prev)) != 1:
                raise Skip(f"{op_name(node)} mutates scores that something else also reads")
            target = IN_PLACE[target]
        other = args[1 - index] if index in (0, 1) and len(args) > 1 else None
        if target in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
            if target in (aten.div.Tensor, aten.div.Scalar) and index != 0:
                raise Skip("the scores are the divisor")
            number, tensor = _factor(other, facts)
            divide = target in (aten.div.Tensor, aten.div.Scalar)
            if number is not None:
                if number == 0:
                    raise Skip("the scores are scaled by 0")
                number = 1 / number if divide else number
                if number < 0 and any(t.kind != "add" for t in found.terms):
                    raise Skip("a negative scale after a boolean mask")
                found.scale *= number
                for term in found.terms:
                    term.coef *= number
            else:
                if any(t.kind != "add" for t in found.terms):
                    raise Skip("a tensor scale after a boolean mask (its sign is unknown)")
                op = aten.div.Tensor if divide else aten.mul.Tensor
                found.scale_tensors.append((op, tensor))
                for term in found.terms:
                    term.coef_tensors.append((op, tensor))
            found.ops.append("div" if divide else "mul")
        elif target in (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar):
            alpha = node.kwargs.get("alpha", 1)
            if target in (aten.sub.Tensor, aten.sub.Scalar):
                if index != 0:
                    raise Skip("the scores are subtracted from something")
                alpha = -alpha
            elif index == 1 and alpha != 1:
                raise Skip("add with alpha applied to the scores")
            if isinstance(other, fx.Node):
                if dtype(other) is torch.bool or not (dtype(other) and dtype(other).is_floating_point):
                    raise Skip(f"a {dtype(other)} tensor is added to the scores")
                found.terms.append(Term("add", other, coef=float(alpha), lead=found.lead))
                found.ops.append("add mask")
            else:  # a constant shift: softmax is unchanged by it
                found.ops.append("add constant")
        elif target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
            if index != 0:
                raise Skip("masked_fill of something else with the scores")
            fill = facts.scalar_constant(args[2])
            if fill is None or fill > NEGATIVE_ENOUGH:
                raise Skip(f"masked_fill with {args[2] if fill is None else fill} is not a mask (needs -inf)")
            found.terms.append(Term("drop", args[1], lead=found.lead, fill=_kept_fill(fill)))
            found.ops.append("masked_fill" + ("" if fill == float("-inf") else f"({fill:.3g} as -inf)"))
        elif target in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf):
            if index == 0:
                raise Skip("the scores are used as a where() condition")
            fill = facts.scalar_constant(args[3 - index])
            if fill is None or fill > NEGATIVE_ENOUGH:
                raise Skip("where() with a value that is not -inf")
            found.terms.append(Term("keep" if index == 1 else "drop", args[0], lead=found.lead,
                                    fill=_kept_fill(fill)))
            found.ops.append("where" + ("" if fill == float("-inf") else f"({fill:.3g} as -inf)"))
        elif target in CASTS or target in IDENTITIES:
            if target in CASTS and not (dtype(node) and dtype(node).is_floating_point):
                raise Skip(f"the scores are cast to {dtype(node)}")
            if target in CASTS:
                found.ops.append(f"to {str(dtype(node)).replace('torch.', '')}")
        else:
            raise Skip(f"{op_name(node)} between q·kᵀ and softmax has no SDPA equivalent")
        prev = node


def _key_from_transposed(kt: fx.Node) -> Operand:
    """k such that kᵀ == ``kt``: undo a transpose/permute of the last two dims, else transpose it back."""
    rank = len(shape(kt) or ())
    dims = shape(kt)[:-2] + (shape(kt)[-1], shape(kt)[-2])
    if kt.target == aten.mT.default:
        return Operand(kt.args[0], dims=dims)
    if kt.target == aten.transpose.int:
        a, b = (d % rank for d in kt.args[1:3])
        if {a, b} == {rank - 2, rank - 1}:
            return Operand(kt.args[0], dims=dims)
    if kt.target == aten.t.default and rank == 2:
        return Operand(kt.args[0], dims=dims)
    if kt.target == aten.permute.default:
        perm = [d % rank for d in kt.args[1]]
        perm[-2], perm[-1] = perm[-1], perm[-2]
        identity = perm == list(range(rank))
        return Operand(kt.args[0], perm=None if identity else tuple(perm), dims=dims)
    return Operand(kt, swap_last=True, dims=dims)


def _einsum(equation: str) -> tuple[str, str, str]:
    try:
        return einsum_operands(equation)
    except ValueError as why:
        raise Skip(str(why)) from None


def _scores(found: Found) -> None:
    """q and k from the q·kᵀ product."""
    node = found.producer
    if node.target == aten.einsum.default:
        a, b, out = _einsum(node.args[0])
        contracted = [c for c in a if c in b and c not in out]
        rows, cols = [c for c in a if c not in b], [c for c in b if c not in a]
        if len(contracted) != 1 or len(rows) != 1 or len(cols) != 1 or out[-2:] != rows[0] + cols[0]:
            raise Skip(f"einsum {node.args[0]!r} is not (batch…, query, key) scores")
        batch = list(out[:-2])
        if sorted(batch + rows + contracted) != sorted(a) or sorted(batch + cols + contracted) != sorted(b):
            raise Skip(f"einsum {node.args[0]!r} broadcasts a batch dim")
        qa, ka = node.args[1]
        q_order, k_order = batch + rows + contracted, batch + cols + contracted
        found.q = Operand(qa, perm=permutation(a, q_order), dims=tuple(shape(qa)[a.index(c)] for c in q_order))
        found.k = Operand(ka, perm=permutation(b, k_order), dims=tuple(shape(ka)[b.index(c)] for c in k_order))
        found.ops.insert(0, "einsum")
        return
    if node.target == aten.baddbmm.default:
        bias, qa, kt = node.args[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        found.scale *= alpha
        if beta != 0:
            found.terms.append(Term("add", bias, coef=float(beta), lead=tuple(shape(node)[:-2])))
    else:
        qa, kt = node.args[:2]
    found.q = Operand(qa, dims=shape(qa))
    found.k = _key_from_transposed(kt)
    found.ops.insert(0, op_name(node))


def _probs(found: Found, facts: Program) -> None:
    """Follow the softmax to its product with v."""
    node = found.softmax
    while True:
        users = real_users(node)
        if len(users) != 1:
            raise Skip("the attention weights are also used elsewhere: "
                       + ", ".join(sorted(op_name(u) for u in users if u is not node)))
        user = users[0]
        if user.target in CASTS or user.target in IDENTITIES:
            found.probs.append(user)
        elif user.target in VIEWS and user.args[0] is node:
            _layout_step(user, node, "between softmax and the product with v")
            found.probs.append(user)
            found.layout_steps += 1
            found.ops.append(op_name(user))
        elif user.target == aten.dropout.default:
            p, train = user.args[1], user.args[2]
            if train and p > 0:
                raise Skip(f"dropout(p={p}) on the attention weights is active (training mode)")
            found.probs.append(user)
            found.ops.append("dropout (off)")
        elif user.target in (aten.matmul.default, aten.bmm.default) and user.args[0] is node \
                and user.args[1] is not node:
            found.out = user
            found.v = Operand(user.args[1], dims=shape(user.args[1]))
            found.ops.append(op_name(user))
            return
        elif user.target == aten.einsum.default and len(user.args[1]) == 2 and user.args[1][0] is node:
            p, v, out = _einsum(user.args[0])
            batch, rows, cols = list(p[:-2]), p[-2], p[-1]
            extra = [c for c in v if c not in batch and c != cols]
            if cols in out or cols not in v or len(extra) != 1 or sorted(v) != sorted(batch + [cols] + extra) \
                    or sorted(out) != sorted(batch + [rows] + extra):
                raise Skip(f"einsum {user.args[0]!r} is not (batch…, query, key)·(batch…, key, e)")
            va = user.args[1][1]
            order = batch + [cols] + extra
            found.out = user
            found.v = Operand(va, perm=permutation(v, order), dims=tuple(shape(va)[v.index(c)] for c in order))
            found.out_perm = permutation(batch + [rows] + extra, list(out))
            found.ops.append("einsum")
            return
        else:
            raise Skip(f"the attention weights go to {op_name(user)}, not to a product with v")
        node = user


# --------------------------------------------------------------------------- check


def _layout(found: Found) -> None:
    """Seen-through layout steps: SDPA runs in the layout with the most leading dims. q, k and v with one
    leading dim (batch·heads) are unflattened to it, and the output flattened back after SDPA."""
    leads = [tuple(o.dims[:-2]) for o in (found.q, found.k, found.v)] + [found.lead]
    leads += [t.lead for t in found.terms]
    target = max(leads, key=len)
    if len(target) < 2:
        return
    sizes = [static_int(d) for d in target[1:]]
    rest = [d for d in sizes if d is not None]
    if len(rest) != len(sizes):
        raise Skip(f"the heads dim {list(target)[1:]} is not a fixed size: cannot unflatten batch·heads")
    for operand in (found.q, found.k, found.v):
        lead = tuple(operand.dims[:-2])
        if text(lead) == text(target):
            continue
        if len(lead) != 1 or operand.perm is not None:
            raise Skip(f"an operand laid out {list(lead)} does not flatten the leading dims {list(target)}")
        operand.unflatten = [-1, *rest]
        operand.dims = (*target, *operand.dims[-2:])
    for term in found.terms:
        dims = shape(term.node) or ()
        if len(term.lead) < len(target) and len(dims) > 2 and not all(static_int(d) == 1 for d in dims[:-2]):
            if len(dims) != 3:
                raise Skip(f"a mask laid out {list(dims)} on scores flattened over batch·heads")
            term.unflatten = [-1, *rest]  # (batch·heads, q, k) -> (batch, heads, q, k)
    if len(shape(found.out) or ()) - 2 < len(target):
        found.out_flatten = len(target)


FOLDS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _heads_broadcast(node: Any) -> tuple[fx.Node, int] | None:
    """(x, heads) where ``node`` (batch·heads, q, k) is ``x`` (batch, 1, q, k) expanded over ``heads`` heads and
    folded into the batch (through a contiguous copy): one mask, copied once per head. Else None."""
    if not isinstance(node, fx.Node) or node.target not in FOLDS:
        return None
    source = node.args[0]
    while isinstance(source, fx.Node) and source.target in IDENTITIES:
        source = source.args[0]
    if not isinstance(source, fx.Node) or source.target != aten.expand.default:
        return None
    base = source.args[0]
    folded, expanded, original = shape(node), shape(source), shape(base)
    if folded is None or expanded is None or original is None or len(folded) != 3 or len(expanded) != 4 \
            or len(original) != 4:
        return None
    heads = static_int(expanded[1])
    if heads is None or heads < 2 or static_int(original[1]) != 1 or text(expanded[-2:]) != text(folded[-2:]) \
            or text((expanded[0] * heads,)) != text(folded[:1]) or text(original[:1]) != text(expanded[:1]):
        return None
    return base, heads


def _unfold_heads(found: Found) -> None:
    """3-D q, k, v (batch·heads, s, d) with a mask made per head (:func:`_heads_broadcast`): SDPA on (batch, heads),
    q, k and v unflattened (views), the mask before its expansion (broadcast over the heads), the output
    flattened back. Without it SDPA ran on (1, batch·heads) and the mask was built at (1, batch·heads, q, k)."""
    operands = (found.q, found.k, found.v)
    if any(len(o.dims) != 3 or o.perm is not None or o.unflatten is not None for o in operands):
        return
    broadcasts = [_heads_broadcast(t.node) for t in found.terms]
    heads = {b[1] for b in broadcasts if b is not None}
    if len(heads) != 1:
        return
    count = heads.pop()
    batch = shape(next(b[0] for b in broadcasts if b is not None))[0]
    for term, broadcast in zip(found.terms, broadcasts):
        dims = shape(term.node) or ()
        if broadcast is not None:
            term.node = broadcast[0]
        elif len(dims) == 3 and text(dims[:1]) == text(found.q.dims[:1]):
            term.unflatten = [-1, count]  # a mask of its own per head: (batch·heads, q, k) -> (batch, heads, q, k)
        elif len(dims) > 2 and not all(static_int(d) == 1 for d in dims[:-2]):
            raise Skip(f"a mask laid out {list(dims)} on scores with heads folded into the batch")
    for operand in operands:
        operand.unflatten = [-1, count]
        operand.dims = (batch, count, *operand.dims[-2:])
    found.out_flatten = 2
    found.ops.append(f"heads unfolded ({count}): mask broadcast")


def _check(found: Found, facts: Program, example: list[torch.Tensor]) -> None:
    if found.layout_steps:
        _layout(found)
    else:
        _unfold_heads(found)
    q, k, v = found.q.dims, found.k.dims, found.v.dims
    if not (len(q) == len(k) == len(v)) or not 2 <= len(q) <= 4:
        raise Skip(f"q, k, v of ranks {len(q)}, {len(k)}, {len(v)} (SDPA needs equal ranks of 2 to 4)")
    dtypes = {dtype(found.q.node), dtype(found.k.node), dtype(found.v.node)}
    if len(dtypes) != 1:
        raise Skip(f"q, k and v have different dtypes ({', '.join(sorted(map(str, dtypes)))})")
    for t in found.terms:
        if t.kind != "add" and dtype(t.node) is not torch.bool:
            raise Skip(f"a {dtype(t.node)} mask where a bool one is needed")
    # grouped-query: un-repeat k and v (enable_gqa) when both are repeats of fewer heads
    if len(q) == 4 and not found.k.swap_last and found.k.perm is None and found.v.perm is None \
            and found.k.unflatten is None and found.v.unflatten is None:
        rk, rv = unrepeated_heads(found.k.node), unrepeated_heads(found.v.node)
        if rk and rv and rk[1] == rv[1] and rk[2] == rv[2]:
            found.grouped_query = True
            found.kv_heads = static_int(shape(rk[0])[1])
            if rk[2]:  # repeat_interleave order is what enable_gqa means
                found.k = Operand(rk[0], dims=shape(rk[0]))
                found.v = Operand(rv[0], dims=shape(rv[0]))
                found.gqa = True
                found.ops.insert(1, f"kv heads ×{rk[1]}")
            else:
                found.ops.insert(1, f"kv heads tiled ×{rk[1]} (passed repeated)")
    q, k, v = found.q.dims, found.k.dims, found.v.dims
    batch_q, batch_k, batch_v = text(q[:-2]), text(k[:-2]), text(v[:-2])
    if not (batch_q == batch_k == batch_v):
        heads_only = len(q) == 4 and batch_k == batch_v and text(q[:1]) == batch_k[:1] and static_int(k[1]) == 1
        if found.gqa or heads_only:
            found.gqa = True
            found.grouped_query = True
            found.kv_heads = static_int(k[1])
        else:
            raise Skip("q, k and v broadcast their batch dims against each other")
    scores = shape(found.softmax)
    for t in found.terms:
        if t.kind != "add" or (t.coef > 0 and not t.coef_tensors):
            t.causal = facts.is_causal(t.node, t.kind, scores[-2], scores[-1], example)
    if found.terms and all(t.causal for t in found.terms):
        found.is_causal = True


def softmax_nodes(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "call_function" and n.target in SOFTMAXES]


def match(softmax: fx.Node, facts: Program, example: list[torch.Tensor]) -> tuple[Found | None, str | None]:
    """Read the attention that ends in ``softmax``: ``(None, None)`` when it is not attention (no product of
    two activations before it), ``(found, None)`` when it can be rewritten, ``(found or None, reason)`` when
    it is attention that cannot be rewritten safely."""
    path = _path_to_scores(softmax.args[0], facts)
    if path is None:
        return None, None
    found = Found(softmax, path[0], path[1:], [], None, None, None, None)
    try:
        _scores(found)
        rank, dim = len(shape(softmax) or ()), softmax.args[1]
        if dim % max(rank, 1) != rank - 1:
            raise Skip(f"softmax over dim {dim}, not the key dim (-1)")
        _logits(found, facts)
        upcast = softmax.target == aten.softmax.int and len(softmax.args) > 2 and softmax.args[2] is not None
        found.ops.append("softmax" + (f"({str(softmax.args[2]).replace('torch.', '')})" if upcast else ""))
        _probs(found, facts)
        _check(found, facts, example)
    except Skip as why:
        return (found if found.q is not None else None), str(why)
    return found, None
