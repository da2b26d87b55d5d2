"""What the softmax-attention rule reads and writes: the ops it sees through, a matched site (``Found``, its
q/k/v ``Operand``s and mask ``Term``s), and ``Skip``, the reason a site is left alone."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

PRODUCTS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default}
SOFTMAXES = {aten.softmax.int, aten._softmax.default}
CASTS = {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default}
IDENTITIES = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default}
ASSERTS = {aten._assert_tensor_metadata.default}
# an in-place op on the scores ("scores /= sqrt(d)", Falcon's spelling) reads as its out-of-place twin when nothing
# else sees the tensor it mutates
IN_PLACE = {aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar, aten.mul_.Tensor: aten.mul.Tensor,
            aten.mul_.Scalar: aten.mul.Scalar, aten.add_.Tensor: aten.add.Tensor, aten.add_.Scalar: aten.add.Scalar,
            aten.sub_.Tensor: aten.sub.Tensor, aten.sub_.Scalar: aten.sub.Scalar,
            aten.masked_fill_.Scalar: aten.masked_fill.Scalar, aten.masked_fill_.Tensor: aten.masked_fill.Tensor}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
         aten.unflatten.int}


# A boolean mask filled with a value this negative (finfo(float32).min, as DeBERTa and others write) is kept as that
# value in an additive mask: SDPA adds it to the scaled scores, which it absorbs whole (its spacing is ~1e31), so a
# row that masks every key gets the uniform weights eager's softmax gives it, where -inf would give NaN or zeros.
ABSORBING = -1e30


class Skip(Exception):
    """This softmax is attention, but rewriting it would not be safe; the message says why."""


@dataclass
class Operand:
    """A tensor for SDPA, made from ``node`` by an optional last-two-dims swap, then an optional permute."""

    node: fx.Node
    swap_last: bool = False
    perm: tuple[int, ...] | None = None
    dims: tuple = ()
    unflatten: list[int] | None = None  # then split the first dim into these sizes (layout, see _layout)


@dataclass
class Term:
    kind: str  # "add": added to the logits | "keep": bool, attend where True | "drop": bool, masked where True
    node: fx.Node
    coef: float = 1.0
    coef_tensors: list[tuple[Any, fx.Node]] = field(default_factory=list)
    causal: bool = False
    lead: tuple = ()  # the leading dims of the scores where the term was applied
    unflatten: list[int] | None = None  # a mask laid out over flattened batch·heads: split its first dim
    fill: float = float("-inf")  # what a boolean term writes where it masks (see ABSORBING)


@dataclass
class Found:
    softmax: fx.Node
    producer: fx.Node
    path: list[fx.Node]  # from the node after the producer up to the softmax input
    probs: list[fx.Node]  # casts/dropout after the softmax
    out: fx.Node
    q: Operand
    k: Operand
    v: Operand
    out_perm: tuple[int, ...] | None = None
    scale: float = 1.0
    scale_tensors: list[tuple[Any, fx.Node]] = field(default_factory=list)
    terms: list[Term] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    is_causal: bool = False
    gqa: bool = False
    grouped_query: bool = False
    kv_heads: int | None = None
    lead: tuple = ()  # leading dims of the scores as the path goes (after each layout step)
    layout_steps: int = 0
    out_flatten: int | None = None  # flatten the output's first dims back into one: how many


def op_name(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def real_users(node: fx.Node) -> list[fx.Node]:
    return [u for u in node.users if u.target not in ASSERTS]
