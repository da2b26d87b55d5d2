"""The weights proof: every constant an artifact carries is traced to the checkpoint tensor it came from and must
equal it, bit for bit, after the declared cast.

Comparing outputs cannot tell a weight defect from rounding once the defect is smaller than the dtype's own
error: a bfloat16 artifact's logits sit ~4e-3 from float64 whatever 1% noise on one Linear does to them. Its
weights, though, can be compared exactly, whatever the dtype and without running anything.

A constant is traced **by name** where the format keeps it (a ``.pt2``'s state dict and constants, ONNX
initializers named by module path; a leading wrapper prefix such as ``model.`` is allowed on either side), else
**by content**: paired with the checkpoint tensor of the same shape, or for a matrix the transposed shape
(TorchScript's ONNX export stores a Linear's weight as ``W^T`` under a name like ``onnx::MatMul_123``), that is
nearest to it (relative L2 of the difference below :data:`PAIRING`). A traced constant must equal the checkpoint's
tensor cast to the constant's dtype; one that differs is **changed** and fails by name, with its largest
difference. A large constant traced to nothing (folded arithmetic, or a tensor of another model) and a large
checkpoint tensor found nowhere are named in the report; they do not fail the proof by themselves, since
exporters legitimately fold and drop tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

PAIRING = 0.5  # a constant this close to a checkpoint tensor (relative L2 of the difference) is paired with it
LARGE = 1024  # elements: a constant at least this large traced to nothing is named in the report


@dataclass
class Changed:
    constant: str  # its name in the artifact
    weight: str  # the checkpoint tensor it was traced to
    how: str  # name, content, transposed
    max_abs: float  # the largest |artifact - checkpoint| (float64)
    rel_l2: float  # ||artifact - checkpoint|| / ||checkpoint||
    against: str = "the checkpoint's"  # what it was compared with

    def line(self) -> str:
        where = self.weight if self.constant in (self.weight,) or self.how == "name" else \
            f"{self.weight} (as {self.constant}, traced by {self.how})"
        return f"weight {where} differs from {self.against} (max |diff| {self.max_abs:.3g}, " \
               f"relative L2 {self.rel_l2:.3g})"


@dataclass
class WeightProof:
    constants: int = 0  # constants the artifact carries
    by_name: int = 0
    by_content: int = 0
    changed: list[Changed] = field(default_factory=list)
    untraced: list[dict[str, Any]] = field(default_factory=list)  # large constants traced to nothing
    not_found: list[str] = field(default_factory=list)  # large checkpoint tensors no constant equals
    small_untraced: int = 0
    note: str = ""

    @property
    def passed(self) -> bool:
        return not self.changed

    def summary(self) -> str:
        if self.changed:
            first = self.changed[0].line()
            more = f" (and {len(self.changed) - 1} more)" if len(self.changed) > 1 else ""
            return f"{first}{more}"
        return (f"{self.by_name + self.by_content} of {self.constants} constants equal the checkpoint's tensors "
                f"({self.by_name} by name, {self.by_content} by content)")

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "constants": self.constants, "by_name": self.by_name,
                "by_content": self.by_content,
                "changed": [{"constant": c.constant, "weight": c.weight, "how": c.how, "max_abs": c.max_abs,
                             "rel_l2": c.rel_l2} for c in self.changed],
                "untraced": self.untraced, "untraced_small": self.small_untraced, "not_found": self.not_found,
                "summary": self.summary(), "note": self.note}


def _suffixes(checkpoint: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each checkpoint name, and each of its dotted tails of two parts or more that no other name shares (an
    artifact of the bare transformer inside a wrapper names ``embeddings.x`` what the wrapper calls
    ``0.auto_model.embeddings.x``)."""
    tails: dict[str, list[str]] = {}
    for name in checkpoint:
        parts = name.split(".")
        for start in range(1, len(parts) - 1):
            tails.setdefault(".".join(parts[start:]), []).append(name)
    found = {tail: full[0] for tail, full in tails.items() if len(full) == 1}
    found.update({name: name for name in checkpoint})
    return found


def _named(constant: str, names: dict[str, str]) -> str | None:
    """The checkpoint tensor named like ``constant``: the same name, or one of them behind a wrapper's prefix."""
    if constant in names:
        return names[constant]
    parts = constant.split(".")
    for start in range(1, len(parts)):
        tail = ".".join(parts[start:])
        if tail in names:
            return names[tail]
    return None


def _difference(constant: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    weight = weight.to(constant.device)  # a checkpoint tensor on the recipe's GPU, a constant read to the CPU
    diff = constant.double() - weight.double()
    norm = float(weight.double().norm())
    return float(diff.abs().max()) if diff.numel() else 0.0, float(diff.norm()) / norm if norm else float(diff.norm())


def _same(constant: torch.Tensor, weight: torch.Tensor) -> bool:
    """Equal after the declared cast: the checkpoint tensor in the constant's dtype, bit for bit (NaN where the
    other has NaN; float8 tensors too, which have no ``nan_to_num``)."""
    cast = weight.to(device=constant.device, dtype=constant.dtype)
    if cast.is_floating_point() and cast.element_size() == 1:  # float8: compared as its bytes (no equal kernel)
        return cast.shape == constant.shape and torch.equal(cast.view(torch.uint8), constant.view(torch.uint8))
    if torch.equal(cast, constant):
        return True
    if not cast.is_floating_point():
        return False
    nans = cast.isnan()
    return bool(nans.any()) and torch.equal(nans, constant.isnan()) and torch.equal(
        cast.double().masked_fill(nans, 0.0), constant.double().masked_fill(nans, 0.0))


def _shapes(weight: torch.Tensor) -> list[tuple[str, tuple[int, ...]]]:
    found = [("content", tuple(weight.shape))]
    if weight.dim() == 2 and weight.shape[0] != weight.shape[1]:
        found.append(("transposed", (weight.shape[1], weight.shape[0])))
    elif weight.dim() == 2:
        found.append(("transposed", tuple(weight.shape)))
    return found


def prove_weights(constants: dict[str, torch.Tensor], checkpoint: dict[str, torch.Tensor],
                  note: str = "", against: str = "the checkpoint's") -> WeightProof:
    """Trace every constant of ``constants`` (an artifact's, by its own names) to ``checkpoint`` (the checkpoint's
    model's state dict; for a quantized run, its model after the declared quantization: each fp8 linear's
    ``qweight`` and ``scales`` computed from the checkpoint's weight) and compare them exactly (see the module's
    docstring). ``against`` says in a failure's line what they were compared with."""
    proof = WeightProof(constants=len(constants), note=note)
    names = _suffixes(checkpoint)
    found: set[str] = set()
    pending: dict[str, torch.Tensor] = {}
    for name, constant in constants.items():
        weight_name = _named(name, names)
        weight = checkpoint.get(weight_name) if weight_name else None
        if weight is not None and weight.numel() == constant.numel() and weight.dim() == constant.dim():
            candidate = weight if weight.shape == constant.shape else (
                weight.t() if weight.dim() == 2 and weight.t().shape == constant.shape else None)
            if candidate is not None:
                found.add(str(weight_name))
                proof.by_name += 1
                if not _same(constant, candidate):
                    proof.changed.append(Changed(name, str(weight_name), "name", *_difference(constant, candidate),
                                                  against))
                continue
        pending[name] = constant
    by_shape: dict[tuple[int, ...], list[tuple[str, str, torch.Tensor]]] = {}
    for weight_name, weight in checkpoint.items():
        for how, shape in _shapes(weight):
            by_shape.setdefault(shape, []).append((weight_name, how, weight if how == "content" else weight.t()))
    for name, constant in pending.items():
        candidates = by_shape.get(tuple(constant.shape), [])
        exact = next(((w, how) for w, how, tensor in candidates if tensor.dtype.is_floating_point ==
                      constant.dtype.is_floating_point and _same(constant, tensor)), None)
        if exact is not None:
            found.add(exact[0])
            proof.by_content += 1
            continue
        nearest = None
        if constant.is_floating_point() and constant.numel() > 1:
            scored = [(_difference(constant, tensor), w, how) for w, how, tensor in candidates
                      if tensor.is_floating_point()]
            scored = [s for s in scored if s[0][1] < PAIRING]
            nearest = min(scored, key=lambda s: s[0][1]) if scored else None
        if nearest is not None:
            (max_abs, rel), weight_name, how = nearest
            found.add(weight_name)
            proof.by_content += 1
            proof.changed.append(Changed(name, weight_name, how, max_abs, rel, against))
        elif constant.numel() >= LARGE:
            proof.untraced.append({"constant": name, "shape": list(constant.shape), "dtype": str(constant.dtype)})
        else:
            proof.small_untraced += 1
    proof.not_found = sorted(n for n, w in checkpoint.items() if n not in found and w.numel() >= LARGE
                             and not any(_same_storage(w, checkpoint[f]) for f in found))
    return proof


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tied tensors (an embedding and the head that shares it) are one weight."""
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape
    except RuntimeError:
        return False


__all__ = ["Changed", "WeightProof", "prove_weights", "PAIRING", "LARGE"]
