"""The weight transform (``[quantize]`` in a recipe): fp8 linears, and what the quantization cost.

    schemes    one row per scheme: the module a linear becomes, the sizes it needs, its weight dtype, its label
    fp8        the fp8 linear module and its arithmetic (torchao's rowwise fp8 recipe), in any dtype and in float64
    transform  which linears become fp8, swapped in place, with a per-layer audit
    cost       the gate's second question: per-layer SQNR, per-output SQNR beside the unquantized model's own error,
               logits top-1 agreement and KL, against the recipe's budget
    stage      the convert stages that run them (forward, text generation)

docs/quantization.md explains the two questions and the budget's defaults.
"""

from .fp8 import Fp8Linear
from .schemes import SCHEMES, Scheme
from .transform import Quantized, quantize_model

__all__ = ["SCHEMES", "Fp8Linear", "Quantized", "Scheme", "quantize_model"]
