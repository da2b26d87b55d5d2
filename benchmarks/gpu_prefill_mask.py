"""Where a padded prefill's attention time goes inside an AOTInductor package, and what the mask costs there.

Run on the GPU machine: ``PYTHONPATH=src python3 benchmarks/gpu_prefill_mask.py OUT.json`` (``PROBE_TINY=1``: a
smoke run of the script on the CPU, nothing timed that means anything).

A Llama-3.2-1B-shaped decoder (hidden 2048, 32/8 heads, ``LAYERS`` layers, default 4), rewritten and exported as
``exporter convert`` does (inputs ``input_ids`` and ``attention_mask``, batch and sequence dynamic, decomposed with
SDPA kept), at 4 x 2048 with two rows left-padded by 256. For the program as exported and for each variant below:

- the graph between the 2-D ``attention_mask`` and each SDPA node's ``attn_bias`` (op, shape, strides);
- the AOTInductor package's kernels for one forward (torch.profiler): the top kernels, the attention kernels'
  time, the time of the kernels that build or copy the mask;
- the forward's time (median of CUDA-event timings), and its largest difference from the eager rewritten model.

The eager rewritten model's own SDPA calls are profiled the same way: the attention a package should match.
Variants: ``as exported``; ``realize_reads_threshold=0`` (Inductor keeps any tensor read by several consumers in
one buffer instead of recomputing it in each: the mask is written once and each SDPA reads it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from exporter.measure.kernels import _device_backend
from exporter.modelio import Signature, make_io_module
from exporter.rewrite import rewrite_attention
from exporter.rewrite.transformers_masks import positions_from_model, trivial_masks_skipped
from exporter.targets.exported_program import decomposition_table

TINY = bool(os.environ.get("PROBE_TINY"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def build_model() -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    layers = int(os.environ.get("LAYERS", "4"))
    config = transformers.LlamaConfig(num_hidden_layers=1 if TINY else layers, hidden_size=128 if TINY else 2048,
                                      intermediate_size=256 if TINY else 8192, num_attention_heads=8 if TINY else 32,
                                      num_key_value_heads=2 if TINY else 8, vocab_size=1024 if TINY else 32000,
                                      max_position_embeddings=4096, rope_theta=500000.0)
    return transformers.LlamaForCausalLM(config).eval().to(DEVICE, DTYPE)


def inputs(batch: int, seq: int, pad: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(batch * seq)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[: batch // 2, :pad] = 0
    return [ids.to(DEVICE), mask.to(DEVICE)]


def describe(node, depth: int = 0, seen: set | None = None) -> list[dict[str, Any]]:
    """The producers of ``node`` back to the graph's inputs (at most 12 deep): op, shape and strides."""
    seen = set() if seen is None else seen
    if node in seen or depth > 12 or not hasattr(node, "op"):
        return []
    seen.add(node)
    val = node.meta.get("val")
    entry = {"depth": depth, "name": node.name, "op": str(node.target) if node.op == "call_function" else node.op}
    if isinstance(val, torch.Tensor):
        entry["shape"] = [str(s) for s in val.shape]
        entry["stride"] = [str(s) for s in val.stride()]
        entry["dtype"] = str(val.dtype)
    out = [entry]
    for arg in node.all_input_nodes:
        out += describe(arg, depth + 1, seen)
    return out


def attention_graph(program) -> dict[str, Any]:
    nodes = [n for n in program.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    out: dict[str, Any] = {"sdpa_nodes": [str(n.target) for n in nodes]}
    if nodes:
        first = nodes[0]
        out["first_args"] = []
        for i, arg in enumerate(first.args):
            val = getattr(arg, "meta", {}).get("val") if hasattr(arg, "meta") else None
            out["first_args"].append({"index": i, "name": getattr(arg, "name", repr(arg)),
                                      "shape": [str(s) for s in val.shape] if isinstance(val, torch.Tensor) else None,
                                      "stride": [str(s) for s in val.stride()] if isinstance(val, torch.Tensor)
                                      else None})
        bias = first.args[3] if len(first.args) > 3 else first.kwargs.get("attn_mask") or first.kwargs.get("attn_bias")
        out["bias_producers"] = describe(bias) if hasattr(bias, "op") else repr(bias)
    return out


def profile(call) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    call()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    kernels = [(e.name, float(e.time_range.elapsed_us())) for e in prof.events()
               if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        by_name.setdefault(name, []).append(us)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:14]
    # the fused attention kernels only (measure.kernels' names): Inductor names the pointwise kernels that build the
    # mask after the SDPA op they feed ("triton_poi_fused__scaled_dot_product_cudnn_attention_..."), and the first
    # run of this script counted those too (docs/runs/h100-prefill-mask-probe.json: its attention_ms)
    attention = sum(us for name, us in kernels if _device_backend(name) is not None)
    return {"kernels": len(kernels), "kernel_ms": sum(us for _, us in kernels) / 1e3,
            "attention_ms": attention / 1e3,
            "top": [{"name": n[:160], "calls": len(t), "ms": sum(t) / 1e3} for n, t in top]}


def timed(call, rounds: int = 20) -> float:
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        call()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def first(out) -> torch.Tensor:
    return out[0] if isinstance(out, (list, tuple)) else out


def main() -> int:
    out: dict[str, Any] = {"torch": torch.__version__, "transformers": transformers.__version__,
                           "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "none",
                           "date": time.strftime("%Y-%m-%d")}
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else None

    def save() -> None:
        if path is not None:
            path.write_text(json.dumps(out, indent=1), encoding="utf-8")

    model = build_model()
    shape = (2, 64, 16) if TINY else (4, 2048, 256)
    args = inputs(*shape)
    io = make_io_module(model, Signature(("input_ids", "attention_mask"), ("logits",)), "eager")
    rewritten, _ = rewrite_attention(io, args)
    with torch.inference_mode():
        expected = first(rewritten(*args)).float()
        out["eager"] = {"ms": timed(lambda: rewritten(*args)), **profile(lambda: rewritten(*args))}
    print(json.dumps({"eager": {k: v for k, v in out["eager"].items() if k != "top"}}), flush=True)
    save()
    dynamic = torch.export.Dim.DYNAMIC
    t0 = time.perf_counter()
    with trivial_masks_skipped(positions_from_model(rewritten)):
        program = torch.export.export(rewritten, tuple(inputs(*shape)), strict=False,
                                      dynamic_shapes=({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic}))
    program = program.run_decompositions(decomposition_table())
    out["export_s"] = time.perf_counter() - t0
    out["graph"] = attention_graph(program)
    print(json.dumps(out["graph"])[:3000], flush=True)
    save()
    variants = {"as exported": {}, "realize_reads_threshold=0": {"realize_reads_threshold": 0}}
    if TINY:
        variants = {"as exported": {}}
    work = Path(tempfile.mkdtemp())
    out["variants"] = {}
    for name, configs in variants.items():
        entry: dict[str, Any] = {"configs": configs}
        out["variants"][name] = entry
        try:
            t0 = time.perf_counter()
            package = work / f"{len(out['variants'])}.pt2"
            import torch._inductor.config as inductor_config  # noqa: PLC0415

            with inductor_config.patch({"cpp.vec_isa_ok": False}) if DEVICE == "cuda" else contextlib.nullcontext():
                torch._inductor.aoti_compile_and_package(program, package_path=str(package),
                                                         inductor_configs=configs)
            entry["build_s"] = time.perf_counter() - t0
            keep = os.environ.get("KEEP_CODE")  # a folder: the package's generated C++ is copied there
            if keep:
                import zipfile  # noqa: PLC0415

                with zipfile.ZipFile(package) as archive:
                    for member in archive.namelist():
                        if member.endswith(".cpp"):
                            target = Path(keep) / f"{len(out['variants'])}-{Path(member).name}"
                            target.write_bytes(archive.read(member))
            loaded = torch._inductor.aoti_load_package(str(package))
            with torch.inference_mode():
                got = first(loaded(*args)).float()
                entry["max_abs_diff_vs_eager"] = float((got - expected).abs().max())
                call = functools.partial(loaded, *args)
                entry["ms"] = timed(call)
                entry.update(profile(call))
            del loaded, call
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a finding
            entry["error"] = f"{type(exc).__name__}: {exc}"[:600]
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "top"}}), flush=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
