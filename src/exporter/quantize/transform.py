"""The weight transform: which linears become fp8, and what happened to each.

``quantize_model(model, section)`` swaps every chosen ``nn.Linear`` (or transformers' ``Conv1D``, GPT-2's linear
with its weight transposed) for an :class:`~.fp8.Fp8Linear` in place, as torchao's ``quantize_(model, config,
filter_fn)`` does, and returns the per-layer audit. Chosen: every linear but the output head
(``get_output_embeddings()``, or a linear whose weight is an embedding's: a tied head) and those whose qualified
name matches one of ``section.exclude`` (``fnmatch`` patterns). A chosen linear that fp8 cannot take falls back to
the model's dtype and says why: fp8 matrix products need both sizes to be multiples of 16.

The original weights are kept (``Quantized.originals``) until the per-layer check has run, then dropped
(:meth:`Quantized.release`): the transform never holds more than the model's weights plus their fp8 copies.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .fp8 import is_linear, linear_weight
from .schemes import scheme as scheme_row


@dataclass
class Layer:
    name: str
    in_features: int
    out_features: int
    status: str  # "fp8", "excluded", "fallback"
    reason: str = ""
    sqnr_db: float | None = None  # this linear's output against its float64 product from the same input

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "in_features": self.in_features, "out_features": self.out_features,
                "status": self.status, "reason": self.reason,
                "sqnr_db": None if self.sqnr_db is None else round(self.sqnr_db, 3)}


@dataclass
class Quantized:
    scheme: str
    layers: list[Layer]
    originals: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """A quantized layer's status ("fp8"): the scheme's label."""
        return scheme_row(self.scheme).label

    def count(self, status: str) -> int:
        return sum(1 for layer in self.layers if layer.status == status)

    def judged(self) -> list[tuple[str, float]]:
        """(name, SQNR dB) of every layer the per-layer check measured, lowest first."""
        return sorted(((layer.name, layer.sqnr_db) for layer in self.layers if layer.sqnr_db is not None),
                      key=lambda pair: pair[1])

    def layer(self, name: str) -> Layer:
        return next(layer for layer in self.layers if layer.name == name)

    def release(self) -> None:
        self.originals.clear()


def head_names(model: nn.Module) -> set[str]:
    """The qualified names of the output head: ``get_output_embeddings()`` and any linear sharing an embedding's
    weight."""
    names: set[str] = set()
    head = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except (AttributeError, NotImplementedError, TypeError):
            head = None
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in model.named_modules():
        if (isinstance(module, nn.Linear) or is_linear(module)) and (module is head or id(module.weight) in embedded):
            names.add(name)
    return names


def _exclusion(name: str, heads: set[str], patterns: tuple[str, ...], include_head: bool) -> str:
    if name in heads and not include_head:
        return "the output head (kept in the model's dtype; quantize.include_head = true to change)"
    for pattern in patterns:
        if fnmatch.fnmatchcase(name, pattern):
            return f"matches quantize.exclude {pattern!r}"
    return ""


def quantize_model(model: nn.Module, scheme: str, exclude: tuple[str, ...] = (), include_head: bool = False,
                   keep_originals: bool = True) -> Quantized:
    """Swap the chosen linears of ``model`` for the scheme's modules in place; the audit lists every linear."""
    row = scheme_row(scheme)
    heads = head_names(model)
    shared: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) or is_linear(module):
            shared[id(module.weight)] = shared.get(id(module.weight), 0) + 1
    result = Quantized(scheme, [])
    swaps: list[tuple[nn.Module, str, str, Any]] = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if not is_linear(child):  # a subclass of nn.Linear may carry behaviour of its own: left as it is
                continue
            full = f"{name}.{child_name}" if name else child_name
            out_features, in_features = linear_weight(child).shape
            layer = Layer(full, int(in_features), int(out_features), row.label)
            reason = _exclusion(full, heads, exclude, include_head)
            if reason:
                layer.status, layer.reason = "excluded", reason
            elif layer.in_features % row.alignment or layer.out_features % row.alignment:
                layer.status = "fallback"
                layer.reason = (f"{layer.in_features} x {layer.out_features}: {row.label} products need both sizes a "
                                f"multiple of {row.alignment}; kept in the model's dtype")
            elif shared.get(id(child.weight), 0) > 1:
                layer.status, layer.reason = "fallback", "its weight is shared with another linear; kept as it is"
            result.layers.append(layer)
            if layer.status == row.label:
                swaps.append((module, child_name, full, child))
    for parent, child_name, full, child in swaps:
        with torch.no_grad():
            replacement = row.make(child, scheme).to(child.weight.device)
        setattr(parent, child_name, replacement)
        if keep_originals:
            result.originals[full] = (linear_weight(child), child.bias)
    return result
