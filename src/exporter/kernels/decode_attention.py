"""The attention of one decode step as Triton kernels: every query row of a key/value head against the whole
static cache, the additive mask read as one row, grouped-query heads read once.

At a decode step the attention reads the cache and little else. SDPA's fused kernels are written for long
queries: on an H200 cuDNN's took about 7 µs a layer for one query over a 512-slot cache (docs/generation.md,
"The decode and prefill targets"), and with a mask transformers first copies every key/value head once per query
head (``repeat_kv``: grouped-query attention with a mask would otherwise fall to SDPA's math kernel), so each
layer copies its cache before reading it. :func:`decode_attention` reads each key/value head's slots once for all
the query rows that share it (the query heads of its group, and any rows of the same position), in slices of
``SPLIT`` slots, one program a head and slice: scores in float32, the mask's row added, an online softmax, the
values summed in float32. With more than one slice a second kernel merges the slices' partial sums (flash
decoding); with one, the first writes the output.

The step's additive mask (``generation.cache.step_mask``) is built by a kernel of its own inside :func:`routed`
(``exporter::step_mask``): one buffer every layer reads, where Inductor, left to itself, writes the few pointwise
operations that make it again beside each layer's attention.

It is registered with ``torch.library.triton_op`` as ``exporter::decode_attention`` and used only inside
:func:`routed` (the decode program of batch 1, ``generation.decode_batch_1``, traced for AOTInductor on CUDA):
there a call of ``scaled_dot_product_attention`` that :func:`eligible` accepts becomes one node of this op, and
transformers is told to leave grouped-query heads unrepeated (its ``use_gqa_in_sdpa``). A call it does not accept
runs SDPA as before (its heads repeated where transformers would have repeated them). The model is not edited.

Arithmetic: scores and sums in float32, the softmax weights rounded to the values' dtype for the product with the
values (as SDPA's fused kernels do), the output rounded once. :func:`reference` is the same attention in float64,
the twin the tests judge the kernel against; on a machine without a GPU the kernel runs under Triton's interpreter
(``TRITON_INTERPRET=1``). Triton comes with PyTorch's CUDA builds only: without it ``AVAILABLE`` is false and
nothing here is used.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from ..rewrite.transformers_masks import _patched

try:  # Triton comes with PyTorch's CUDA builds only
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:
    triton = None

AVAILABLE = triton is not None
# Triton's interpreter (the tests on a machine without a GPU) multiplies bfloat16 operands of tl.dot wrongly: there
# the kernel widens them to float32 first, which changes nothing else (a product of two bfloat16 values is exact in
# float32, and the softmax weights are still rounded to the values' dtype before their product)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROWS = 16  # query rows one program holds: the heads of a group times the rows at one position
MAX_HEAD_DIM = 256
SPLIT = 128  # cache slots one program reads (the fastest on an H100 for 512 and 2048 slots, 1B and 0.5B heads)


def config(slots: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK_C, splits, num_warps)`` for a cache of ``slots`` slots and heads of ``head_dim``."""
    block_c = 64 if head_dim <= 128 else 32
    return block_c, max(1, math.ceil(slots / SPLIT)), 4


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


def _static(*sizes: Any) -> bool:
    return all(isinstance(s, int) for s in sizes)


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
             is_causal: bool, enable_gqa: bool, devices: tuple[str, ...] = ("cuda",)) -> bool:
    """Whether :func:`decode_attention` computes this SDPA call: batch 1, every size static, no dropout, not causal,
    a float mask that is one row over the slots (``[..., 1, C]``, every other size 1) or none, query heads a multiple
    of the key/value heads (grouped only when ``enable_gqa`` says so), at most ``MAX_ROWS`` query rows a key/value
    head, float tensors of one dtype on one of ``devices``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or dropout_p or is_causal:
        return False
    if not _static(*q.shape, *k.shape, *v.shape) or q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
        return False
    if q.device.type not in devices or q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    heads, rows, dim = q.shape[1], q.shape[2], q.shape[3]
    kv_heads, slots = k.shape[1], k.shape[2]
    if v.shape[1] != kv_heads or v.shape[2] != slots or k.shape[3] != dim or heads % kv_heads:
        return False
    if heads != kv_heads and not enable_gqa:
        return False
    if (heads // kv_heads) * rows > MAX_ROWS or max(dim, v.shape[3]) > MAX_HEAD_DIM or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        return False
    if mask is not None:
        if not mask.is_floating_point() or not _static(*mask.shape) or mask.shape[-1] != slots:
            return False
        if any(size != 1 for size in mask.shape[:-1]):
            return False
    return True


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None) -> torch.Tensor:
    """The same attention in float64 (the kernel's twin): ``softmax(q kᵀ · scale + mask) v`` with each key/value head
    shared by ``heads // kv_heads`` query heads, in ``q``'s dtype."""
    group = q.shape[1] // k.shape[1]
    q64, k64, v64 = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    scores = q64 @ k64.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        scores = scores + mask.double()
    return (scores.softmax(-1) @ v64).to(q.dtype)


if AVAILABLE:

    @triton.jit
    def _slice_kernel(q_ptr, k_ptr, v_ptr, b_ptr, o_ptr, part_ptr, ml_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, pos_ptr,
                      count_ptr,
                      sq_h, sq_r, sk_h, sk_c, sv_h, sv_c, slots, rows, dim, dim_v, scale,
                      GROUP: tl.constexpr, ROWS_PER_HEAD: tl.constexpr, SPLITS: tl.constexpr, SPLIT_LEN: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                      HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, APPEND: tl.constexpr = False,
                      ROPE: tl.constexpr = False, LAST_MERGES: tl.constexpr = False):
        # APPEND (kernels/decode_step_attention.py): this step's key and value (kn, vn: [Hkv, D], one position) are
        # not in the cache yet. Every program leaves their slot (pos) out of what it reads; the first slice's
        # program scores them from registers and writes them into the cache, so no program reads a slot another
        # writes. ROPE: q and the new key are rotated here first (rotate_half, cos/sin [D]), rounded once
        head = tl.program_id(0)  # the key/value head
        part = tl.program_id(1)  # the slice of slots
        r = tl.arange(0, BLOCK_R)  # row r: query head head * GROUP + r // ROWS_PER_HEAD, its row r % ROWS_PER_HEAD
        d = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        q_head = head * GROUP + r // ROWS_PER_HEAD
        q_row = r % ROWS_PER_HEAD
        live = r < rows
        q_at = q_ptr + q_head[:, None] * sq_h + q_row[:, None] * sq_r
        q = tl.load(q_at + d[None, :], mask=live[:, None] & (d[None, :] < dim), other=0.0)
        if ROPE:
            half = dim // 2
            partner = tl.where(d < half, d + half, d - half)
            sign = tl.where(d < half, -1.0, 1.0)
            cos = tl.load(cos_ptr + d, mask=d < dim, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + d, mask=d < dim, other=0.0).to(tl.float32)
            turned = tl.load(q_at + partner[None, :], mask=live[:, None] & (d[None, :] < dim), other=0.0)
            q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * turned.to(tl.float32) * sin[None, :]).to(
                q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
        pos = -1
        if APPEND:
            pos = tl.load(pos_ptr).to(tl.int32)
            if part == 0:
                k_new = tl.load(kn_ptr + head * dim + d, mask=d < dim, other=0.0)
                if ROPE:
                    k_turned = tl.load(kn_ptr + head * dim + partner, mask=d < dim, other=0.0)
                    k_new = (k_new.to(tl.float32) * cos + sign * k_turned.to(tl.float32) * sin).to(
                        kn_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
                v_new = tl.load(vn_ptr + head * dim_v + dv, mask=dv < dim_v, other=0.0)
                tl.store(k_ptr + head * sk_h + pos * sk_c + d, k_new, mask=d < dim)
                tl.store(v_ptr + head * sv_h + pos * sv_c + dv, v_new, mask=dv < dim_v)
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale
                if HAS_BIAS:
                    s_new += tl.load(b_ptr + pos).to(tl.float32)
                m_i = s_new
                m_safe0 = tl.where(s_new == float("-inf"), 0.0, s_new)
                w_new = tl.exp(s_new - m_safe0).to(v_new.dtype)
                l_i = w_new.to(tl.float32)
                acc = w_new.to(tl.float32)[:, None] * v_new.to(tl.float32)[None, :]
        start = part * SPLIT_LEN
        for offset in range(0, SPLIT_LEN, BLOCK_C):
            c = start + offset + tl.arange(0, BLOCK_C)
            inside = (c < slots) & (c != pos)
            k = tl.load(k_ptr + head * sk_h + c[:, None] * sk_c + d[None, :],
                        mask=inside[:, None] & (d[None, :] < dim), other=0.0)
            if IEEE:  # float32 operands, or Triton's interpreter (whose dot misreads bfloat16): exact products
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = (s * scale).to(tl.float32)  # Inductor passes the scale as a float64 scalar
            if HAS_BIAS:
                s += tl.load(b_ptr + c, mask=inside, other=0.0).to(tl.float32)[None, :]
            s = tl.where(inside[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slice past the cache's end: nothing to add
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(v_ptr + head * sv_h + c[:, None] * sv_c + dv[None, :],
                        mask=inside[:, None] & (dv[None, :] < dim_v), other=0.0)
            # the softmax weights rounded to the values' dtype for their product, as SDPA's fused kernels do, and
            # summed as rounded: the output divides by the weights it used
            weights = tl.exp(s - m_safe[:, None]).to(v.dtype)
            l_i = l_i * alpha + tl.sum(weights.to(tl.float32), 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(weights.to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(weights, v)
            m_i = m_new
        if SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(o_ptr + (q_head[:, None] * ROWS_PER_HEAD + q_row[:, None]) * dim_v + dv[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=live[:, None] & (dv[None, :] < dim_v))
        else:
            at = (head * SPLITS + part) * BLOCK_R + r
            tl.store(part_ptr + at[:, None] * BLOCK_DV + dv[None, :], acc)
            tl.store(ml_ptr + 2 * at, m_i)
            tl.store(ml_ptr + 2 * at + 1, l_i)
            if LAST_MERGES:  # the head's slices counted as they finish (acq_rel: each one's sums are visible to
                # the program that counts after it); the last merges them, and no merge kernel is launched
                done = tl.atomic_add(count_ptr + head, 1, sem="acq_rel")
                if done == SPLITS - 1:
                    _merge(head, o_ptr, part_ptr, ml_ptr, rows, dim_v, GROUP, ROWS_PER_HEAD, SPLITS, BLOCK_R,
                           BLOCK_DV)

    @triton.jit
    def _merge(head, o_ptr, part_ptr, ml_ptr, rows, dim_v, GROUP: tl.constexpr, ROWS_PER_HEAD: tl.constexpr,
               SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
        # the slices' partial sums read past the L1 (.cg): in the slice kernel's last program they were written by
        # other programs
        r = tl.arange(0, BLOCK_R)
        dv = tl.arange(0, BLOCK_DV)
        m_all = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        for part in tl.static_range(SPLITS):
            at = (head * SPLITS + part) * BLOCK_R + r
            m_all = tl.maximum(m_all, tl.load(ml_ptr + 2 * at, cache_modifier=".cg"))
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        total = tl.zeros([BLOCK_R], dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], dtype=tl.float32)
        for part in tl.static_range(SPLITS):
            at = (head * SPLITS + part) * BLOCK_R + r
            weight = tl.exp(tl.load(ml_ptr + 2 * at, cache_modifier=".cg") - m_safe)
            total += weight * tl.load(ml_ptr + 2 * at + 1, cache_modifier=".cg")
            acc += weight[:, None] * tl.load(part_ptr + at[:, None] * BLOCK_DV + dv[None, :], cache_modifier=".cg")
        out = acc / total[:, None]
        q_head = head * GROUP + r // ROWS_PER_HEAD
        q_row = r % ROWS_PER_HEAD
        tl.store(o_ptr + (q_head[:, None] * ROWS_PER_HEAD + q_row[:, None]) * dim_v + dv[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(r[:, None] < rows) & (dv[None, :] < dim_v))

    @triton.jit
    def _merge_kernel(o_ptr, part_ptr, ml_ptr, rows, dim_v,
                      GROUP: tl.constexpr, ROWS_PER_HEAD: tl.constexpr, SPLITS: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
        _merge(tl.program_id(0), o_ptr, part_ptr, ml_ptr, rows, dim_v, GROUP, ROWS_PER_HEAD, SPLITS, BLOCK_R,
               BLOCK_DV)

    def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               scale: float, block_c: int, splits: int, warps: int, wrap=lambda kernel: kernel,
               append: tuple | None = None, count: torch.Tensor | None = None) -> None:
        """One attention at the given tile and number of slices (``wrap``: ``wrap_triton`` inside the op). ``q``
        ``[1, H, R, D]``, ``k``/``v`` ``[1, Hkv, C, D]`` with unit last strides, ``bias`` ``[C]`` or None, ``out``
        ``[1, H, R, Dv]`` contiguous. ``append``: ``(k_new, v_new, cos, sin, position)``, this step's key and value
        ``[Hkv, D]`` contiguous written into ``k``/``v`` at ``position`` ``[1]`` by the kernel, q and the key rotated
        first where ``cos``/``sin`` ``[D]`` are given (kernels/decode_step_attention.py). ``count``: ``[Hkv]``
        int32 zeros; with more than one slice the last program of each head merges the slices (and leaves its
        count at the number of slices), instead of a second kernel."""
        heads, per_head, dim = q.shape[1], q.shape[2], q.shape[3]
        kv_heads, slots, dim_v = k.shape[1], k.shape[2], v.shape[3]
        group = heads // kv_heads
        rows = group * per_head
        block_r, block_d, block_dv = _pow2(rows), _pow2(dim), _pow2(dim_v)
        split_len = math.ceil(math.ceil(slots / splits) / block_c) * block_c
        splits = math.ceil(slots / split_len)
        parts = torch.empty((kv_heads * splits * block_r, block_dv) if splits > 1 else (1,), dtype=torch.float32,
                            device=q.device)
        ml = torch.empty((kv_heads * splits * block_r * 2) if splits > 1 else 1, dtype=torch.float32, device=q.device)
        new = [t if t is not None else ml for t in (append or (None,) * 5)]
        rope = append is not None and append[2] is not None
        wrap(_slice_kernel)[(kv_heads, splits)](
            q, k, v, bias if bias is not None else ml, out, parts, ml, *new, count if count is not None else ml,
            q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), slots, rows, dim, dim_v,
            scale, GROUP=group, ROWS_PER_HEAD=per_head, SPLITS=splits, SPLIT_LEN=split_len, BLOCK_R=block_r,
            BLOCK_C=block_c, BLOCK_D=block_d, BLOCK_DV=block_dv, HAS_BIAS=bias is not None,
            IEEE=q.dtype == torch.float32 or INTERPRETED, APPEND=append is not None, ROPE=rope,
            LAST_MERGES=count is not None and splits > 1, num_warps=warps)
        if splits > 1 and count is None:
            wrap(_merge_kernel)[(kv_heads,)](out, parts, ml, rows, dim_v, GROUP=group, ROWS_PER_HEAD=per_head,
                                             SPLITS=splits, BLOCK_R=block_r, BLOCK_DV=block_dv, num_warps=warps)

    @triton_op("exporter::decode_attention", mutates_args={})
    def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],  # noqa: UP045
                         scale: float) -> torch.Tensor:
        """``softmax(q kᵀ · scale + bias) v`` for ``q [1, H, R, D]`` over ``k``, ``v`` ``[1, Hkv, C, D]`` (each
        key/value head shared by ``H // Hkv`` query heads), ``bias`` one row over the ``C`` slots or None."""
        out = torch.empty((1, q.shape[1], q.shape[2], v.shape[3]), dtype=q.dtype, device=q.device)
        block_c, splits, warps = config(k.shape[2], q.shape[3])
        row = None if bias is None else bias.reshape(k.shape[2]).contiguous()
        launch(q.contiguous() if q.stride(-1) != 1 else q, k, v, row, out, scale, block_c, splits, warps,
               wrap=wrap_triton)
        return out

    @triton.jit
    def _mask_kernel(pad_ptr, pos_ptr, out_ptr, slots, queries, low, BLOCK: tl.constexpr):
        row = tl.program_id(0)  # batch row row // queries, query row % queries
        position = tl.load(pos_ptr + row % queries)
        for start in range(0, slots, BLOCK):
            c = start + tl.arange(0, BLOCK)
            inside = c < slots
            pad = tl.load(pad_ptr + (row // queries) * slots + c, mask=inside, other=0)
            value = tl.where((pad != 0) & (c <= position), 0.0, low).to(tl.float32)  # a float64 scalar in Inductor
            tl.store(out_ptr + row * slots + c, value.to(out_ptr.dtype.element_ty), mask=inside)

    @triton_op("exporter::step_mask", mutates_args={})
    def step_mask(padding_mask: torch.Tensor, cache_position: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``generation.cache.step_mask`` as one kernel: ``[B, 1, q, C]``, 0 where query i may see slot j (j at most
        its position and not padding), the dtype's lowest value elsewhere."""
        batch, slots = padding_mask.shape
        queries = cache_position.shape[0]
        out = torch.empty((batch, 1, queries, slots), dtype=dtype, device=padding_mask.device)
        wrap_triton(_mask_kernel)[(batch * queries,)](padding_mask.contiguous(), cache_position.contiguous(), out,
                                                      slots, queries, torch.finfo(dtype).min,
                                                      BLOCK=min(1024, _pow2(slots)))
        return out


_MASK_DEVICES: tuple[str, ...] = ()  # set inside routed(): where the step's mask is built by exporter::step_mask


def mask_in_kernel(padding_mask: torch.Tensor) -> bool:
    """Whether ``generation.cache.step_mask`` builds this step's mask with ``exporter::step_mask`` (inside
    :func:`routed`, on one of its devices)."""
    return padding_mask.device.type in _MASK_DEVICES


class _Route(TorchFunctionMode):
    """Each SDPA call that :func:`eligible` accepts becomes :func:`decode_attention`; the rest run as before."""

    def __init__(self, devices: tuple[str, ...]):
        super().__init__()
        self.devices = devices
        self.routed = 0
        self.kept = 0
        self.gqa_forced = False  # set by the patched use_gqa_in_sdpa for the call that follows it

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        forced, self.gqa_forced = self.gqa_forced, False
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = {**dict(zip(names, args)), **kwargs}
        q, k, v = call["query"], call["key"], call["value"]
        mask, scale = call.get("attn_mask"), call.get("scale")
        if eligible(q, k, v, mask, call.get("dropout_p", 0.0), bool(call.get("is_causal", False)),
                    bool(call.get("enable_gqa", False)), self.devices):
            self.routed += 1
            return torch.ops.exporter.decode_attention(q, k, v, mask,
                                                       scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
        self.kept += 1
        if forced and q.shape[1] != k.shape[1]:  # as transformers would have called it: the heads repeated
            group = q.shape[1] // k.shape[1]
            call["key"], call["value"] = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            call.pop("enable_gqa", None)
        return func(**call)


@contextlib.contextmanager
def routed(active: bool = True, devices: tuple[str, ...] = ("cuda",)) -> Iterator[_Route | None]:
    """Inside: SDPA calls that :func:`eligible` accepts run :func:`decode_attention` (a program traced here holds
    it), the step's mask is built by ``exporter::step_mask``, and transformers passes grouped-query heads
    unrepeated. Yields the router (its ``routed`` and ``kept`` count the calls), or None where the kernel is not
    available or ``active`` is false."""
    if not (active and AVAILABLE):
        yield None
        return
    global _MASK_DEVICES
    route = _Route(devices)
    before, _MASK_DEVICES = _MASK_DEVICES, devices
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_gqa_unrepeated(route))
            stack.enter_context(route)
            yield route
    finally:
        _MASK_DEVICES = before


@contextlib.contextmanager
def _gqa_unrepeated(route: _Route) -> Iterator[None]:
    """transformers' SDPA entry told that SDPA takes grouped-query heads as they are, where the mask is one row (the
    router repeats them itself for a call it keeps)."""
    try:
        from transformers.integrations import sdpa_attention  # noqa: PLC0415 - transformers is optional
    except ImportError:
        yield
        return
    if getattr(sdpa_attention, "use_gqa_in_sdpa", None) is None:
        yield
        return

    def unrepeated(original: Callable[..., bool]) -> Callable[..., bool]:
        def use_gqa_in_sdpa(attention_mask, key, *args, **kwargs):
            if original(attention_mask, key, *args, **kwargs):
                return True
            one_row = attention_mask is None or all(size == 1 for size in attention_mask.shape[:-1])
            route.gqa_forced = one_row
            return one_row
        return use_gqa_in_sdpa

    with _patched(sdpa_attention, "use_gqa_in_sdpa", unrepeated):
        yield
