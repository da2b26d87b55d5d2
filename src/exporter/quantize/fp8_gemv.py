"""The fp8 weight-only product of one row as one Triton kernel: ``y = (x @ qweight.T) * scales.T (+ bias)`` for
``x`` of one row, the matrix-vector product of a decode step at batch 1.

A decode step at batch 1 reads every weight once and does little else: its time is the weights' bytes over the
memory bandwidth. Storing the weights in fp8 halves those bytes, but only a kernel that reads them at the
bandwidth turns that into time. Inductor, left to itself, writes :func:`.fp8.weight_only_product` at one row as
one reduction per linear that widens each fp8 byte as it loads it; on an H200 those reductions read at about 63%
of the copy bandwidth where bf16's products read at 86% (docs/quantization.md, "Decode at batch 1"). This kernel
reads the weight in tiles of ``BLOCK_N`` rows by ``BLOCK_K`` columns, 16 bytes per thread per load along a row,
streamed past the L2 (``evict_first``), accumulates ``w * x`` in float32, and applies the row's scale, the bias and
the cast to the activation's dtype in its epilogue: one kernel per linear, no second pass over partial sums.

It is registered with ``torch.library.triton_op`` as ``exporter::fp8_gemv``: ``torch.export`` keeps it as one node
and AOTInductor compiles the kernel into the package (the package needs no library of ours to load). Inductor
cannot fuse other operations into it (the RMSNorm before a projection, the activation after one); where
``generation.decode_gemv_kernel`` is on, ``kernels.decode_products.fuse`` replaces each such node, with the norm,
activation and residual add around it, by one ``exporter::gemv`` that reads the fp8 weight and its scales.

Where it is used (:func:`eligible`): CUDA, a float activation whose leading dimensions are all statically 1 (the
decode program of batch 1, ``generation.decode_batch_1``, traced inside :func:`one_row_kernel`); a program with a
symbolic batch keeps Inductor's form, which serves every batch.

Arithmetic: every product and the sum in float32, the output rounded once to the activation's dtype, where the
unfused form rounds the product to the activation's dtype, scales in float32 and rounds again. Both are the same
value in exact arithmetic, so the float64 reference (:mod:`.fp8`) judges either. On a machine without a GPU the
kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``) for the tests, which pin its arithmetic against the
float64 reference.

Triton is a dependency of PyTorch's CUDA builds only: without it ``AVAILABLE`` is false and nothing here is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

try:  # Triton comes with PyTorch's CUDA builds only
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:
    triton = None

AVAILABLE = triton is not None
_ACTIVE = False  # set by one_row_kernel(): only programs traced inside it hold the kernel
ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


def config(n: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for a weight of ``n`` rows by ``k`` columns.

    From a sweep of 56 tiles on an H200 at the Llama-3.1-8B shapes (benchmarks/gpu_fp8_gemv.py; docs/quantization.md,
    "The kernel of one row"): 4 rows a program and 2 warps (64 threads, two 16-byte loads each a step) for wide
    weights, a longer step along ``K`` for the long rows of a down projection and for weights of few rows, whose
    grid is small."""
    if k >= 8192:  # down: 4096 x 14336
        block_n, block_k, warps = 4, 1024, 2
    elif n >= 6144:  # q/k/v fused, gate, gate/up fused
        block_n, block_k, warps = 4, 512, 2
    elif n >= 2048:  # q, o
        block_n, block_k, warps = 4, 1024, 2
    else:  # k, v of a grouped-query attention
        block_n, block_k, warps = 2, 2048, 8
    return block_n, min(block_k, max(16, 1 << (k - 1).bit_length())), warps


@contextlib.contextmanager
def one_row_kernel(active: bool = True) -> Iterator[None]:
    """Inside: a weight-only fp8 linear given one row on CUDA runs :func:`fp8_gemv` (and a program traced here
    holds it). Entered only where the program is compiled by AOTInductor (the decode program of batch 1), so an
    exported program (``model.pt2``) never needs this module to load, and eager runs keep the unfused form."""
    global _ACTIVE
    before, _ACTIVE = _ACTIVE, active and AVAILABLE
    try:
        yield
    finally:
        _ACTIVE = before


def eligible(x: torch.Tensor, qweight: torch.Tensor) -> bool:
    """Whether :func:`fp8_gemv` takes ``x @ qweight.T``: inside :func:`one_row_kernel`, ``x`` on CUDA in a float
    dtype, and one row whose count is a plain int (a program traced with a symbolic batch keeps Inductor's form)."""
    if not _ACTIVE or not x.is_cuda or x.dtype not in ACTIVATIONS:
        return False
    for size in x.shape[:-1]:
        if not isinstance(size, int) or size != 1:
            return False
    return isinstance(x.shape[-1], int) and x.shape[-1] == qweight.shape[1]


if AVAILABLE:

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, K,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rows[:, None].to(tl.int64) * K + cols[None, :]
        x_ptrs = x_ptr + cols
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_N and EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                x = tl.load(x_ptrs)
            else:
                inside = (rows[:, None] < N) & (k0 + cols[None, :] < K)
                w = tl.load(w_ptrs, mask=inside, other=0.0, eviction_policy="evict_first")
                x = tl.load(x_ptrs, mask=k0 + cols < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1)
        if EVEN_N:
            out = out * tl.load(s_ptr + rows)
            if HAS_BIAS:
                out += tl.load(b_ptr + rows).to(tl.float32)
            tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"))
        else:
            out = out * tl.load(s_ptr + rows, mask=rows < N, other=0.0)
            if HAS_BIAS:
                out += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=rows < N)

    def launch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
               out: torch.Tensor, block_n: int, block_k: int, warps: int, wrap=lambda kernel: kernel) -> None:
        """One launch of the kernel at the given tile (``wrap``: ``wrap_triton`` inside the op)."""
        n, k = qweight.shape
        wrap(_fp8_gemv_kernel)[(triton.cdiv(n, block_n),)](
            x, qweight, scales, bias if bias is not None else scales, out, n, k,
            BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0,
            EVEN_K=k % block_k == 0, num_warps=warps)

    @triton_op("exporter::fp8_gemv", mutates_args={})
    def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045 - the op's schema reads it
        """``(x @ qweight.T) * scales.T (+ bias)`` for ``x [..., K]`` of one row, in ``x``'s dtype."""
        n, k = qweight.shape
        flat = x.reshape(k).contiguous()
        out = torch.empty(n, dtype=x.dtype, device=x.device)
        block_n, block_k, warps = config(n, k)
        launch(flat, qweight, scales.reshape(n), None if bias is None else bias.reshape(n), out,
               block_n, block_k, warps, wrap=wrap_triton)
        return out.reshape(*x.shape[:-1], n)
