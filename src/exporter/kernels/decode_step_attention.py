"""A decode step's rotary embedding, cache write and attention as one kernel: what a layer of the decode program of
batch 1 launches between its q/k/v product and its o product.

With ``exporter::decode_attention`` alone, each layer still launched an Inductor kernel before it: q and this
step's key rotated (``q * cos + rotate_half(q) * sin``), the key and value written into the cache at the step's
position (``index_copy_``). :func:`fold` rewrites the decode program so that each attention node whose key and
value caches were written just before it becomes one ``exporter::decode_step_attention`` node, which takes the
unrotated q, key and value, rotates them, writes the key and value into the cache and attends: the cache write
and the rotation need no kernel of their own (``decode_attention._slice_kernel``'s ``APPEND``/``ROPE``: the
step's slot is scored from registers by the first slice's program, which also writes it; no program reads it from
memory, so none reads a slot another writes). Where the cache is read in several slices, the last slice of each
head to finish merges them (``LAST_MERGES``: counted in one int32 buffer the program zeroes once a step), so the
merge needs no kernel either: a layer is then its products and this one kernel.

The rewrite acts on the program as ``torch.export`` traced it, before its decomposition, where the cache write is
still ``index_copy_`` on the cache input (``generation.cache``'s slots); the decomposition then makes the op's
writes functional (``auto_functionalized``), and AOTInductor writes them in place again. It matches:

- an attention node (``exporter::decode_attention``; ``sdpa=True`` also SDPA's, the tests on the CPU) whose key
  and value are ``index_copy_(cache, 2, position, new)`` of two cache inputs at one position, read by nothing else;
- optionally, q and the new key each ``add(mul(x, cos), mul(cat([neg(x[..., D/2:]), x[..., :D/2]], -1), sin))``
  with the same ``cos``/``sin`` of ``D`` values (transformers' ``apply_rotary_pos_emb``); a rotation of another form
  (interleaved pairs, a partial rotary dimension) is left to Inductor and the rotated tensors are passed as they are.

Arithmetic: the rotation in float32 rounded once to the activation's dtype (as Inductor's fused kernel does), the
attention as ``exporter::decode_attention``'s. :func:`reference` is the same step in float64, the twin the tests
judge the kernel against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import Node

from . import decode_attention as da
from .decode_products import is_call, prune, tensor_value

aten = torch.ops.aten


def rotate(x: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the last dimension (``x`` itself without ``cos``)."""
    if cos is None or sin is None:
        return x
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cos: torch.Tensor | None,
              sin: torch.Tensor | None, position: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              bias: torch.Tensor | None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The step in float64, nothing rounded: ``(out, k_cache', v_cache')`` with the rotated key and the value
    written at ``position`` into float64 copies of the caches."""
    c64, s64 = (None, None) if cos is None or sin is None else (cos.double().reshape(-1), sin.double().reshape(-1))
    q64, k64 = rotate(q.double(), c64, s64), rotate(k_new.double(), c64, s64)
    keys, values = k_cache.double().clone(), v_cache.double().clone()
    keys.index_copy_(2, position, k64)
    values.index_copy_(2, position, v_new.double())
    return da.reference(q64, keys, values, None if bias is None else bias.double(), scale), keys, values


if da.AVAILABLE:
    from torch.library import triton_op, wrap_triton

    @triton_op("exporter::decode_step_attention", mutates_args={"k_cache", "v_cache", "count"})
    def decode_step_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                              cos: Optional[torch.Tensor], sin: Optional[torch.Tensor],  # noqa: UP045
                              position: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              bias: Optional[torch.Tensor], scale: float,  # noqa: UP045
                              count: torch.Tensor, offset: int) -> torch.Tensor:
        """``q [1, H, 1, D]`` rotated, this step's key ``[1, Hkv, 1, D]`` rotated and value ``[1, Hkv, 1, Dv]``
        written into ``k_cache``/``v_cache`` ``[1, Hkv, C, D]`` at ``position [1]``, then ``softmax(q kᵀ · scale
        + bias) v`` over the caches; ``cos``/``sin`` ``D`` values each, or None (no rotation). ``count``: int32
        zeros, ``Hkv`` of them from ``offset`` this call's, the last slice of each head counted there merging the
        slices; empty: a merge kernel of its own."""
        out = torch.empty((1, q.shape[1], 1, v_cache.shape[3]), dtype=q.dtype, device=q.device)
        kv_heads, slots = k_cache.shape[1], k_cache.shape[2]
        block_c, splits, warps = da.config(slots, q.shape[3])
        row = None if bias is None else bias.reshape(slots).contiguous()
        turn = (None, None) if cos is None or sin is None else (cos.reshape(-1).contiguous(),
                                                                sin.reshape(-1).contiguous())
        append = (k_new.reshape(kv_heads, -1).contiguous(), v_new.reshape(kv_heads, -1).contiguous(), *turn,
                  position.reshape(1).contiguous())
        da.launch(q.contiguous(), k_cache, v_cache, row, out, scale, block_c, splits, warps, wrap=wrap_triton,
                  append=append, count=count[offset:offset + kv_heads] if count.numel() else None)
        return out


# --------------------------------------------------------------------------- the rewrite of the decode program


@dataclass
class Folded:
    """What :func:`fold` did: attention nodes that took their cache writes, and how many their rotation too."""

    attentions: int = 0
    rotations: int = 0
    kept: list[str] = field(default_factory=list)  # attention nodes left as they were, and why

    def note(self) -> str:
        kept = f"; {len(self.kept)} left as they were ({self.kept[0]})" if self.kept else ""
        return (f"{self.attentions} attention call(s) as exporter::decode_step_attention, the cache write folded in "
                f"({self.rotations} with the rotary embedding of q and the key){kept}")


def _same_dtype_cast(node: Any) -> Any:
    """``node`` past casts that do not change the dtype (``key_states.to(keys.dtype)``)."""
    while (is_call(node, aten._to_copy.default, aten.to.dtype) and tensor_value(node) is not None and
           tensor_value(node.args[0]) is not None and tensor_value(node).dtype == tensor_value(node.args[0]).dtype):
        node = node.args[0]
    return node


def _readers(node: Node) -> list[Node]:
    return [u for u in node.users if u.target is not aten._assert_tensor_metadata.default]


def _write(node: Any) -> Any:
    """``(cache, position, new)`` where ``node`` is ``index_copy_(cache, 2, position, new)`` of a program input at
    one position, the cache read by nothing else."""
    if not is_call(node, aten.index_copy_.default) or node.args[1] != 2:
        return None
    cache, position, new = node.args[0], node.args[2], _same_dtype_cast(node.args[3])
    if not isinstance(cache, Node) or cache.op != "placeholder" or _readers(cache) != [node]:
        return None
    new_val, cache_val, pos_val = tensor_value(new), tensor_value(cache), tensor_value(position)
    if new_val is None or cache_val is None or pos_val is None or pos_val.numel() != 1 or \
            tuple(new_val.shape) != (1, cache_val.shape[1], 1, cache_val.shape[3]) or new_val.dtype != cache_val.dtype:
        return None
    return cache, position, new


def _rotation(node: Any) -> Any:
    """``(x, cos, sin)`` where ``node`` is transformers' ``x * cos + rotate_half(x) * sin`` over the last dimension."""
    if not is_call(node, aten.add.Tensor) or len(node.args) != 2:
        return None
    for straight, turned in (node.args, node.args[::-1]):
        if not (is_call(straight, aten.mul.Tensor) and is_call(turned, aten.mul.Tensor)):
            continue
        for x, cos in (straight.args, straight.args[::-1]):
            for cat, sin in (turned.args, turned.args[::-1]):
                if not is_call(cat, aten.cat.default) or len(cat.args[0]) != 2 or cat.args[1:] not in ((-1,), (3,)):
                    continue
                neg, first = cat.args[0]
                if not is_call(neg, aten.neg.default) or not is_call(first, aten.slice.Tensor):
                    continue
                second = neg.args[0]
                if not is_call(second, aten.slice.Tensor) or second.args[0] is not x or first.args[0] is not x:
                    continue
                x_val, c_val, s_val = tensor_value(x), tensor_value(cos), tensor_value(sin)
                if x_val is None or c_val is None or s_val is None:
                    continue
                dim, half = x_val.shape[-1], x_val.shape[-1] // 2
                if dim % 2 or tuple(first.args[1:4]) not in ((3, 0, half), (-1, 0, half)) or \
                        first.args[4:] not in ((), (1,)) or second.args[1] not in (3, -1) or \
                        second.args[2] != half or second.args[3] < dim or second.args[4:] not in ((), (1,)):
                    continue
                if c_val.numel() != dim or s_val.numel() != dim or c_val.shape[-1] != dim or \
                        c_val.dtype != x_val.dtype or s_val.dtype != x_val.dtype:
                    continue
                return x, cos, sin
    return None


def _attention(node: Node, sdpa: bool) -> Any:
    """``(q, k, v, mask, scale)`` of an attention node this rewrite can take."""
    if is_call(node, torch.ops.exporter.decode_attention.default):
        q, k, v, mask, scale = node.args
        return q, k, v, mask, scale
    if not (sdpa and is_call(node, aten.scaled_dot_product_attention.default)):
        return None
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    call = {**dict(zip(names, node.args)), **node.kwargs}
    q, k, v, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
    q_val, k_val, v_val = tensor_value(q), tensor_value(k), tensor_value(v)
    if q_val is None or k_val is None or v_val is None or not da.eligible(
            q_val, k_val, v_val, tensor_value(mask), float(call.get("dropout_p", 0.0) or 0.0),  # type: ignore[arg-type]
            bool(call.get("is_causal", False)),
            bool(call.get("enable_gqa", False)), ("cpu", "cuda")):
        return None
    scale = call.get("scale")
    return q, k, v, mask, scale if scale is not None else 1 / math.sqrt(q_val.shape[-1])


def fold(program: torch.export.ExportedProgram, sdpa: bool = False, merge_in_kernel: bool = True) -> Folded:
    """Rewrite ``program`` (as ``torch.export`` traced it, not yet decomposed) in place; see the module's docstring.
    ``merge_in_kernel``: each attention's slices merged by its last program (one int32 count per key/value head of
    every layer, zeroed once a step), not by a kernel of their own."""
    assert da.AVAILABLE, "exporter::decode_step_attention needs Triton"
    graph = program.graph_module.graph
    done = Folded()
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):  # the counts, sized once every attention is known (empty: merge kernels)
        count = graph.call_function(aten.zeros.default, ([0],), {"dtype": torch.int32})
    heads = 0  # the counts' offset: key/value heads of the attentions folded so far
    for node in list(graph.nodes):
        found = _attention(node, sdpa)
        if found is None:
            continue
        q, k, v, mask, scale = found
        key, value = _write(k), _write(v)
        if key is None or value is None or key[1] is not value[1] or _readers(k) != [node] or \
                _readers(v) != [node] or tensor_value(q).shape[2] != 1:
            done.kept.append(f"{node.name}: its key and value are not this step's cache writes")
            continue
        (k_cache, position, k_new), (v_cache, _, v_new) = key, value
        turned_q, turned_k = _rotation(q), _rotation(k_new)
        cos = sin = None
        if turned_q is not None and turned_k is not None and turned_q[1:] == turned_k[1:]:
            (q, cos, sin), k_new = turned_q, turned_k[0]
            done.rotations += 1
        with graph.inserting_before(node):
            step = graph.call_function(torch.ops.exporter.decode_step_attention.default,
                                       (q, k_new, v_new, cos, sin, position, k_cache, v_cache, mask, scale, count,
                                        heads))
        heads += tensor_value(k_cache).shape[1]
        step.meta = dict(node.meta)
        node.replace_all_uses_with(step)
        graph.erase_node(node)
        for write in (k, v):
            for user in list(write.users):
                graph.erase_node(user)  # metadata asserts
            graph.erase_node(write)
        done.attentions += 1
        count.args, count.kwargs = ([heads if merge_in_kernel else 0],), {"dtype": torch.int32,
                                                                          "device": tensor_value(k_cache).device}
    prune(graph)  # the counts too, where nothing was folded
    graph.lint()
    program.graph_module.recompile()
    return done


__all__ = ["Folded", "fold", "reference", "rotate"]
