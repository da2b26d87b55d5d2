"""Every dtype exporter knows, in one table: its name, its safetensors code, its size, its unit roundoff and the
default ``numerics.k`` a candidate in it is held to.

The table is plain data (no torch), so a recipe can be checked before torch is imported; :func:`torch_dtype` and
:func:`from_safetensors` turn names and codes into torch dtypes where torch is loaded anyway. The one other copy
is ``targets/aoti_loader.py``'s safetensors codes: that file is shipped beside an AOTInductor package and runs in a
server without exporter installed, so it cannot import this module (``tests/test_layout.py`` pins that it agrees).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    name: str  # as recipes, reports and torch (``torch.<name>``) spell it
    safetensors: str  # the dtype code in a safetensors header
    itemsize: int  # bytes per element
    roundoff: float | None = None  # unit roundoff (the largest relative error of one rounding); None: not a float
    k: float | None = None  # numerics.k when a recipe gives none: how many times eager's own error a candidate may make
    runtime: bool = False  # a recipe may run the model in it (runtime.dtype)
    declarable: bool = False  # an input may be declared in it ([[inputs.tensor]], --input)


DTYPES: tuple[DType, ...] = (
    DType("float64", "F64", 8, 2.0**-53, 2.0, declarable=True),
    DType("float32", "F32", 4, 2.0**-24, 2.0, runtime=True, declarable=True),
    DType("bfloat16", "BF16", 2, 2.0**-8, 3.0, runtime=True, declarable=True),
    DType("float16", "F16", 2, 2.0**-11, 3.0, runtime=True, declarable=True),
    DType("float8_e4m3fn", "F8_E4M3", 1, 2.0**-4),
    DType("float8_e5m2", "F8_E5M2", 1, 2.0**-3),
    DType("int64", "I64", 8, declarable=True),
    DType("int32", "I32", 4, declarable=True),
    DType("int16", "I16", 2),
    DType("int8", "I8", 1),
    DType("uint64", "U64", 8),
    DType("uint32", "U32", 4),
    DType("uint16", "U16", 2),
    DType("uint8", "U8", 1),
    DType("bool", "BOOL", 1, declarable=True),
)
BY_NAME = {d.name: d for d in DTYPES}
BY_CODE = {d.safetensors: d for d in DTYPES}

RUNTIME_DTYPES = tuple(d.name for d in DTYPES if d.runtime)  # what a recipe may run in
TENSOR_DTYPES = tuple(d.name for d in DTYPES if d.declarable)  # what a declared input may be
K_DEFAULTS = {d.name: d.k for d in DTYPES if d.k is not None and (d.runtime or d.name == "float64")}
UNIT_ROUNDOFF = {d.name: d.roundoff for d in DTYPES if d.roundoff is not None}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (a KeyError names the dtype when the table has no such name)."""
    import torch  # noqa: PLC0415 - the table itself is read before torch is imported (recipes, --help)

    return getattr(torch, BY_NAME[name].name)


def name_of(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def safetensors_code(name: str) -> str:
    return BY_NAME[name].safetensors


def from_safetensors(code: str) -> torch.dtype:
    """A safetensors header's dtype code (``"BF16"``) as a torch dtype."""
    return torch_dtype(BY_CODE[code].name)


__all__ = ["DType", "DTYPES", "BY_NAME", "BY_CODE", "RUNTIME_DTYPES", "TENSOR_DTYPES", "K_DEFAULTS", "UNIT_ROUNDOFF",
           "torch_dtype", "name_of", "safetensors_code", "from_safetensors"]
