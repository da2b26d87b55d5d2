"""Facts about nodes of a captured graph, for the graph rules: shapes, constants, weights, causal masks.

Everything here reads the graph (``node.meta["val"]``, the exported program's
state and constants); nothing changes it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind

aten = torch.ops.aten
FULL_SLICE_END = 2**62  # slice(x, d, 0, end >= this) takes the whole dim
NEGATIVE_ENOUGH = -1e4  # a mask value at or below this is treated as -inf (exp() of it underflows to 0)

# Ops that only move or relabel data: a chain of them from a weight is still a weight.
VIEWS = {aten.transpose.int, aten.permute.default, aten.t.default, aten.mT.default, aten.view.default,
         aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.slice.Tensor,
         aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
         aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default}
# Ops whose tensor arguments only lend dtype, device or shape to the result (not their values).
METADATA_ONLY = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
                 aten.ones_like.default, aten.zeros_like.default, aten.full_like.default, aten.empty_like.default}


def val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: Any) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def text(dims) -> tuple[str, ...]:
    """Sizes as strings: equal strings mean the same symbolic size."""
    return tuple(str(d) for d in dims)


def numel_text(node: Any) -> str | None:
    s = shape(node)
    return None if s is None else str(math.prod(s) if s else 1)


def static_int(size) -> int | None:
    return size if isinstance(size, int) else None


def is_one_element(node: Any) -> bool:
    s = shape(node)
    return s is not None and all(static_int(d) == 1 for d in s)


class Program:
    """The exported program's placeholders, by kind, and the values of its state and constants."""

    def __init__(self, ep):
        self.ep = ep
        self.kinds: dict[str, Any] = {}
        self.targets: dict[str, str] = {}
        for spec in ep.graph_signature.input_specs:
            name = getattr(spec.arg, "name", None)
            if name is not None:
                self.kinds[name] = spec.kind
                self.targets[name] = spec.target
        self.weight_kinds = {InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR}
        self.user_input = InputKind.USER_INPUT
        self.range_constraints = ep.range_constraints

    def is_weight(self, node: Any) -> bool:
        """A parameter, buffer or constant, possibly viewed, transposed or cast."""
        while isinstance(node, fx.Node):
            if node.op == "placeholder":
                return self.kinds.get(node.name) in self.weight_kinds
            if node.op != "call_function" or node.target not in VIEWS:
                return False
            node = node.args[0]
        return False

    def is_user_input(self, node: fx.Node) -> bool:
        return node.op == "placeholder" and self.kinds.get(node.name) == self.user_input

    def tensor_value(self, node: fx.Node) -> torch.Tensor | None:
        """The value of a state or constant placeholder."""
        if node.op != "placeholder" or self.kinds.get(node.name) not in self.weight_kinds:
            return None
        target = self.targets[node.name]
        if target in self.ep.constants:
            return self.ep.constants[target]
        return self.ep.state_dict.get(target)

    def scalar_constant(self, node: Any) -> float | None:
        """The value of a Python number, a one-element constant tensor (``torch.tensor(-inf)``) or a tensor
        filled with one value (``full``, ``full_like``, ``new_full``)."""
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            return float(node)
        if not isinstance(node, fx.Node):
            return None
        while node.op == "call_function" and node.target in (aten.lift_fresh_copy.default, aten.detach_.default,
                                                              aten.detach.default, aten.clone.default,
                                                              aten._to_copy.default, aten.to.dtype):
            node = node.args[0]
        filled = {aten.full.default: 1, aten.scalar_tensor.default: 0, aten.full_like.default: 1,
                  aten.new_full.default: 2}  # tensors of one value, at any size: where the value is
        if node.op == "call_function" and node.target in filled:
            value = node.args[filled[node.target]]
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if not is_one_element(node):
            return None
        value = self.tensor_value(node)
        return float(value.reshape(-1)[0]) if value is not None and value.numel() == 1 else None

    # ------------------------------------------------------------------ causal masks

    def symbol_values(self, example: list[torch.Tensor]) -> dict:
        """Each size symbol of the user inputs -> its value in the example."""
        values = {}
        inputs = [n for n in self.ep.graph.nodes if self.is_user_input(n)]
        for node, tensor in zip(inputs, example):
            for size, concrete in zip(shape(node) or (), tensor.shape):
                if isinstance(size, torch.SymInt):
                    expr = size.node.expr
                    if len(expr.free_symbols) == 1 and expr == next(iter(expr.free_symbols)):
                        values[expr] = int(concrete)
        return values

    def _sizes_to_try(self, symbol, hint: int) -> list[int]:
        bound = self.range_constraints.get(symbol)
        low, high = _as_int(getattr(bound, "lower", None), 1), _as_int(getattr(bound, "upper", None), 10**9)
        wanted = {hint, 1, 2, 3, 5, hint - 1, hint + 3, 2 * hint}
        return sorted(n for n in wanted if low <= n <= high and n >= 1)

    def is_causal(self, mask: fx.Node, kind: str, rows, cols, example: list[torch.Tensor]) -> bool:
        """Whether ``mask`` is the lower-triangular causal mask.

        ``kind``: "keep" (bool, attend where True), "drop" (bool, masked where True) or "add"
        (float, added to the logits: 0 where attended, -inf or at most ``NEGATIVE_ENOUGH`` where not).
        True only when the mask depends on sizes and constants alone (never on input values) and,
        evaluated at several sizes of the query/key length, equals ``tril(ones(n, n))`` every time.
        """
        if text([rows]) != text([cols]):
            return False
        values = self.symbol_values(example)
        if isinstance(rows, int):
            sizes, symbol = [rows], None
        else:
            expr = rows.node.expr
            if len(expr.free_symbols) != 1 or expr != next(iter(expr.free_symbols)) or expr not in values:
                return False
            symbol = expr
            sizes = self._sizes_to_try(symbol, values[symbol])
        for n in sizes:
            assignment = dict(values)
            if symbol is not None:
                assignment[symbol] = n
            try:
                value = self.evaluate(mask, assignment)
            except Exception:  # _DataDependent, or anything the partial evaluation cannot run
                return False
            if not isinstance(value, torch.Tensor) or value.dim() < 2 or tuple(value.shape[-2:]) != (n, n):
                return False
            value = value.cpu()
            if kind == "add":
                if not value.is_floating_point():
                    return False
                attend, masked = value == 0, value <= NEGATIVE_ENOUGH
                if not bool((attend | masked).all()):
                    return False
                value = attend
            elif value.dtype != torch.bool:
                return False
            elif kind == "drop":
                value = ~value
            if not bool((value == torch.ones(n, n, dtype=torch.bool).tril()).all()):
                return False
        return True

    def evaluate(self, node: fx.Node, assignment: dict) -> Any:
        """Run the part of the graph that computes ``node`` with sizes from ``assignment``.

        Raises _DataDependent when the value depends on a user input's values (not just its sizes).
        """
        cache: dict[fx.Node, Any] = {}

        def size_value(v):
            expr = v.node.expr
            result = expr.subs(assignment)
            if result.free_symbols:
                raise _DataDependent(f"size {expr} has no value")
            return int(result) if isinstance(v, torch.SymInt) else float(result)

        def placeholder_like(n: fx.Node):
            v = val(n)
            dims = [size_value(d) if isinstance(d, torch.SymInt) else d for d in v.shape]
            return torch.zeros(dims, dtype=v.dtype, device=v.device)

        def go(n: Any, metadata_only: bool = False) -> Any:
            if isinstance(n, (list, tuple)):
                return type(n)(go(x, metadata_only) for x in n)
            if not isinstance(n, fx.Node):
                return n
            v = val(n)
            if isinstance(v, (torch.SymInt, torch.SymFloat)):
                return size_value(v)
            if n in cache:
                return cache[n]
            if n.op == "placeholder":
                value = self.tensor_value(n)
                if value is None:
                    if not metadata_only:
                        raise _DataDependent(f"depends on the values of input {n.name}")
                    value = placeholder_like(n)
            elif n.op == "call_function":
                meta = n.target in METADATA_ONLY
                args = [go(a, meta and i == 0) for i, a in enumerate(n.args)]
                kwargs = {k: go(a) for k, a in n.kwargs.items()}
                if metadata_only and n.target not in METADATA_ONLY and isinstance(v, torch.Tensor):
                    value = placeholder_like(n)
                else:
                    value = n.target(*args, **kwargs)
            else:
                raise _DataDependent(f"{n.op} node")
            cache[n] = value
            return value

        return go(node)


class _DataDependent(Exception):
    pass


def _as_int(bound, default: int) -> int:
    """A range bound as an int; ``default`` for an infinite or missing one."""
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return default


# --------------------------------------------------------------------------- einsum, repeated heads


def einsum_operands(equation: str) -> tuple[str, str, str]:
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise ValueError(f"einsum {equation!r} has an ellipsis or no explicit output")
    inputs, out = equation.split("->")
    parts = inputs.split(",")
    if len(parts) != 2 or any(len(set(p)) != len(p) for p in parts + [out]):
        raise ValueError(f"einsum {equation!r} is not a plain product of two tensors")
    return parts[0], parts[1], out


def permutation(source: str, order: list[str]) -> tuple[int, ...] | None:
    perm = tuple(source.index(c) for c in order)
    return None if perm == tuple(range(len(perm))) else perm


def unrepeated_heads(node: fx.Node) -> tuple[fx.Node, int, bool] | None:
    """(kv, repeats, interleaved) when ``node`` repeats the heads (dim 1) of a 4-D ``kv``."""

    def full_slice(n) -> bool:
        """``x[:, ...]``-style slice of a whole dim (start 0, end past the size, step 1)."""
        args = n.args
        return ((len(args) < 3 or args[2] in (0, None))
                and (len(args) < 4 or args[3] is None or (isinstance(args[3], int) and args[3] >= FULL_SLICE_END))
                and (len(args) < 5 or args[4] == 1))

    def through_full_slices(n):
        while isinstance(n, fx.Node) and n.target == aten.slice.Tensor and full_slice(n):
            n = n.args[0]
        return n

    if not isinstance(node, fx.Node):
        return None
    if node.target == aten.repeat_interleave.self_int and isinstance(node.args[1], int):
        kv, repeats = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        if len(shape(kv) or ()) == 4 and dim is not None and dim % 4 == 1:
            return kv, repeats, True
    if node.target == aten.repeat.default and len(shape(node) or ()) == 4:
        reps = list(node.args[1])
        if len(reps) == 4 and reps[0] == reps[2] == reps[3] == 1 and isinstance(reps[1], int):
            return node.args[0], reps[1], False
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        expanded = node.args[0]
        if getattr(expanded, "target", None) != aten.expand.default:
            return None
        unsq = through_full_slices(expanded.args[0])
        if getattr(unsq, "target", None) != aten.unsqueeze.default or unsq.args[1] % 5 != 2:
            return None
        kv = through_full_slices(unsq.args[0])
        ks, es, rs = shape(kv), shape(expanded), shape(node)
        if not ks or len(ks) != 4 or len(es) != 5 or len(rs) != 4:
            return None
        repeats, heads = static_int(es[2]), static_int(ks[1])
        if repeats is None or heads is None or static_int(rs[1]) != heads * repeats:
            return None
        if text(es[:2]) != text(ks[:2]) or text(es[3:]) != text(ks[2:]) or text([rs[0], *rs[2:]]) != text(
                [ks[0], *ks[2:]]):
            return None
        return kv, repeats, True
    return None


def count_graph_ops(graph: fx.Graph) -> dict[str, int]:
    """SDPA, softmax and matmul nodes of an FX graph (the proof that attention survived as SDPA), and
    ``exporter::decode_attention`` and ``exporter::gemv`` nodes where there are any."""
    counts = {"sdpa": 0, "softmax": 0, "matmul": 0}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        text = str(node.target)
        if "scaled_dot_product" in text:
            counts["sdpa"] += 1
        elif text.startswith("exporter.decode_attention"):  # kernels/decode_attention.py: one decode step's attention
            counts["decode_attention"] = counts.get("decode_attention", 0) + 1
        elif text.startswith("exporter.decode_step_attention") or (  # with its cache write (a functional program:
                "auto_functionalized" in text and "decode_step_attention" in str(node.args[:1])):  # as its writes)
            counts["decode_step_attention"] = counts.get("decode_step_attention", 0) + 1
        elif text.startswith("exporter.gemv"):  # kernels/gemv.py: a product of one row and what surrounds it
            counts["gemv"] = counts.get("gemv", 0) + 1
        elif "softmax" in text:
            counts["softmax"] += 1
        elif any(op in text for op in ("aten.bmm", "aten.matmul", "aten.mm.", "aten.baddbmm")):
            counts["matmul"] += 1
    return counts
