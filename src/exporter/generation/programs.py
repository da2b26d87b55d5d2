"""Exporting a decoder's two programs from ``DecoderStep``: prefill and decode.

``export_steps`` exports the step twice: prefill with the prompt length dynamic (2 to the cache length) and
decode with one token; the batch is dynamic in both (1 to the recipe's batch) and the cache length fixed.
With ``one`` (``generation.decode_batch_1``) the decode program is exported once more with every shape static
and the batch 1: what a target that compiles it apart (AOTI, tuned to one row) builds for a batch of one.
The cache tensors are program inputs mutated in place, so the two programs share whatever cache the caller
passes. With ``past`` it also exports both as ``PastStep`` (the cache in and returned updated), the form ONNX
can express. In the decode program of batch 1 a weight-only fp8 linear runs ``quantize.fp8_gemv``'s kernel on
CUDA, and with ``fuse`` the weight-only fp8 linears that read one input are fused too, in every program, so the
three keep one copy of the weights (docs/quantization.md, "The kernel of one row"). Each target writes and loads
its own files from these programs (``build_decoder`` and
``load_decoder`` in ``exporter/targets/<kind>.py``; the files each writes are its ``decoder`` row in
``exporter/targets/__init__.py``).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import describe
from ..kernels import decode_products, decode_step_attention, gemv
from ..kernels.decode_attention import routed
from ..quantize.fp8 import Fp8Linear
from ..quantize.fp8_gemv import one_row_kernel
from ..quantize.schemes import scheme
from ..targets.context import DecoderPrograms
from ..targets.exported_program import decomposition_table
from .cache import CacheLayout, DecoderStep
from .fused_projections import fused_projections


class PastStep(nn.Module):
    """``DecoderStep`` without in-place inputs: it updates copies of the cache and returns them after the
    logits (the form ONNX can express)."""

    def __init__(self, step: nn.Module):
        super().__init__()
        self.step = step

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor, cache_position: torch.Tensor,
                kv: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        present = [t.clone() for t in kv]
        logits = self.step(input_ids, padding_mask, cache_position, present)
        return (logits, *present)


def _examples(layout: CacheLayout, batch: int, prompt: int, cache_length: int, dtype, device):
    ids = torch.ones(batch, prompt, dtype=torch.long, device=device)
    padding = torch.ones(batch, cache_length, dtype=torch.long, device=device)
    kv = layout.allocate(batch, cache_length, dtype, device)
    prefill = (ids, padding, torch.arange(prompt, device=device), kv)
    decode = (ids[:, :1].contiguous(), padding, torch.tensor([prompt], device=device),
              layout.allocate(batch, cache_length, dtype, device))
    return prefill, decode


def export_steps(step: DecoderStep, layout: CacheLayout, batch: int, prompt: int, cache_length: int,
                 dtype: torch.dtype, device: str, fuse: bool = False, past: bool = False,
                 one: bool = False, attention_kernel: bool = False, gemv_kernel: bool = False,
                 step_kernel: bool = False) -> DecoderPrograms:
    """Both programs, decomposed to core ATen with SDPA kept. Named dims first; on a guard torch cannot prove
    over the range (seen on CUDA) the same ranges as ``Dim.DYNAMIC`` hints, noted. ``fuse``: the linears that
    read one tensor (q, k, v; gate, up) exported as one product each (``generation.fused_projections``).
    ``past``: also both programs as ``PastStep`` (the cache in and out), for ONNX, left as exported (the ONNX
    exporter decomposes them with its own table); a failure there is recorded (``past_error``) and leaves the
    other programs be. ``one``: also the decode program of batch 1, every shape static (``decode_one``); with
    ``attention_kernel`` its attention calls on CUDA run ``exporter::decode_attention``
    (``kernels/decode_attention.py``), the calls it does not take SDPA as before; with ``gemv_kernel`` its
    products of one row on CUDA, with the RMSNorm before and the activation or residual add after each, run
    ``exporter::gemv`` (``kernels/decode_products.py``); with ``step_kernel`` (and ``attention_kernel``) each such
    attention takes this step's rotary embedding and cache write, as ``exporter::decode_step_attention``
    (``kernels/decode_step_attention.py``)."""
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        groups = []
        if fuse:
            _, probe_args = _examples(layout, 1, prompt, cache_length, dtype, device)
            groups = stack.enter_context(fused_projections(step.model, lambda: step(*probe_args),
                                                           fusable(step.model, one)))
        exported = _export_both(step, layout, batch, prompt, cache_length, dtype, device)
        if one:
            _, single = _examples(layout, 1, prompt, cache_length, dtype, device)
            with one_row_kernel(), routed(attention_kernel and device.startswith("cuda")) as route:
                program = torch.export.export(step, single, strict=False)
            if route is not None and step_kernel:
                folded = decode_step_attention.fold(program)  # before the decomposition: index_copy_ still in place
                exported.notes.append(f"the decode program of batch 1: {folded.note()} "
                                      "(generation.decode_step_kernel)")
            exported.decode_one = program.run_decompositions(decompositions(layout))
            if gemv_kernel and device.startswith("cuda") and gemv.AVAILABLE:
                fused = decode_products.fuse(exported.decode_one)
                exported.notes.append(f"the decode program of batch 1: {fused.note()} (generation.decode_gemv_kernel)")
            if route is not None:
                exported.notes.append(f"the decode program of batch 1: {route.routed} attention call(s) as "
                                      f"exporter::decode_attention, {route.kept} kept on SDPA "
                                      "(generation.decode_attention_kernel)")
        if past:
            try:
                both = _export_both(PastStep(step), layout, batch, prompt, cache_length, dtype, device, for_onnx=True)
                exported.past = (both.prefill, both.decode)
            except Exception as exc:  # the ONNX target fails with it; the others are built
                exported.past_error = describe(exc)
    exported.export_s = time.perf_counter() - t0
    exported.layers = layout.layers
    exported.fused = [g.to_dict() for g in groups]
    if fuse:
        exported.notes.append(f"{len(groups)} groups of linears that read one input exported as one matrix product "
                              "each (generation.fuse_projections)" if groups else
                              "no linears that read one input to fuse (generation.fuse_projections)")
    return exported


def fusable(model: nn.Module, one: bool) -> tuple[type, ...]:
    """The linears ``fuse`` groups: ``nn.Linear``, and weight-only fp8 linears where a decode program of batch 1 is
    built (its kernel reads a group's concatenated fp8 weight in one launch). Rowwise fp8 linears stay apart, as
    measured (docs/quantization.md)."""
    kernels = any(isinstance(m, Fp8Linear) and scheme(m.scheme).one_row_kernel for m in model.modules())
    return (nn.Linear, Fp8Linear) if one and kernels else (nn.Linear,)


def decompositions(layout: CacheLayout) -> dict:
    """The decomposition table the programs are lowered with: core ATen with SDPA kept; none for a model that takes
    the 2-D padding mask (``CacheLayout.padding_mask_2d``: BLOOM). Re-traced by ``run_decompositions`` with any
    table, BLOOM's prefill gains a guard that the batch exceeds 1 (its ALiBi biases, shaped from the mask's batch,
    are reshaped against the query's, and the re-trace no longer knows the two batches are one), and a program of
    batch 1 then fails at run time; ``run_decompositions({})`` keeps the program as exported."""
    return {} if layout.padding_mask_2d else decomposition_table()


def dims(named: bool) -> Callable[[str, int, int], Any]:
    """A dimension of ``name`` over ``lo..hi``: a named ``Dim``, or (the retry) a ``Dim.DYNAMIC`` hint."""
    if named:
        return lambda name, lo, hi: torch.export.Dim(name, min=lo, max=hi)
    return lambda name, lo, hi: torch.export.Dim.DYNAMIC(min=lo, max=hi)


def export_pair(steps: tuple[nn.Module, nn.Module], args: tuple[tuple, tuple], shapes: Callable[[Any], tuple],
                table: dict | None, notes: list[str], what: str) -> tuple[Any, Any]:
    """The prefill and decode ``steps`` exported with their ``args`` and ``shapes(dims(named))``, lowered with
    ``table`` (None: left as exported, for the ONNX exporter, which decomposes a program with its own table: a
    decomposition before it would be a second re-trace); named dims first; on a guard torch cannot prove over the
    named dims' ranges (seen on CUDA) the same ranges as ``Dim.DYNAMIC`` hints, noted (``what``: the dims beyond
    the batch)."""
    def export(named: bool) -> tuple[Any, Any]:
        dynamic = shapes(dims(named))
        prefill, decode = (torch.export.export(step, example, dynamic_shapes=shape, strict=False)
                           for step, example, shape in zip(steps, args, dynamic))
        if table is None:
            return prefill, decode
        return prefill.run_decompositions(table), decode.run_decompositions(table)

    try:
        return export(True)
    except Exception as exc:
        if "Constraints violated" not in str(exc):
            raise
        notes.append(f"exported with Dim.DYNAMIC hints of the batch and {what} ranges (a guard torch could not prove "
                     "over the named dims' ranges)")
        return export(False)


def _export_both(step: nn.Module, layout: CacheLayout, batch: int, prompt: int, cache_length: int,
                 dtype: torch.dtype, device: str, for_onnx: bool = False) -> DecoderPrograms:
    """The prefill and decode programs of ``step``; ``for_onnx``: left as exported (``export_pair``)."""
    notes: list[str] = []

    def shapes(make):
        b = make("batch", 1, batch)
        p = make("prompt", 2, cache_length)
        kv = [{0: b} for _ in range(2 * layout.layers)]
        return ({0: b, 1: p}, {0: b}, {0: p}, kv), ({0: b}, {0: b}, None, kv)

    table = None if for_onnx else decompositions(layout)
    prefill, decode = export_pair((step, step), _examples(layout, batch, prompt, cache_length, dtype, device), shapes,
                                  table, notes, "prompt")
    if table == {}:
        notes.append("kept in ATen as exported, not decomposed to core ATen: the model takes the 2-D padding mask, "
                     "and decomposing its programs re-traces them with a batch guard (batch > 1) that a batch of "
                     "one row then fails")
    return DecoderPrograms(prefill, decode, 0.0, notes)
