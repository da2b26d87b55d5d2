"""``exporter::fp8_gemv``, the fp8 weight-only product of one row that the decode program of batch 1 runs on CUDA.

Its speed is a GPU figure (docs/quantization.md). Its arithmetic is pinned here on the CPU: the Triton kernel runs
under Triton's interpreter (``TRITON_INTERPRET=1``), in a process of its own with Triton on its path (scripts/test.sh
installs Triton into ``.triton/``, apart from the suite's environment, whose CPU torch has none). Every product and
the sum are float32 and the output is rounded once, so the kernel's error against the float64 reference of the
quantized linear is one rounding to bfloat16 and no more: at every tile the GPU uses, with rows and columns the
tiles do not divide, and with a bias. A launch writing float32 shows the sum itself (float32's error, nothing
else); through the op, in bfloat16, the output is rounded once: Triton's interpreter rounds toward zero where the
GPU rounds to nearest, so there the bound is one unit in the last place rather than half of one."""

from __future__ import annotations

import json

import pytest
import torch

from exporter.quantize import fp8, fp8_gemv
from exporter.testing.interpreted import run_interpreted

INTERPRETED = r"""
import json, sys, torch
from exporter.quantize import fp8, fp8_gemv
assert fp8_gemv.AVAILABLE
torch.manual_seed(0)
rows = []
for n, k, tile, bias, *planted in json.loads(sys.argv[1]):
    weight = torch.randn(n, k, dtype=torch.bfloat16) / k ** 0.5
    qweight, scales = fp8.quantize_weight(weight)
    given = scales.clone()
    if planted:  # the kernel is handed one row's scale doubled; the reference keeps the right one
        given[planted[0]] *= 2
    x = torch.randn(1, 1, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    if tile:  # one launch at the given tile, the float32 sum written as it is (no rounding after it)
        out = torch.empty(n, dtype=torch.float32)
        fp8_gemv.launch(x.reshape(k), qweight, given.reshape(n), b, out, *tile)
    else:  # the registered op, at the tile config() chooses
        out = torch.ops.exporter.fp8_gemv(x, qweight, given, b).reshape(n)
    ref = (x.double().reshape(1, k) @ fp8.dequantize(qweight, scales, torch.float64).t()).reshape(n)
    if b is not None:
        ref = ref + b.double()
    rel = lambda t: float((t.double() - ref).norm() / ref.norm())
    toward_zero = (ref.float().view(torch.int32) & -65536).view(torch.float32)  # bfloat16, rounded toward zero
    rows.append({"n": n, "k": k, "kernel": rel(out), "rounding": rel(ref.to(torch.bfloat16)),
                 "toward_zero": rel(toward_zero), "dtype": str(out.dtype)})
print(json.dumps(rows))
"""


def interpreted(cases: list) -> list[dict]:
    return run_interpreted(INTERPRETED, json.dumps(cases))


def test_the_kernel_sums_in_float32_at_every_tile_the_gpu_uses_and_rounds_once():
    cases = [[n, k, list(fp8_gemv.config(n, k)), False] for n, k in ((64, 1024), (48, 2048), (16, 8192))]
    cases += [[48, 96, [4, 64, 4], True],     # neither size a multiple of the tile, a bias
              [7, 48, [2, 32, 2], False]]     # 7 rows: the last program holds one
    for row in interpreted(cases):
        assert row["dtype"] == "torch.float32"
        assert row["kernel"] < 1e-5, row  # the exact value, give or take float32's sums
    (op,) = interpreted([[64, 4096, None, True]])  # the registered op, at config()'s tile, bfloat16 in and out
    assert op["dtype"] == "torch.bfloat16"
    assert op["kernel"] <= 1.05 * op["toward_zero"] + 1e-6, op  # one rounding (toward zero under the interpreter)


def test_the_bound_fails_a_kernel_given_a_wrong_scale():
    """The bound above can fail: the kernel handed one row's scale doubled misses it by far."""
    (row,) = interpreted([[16, 256, [4, 64, 2], False, 3]])
    assert row["kernel"] > 1e-2, row


def test_only_one_row_on_cuda_inside_its_context_takes_the_kernel():
    qweight = torch.zeros(32, 64, dtype=fp8.FP8)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    assert not fp8_gemv.eligible(x, qweight)  # outside one_row_kernel(): never
    with fp8_gemv.one_row_kernel():
        assert not fp8_gemv.eligible(x, qweight)  # a CPU tensor: Inductor's form
    assert not fp8_gemv._ACTIVE  # the context is left as it was found


@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (1024, 4096), (28672, 4096), (4096, 14336),
                                  (1152, 896), (64, 48)])
def test_every_tile_divides_the_threads_and_fits_the_row(n, k):
    block_n, block_k, warps = fp8_gemv.config(n, k)
    assert block_k & (block_k - 1) == 0 and block_n & (block_n - 1) == 0  # Triton's blocks are powers of two
    assert block_k <= max(16, 1 << (k - 1).bit_length())  # never wider than the row rounded up
    assert warps in (2, 4, 8)
