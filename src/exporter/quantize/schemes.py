"""The weight schemes a recipe's ``quantize.scheme`` names, one row each (:data:`SCHEMES`): the module a chosen
linear becomes, the sizes a linear needs to take it, the stored weight's dtype, what the report calls a quantized
linear, and what the programs do with it. The transform, the convert stages, the report and the generation
programs read the row; an int8 or int4 scheme is one more row and the module its row names.

The recipe parser keeps the list of names a recipe may give (``recipe.QUANTIZE_SCHEMES``: the parser runs without
torch), and ``tests/quantize/test_fp8_transform.py`` pins that it names these rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from torch import nn

from .fp8 import FP8, Fp8Linear


@dataclass(frozen=True)
class Scheme:
    name: str
    make: Callable[[Any, str], nn.Module]  # the quantized module from an ``nn.Linear`` or ``Conv1D``, and the name
    module: type  # the class ``make`` returns
    alignment: int  # both sizes of a linear a multiple of this, or it stays in the model's dtype
    weight_dtype: str  # the stored weight's dtype
    label: str  # a quantized linear's status in the audit and the report ("fp8")
    per_token: bool  # activations quantized at run time, one scale per token
    one_row_kernel: bool  # the decode program of batch 1 runs its own kernel over a group's fused weight


FP8_ROWWISE = Scheme("fp8-rowwise", Fp8Linear.from_linear, Fp8Linear, alignment=16,  # _scaled_mm: both sizes
                     weight_dtype=str(FP8).replace("torch.", ""), label="fp8", per_token=True, one_row_kernel=False)
SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    FP8_ROWWISE,
    replace(FP8_ROWWISE, name="fp8-weight-only", per_token=False, one_row_kernel=True),
)}


def scheme(name: str) -> Scheme:
    """The row of ``name``; a KeyError names the schemes there are."""
    try:
        return SCHEMES[name]
    except KeyError:
        raise KeyError(f"unknown quantize.scheme {name!r}; schemes are {', '.join(SCHEMES)}") from None


__all__ = ["SCHEMES", "Scheme", "scheme"]
