"""A Triton kernel for the fp8 weight-only product of one row: ``x [1, K] @ (qweight [N, K] * scales).T``, the
candidate that ``gpu_fp8_gemv.py`` times against Inductor's own form. Not part of exporter: measured, it does not
beat Inductor over a whole layer of the 8B shape (docs/quantization.md, "A hand-written kernel").

A decode step at batch 1 is matrix-vector products, bound by the bytes of the weights. Inductor, left to
itself, writes ``fp8-weight-only``'s product (:func:`exporter.quantize.fp8.weight_only_product`) as one
reduction per linear that widens each fp8 byte as it reads it, at about half of the copy bandwidth on an H200
(docs/quantization.md, "Decode at batch 1"). This kernel reads the weight in tiles of ``BLOCK_N`` rows by
``BLOCK_K`` columns (16-byte loads along a row), accumulates ``w * x`` in float32, and, where the rows are too
few to fill the GPU, splits ``K`` across ``SPLIT`` programs that each write a float32 partial sum; the partial
sums, the row scales and the cast to the activation's dtype are one small step after it.

It is registered with ``torch.library.triton_op`` as ``exporter::fp8_gemv`` so that ``torch.export`` keeps it
as one node and AOTInductor compiles the kernel into the package; it would serve the decode program of batch 1
(every shape static, ``generation.decode_batch_1``) on CUDA, where a linear's leading dimensions are statically
one row (``eligible``). The arithmetic differs from the unfused form by one rounding: the product
is rounded to the activation's dtype once, after the scale, instead of before and after it. The gate judges
the artifact that holds it like any other, against the float64 reference of the quantized model.

Triton is a dependency of PyTorch's CUDA builds only: without it ``AVAILABLE`` is false.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # a CPU build of torch: no Triton
    triton = None

AVAILABLE = triton is not None

# (BLOCK_N, BLOCK_K, SPLIT, num_warps) by the shape of the weight; see ``config``
_TARGET_PROGRAMS = 512  # enough programs in flight to keep an H200's 132 SMs reading


def config(n: int, k: int) -> tuple[int, int, int, int]:
    """The tile and split for a weight of ``n`` rows by ``k`` columns: 8 rows by 512 columns per step, and ``K``
    split (1 to 8 ways, each part a whole number of tiles) until about 512 programs run."""
    block_n, block_k = 8, 512
    split = 1
    while n // block_n * split < _TARGET_PROGRAMS and split < 8 and k % (block_k * split * 2) == 0:
        split *= 2
    return block_n, block_k, split, 4


def eligible(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether the kernel takes this product: Triton present, on CUDA, one row whose count is a plain int (a
    program traced with a symbolic batch keeps the unfused form), and a weight that the tiles divide."""
    if not AVAILABLE or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    rows = 1
    for size in x.shape[:-1]:
        if not isinstance(size, int):
            return False
        rows *= size
    n, k = int(qweight.shape[0]), int(qweight.shape[1])
    block_n, block_k, split, _ = config(n, k)
    return rows == 1 and n % block_n == 0 and k % (block_k * split) == 0


if AVAILABLE:

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, part_ptr, N, K, K_PER_SPLIT,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        start = pid_s * K_PER_SPLIT
        w_rows = w_ptr + rows[:, None].to(tl.int64) * K
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            offs = start + k0 + cols
            x = tl.load(x_ptr + offs).to(tl.float32)
            w = tl.load(w_rows + offs[None, :]).to(tl.float32)
            acc += w * x[None, :]
        tl.store(part_ptr + pid_s * N + rows, tl.sum(acc, axis=1))

    @triton_op("exporter::fp8_gemv", mutates_args={})
    def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x @ (qweight * scales).T`` for one row ``x [..., K]`` (leading dimensions all 1)."""
        n, k = qweight.shape
        block_n, block_k, split, warps = config(n, k)
        flat = x.reshape(k)
        parts = torch.empty((split, n), dtype=torch.float32, device=x.device)
        wrap_triton(_fp8_gemv_kernel)[(n // block_n, split)](flat, qweight, parts, n, k, k // split,
                                                             BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
        out = parts.sum(0) * scales.reshape(n)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
