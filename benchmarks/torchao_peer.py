"""exporter's fp8 rowwise weights and activations against torchao's own quantization primitives, bit for bit.

    pip install torchao==0.18.0 && python benchmarks/torchao_peer.py

torchao refuses ``quantize_`` with its fp8 configs on a machine without fp8 hardware, but its primitives
(``_choose_scale_float8``, ``_quantize_affine_float8``) are plain torch and run anywhere: this compares them with
``exporter.quantize.fp8`` for bfloat16 and float32 weights (per output row) and activations (per token). On the
GPU, ``benchmarks/gpu_fp8_layer.py`` compares against torchao's ``quantize_`` with its rowwise fp8 config.
"""

from __future__ import annotations

import json

import torch
from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

from exporter.quantize.fp8 import FP8, quantize_weight, row_scales, to_fp8


def theirs(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _choose_scale_float8(tensor, block_size=[1, tensor.shape[-1]], float8_dtype=FP8)
    return _quantize_affine_float8(tensor, scale, FP8), scale


def main() -> None:
    torch.manual_seed(0)
    result = {}
    for dtype in (torch.bfloat16, torch.float32):
        weight = (torch.randn(1024, 512) * torch.logspace(-2, 1, 1024)[:, None]).to(dtype)
        activation = torch.randn(256, 512).to(dtype) * 3
        q_w, s_w = quantize_weight(weight)
        t_w, ts_w = theirs(weight)
        s_x = row_scales(activation)
        t_x, ts_x = theirs(activation)
        result[str(dtype).removeprefix("torch.")] = {
            "weight_scales_equal": torch.equal(s_w.reshape(-1), ts_w.reshape(-1)),
            "weights_equal": torch.equal(q_w.view(torch.uint8), t_w.view(torch.uint8)),
            "activation_scales_equal": torch.equal(s_x.reshape(-1), ts_x.reshape(-1)),
            "activations_equal": torch.equal(to_fp8(activation, s_x).view(torch.uint8), t_x.view(torch.uint8)),
        }
    print(json.dumps(result, indent=2))
    if not all(all(v.values()) for v in result.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
