"""One matrix product for the projections that read the same tensor: q, k and v of an attention, gate and up
of a gated MLP.

At batch 1 a decode step is matrix-vector products, and the small ones (k and v of a grouped-query attention:
2 MB each in a 1B model) cost their launch and tail more than their bytes (docs/generation.md). Concatenating
the weights of the linears that read one input makes them one product over the concatenated weight, split
after: one read of 12.6 MB instead of three kernels.

``fused_projections(model, probe)`` finds the groups by running ``probe`` once with a pre-hook on every
``nn.Linear``: linears that received the very same tensor object, each exactly once, with the same input size,
dtype and device, all with or all without a bias, none sharing its weight with another module (a tied weight
stays as it is). Inside the context each linear of a group is replaced by a ``Projection`` that returns its
slice of the group's product; the product is computed once per input object (the first projection called on a
new input computes it, the others reuse it; a projection called on another tensor computes its own, so the
result is always the linear's output whatever order the model calls them in). The concatenated weight is the
only copy: each original linear's weight becomes a view into it, so leaving the context restores the model
with no second copy of those weights, and the values are unchanged.

fp8 linears (``quantize.fp8.Fp8Linear``) are grouped only when asked (``kinds``): their fp8 weights and per-row
scales are concatenated the same way (a row's scale goes with its row, so each member's output is unchanged), and
the group computes one fp8 product. The decode program of batch 1 asks for it, where one matrix-vector kernel per
group reads the concatenated fp8 weight (``quantize.fp8_gemv``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..quantize.fp8 import Fp8Linear

Fusable = nn.Linear | Fp8Linear


@dataclass
class Group:
    names: list[str]  # the linears' qualified names, in the order the probe called them
    in_features: int
    out_features: list[int]

    def to_dict(self) -> dict[str, Any]:
        return {"linears": self.names, "in_features": self.in_features, "out_features": self.out_features}


class _Memo:
    """The last input a group's product was computed for, and the product's slices (a plain object: no module
    state changes while a program is traced)."""

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.parts: tuple[torch.Tensor, ...] = ()


class FusedLinear(nn.Module):
    """The group's concatenated weight (and bias); ``parts(x)`` is every member's output for ``x``. ``fp8``: the
    group's fp8 linear over the concatenated fp8 weight and scales, in place of the weight."""

    def __init__(self, weight: torch.Tensor | None, bias: torch.Tensor | None, sizes: list[int],
                 fp8: Fp8Linear | None = None):
        super().__init__()
        if fp8 is not None:
            self.fp8 = fp8
        else:
            assert weight is not None
            self.weight = nn.Parameter(weight, requires_grad=False)
            self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = list(sizes)
        self._memo = _Memo()

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if "fp8" in self._modules:
            return self.fp8(x)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def parts(self, x: torch.Tensor, last: bool) -> tuple[torch.Tensor, ...]:
        memo = self._memo
        if memo.input is not x:
            memo.input, memo.parts = x, self.product(x).split(self.sizes, -1)
        parts = memo.parts
        if last:  # the group's last member: nothing holds the input or the product past this call
            memo.input, memo.parts = None, ()
        return parts


class Projection(nn.Module):
    """One member of a fused group, in place of its ``nn.Linear``: its slice of the group's product. The first
    member owns the ``FusedLinear`` (so its weight is a parameter once); the others refer to it."""

    _group: FusedLinear  # every member's group, kept outside the module tree (object.__setattr__)

    def __init__(self, fused: FusedLinear, index: int, owner: bool):
        super().__init__()
        if owner:
            self.fused = fused  # a submodule of this member only: the weight is listed once
        object.__setattr__(self, "_group", fused)
        self.index, self.count = index, len(fused.sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group.parts(x, last=self.index == self.count - 1)[self.index]


def _weight(module: Fusable) -> torch.Tensor:
    return module.qweight if isinstance(module, Fp8Linear) else module.weight


def find_groups(model: nn.Module, probe: Callable[[], Any],
                kinds: tuple[type, ...] = (nn.Linear,)) -> list[Group]:
    """The linears of ``model`` (of the types ``kinds``: ``nn.Linear``, ``Fp8Linear``) that one run of ``probe``
    fed the same input tensor (rules in the module doc)."""
    names = {module: name for name, module in model.named_modules()}
    uses: dict[int, int] = {}
    for _, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        uses[id(tensor)] = uses.get(id(tensor), 0) + 1
    calls: list[tuple[Fusable, torch.Tensor]] = []

    def record(module, args):
        if args and isinstance(args[0], torch.Tensor):
            calls.append((module, args[0]))  # the tensor is kept until the probe ends: no id is reused

    linears = [m for m in names if type(m) in kinds and type(m) in (nn.Linear, Fp8Linear)]
    handles = [m.register_forward_pre_hook(record) for m in linears]
    try:
        with torch.no_grad():
            probe()
    finally:
        for handle in handles:
            handle.remove()
    count: dict[nn.Module, int] = {}
    for module, _ in calls:
        count[module] = count.get(module, 0) + 1
    by_input: dict[int, list[Fusable]] = {}
    for module, x in calls:
        by_input.setdefault(id(x), []).append(module)
    groups = []
    for readers in by_input.values():
        alike: dict[tuple, list[Fusable]] = {}
        for m in readers:  # called once in the whole run, its weight its own; then grouped by what must match
            weight = _weight(m)
            if count[m] == 1 and uses.get(id(weight), 0) == 1:
                key = (type(m), getattr(m, "scheme", None), m.in_features, weight.dtype, weight.device,
                       m.bias is None)
                alike.setdefault(key, []).append(m)
        groups += [Group([names[m] for m in members], members[0].in_features, [m.out_features for m in members])
                   for members in alike.values() if len(members) > 1]
    return groups


def _linear(model: nn.Module, name: str) -> Fusable:
    module = model.get_submodule(name)
    assert isinstance(module, (nn.Linear, Fp8Linear)), name
    return module


def _swap(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _fuse(members: list[Fusable], sizes: list[int]) -> FusedLinear:
    """The group's ``FusedLinear``; each member's weight (fp8 weight and scales) and bias become views of the
    concatenated ones: one copy of the values, in and after the context."""
    biases: list[torch.Tensor] = [m.bias for m in members if m.bias is not None]
    fp8s = [m for m in members if isinstance(m, Fp8Linear)]
    linears = [m for m in members if isinstance(m, nn.Linear)]
    with torch.no_grad():
        bias = torch.cat(biases) if len(biases) == len(members) else None
        if fp8s:
            qweight = torch.cat([m.qweight for m in fp8s])
            scales = torch.cat([m.scales for m in fp8s])
            fused = FusedLinear(None, None, sizes, fp8=Fp8Linear(qweight, scales, bias, fp8s[0].scheme))
        else:
            weight = torch.cat([m.weight for m in linears])
            fused = FusedLinear(weight, bias, sizes)
    start = 0
    for member, size in zip(members, sizes):
        end = start + size
        if isinstance(member, Fp8Linear):
            member.qweight, member.scales = qweight[start:end], scales[start:end]
        else:
            member.weight = nn.Parameter(weight[start:end], requires_grad=member.weight.requires_grad)
        if bias is not None and member.bias is not None:
            member.bias = nn.Parameter(bias[start:end], requires_grad=member.bias.requires_grad)
        start = end
    return fused


@contextlib.contextmanager
def fused_projections(model: nn.Module, probe: Callable[[], Any],
                      kinds: tuple[type, ...] = (nn.Linear,)) -> Iterator[list[Group]]:
    """``model`` with each group ``find_groups`` finds (among linears of the types ``kinds``) computed as one
    product; restored on exit."""
    groups = find_groups(model, probe, kinds)
    originals: list[tuple[str, Fusable]] = []
    try:
        for group in groups:
            members = [_linear(model, n) for n in group.names]
            fused = _fuse(members, [int(size) for size in group.out_features])
            for index, (name, member) in enumerate(zip(group.names, members)):
                originals.append((name, member))
                _swap(model, name, Projection(fused, index, owner=index == 0))
        yield groups
    finally:
        for name, member in originals:
            _swap(model, name, member)


__all__ = ["FusedLinear", "Group", "Projection", "find_groups", "fused_projections"]
