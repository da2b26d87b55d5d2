"""A rewrite of the decode program of batch 1: each matrix product of one row, with the RMSNorm before it, the gated
activation after a fused gate/up product and the residual add after it, becomes one ``exporter::gemv`` node.

:func:`fuse` walks the program's core-ATen graph (``torch.export`` then ``run_decompositions``) and matches, around
every ``mm``/``addmm`` of one row by a weight that is a program parameter (``view(h, [1, K]) @ permute(W, [1, 0])``,
then ``view`` back):

- before it, transformers' RMSNorm (``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``…) as the graph spells
  it: ``weight * to(x32 * rsqrt(mean(x32 ** 2, -1, keepdim) + eps))`` with ``x32 = to(x, float32)`` (a slice that
  keeps the one row, as before the head, is allowed between);
- after it, ``split`` of a fused gate/up product into two halves, ``silu(gate) * up`` (decomposed or not);
- after it (or after the activation), an ``add`` with a tensor of its shape: the residual.

An fp8 weight-only product of one row (``exporter::fp8_gemv``, which ``quantize.fp8_gemv.one_row_kernel`` puts in the
decode program of batch 1) is matched the same way, its weight and row scales program buffers: the ``exporter::gemv``
node reads the fp8 weight with its scales (``scales``), so an fp8 layer takes the same five kernels as a bf16 one.

What matches is replaced by one node; what does not (a norm of another form, Gemma's ``1 + weight``, a LayerNorm,
GPT-2's transposed ``Conv1D``, a rowwise fp8 product, a product of several rows) is left as it was, so the rewrite never
changes what a program computes beyond the order of float32 sums (:mod:`.gemv`). The model is not edited: the
program is. The nodes the match leaves unused, and the metadata asserts on them, are removed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten


@dataclass
class Fused:
    """What :func:`fuse` did: products made ``exporter::gemv`` nodes, and how many took each surrounding step."""

    products: int = 0
    fp8: int = 0  # of them, fp8 weight-only products (exporter::fp8_gemv before)
    norms: int = 0
    activations: int = 0
    residuals: int = 0
    kept: list[str] = field(default_factory=list)  # products of one row left as they were, and why

    def note(self) -> str:
        kept = f"; {len(self.kept)} left as Inductor writes them ({self.kept[0]}…)" if self.kept else ""
        fp8 = f", {self.fp8} of them fp8" if self.fp8 else ""
        return (f"{self.products} products of one row as exporter::gemv{fp8} ({self.norms} with their RMSNorm, "
                f"{self.activations} with silu(gate) * up, {self.residuals} with the residual add){kept}")


def is_call(node: Any, *targets: Any) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def tensor_value(node: Any) -> Any:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _param(node: Any, dims: int) -> bool:
    value = tensor_value(node)
    return isinstance(node, Node) and node.op == "placeholder" and value is not None and value.dim() == dims


def _skip_casts(node: Any, dtype: torch.dtype | None = None) -> Any:
    """``node`` past any ``_to_copy`` that changes only the dtype (to ``dtype`` where given)."""
    while is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype"}:
        if dtype is not None and node.kwargs.get("dtype") != dtype:
            break
        node = node.args[0]
    return node


def _same_shape_slice(node: Any) -> Any:
    while is_call(node, aten.slice.Tensor) and tensor_value(node) is not None and \
            tensor_value(node.args[0]) is not None and \
            tuple(tensor_value(node).shape) == tuple(tensor_value(node.args[0]).shape):
        node = node.args[0]
    return node


def _rmsnorm(h: Any) -> Any:
    """``(x, weight, eps)`` where ``h`` is transformers' RMSNorm of ``x``."""
    h = _same_shape_slice(h)
    if not is_call(h, aten.mul.Tensor) or len(h.args) != 2:
        return None
    a, b = h.args
    weight, normed = (a, b) if _param(a, 1) else (b, a) if _param(b, 1) else (None, None)
    if weight is None:
        return None
    scaled = _skip_casts(normed)
    if not is_call(scaled, aten.mul.Tensor) or len(scaled.args) != 2:
        return None
    for x32, inv in (scaled.args, scaled.args[::-1]):
        if not is_call(inv, aten.rsqrt.default) or not is_call(inv.args[0], aten.add.Tensor):
            continue
        mean, eps = inv.args[0].args[:2]
        if not isinstance(eps, float) or not is_call(mean, aten.mean.dim) or list(mean.args[1]) != [-1] or \
                not (len(mean.args) > 2 and mean.args[2] or mean.kwargs.get("keepdim")):
            continue
        square = mean.args[0]
        if not is_call(square, aten.pow.Tensor_Scalar) or square.args[1] != 2 or square.args[0] is not x32:
            continue
        x = _skip_casts(x32)
        x_val, x32_val = tensor_value(x), tensor_value(x32)
        if x_val is None or x32_val is None or x32_val.dtype != torch.float32:
            return None
        return x, weight, eps
    return None


def _product(node: Any) -> Any:
    """``(h, weight, bias, out)`` where ``node`` is ``mm``/``addmm`` of one row of ``h`` by a parameter's transpose
    and ``out`` the ``view`` of its result back to ``h``'s leading dimensions."""
    if is_call(node, aten.mm.default):
        rows, transposed, bias = node.args[0], node.args[1], None
    elif is_call(node, aten.addmm.default) and not node.kwargs:
        bias, rows, transposed = node.args[:3]
        if not _param(bias, 1):
            return None
    else:
        return None
    if not is_call(transposed, aten.permute.default) or list(transposed.args[1]) != [1, 0] or \
            not _param(transposed.args[0], 2) or not is_call(rows, aten.view.default):
        return None
    weight, h = transposed.args[0], rows.args[0]
    h_val, w_val, out_val = tensor_value(h), tensor_value(weight), tensor_value(node)
    if h_val is None or w_val is None or out_val is None or h_val.numel() != w_val.shape[1] or \
            h_val.dtype != w_val.dtype or h_val.dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
            out_val.shape[0] != 1 or len(node.users) != 1:
        return None
    (out,) = node.users
    if not is_call(out, aten.view.default) or tuple(tensor_value(out).shape) != (*h_val.shape[:-1], w_val.shape[0]):
        return None
    return h, weight, bias, out


def _fp8_product(node: Any) -> Any:
    """``(h, qweight, bias, node, scales)`` where ``node`` is ``exporter::fp8_gemv`` of one row of ``h`` by an fp8
    buffer with its row scales."""
    h, qweight, scales = node.args[:3]
    bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
    h_val, w_val, s_val, out_val = (tensor_value(n) for n in (h, qweight, scales, node))
    if not _param(qweight, 2) or not isinstance(scales, Node) or scales.op != "placeholder" or \
            (bias is not None and not _param(bias, 1)) or None in (h_val, w_val, s_val, out_val) or \
            w_val.dtype != torch.float8_e4m3fn or s_val.dtype != torch.float32 or \
            s_val.numel() != w_val.shape[0] or h_val.numel() != w_val.shape[1] or \
            h_val.dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
            tuple(out_val.shape) != (*h_val.shape[:-1], w_val.shape[0]):
        return None
    return h, qweight, bias, node, scales


def _glu(out: Any) -> Any:
    """The node ``silu(gate) * up`` where ``out`` is split into two halves, gate first."""
    if len(out.users) != 1:
        return None
    (split,) = out.users
    if not is_call(split, aten.split_with_sizes.default) or len(set(split.args[1])) != 1 or len(split.args[1]) != 2 \
            or split.args[2] not in (-1, tensor_value(out).dim() - 1):
        return None
    halves = {user.args[1]: user for user in split.users if is_call(user, operator.getitem)}
    if set(halves) != {0, 1} or len(split.users) != 2:
        return None
    gate, up = halves[0], halves[1]
    first: Any = next(iter(gate.users)) if len(gate.users) == 1 else None
    if is_call(first, aten.silu.default):
        activation = first
    else:  # silu decomposed: x * sigmoid(x), in float32 for a half dtype
        wide: Any = first if is_call(first, aten._to_copy.default) else gate
        sigmoid = next((u for u in wide.users if is_call(u, aten.sigmoid.default)), None)
        if len(wide.users) != 2 or sigmoid is None or len(sigmoid.users) != 1:
            return None
        (activation,) = sigmoid.users
        if not is_call(activation, aten.mul.Tensor) or set(activation.args) != {wide, sigmoid} or \
                activation not in wide.users:
            return None
    if len(activation.users) != 1:
        return None
    (narrowed,) = activation.users
    if not is_call(narrowed, aten._to_copy.default):
        narrowed = activation
    elif len(narrowed.users) != 1:
        return None
    (after,) = narrowed.users
    if not is_call(after, aten.mul.Tensor) or set(after.args) != {narrowed, up} or len(up.users) != 1:
        return None
    return after


def _residual(out: Any) -> Any:
    """``(add, residual)`` where ``out``'s one use is ``residual + out`` of one shape and dtype."""
    if len(out.users) != 1:
        return None
    (add,) = out.users
    if not is_call(add, aten.add.Tensor) or len(add.args) != 2 or add.kwargs:
        return None
    other = add.args[1] if add.args[0] is out else add.args[0]
    value, mine = tensor_value(other), tensor_value(out)
    if value is None or mine is None or value.shape != mine.shape or value.dtype != mine.dtype:
        return None
    return add, other


def prune(graph: Graph) -> None:
    """Remove nodes nothing reads, and the metadata asserts that alone read them."""
    while True:
        removed = False
        for node in reversed(list(graph.nodes)):
            if node.op != "call_function":
                continue
            if node.target is aten._assert_tensor_metadata.default:
                subject = node.args[0]
                if isinstance(subject, Node) and all(u.target is aten._assert_tensor_metadata.default
                                                     for u in subject.users):
                    graph.erase_node(node)
                    removed = True
            elif not node.users and not node.is_impure():
                graph.erase_node(node)
                removed = True
        if not removed:
            return


def fuse(program: torch.export.ExportedProgram) -> Fused:
    """Rewrite ``program`` in place (see the module's docstring); what it did."""
    from . import gemv  # noqa: PLC0415 - registers exporter::gemv (Triton: CUDA builds, or the interpreter)

    assert gemv.AVAILABLE, "exporter::gemv needs Triton"
    graph = program.graph_module.graph
    done = Fused()
    fp8 = getattr(getattr(torch.ops, "exporter", None), "fp8_gemv", None)
    fp8_targets = (fp8.default,) if fp8 is not None and hasattr(fp8, "default") else ()
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default, *fp8_targets):
            continue
        scales = None
        if node.target in fp8_targets:
            found = _fp8_product(node)
            if found is not None:
                *found, scales = found
        else:
            if tensor_value(node) is not None and tensor_value(node).shape[0] != 1:
                continue
            found = _product(node)
        if found is None:
            done.kept.append(node.name)
            continue
        h, weight, bias, last = found
        norm = _rmsnorm(h)
        if norm is not None and tensor_value(norm[0]).dtype != tensor_value(h).dtype:
            norm = None  # the kernel's output takes the dtype of what it reads
        x, norm_weight, eps = norm if norm is not None else (h, None, 1e-6)
        glu = _glu(last)
        if glu is not None:
            if tensor_value(weight).shape[0] % 2:
                glu = None
            else:
                last = glu
        residual = _residual(last)
        residual_node = None
        if residual is not None:
            last, residual_node = residual
        rows = tensor_value(weight).shape[0] // (2 if glu is not None else 1)
        if tuple(tensor_value(last).shape) != (*tensor_value(x).shape[:-1], rows):
            done.kept.append(node.name)
            continue
        with graph.inserting_before(last):
            fused = graph.call_function(torch.ops.exporter.gemv.default,
                                        (x, weight, norm_weight, eps, glu is not None, residual_node, bias, scales))
        fused.meta = dict(last.meta)
        last.replace_all_uses_with(fused)
        done.products += 1
        done.fp8 += scales is not None
        done.norms += norm is not None
        done.activations += glu is not None
        done.residuals += residual_node is not None
    prune(graph)
    graph.lint()
    program.graph_module.recompile()
    return done
