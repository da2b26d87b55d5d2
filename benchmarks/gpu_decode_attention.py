"""``exporter::decode_attention`` against SDPA at one decode step, alone: error against float64 and time.

Run on the GPU machine: ``PYTHONPATH=src python3 benchmarks/gpu_decode_attention.py OUT.json``.

For the attention shapes of the Llama-3.2-1B (32/8 heads, head dim 64), Qwen2-0.5B (14/2, 64) and Llama-3.1-8B
(32/8, 128) decoders at batch 1, one query, bf16, caches of 512, 2048 and 8192 slots with an additive mask (the
decode step's: 0, or the dtype's lowest value on a left-padded prompt's first slots):

- what the decode program runs today: transformers' ``repeat_kv`` (each key/value head copied once per query head)
  then SDPA with the mask, under each backend that takes it (cuDNN, memory-efficient; FlashAttention takes no
  mask), and SDPA alone on heads already repeated;
- the kernel at the tile ``decode_attention.config`` chooses, and (1B and 0.5B heads, up to 2048 slots) a sweep
  of tiles, slice lengths and warps.

Each is timed as 50 calls captured in one CUDA graph, replayed 20 times (the median a call): inside a package the
attention runs in a graph too, so a launch's host cost is not what is compared. Its relative L2 error against the
same attention in float64 is beside it.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys
import time
from typing import Any, Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from exporter.kernels import decode_attention as da

SHAPES = {"llama1b": (32, 8, 64), "qwen05b": (14, 2, 64), "llama8b": (32, 8, 128)}
SLOTS = (512, 2048, 8192)
CALLS = 50


def graph_us(call: Callable[[], Any]) -> float:
    """Microseconds a call, replayed from a CUDA graph of ``CALLS`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            call()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def measure(shape: str, heads: int, kv_heads: int, dim: int, slots: int) -> dict[str, Any]:
    """One attention shape: each form's time and error, and the sweep of the kernel's tiles."""
    q = torch.randn(1, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, slots, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_heads, slots, dim, device="cuda", dtype=torch.bfloat16)
    mask = torch.zeros(1, 1, 1, slots, device="cuda", dtype=torch.bfloat16)
    mask[..., :37] = torch.finfo(torch.bfloat16).min  # a left-padded prompt
    group = heads // kv_heads
    ref = da.reference(q.double(), k.double(), v.double(), mask.double())
    row: dict[str, Any] = {"shape": shape, "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "slots": slots,
                           "us": {}, "error": {}}
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def repeated(backend):  # transformers' repeat_kv, then SDPA: what the decode program runs today
        with sdpa_kernel([backend]):
            keys = k[:, :, None].expand(1, kv_heads, group, slots, dim).reshape(1, heads, slots, dim)
            values = v[:, :, None].expand(1, kv_heads, group, slots, dim).reshape(1, heads, slots, dim)
            return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    def alone(backend):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)

    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            row["error"][f"repeat_kv + sdpa {name}"] = rel(repeated(backend), ref)
            row["us"][f"repeat_kv + sdpa {name}"] = graph_us(functools.partial(repeated, backend))
            row["us"][f"sdpa {name}, heads repeated beforehand"] = graph_us(functools.partial(alone, backend))
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the call is not a candidate
            row["error"][f"repeat_kv + sdpa {name}"] = f"refused: {str(exc).splitlines()[0][:100]}"

    def kernel():
        return torch.ops.exporter.decode_attention(q, k, v, mask, 1 / math.sqrt(dim))

    row["error"]["decode_attention"] = rel(kernel(), ref)
    row["us"]["decode_attention"] = graph_us(kernel)
    row["config"] = list(da.config(slots, dim))
    result = torch.empty(1, heads, 1, dim, device="cuda", dtype=torch.bfloat16)

    def tiled(block_c: int, splits: int, warps: int):
        da.launch(q, k, v, mask.reshape(slots), result, 1 / math.sqrt(dim), block_c, splits, warps)
        return result

    sweep = {}
    tiles = (32, 64) if shape != "llama8b" and slots <= 2048 else ()  # the sweep where a call's time allows it
    for block_c in tiles:
        for split in (128, 256, 512, 1024):
            for warps in (2, 4):
                if split < block_c or split > slots * 2:
                    continue
                call = functools.partial(tiled, block_c, max(1, math.ceil(slots / split)), warps)
                try:
                    error = rel(call(), ref)
                    sweep[f"{block_c}/{split}/{warps}"] = {"us": graph_us(call), "error": error}
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is noted
                    sweep[f"{block_c}/{split}/{warps}"] = {"error": str(exc).splitlines()[0][:100]}
    timed = {key: value for key, value in sweep.items() if "us" in value}
    best = min(timed, key=lambda key: timed[key]["us"]) if timed else None
    row["sweep_best"] = {"tile (block_c/split/warps)": best, **(timed[best] if best else {})}
    row["sweep"] = sweep
    return row


def main() -> int:
    out: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                           "date": time.strftime("%Y-%m-%d"), "calls_per_graph": CALLS, "rows": []}
    torch.manual_seed(0)
    for shape, (heads, kv_heads, dim) in SHAPES.items():
        for slots in SLOTS:
            row = measure(shape, heads, kv_heads, dim, slots)
            out["rows"].append(row)
            print(json.dumps({key: row[key] for key in ("shape", "slots", "us", "error", "config", "sweep_best")}),
                  flush=True)
            if len(sys.argv) > 1:
                with open(sys.argv[1], "w", encoding="utf-8") as f:
                    json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
