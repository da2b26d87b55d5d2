"""float8 (e4m3) linears, the arithmetic of torchao's rowwise fp8 inference recipe as a plain module.

``fp8-rowwise`` is torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``: the weight is
stored in ``float8_e4m3fn`` with one float32 scale per output row (``amax(|row|) / 448``); at run time each row of
the activation (one token) gets its own scale the same way, and ``torch._scaled_mm`` multiplies the two fp8
operands with both scales applied to the float32 accumulator, writing the model's dtype. ``fp8-weight-only`` is
torchao's ``Float8WeightOnlyConfig``: the same stored weight and the product in the model's dtype (it halves
the bytes a decode step reads; the product itself is not fp8). It is written as the fp8 weight cast to the
activation's dtype (exact: every e4m3 value is a bfloat16, float16 and float32 value), the product, then each
output column times its row's scale in float32 (:func:`weight_only_product`), where torchao dequantizes the
weight before the product: the same value in exact arithmetic, and a form Inductor fuses whole, the cast into
the product's loads and the scale into its epilogue, so a decode step reads each weight byte once
(docs/quantization.md, "Decode at batch 1": 1.49x the bf16 layer, where the dequantized form is 0.45x).

A plain module rather than torchao's tensor subclass, for three reasons the gate needs: the float64 reference
runs the same arithmetic (the two roundings to fp8, every product in float64), a move or cast of the model
(``model.to(dtype)``) never touches the fp8 weight or its float32 scales, and the programs exported from it hold
ordinary aten ops (one ``_scaled_mm`` per linear) that ``torch.export`` and AOTInductor take on every device
(PyTorch's CPU ``_scaled_mm`` runs it on a machine without fp8 hardware, with the same roundings).
Weights and scales are torchao's own bit for bit (its ``_choose_scale_float8`` and ``_quantize_affine_float8``,
compared on the CPU; docs/quantization.md). One deliberate difference: an all-zero row gets a tiny scale instead
of 0, so padding stays 0 where torchao's division would give NaN.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import fp8_gemv

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_FLOOR = 1e-12  # an all-zero row (padding) gets this scale instead of 0: its values stay 0, not NaN
FP8_SCHEMES = ("fp8-rowwise", "fp8-weight-only")  # the rows of schemes.SCHEMES this module implements


def row_scales(tensor: torch.Tensor) -> torch.Tensor:
    """One scale per row (last dimension reduced), as torchao chooses it: ``amax(|row|) / 448`` computed in the
    tensor's own dtype (a bfloat16 weight or activation gets a bfloat16-rounded scale), then held in float32."""
    amax = tensor.abs().amax(dim=-1, keepdim=True)
    return (amax.clamp(min=SCALE_FLOOR) / FP8_MAX).to(torch.float32)


def to_fp8(tensor: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``tensor / scales`` rounded to e4m3 (the division in float32, or float64 for the reference)."""
    wide = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return (tensor.to(wide) / scales.to(wide)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight ``[out, in]``, float32 scales ``[out, 1]``) of a linear's weight."""
    scales = row_scales(weight.detach())
    return to_fp8(weight.detach(), scales), scales


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    return (qweight.to(wide) * scales.to(wide)).to(dtype)


def rowwise_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` with x quantized per row to fp8 and W the fp8 weight: ``_scaled_mm`` in x's dtype, or in float64
    the same two roundings followed by exact float64 products (the reference of this arithmetic)."""
    rows = x.reshape(-1, x.shape[-1])
    x_scales = row_scales(rows)
    if x.dtype == torch.float64:
        qx = to_fp8(rows, x_scales).to(torch.float64) * x_scales.double()
        out = qx @ dequantize(qweight, scales, torch.float64).t()
    else:
        out = torch._scaled_mm(to_fp8(rows, x_scales), qweight.t(), scale_a=x_scales, scale_b=scales.t(),
                               out_dtype=x.dtype, use_fast_accum=x.is_cuda)
    return out.reshape(*x.shape[:-1], qweight.shape[0])


def weight_only_product(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scales).T`` as ``(x @ qweight.T) * scales.T``: the weight cast (exactly) to x's dtype, the
    product in x's dtype, the scales applied in float32 (float64 for the reference) and the result in x's dtype."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    product = x @ qweight.to(x.dtype).t()
    return (product.to(wide) * scales.t().to(wide)).to(x.dtype)


class Fp8Linear(nn.Module):
    """A linear whose weight is stored in fp8 with per-row float32 scales (``scheme``: one of :data:`FP8_SCHEMES`).

    ``qweight`` and ``scales`` keep their dtypes through ``module.to(dtype)`` (only their device follows), so a
    model cast to bfloat16 keeps fp8 weights; the float64 reference (which upcasts each module's tensors while it
    runs) computes the same roundings in float64.
    """

    _KEEP_DTYPE = ("qweight", "scales")
    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, scheme: str):
        super().__init__()
        if scheme not in FP8_SCHEMES:
            raise ValueError(f"unknown fp8 scheme {scheme!r}")
        self.scheme = scheme
        self.in_features, self.out_features = int(qweight.shape[1]), int(qweight.shape[0])
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: Any, scheme: str) -> "Fp8Linear":
        """From an ``nn.Linear`` (weight [out, in]) or transformers' ``Conv1D`` (GPT-2's linears: weight [in, out],
        ``x @ W + b``), the same product either way."""
        qweight, scales = quantize_weight(linear_weight(linear).contiguous())
        return cls(qweight, scales, linear.bias, scheme)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme == "fp8-rowwise":
            out = rowwise_product(x, self.qweight, self.scales)
        elif fp8_gemv.eligible(x, self.qweight):  # one row on CUDA, inside fp8_gemv.one_row_kernel()
            return torch.ops.exporter.fp8_gemv(x, self.qweight, self.scales, self.bias)
        else:
            out = weight_only_product(x, self.qweight, self.scales)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def _apply(self, fn, recurse=True):
        kept = {name: self._buffers.pop(name) for name in self._KEEP_DTYPE}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in kept.items():
                target = fn(tensor.reshape(-1)[:1])  # where fn sends this tensor (a device move, maybe a cast)
                self._buffers[name] = tensor if target.device == tensor.device else tensor.to(target.device)
        return self

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme}")


def is_conv1d(module: Any) -> bool:
    """transformers' ``Conv1D`` (GPT-2, GPT-J's ancestors): a linear whose weight is stored transposed."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.") and \
        isinstance(getattr(module, "weight", None), torch.Tensor) and module.weight.dim() == 2


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` itself (a subclass may carry behaviour of its own) or transformers' ``Conv1D``."""
    return type(module) is nn.Linear or is_conv1d(module)


def linear_weight(module: Any) -> torch.Tensor:
    """The weight as ``F.linear`` takes it, [out, in] (a view of a ``Conv1D``'s, no copy)."""
    return module.weight.t() if is_conv1d(module) else module.weight


def fp8_weights(model: nn.Module) -> int:
    """How many weights the model's fp8 linears hold (buffers, so ``parameters()`` leaves them out)."""
    return sum(m.qweight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
