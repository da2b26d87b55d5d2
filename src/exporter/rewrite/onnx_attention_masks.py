"""Spell out SDPA masks over the query length in an exported program, so onnxruntime can run them.

onnxruntime 1.32's CPU ``Attention`` kernel rejects a mask that broadcasts over the
query length ("inconsistent q_sequence_length (between attn_mask and Q)"), though the
ONNX spec allows it. PyTorch's own SDPA callers make such masks: ``nn.MultiheadAttention``
turns a ``key_padding_mask`` into ``(batch, 1, 1, key)``, so ``nn.TransformerEncoderLayer``
models with padding fail in onnxruntime. This pass inserts an ``expand`` to
``(…, query, key)`` before each such SDPA node (a view: the result is the same).

It is not one of the rewrite RULES: the onnx target applies it to the program it converts
(the SDPA nodes written by ``softmax_attention_graph`` already carry full masks).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_facts import text, val

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


def _size(graph: fx.Graph, tensor: fx.Node, dim: int):
    size = val(tensor).shape[dim]
    if isinstance(size, int):
        return size
    node = graph.call_function(aten.sym_size.int, (tensor, dim))
    node.meta["val"] = size
    return node


def expand_attention_masks(program) -> int:
    """Expand each SDPA ``attn_mask`` that broadcasts over (query, key) in ``program``; returns how many."""
    graph = program.graph_module.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target != SDPA:
            continue
        in_args = len(node.args) > 3
        mask = node.args[3] if in_args else node.kwargs.get("attn_mask")
        q, k = node.args[0], node.args[1]
        if not isinstance(mask, fx.Node) or not all(isinstance(val(n), torch.Tensor) for n in (mask, q, k)):
            continue
        mask_val, q_val, k_val = val(mask), val(q), val(k)
        rows, cols = q_val.shape[-2], k_val.shape[-2]
        if mask_val.dim() >= 2 and text(mask_val.shape[-2:]) == text((rows, cols)):
            continue
        with graph.inserting_before(node):
            current, current_val = mask, mask_val
            while current_val.dim() < 2:
                current = graph.call_function(aten.unsqueeze.default, (current, 0))
                current_val = current_val.unsqueeze(0)
                current.meta["val"] = current_val
            sizes = [-1] * (current_val.dim() - 2) + [_size(graph, q, q_val.dim() - 2),
                                                      _size(graph, k, k_val.dim() - 2)]
            expanded = graph.call_function(aten.expand.default, (current, sizes))
            expanded.meta["val"] = current_val.expand(*current_val.shape[:-2], rows, cols)
        if in_args:
            node.args = node.args[:3] + (expanded,) + node.args[4:]
        else:
            node.kwargs = {**node.kwargs, "attn_mask": expanded}
        count += 1
    if count:
        graph.lint()
        program.graph_module.recompile()
    return count
