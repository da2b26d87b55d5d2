"""The product of one row with a weight as one Triton kernel, with what a decoder layer does around it folded in:
the RMSNorm before it, the gated activation after a fused gate/up product, the residual add after it.

A decode step at batch 1 is matrix-vector products: each reads its weight once, and its time is the weight's bytes
over the memory bandwidth. Inductor writes each as a reduction and fuses the RMSNorm or the activation into it
where it can, but it cannot read every weight at the bandwidth (docs/generation.md, "Where the decode step's time
goes"). :func:`gemv` computes

    y = epilogue(x' @ weight.T)       with x' = x, or RMSNorm(x) * norm_weight (``norm``)

for ``x`` of one row: each program reads ``BLOCK_N`` rows of the weight in steps of ``BLOCK_K`` columns, 16 bytes
per thread per load, streamed past the L2 (``evict_first``), and sums ``w * x'`` in float32. ``glu``: the weight
is a fused gate/up weight ``[2I, K]`` (gate rows first, as ``generation.fused_projections`` concatenates them) and
the output is ``silu(gate) * up`` ``[I]``, each program reading the gate row and the up row of its outputs.
``residual``: the output is ``residual + y``. ``bias``: added to the product. ``scales``: the weight is stored in
fp8 (``float8_e4m3fn``) with one float32 scale a row (``quantize.fp8``'s weight-only scheme), and each output is
scaled by its row's scale before the bias: half the bytes a step reads, the same fusions.

Rounding follows the unfused model's, step by step, so the kernel and the form it replaces differ only by the order
of the float32 sums: with ``norm``, ``x`` is normalised in float32 and rounded to its dtype, then multiplied by the
norm's weight and rounded again (transformers' ``LlamaRMSNorm``); the product is rounded to the activation's dtype;
``silu(gate)`` is rounded before it multiplies ``up``, and that product is rounded; the residual add is one more
rounding. An fp8 product is scaled and biased in float32 and rounded once, as ``exporter::fp8_gemv`` rounds it
(``quantize/fp8_gemv.py``), where the unfused weight-only form rounds the product before it scales it: the same
value in exact arithmetic. :func:`reference` is the same computation in float64 without any rounding, the twin
the tests judge the kernel against; on a machine without a GPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``).

It is registered with ``torch.library.triton_op`` as ``exporter::gemv``, so ``torch.export`` keeps it as one node
and AOTInductor compiles it into the package. Triton comes with PyTorch's CUDA builds only: without it
``AVAILABLE`` is false and nothing here is used.
"""

from __future__ import annotations

from typing import Optional

import torch

try:  # Triton comes with PyTorch's CUDA builds only
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:
    triton = None

AVAILABLE = triton is not None
ACTIVATIONS = (torch.bfloat16, torch.float16, torch.float32)


def config(n: int, k: int, glu: bool = False, fp8: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps)`` for ``n`` outputs of rows of ``k`` columns (``glu``: two rows an output;
    ``fp8``: a weight of one byte an element, tiled as ``exporter::fp8_gemv`` tiles it, a program of a gate/up
    weight reading half the outputs since it reads two rows for each).

    From sweeps of 20 tiles at the Llama-3.2-1B shapes and 36 at the Qwen2-0.5B shapes on an H100
    (benchmarks/gpu_gemv.py; docs/runs/h100-gemv.json, h100-gemv-qwen05b.json): each choice is within 3% of its
    shape's best. Rows that no 1024 divides (the 0.5B's 896) take short steps that divide them, more rows a
    program."""
    if fp8:
        from ..quantize.fp8_gemv import config as fp8_config  # noqa: PLC0415 - one tile rule for fp8 weights

        block_n, block_k, warps = fp8_config(2 * n if glu else n, k)
        return max(1, block_n // 2) if glu else block_n, block_k, warps
    odd = k % 1024 != 0
    if k >= 4096:  # a down projection: few, long rows
        block_n, block_k, warps = 2, 2048, 8
    elif glu:  # gate/up: each program reads a gate row and an up row
        block_n, block_k, warps = (4, 256, 4) if odd else (2, 1024, 2)
    elif n >= 3072:  # fused q/k/v, the vocabulary
        block_n, block_k, warps = (8, 128, 2) if odd else (4, 1024, 2)
    else:  # o, a small q/k/v
        block_n, block_k, warps = 2, 1024, 4
    return block_n, min(block_k, max(16, 1 << (k - 1).bit_length())), warps


def reference(x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-6,
              glu: bool = False, residual: torch.Tensor | None = None,
              bias: torch.Tensor | None = None, scales: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`gemv` in float64, nothing rounded between its steps."""
    h = x.double().reshape(-1)
    if norm is not None:
        h = h * torch.rsqrt(h.square().mean() + eps) * norm.double()
    y = weight.double() @ h
    if scales is not None:
        y = y * scales.double().reshape(-1)
    if bias is not None:
        y = y + bias.double()
    if glu:
        gate, up = y.chunk(2)
        y = torch.nn.functional.silu(gate) * up
    if residual is not None:
        y = y + residual.double().reshape(-1)
    return y.reshape(*x.shape[:-1], -1)


if AVAILABLE:

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, b_ptr, s_ptr, N, K, eps,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, GLU: tl.constexpr,
                     RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ROUND: tl.constexpr,
                     SCALED: tl.constexpr):
        # ROUND: the activation is narrower than float32, and each step's value is rounded to it. No method is called
        # on a scalar argument (``N.to``): Inductor's analysis of which arguments a kernel writes compiles the kernel
        # with its ints as plain Python ints, and a kernel it cannot compile has every argument taken as written (the
        # package then returns each weight as an output of its own)
        dtype: tl.constexpr = out_ptr.dtype.element_ty
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        live = rows < N
        safe = tl.where(live, rows, 0)  # rows past N read row 0 and are never stored: no mask on the weight's loads
        cols = tl.arange(0, BLOCK_K)
        inv = 1.0
        if NORM:
            squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                v = tl.load(x_ptr + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
                squares += v * v
            mean = (tl.sum(squares, axis=0) / K + eps).to(tl.float32)  # Inductor passes eps as a float64 scalar
            inv = 1.0 / tl.sqrt(mean)
        w_ptrs = w_ptr + safe[:, None].to(tl.int64) * K + cols[None, :]
        u_ptrs = w_ptr + (safe + N)[:, None].to(tl.int64) * K + cols[None, :]  # GLU: the up rows
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            inside = k0 + cols < K
            h = tl.load(x_ptr + k0 + cols, mask=inside, other=0.0).to(tl.float32)
            if NORM:
                h = h * inv
                if ROUND:
                    h = h.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
                h = h * tl.load(norm_ptr + k0 + cols, mask=inside, other=0.0).to(tl.float32)
                if ROUND:
                    h = h.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            if EVEN_K:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs, mask=inside[None, :], other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * h[None, :]
            if GLU:
                if EVEN_K:
                    u = tl.load(u_ptrs, eviction_policy="evict_first")
                else:
                    u = tl.load(u_ptrs, mask=inside[None, :], other=0.0, eviction_policy="evict_first")
                acc_up += u.to(tl.float32) * h[None, :]
                u_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = tl.sum(acc, axis=1)
        if SCALED:  # an fp8 weight: each row's scale, in float32, before the bias (exporter::fp8_gemv's epilogue)
            y = y * tl.load(s_ptr + safe)
        if HAS_BIAS:
            y += tl.load(b_ptr + safe).to(tl.float32)
        if ROUND:
            y = y.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
        if GLU:
            up = tl.sum(acc_up, axis=1)
            if SCALED:
                up = up * tl.load(s_ptr + N + safe)
            if HAS_BIAS:
                up += tl.load(b_ptr + N + safe).to(tl.float32)
            y = y / (1.0 + tl.exp(-y))
            if ROUND:
                y = y.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
                up = up.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
            y = y * up
            if ROUND:
                y = y.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
        if RESIDUAL:
            y = y + tl.load(res_ptr + safe).to(tl.float32)
            if ROUND:
                y = y.to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
        tl.store(out_ptr + rows, y.to(dtype), mask=live)  # already a value of the dtype

    def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, norm: torch.Tensor | None, eps: float,
               glu: bool, residual: torch.Tensor | None, bias: torch.Tensor | None, block_n: int, block_k: int,
               warps: int, wrap=lambda kernel: kernel, scales: torch.Tensor | None = None) -> None:
        """One launch at the given tile (``wrap``: ``wrap_triton`` inside the op). ``x``, ``out`` and ``scales``
        flat."""
        rows, k = weight.shape
        n = rows // 2 if glu else rows
        wrap(_gemv_kernel)[(triton.cdiv(n, block_n),)](
            x, weight, out, norm if norm is not None else x, residual if residual is not None else x,
            bias if bias is not None else x, scales if scales is not None else x, n, k, eps,
            BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm is not None, GLU=glu, RESIDUAL=residual is not None,
            HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, ROUND=out.dtype != torch.float32,
            SCALED=scales is not None, num_warps=warps)

    @triton_op("exporter::gemv", mutates_args={})
    def gemv(x: torch.Tensor, weight: torch.Tensor, norm: Optional[torch.Tensor] = None,  # noqa: UP045
             eps: float = 1e-6, glu: bool = False, residual: Optional[torch.Tensor] = None,  # noqa: UP045
             bias: Optional[torch.Tensor] = None,  # noqa: UP045
             scales: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045 - the op's schema reads it
        """``x [..., K]`` of one row times ``weight [N, K]`` (fp8 with ``scales`` ``[N]`` or ``[N, 1]``), see the
        module's docstring; in ``x``'s dtype."""
        rows, k = weight.shape
        n = rows // 2 if glu else rows
        out = torch.empty(n, dtype=x.dtype, device=x.device)
        block_n, block_k, warps = config(n, k, glu, fp8=scales is not None)
        launch(x.reshape(k).contiguous(), weight, out, norm, eps, glu,
               None if residual is None else residual.reshape(n).contiguous(), bias, block_n, block_k, warps,
               wrap=wrap_triton, scales=None if scales is None else scales.reshape(rows).contiguous())
        return out.reshape(*x.shape[:-1], n)
