"""The quantize stage of a forward convert: transform, then the second question's figures.

    reference (original, float64) -> quantize -> reference (quantized, float64) -> rewrite -> export -> validate

It runs the unquantized model once in the recipe's dtype (its own error, shown beside the fp8 one), swaps the
chosen linears for fp8 ones, runs the quantized model in the recipe's dtype with the per-layer check attached, and
judges both against the original model's float64 reference (:mod:`.cost`). The original weights of the swapped
linears are dropped before it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..dtypes import torch_dtype
from ..errors import RecipeError
from ..inputs import cast_sample
from ..modelio import cast_in_place
from ..numerics.reference import full_float32
from ..recipe import QuantizeSection, Recipe
from .cost import Budget, Cost, judge_layers, judge_outputs, layer_sqnr
from .schemes import scheme
from .transform import Quantized, quantize_model

WORST_LAYERS = 5


def nothing_quantized(quantized: Quantized) -> str:
    """Why a quantize recipe quantized no linear of the model."""
    if not quantized.layers:
        return f"quantize.scheme {quantized.scheme}: the model has no linear layer to quantize"
    reasons = sorted({layer.reason for layer in quantized.layers})
    return (f"quantize.scheme {quantized.scheme} quantized none of the model's {len(quantized.layers)} linear "
            f"layer(s) ({quantized.count('excluded')} excluded, {quantized.count('fallback')} kept: "
            f"{reasons[0]})")


def budget_of(section: QuantizeSection) -> Budget:
    return Budget(min_sqnr_db=section.min_sqnr_db, max_error_ratio=section.max_error_ratio,
                  layer_min_sqnr_db=section.layer_min_sqnr_db, min_top1=section.min_top1, max_kl=section.max_kl)


@dataclass
class Quantization:
    quantized: Quantized
    cost: Cost

    def to_dict(self) -> dict[str, Any]:
        layers = self.quantized.layers
        judged = self.quantized.judged()
        row = scheme(self.quantized.scheme)
        return {
            "scheme": self.quantized.scheme,
            "weight_dtype": row.weight_dtype,
            "scales": {"dtype": "float32", "granularity": "per output row (weights)" + (
                ", per token (activations, at run time)" if row.per_token else "")},
            "counts": {s: self.quantized.count(s) for s in (row.label, "excluded", "fallback")},
            "excluded": [layer.name for layer in layers if layer.status == "excluded"],
            "fallback": [{"name": layer.name, "reason": layer.reason} for layer in layers
                         if layer.status == "fallback"],
            "budget": self.cost.budget.to_dict(),
            "unquantized_dtype": self.cost.dtype,
            "passed": self.cost.passed,
            "problems": list(self.cost.problems),
            "notes": list(self.cost.notes),
            "worst_layers": [{"name": name, "sqnr_db": round(value, 3)} for name, value in judged[:WORST_LAYERS]],
            "outputs": self.cost.outputs,
            "logits": self.cost.logits,
            "layers": [layer.to_dict() for layer in layers],
        }


def _outputs(io, samples, dtype: torch.dtype, device: str, first=None) -> list[list[torch.Tensor]]:
    outs = []
    with torch.inference_mode(), full_float32():
        for index, sample in enumerate(samples):
            def run(s=sample):
                return io(*cast_sample(s, dtype, device))

            if index == 0 and first is not None:
                result = first(run)
            else:
                result = run()
            outs.append([t.detach().clone() for t in result])
    return outs


def _quantize_and_judge(model: torch.nn.Module, section: QuantizeSection, dtype: str, run, names: tuple[str, ...],
                        samples: list[dict[str, torch.Tensor]], unquantized: list[list[torch.Tensor]],
                        reference: list[list[torch.Tensor]]) -> Quantization:
    """What both tasks share: quantize ``model`` in place, ``run(checked)`` the quantized model once (``checked``
    wraps one call with the per-layer check; ``run`` returns every sample's outputs), judge the layers and the
    outputs, and drop the original weights whatever happened."""
    quantized = quantize_model(model, section.scheme, section.exclude, section.include_head)
    if not quantized.count(quantized.label):
        quantized.release()
        raise RecipeError(nothing_quantized(quantized), "convert with a recipe without [quantize] (fp8 would change "
                          "nothing), or narrow quantize.exclude")
    captured: list[Any] = []

    def checked(call):
        layer_sqnr(model, quantized, lambda: captured.append(call()))
        return captured[0]

    try:
        outputs = run(checked)
        cost = Cost(section.scheme, budget_of(section), dtype)
        judge_layers(cost, quantized)
        judge_outputs(cost, names, samples, outputs, unquantized, reference)
    finally:
        quantized.release()
    return Quantization(quantized, cost)


def quantize_stage(io, model: torch.nn.Module, recipe: Recipe, samples: list[dict[str, torch.Tensor]],
                   names: tuple[str, ...], reference_outputs: list[list[torch.Tensor]]) -> Quantization:
    """Quantize ``model`` (the module ``io`` runs) in place and judge what it cost."""
    section, device, dtype = recipe.quantize, recipe.runtime.device, recipe.runtime.dtype
    with cast_in_place(io, torch_dtype(dtype), device):
        unquantized = _outputs(io, samples, torch_dtype(dtype), device)

    def run(checked):
        with cast_in_place(io, torch_dtype(dtype), device):
            return _outputs(io, samples, torch_dtype(dtype), device, first=checked)

    return _quantize_and_judge(model, section, dtype, run, names, samples, unquantized, reference_outputs)


def quantize_decoder(model: torch.nn.Module, recipe: Recipe, forced: Callable[[], torch.Tensor],
                     reference_logits: torch.Tensor, unquantized_logits: torch.Tensor) -> Quantization:
    """``--task text-generation``: quantize ``model`` (in the recipe's dtype) in place and judge what it cost on
    the judged steps, teacher-forced on the original reference's tokens (``forced()``: the model's logits for each
    step, ``[steps, batch, vocab]``, computed by the generation stage): each step's logits against the original
    float64 logits (``reference_logits``), beside the unquantized model's (``unquantized_logits``), with top-1
    agreement and KL against the latter over every step and row."""
    from ..modelio import attention_implementation  # noqa: PLC0415

    section, dtype = recipe.quantize, recipe.runtime.dtype

    def run(checked):
        model.to(torch_dtype(dtype))
        with attention_implementation(model, "eager"):
            return [[checked(forced)]]

    return _quantize_and_judge(model, section, dtype, run, ("logits",), [{}], [[unquantized_logits]],
                               [[reference_logits]])
