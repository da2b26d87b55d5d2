"""The generation artifacts: a prefill and a decode program per target, built from ``DecoderStep``.

``export_steps`` exports the step twice: prefill with the prompt length dynamic (2 to the cache length) and
decode with one token; the batch is dynamic in both (1 to the recipe's batch) and the cache length fixed.
The cache tensors are program inputs mutated in place, so the two programs share whatever cache the caller
passes. Files per target:

- ``exported_program``: ``prefill.pt2`` and ``decode.pt2`` (core ATen, SDPA kept as one node);
- ``aoti``: ``prefill.aoti.pt2`` and ``decode.aoti.pt2``, both built without their weights, which are written
  once in ``generation.aoti.weights.safetensors`` and handed to both at load (``aoti_loader.load_package``'s
  ``weights`` and ``constants``): one copy of the weights on disk and on the device, not one per program;
  ``aoti_loader.py`` is beside them.

- ``onnx``: ``prefill.onnx`` and ``decode.onnx``, which take the cache and return it updated (ONNX has no
  in-place input update: ``onnx_programs``), with ``generation.onnx.data`` holding the weights of both once;
  built for CPU float32 recipes (``onnx_programs.refusal``).

``load_steps`` loads a target's two programs back.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..attention_backend import backend_context
from ..rewrite.fused_projections import fused_projections
from ..rewrite.graph_facts import count_graph_ops
from ..targets.exported_program import decomposition_table
from . import onnx_programs
from .cache import CacheLayout, DecoderStep
from .driver import Steps

BUILT = ("exported_program", "aoti", "onnx")
NOT_BUILT = {
    "compile": "not built for text-generation: the AOTI decode replayed in a CUDA graph is the compiled decode "
               "this run times",
}
FILES = {"exported_program": ("prefill.pt2", "decode.pt2"), "aoti": ("prefill.aoti.pt2", "decode.aoti.pt2"),
         "onnx": onnx_programs.FILES}
WEIGHTS = "generation.aoti.weights.safetensors"  # the weights of both AOTI programs, once


@dataclass
class Exported:
    prefill: Any  # torch.export.ExportedProgram, core ATen
    decode: Any
    export_s: float
    notes: list[str] = field(default_factory=list)
    fused: list[dict[str, Any]] = field(default_factory=list)  # projections computed as one product (groups)
    layers: int = 0
    past: tuple[Any, Any] | None = None  # the same two programs as onnx_programs.PastStep (cache in and out)
    past_error: str | None = None  # why those could not be exported


def _examples(layout: CacheLayout, batch: int, prompt: int, cache_length: int, dtype, device):
    ids = torch.ones(batch, prompt, dtype=torch.long, device=device)
    padding = torch.ones(batch, cache_length, dtype=torch.long, device=device)
    kv = layout.allocate(batch, cache_length, dtype, device)
    prefill = (ids, padding, torch.arange(prompt, device=device), kv)
    decode = (ids[:, :1].contiguous(), padding, torch.tensor([prompt], device=device),
              layout.allocate(batch, cache_length, dtype, device))
    return prefill, decode


def export_steps(step: DecoderStep, layout: CacheLayout, batch: int, prompt: int, cache_length: int,
                 dtype: torch.dtype, device: str, fuse: bool = False, past: bool = False) -> Exported:
    """Both programs, decomposed to core ATen with SDPA kept. Named dims first; on a guard torch cannot prove
    over the range (seen on CUDA) the same ranges as ``Dim.DYNAMIC`` hints, noted. ``fuse``: the linears that
    read one tensor (q, k, v; gate, up) exported as one product each (``rewrite.fused_projections``). ``past``:
    also both programs as ``onnx_programs.PastStep`` (the cache in and out), for ONNX; a failure there is
    recorded (``past_error``) and leaves the other programs be."""
    t0 = time.perf_counter()
    with contextlib.ExitStack() as stack:
        groups = []
        if fuse:
            _, probe_args = _examples(layout, 1, prompt, cache_length, dtype, device)
            groups = stack.enter_context(fused_projections(step.model, lambda: step(*probe_args)))
        exported = _export_both(step, layout, batch, prompt, cache_length, dtype, device)
        if past:
            try:
                both = _export_both(onnx_programs.PastStep(step), layout, batch, prompt, cache_length, dtype, device)
                exported.past = (both.prefill, both.decode)
            except Exception as exc:  # the ONNX target fails with it; the others are built
                from ..errors import describe  # noqa: PLC0415

                exported.past_error = describe(exc)
    exported.export_s = time.perf_counter() - t0
    exported.layers = layout.layers
    exported.fused = [g.to_dict() for g in groups]
    if fuse:
        exported.notes.append(f"{len(groups)} groups of linears that read one input exported as one matrix product "
                              "each (generation.fuse_projections)" if groups else
                              "no linears that read one input to fuse (generation.fuse_projections)")
    return exported


def _export_both(step: nn.Module, layout: CacheLayout, batch: int, prompt: int, cache_length: int,
                 dtype: torch.dtype, device: str) -> Exported:
    prefill_args, decode_args = _examples(layout, batch, prompt, cache_length, dtype, device)
    notes: list[str] = []

    def shapes(named: bool):
        make = (lambda name, lo, hi: torch.export.Dim(name, min=lo, max=hi)) if named else \
            (lambda name, lo, hi: torch.export.Dim.DYNAMIC(min=lo, max=hi))
        b = make("batch", 1, batch)
        p = make("prompt", 2, cache_length)
        kv = [{0: b} for _ in range(2 * layout.layers)]
        return ({0: b, 1: p}, {0: b}, {0: p}, kv), ({0: b}, {0: b}, None, kv)

    def export(args, dynamic):
        return torch.export.export(step, args, dynamic_shapes=dynamic, strict=False)

    try:
        named_prefill, named_decode = shapes(True)
        prefill = export(prefill_args, named_prefill)
        decode = export(decode_args, named_decode)
    except Exception as exc:
        if "Constraints violated" not in str(exc):
            raise
        hinted_prefill, hinted_decode = shapes(False)
        prefill = export(prefill_args, hinted_prefill)
        decode = export(decode_args, hinted_decode)
        notes.append("exported with Dim.DYNAMIC hints of the batch and prompt ranges (a guard torch could not "
                     "prove over the named dims' ranges)")
    table = decomposition_table()
    return Exported(prefill.run_decompositions(table), decode.run_decompositions(table), 0.0, notes)


def attention_ops(program: Any) -> dict[str, int]:
    """SDPA and softmax nodes in a program's graph: what its attention runs as."""
    ops = count_graph_ops(program.graph_module.graph)
    return {"sdpa": ops["sdpa"], "softmax": ops["softmax"]}


def target_attention(target: str, exported: Exported, staging: Path) -> dict[str, dict[str, int]]:
    """What each of a built target's programs runs its attention as (ONNX: ``Attention`` nodes count as SDPA)."""
    if target == "onnx":
        return {label: onnx_programs.attention_ops(staging / name) for label, name in zip(("prefill", "decode"),
                                                                                       onnx_programs.FILES)}
    return {"prefill": attention_ops(exported.prefill), "decode": attention_ops(exported.decode)}


def build(target: str, exported: Exported, staging: Path, device: str, attention_backend: str,
          onnx_opset: int = 23) -> list[Path]:
    """Write one target's two programs into ``staging``; returns the files written."""
    prefill_file, decode_file = (staging / name for name in FILES[target])
    if target == "onnx":
        if exported.past is None:
            raise RuntimeError(f"the programs with the cache in and out could not be exported: {exported.past_error}")
        return onnx_programs.build(*exported.past, exported.layers, staging, onnx_opset)
    if target == "exported_program":
        torch.export.save(exported.prefill, str(prefill_file))
        torch.export.save(exported.decode, str(decode_file))
        return [prefill_file, decode_file]
    import torch._inductor.config as inductor_config  # noqa: PLC0415

    from ..outdir import save_named_tensors  # noqa: PLC0415
    from ..targets import aoti_loader  # noqa: PLC0415
    from ..targets.aoti import LOADER, program_tensors  # noqa: PLC0415

    tensors = shared_tensors(program_tensors(exported.prefill), program_tensors(exported.decode))
    with contextlib.ExitStack() as stack:
        stack.enter_context(backend_context(attention_backend, device))
        if device != "cpu":
            stack.enter_context(inductor_config.patch({"cpp.vec_isa_ok": False}))
        configs = {"aot_inductor.package_constants_in_so": False}
        for program, path in ((exported.prefill, prefill_file), (exported.decode, decode_file)):
            torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    weights = staging / WEIGHTS
    save_named_tensors(weights, tensors)
    loader = staging / LOADER
    shutil.copyfile(aoti_loader.__file__, loader)
    return [prefill_file, decode_file, weights, loader]


def shared_tensors(prefill: list[tuple[str, torch.Tensor]],
                   decode: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The constants of both programs, each name once. Both come from one module, so a name they share is one
    weight; one that differed between them (a constant traced differently) could not be shared, and is refused."""
    merged = dict(prefill)
    for name, tensor in decode:
        mine = merged.setdefault(name, tensor)
        if mine is not tensor and (mine.shape != tensor.shape or mine.dtype != tensor.dtype
                                   or not torch.equal(mine, tensor)):
            raise RuntimeError(f"the prefill and decode programs hold different values for constant {name!r}: "
                               "their weights cannot be shared")
    return sorted(merged.items())


def load_steps(target: str, folder: Path, layout: CacheLayout, cache_length: int, dtype: torch.dtype,
               device: str) -> Steps:
    """A built target's programs, callable as ``Steps``."""
    prefill_file, decode_file = (folder / name for name in FILES[target])
    fresh = None
    prefill: Any
    decode: Any
    if target == "exported_program":
        prefill = torch.export.load(str(prefill_file)).module()
        decode = torch.export.load(str(decode_file)).module()
    elif target == "aoti":
        from ..targets.aoti_loader import load_package  # noqa: PLC0415

        weights = str(folder / WEIGHTS)
        prefill = load_package(prefill_file, weights=weights)
        decode = load_package(decode_file, weights=weights, constants=prefill.constants)
        fresh = lambda: load_package(decode_file, weights=weights, constants=prefill.constants)  # noqa: E731
    elif target == "onnx":
        prefill, decode = onnx_programs.OnnxStep(prefill_file), onnx_programs.OnnxStep(decode_file)
    else:
        raise ValueError(f"no generation programs for target {target!r}")
    return Steps(prefill, decode, layout, cache_length, dtype, device, fresh)
