"""Comparing outputs where they are, chunk by chunk: the tolerance rule's metrics without a second copy.

A language model's logits are large (8 × 512 × 128256 values: 4.2 GB in float64), so neither the float64
reference nor a candidate's outputs should have to sit whole in host memory. :class:`Accumulator` keeps the
running sums that :func:`exporter.numerics.tolerance.metrics` needs (squared error, norms, dot product, the
largest absolute and relative errors, NaN/Inf where the reference is finite) and is fed a candidate's
output in flat, ordered chunks, which it compares with the matching slice of the reference on the
reference's own device (the GPU when the reference was computed there). The result equals ``metrics()`` on
the whole tensors up to float64 rounding (tests/numerics/test_compare.py).

A reference is any :class:`Source`: a tensor in memory (:class:`InMemory`) or a tensor stored in a
safetensors file and read slice by slice (:class:`InFile`, what ``exporter verify`` compares against).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator, Protocol

import torch

from ..child import CHUNK_ELEMENTS
from ..dtypes import from_safetensors
from ..results import OutputCheck
from .tolerance import check_against_metrics


class Source(Protocol):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def flat(self, start: int, stop: int) -> torch.Tensor: ...


class InMemory:
    """A reference tensor that is already loaded (on any device)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach()
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype
        self.device = tensor.device
        self._flat = self.tensor.reshape(-1)

    def flat(self, start: int, stop: int) -> torch.Tensor:
        return self._flat[start:stop]


def safetensors_index(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute byte offset of its data) from a safetensors header."""
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(size))
    index = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        index[name] = (from_safetensors(entry["dtype"]), tuple(entry["shape"]), 8 + size + entry["data_offsets"][0])
    return index


class InFile:
    """A tensor of a safetensors file, read slice by slice with plain reads: only the slice is in memory."""

    def __init__(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...], offset: int):
        self.path = Path(path)
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.offset = offset
        self.itemsize = torch.empty((), dtype=dtype).element_size()

    def flat(self, start: int, stop: int) -> torch.Tensor:
        count = max(stop - start, 0)
        buffer = bytearray(count * self.itemsize)
        with open(self.path, "rb") as handle:
            handle.seek(self.offset + start * self.itemsize)
            handle.readinto(buffer)
        return torch.frombuffer(buffer, dtype=self.dtype) if count else torch.empty(0, dtype=self.dtype)


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


class Accumulator:
    """Running metrics of a candidate against ``reference``, fed flat chunks in order (any device, any dtype)."""

    def __init__(self, reference: Source):
        self.reference = reference
        self.size = numel(reference.shape)
        self.offset = 0
        self.floating = reference.dtype.is_floating_point
        device = reference.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        self.sq, self.r2, self.c2, self.dot = zero.clone(), zero.clone(), zero.clone(), zero.clone()
        self.max_abs, self.max_rel = zero.clone(), zero.clone()
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)  # candidate NaN/Inf, reference finite
        self.ref_nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        self.equal = True

    def add(self, chunk: torch.Tensor) -> None:
        flat = chunk.detach().reshape(-1)
        stop = self.offset + flat.numel()
        if stop > self.size:
            raise ValueError(f"candidate chunk runs past the reference ({stop} > {self.size} values)")
        ref = self.reference.flat(self.offset, stop)
        self.offset = stop
        if not self.floating:
            self.equal = self.equal and bool(torch.equal(flat.to(ref.device, ref.dtype), ref))
            return
        r = ref.to(torch.float64)
        c = flat.to(ref.device, torch.float64)
        if not c.numel():
            return
        # One pass per sum (dot products: no temporary), and the masks only where something is not finite: the
        # sums of squares are finite exactly when both chunks are (float64 squares of float values stay finite).
        r2, c2 = torch.dot(r, r), torch.dot(c, c)
        if not bool(torch.isfinite(r2 + c2)):
            judged = torch.isfinite(r)  # where the reference is NaN/Inf nothing can be judged: counted, not summed
            self.ref_nonfinite += (~judged).sum()
            self.nonfinite += (judged & ~torch.isfinite(c)).sum()
            r, c = r[judged], c[judged]
            if not r.numel():
                return
            r2, c2 = torch.dot(r, r), torch.dot(c, c)
        d = c - r
        self.sq += torch.dot(d, d)
        self.r2 += r2
        self.c2 += c2
        self.dot += torch.dot(r, c)
        low, high = torch.aminmax(d)
        self.max_abs = torch.maximum(self.max_abs, torch.maximum(-low, high))
        d.div_(r.abs().clamp_min_(1e-12))  # the relative error, in d's own memory
        low, high = torch.aminmax(d)
        self.max_rel = torch.maximum(self.max_rel, torch.maximum(-low, high))

    @property
    def complete(self) -> bool:
        return self.offset == self.size

    def metrics(self) -> dict[str, float]:
        """What :func:`exporter.numerics.tolerance.metrics` gives on the whole tensors."""
        if self.size == 0:
            return {"max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "cosine": 1.0, "rmse": 0.0, "ref_rms": 0.0,
                    "ref_nonfinite": 0}
        sq, r2, c2, dot = (float(x) for x in (self.sq, self.r2, self.c2, self.dot))
        max_abs, max_rel = float(self.max_abs), float(self.max_rel)
        ref_norm, diff_norm = math.sqrt(r2) if r2 >= 0 else math.nan, math.sqrt(sq) if sq >= 0 else math.nan
        rel_l2 = diff_norm / ref_norm if ref_norm > 0 else diff_norm
        denom = ref_norm * (math.sqrt(c2) if c2 >= 0 else math.nan)
        cosine = dot / denom if denom > 0 else (1.0 if max_abs == 0 else 0.0)
        rmse = math.sqrt(sq / max(self.size - int(self.ref_nonfinite), 1)) if sq >= 0 else math.nan

        def finite(x: float) -> float:
            return x if math.isfinite(x) else float("inf")

        judged = self.size - int(self.ref_nonfinite)
        ref_rms = math.sqrt(r2 / judged) if judged and math.isfinite(r2) and r2 >= 0 else 0.0
        return {"max_abs": finite(max_abs), "max_rel": finite(max_rel), "rel_l2": finite(rel_l2),
                "cosine": cosine if math.isfinite(cosine) else 0.0, "rmse": finite(rmse), "ref_rms": ref_rms,
                "ref_nonfinite": int(self.ref_nonfinite)}

    def check(self, name: str, sample: int, allowed: float, baseline_rmse: float = 0.0,
              explain: str = "", relative: float = 0.0) -> OutputCheck:
        """The tolerance rule's verdict on what was fed (everything must have been); ``allowed`` grows by
        ``relative`` times the reference's RMS (the floor, :func:`~exporter.numerics.tolerance.relative_floor`)."""
        if not self.complete:
            return OutputCheck(name, sample, math.inf, math.inf, math.inf, 0.0, math.inf, 0.0, 0.0, False,
                               f"the candidate returned {self.offset} of the reference's {self.size} values")
        if not self.floating:
            value = 0.0 if self.equal else math.inf
            return OutputCheck(name, sample, value, value, value, 1.0 if self.equal else 0.0, value, 0.0, 0.0,
                               self.equal, "" if self.equal else "integer output differs")
        m = self.metrics()
        floor = relative * m["ref_rms"]
        if relative and explain:
            explain += f" + floor {floor:.3g}"
        return check_against_metrics(name, sample, m, int(self.nonfinite), allowed + floor, baseline_rmse, explain)


def shape_mismatch(name: str, sample: int, got: tuple[int, ...], want: tuple[int, ...]) -> OutputCheck:
    return OutputCheck(name, sample, math.inf, math.inf, math.inf, 0.0, math.inf, 0.0, 0.0, False,
                       f"shape {list(got)} differs from the reference's {list(want)}")


def read_stream(stream: Iterator[tuple], names: tuple[str, ...] | list[str], references: list[Source],
                sample: int) -> list[Accumulator | OutputCheck]:
    """Read one sample's output stream (a runner's ``begin_stream``) against its references: per output, an
    :class:`Accumulator` fed every chunk, or the failing check when its shape differs; one failing check
    named ``*`` when the run returned another number of outputs (the stream is read to its end either way)."""
    items: list[Accumulator | OutputCheck] = []
    for event in stream:
        if event[0] == "outputs":
            meta = event[1]
            if len(meta) != len(names):
                for _ in stream:  # read what the child sends, to stay in step with it
                    pass
                return [OutputCheck("*", sample, math.inf, math.inf, math.inf, 0.0, math.inf, 0.0, 0.0, False,
                                    f"returned {len(meta)} outputs, expected {len(names)}")]
            items = [shape_mismatch(name, sample, tuple(shape), tuple(ref.shape))
                     if tuple(shape) != tuple(ref.shape) else Accumulator(ref)
                     for name, (shape, _), ref in zip(names, meta, references)]
            continue
        item = items[event[1]]
        if isinstance(item, Accumulator):
            item.add(event[2])
    return items


def rmse_of(reference: torch.Tensor, other: torch.Tensor, chunk: int = CHUNK_ELEMENTS) -> float:
    """``metrics(reference, other)["rmse"]`` computed in chunks on the reference's device."""
    accumulator = Accumulator(InMemory(reference))
    flat = other.detach().reshape(-1)
    for start in range(0, flat.numel(), chunk):
        accumulator.add(flat[start:start + chunk])
    if flat.numel() == 0:
        accumulator.offset = accumulator.size
    return accumulator.metrics()["rmse"]


__all__ = ["Accumulator", "InMemory", "InFile", "Source", "safetensors_index", "read_stream", "rmse_of",
           "shape_mismatch"]
