"""On the GPU machine: the fp8 weight-only product of one row (a batch-1 decode step's linears) at the
Llama-3.1-8B shapes, replayed from a CUDA graph over enough copies of each weight that none is read from L2:

- ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS), the bytes fp8 halves;
- ``kernel``: ``exporter::fp8_gemv`` (``src/exporter/quantize/fp8_gemv.py``) at the tile its ``config`` chooses,
  and every tile of a sweep (rows per program x columns per step x warps), each checked against float64;
- ``inductor`` (``--inductor``): the unfused form (``weight_only_product``) under torch.compile with
  coordinate-descent tuning and static shapes, what the decode program of batch 1 compiled before the kernel.

    PYTHONPATH=src:benchmarks python3 benchmarks/gpu_fp8_gemv.py OUT.json [--inductor] [--budget-s 150]

Prints a line per shape and the sums over one layer (q/k/v and gate/up fused, as the decode program of batch 1
builds them, and unfused); docs/quantization.md quotes them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch
import torch.nn.functional as F
from gpu_fp8_layer import timed

from exporter.quantize import fp8, fp8_gemv

SHAPES = {  # name: (N, K); fused: the products the decode program of batch 1 fuses (q, k, v; gate, up)
    "8b.qkv_fused": (6144, 4096), "8b.q": (4096, 4096), "8b.kv": (1024, 4096),
    "8b.gateup_fused": (28672, 4096), "8b.gate": (14336, 4096), "8b.down": (4096, 14336),
}
LAYER = {"fused": ["8b.qkv_fused", "8b.q", "8b.gateup_fused", "8b.down"],  # o has q's shape
         "unfused": ["8b.q", "8b.kv", "8b.kv", "8b.q", "8b.gate", "8b.gate", "8b.down"]}
SWEEP = [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (512, 1024, 2048, 4096) for w in (2, 4, 8)
         if bn * bk // (32 * w) <= 256]  # at most 256 accumulators a thread


def graph_time(calls, rounds=20):
    """ms per call: every call captured once in a CUDA graph, replayed ``rounds`` times (median of 5)."""
    return timed(lambda: [c() for c in calls], iters=rounds) / len(calls)


def shape_row(name, n, k, inductor, deadline):
    copies = max(4, math.ceil(400e6 / (n * k)))
    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
    quant = [fp8.quantize_weight(w) for w in weights]
    del weights[1:]
    ref = (x.double() @ fp8.dequantize(*quant[0], torch.float64).t()).reshape(n)
    row: dict = {"shape": [n, k], "copies": copies, "fp8_mb": n * k / 1e6}
    bf16 = [weights[0]] + [fp8.dequantize(q, s, torch.bfloat16) for q, s in quant[1:]]
    row["bf16_ms"] = graph_time([lambda w=w: F.linear(x, w) for w in bf16])
    del bf16
    op = torch.ops.exporter.fp8_gemv
    row["kernel_config"] = list(fp8_gemv.config(n, k))
    row["kernel_ms"] = graph_time([lambda q=q: op(x, *q) for q in quant])
    got = op(x, *quant[0]).reshape(n)
    row["kernel_rel_err"] = float((got.double() - ref).norm() / ref.norm())
    if inductor:
        compiled = torch.compile(fp8.weight_only_product, dynamic=False, options={"coordinate_descent_tuning": True})
        t0 = time.perf_counter()
        got = compiled(x, *quant[0]).reshape(n)
        row["inductor_compile_s"] = time.perf_counter() - t0
        row["inductor_rel_err"] = float((got.double() - ref).norm() / ref.norm())
        row["inductor_ms"] = graph_time([lambda q=q: compiled(x, *q) for q in quant])
    sweep = []
    out = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    flat = x.reshape(k)
    for block_n, block_k, warps in SWEEP:
        if block_k > k or time.perf_counter() > deadline:
            continue
        try:
            tile = (block_n, block_k, warps)
            calls = [lambda q=q, s=s, tile=tile: fp8_gemv.launch(flat, q, s.reshape(n), None, out, *tile)
                     for q, s in quant]
            ms = graph_time(calls, rounds=10)
            calls[0]()
            err = float((out.double() - ref).norm() / ref.norm())
            sweep.append({"tile": [block_n, block_k], "warps": warps, "ms": ms, "rel_err": err})
        except Exception as exc:  # noqa: BLE001 - a tile that fails is listed
            sweep.append({"tile": [block_n, block_k], "warps": warps, "error": f"{type(exc).__name__}: {exc}"[:200]})
    timed_rows = sorted((s for s in sweep if "ms" in s), key=lambda s: s["ms"])
    row["sweep_best"] = timed_rows[:5]
    row["sweep"] = sweep
    for key in ("bf16_ms", "kernel_ms", "inductor_ms"):
        if key in row:
            row[key.replace("_ms", "_tb_s")] = n * k * (2 if key == "bf16_ms" else 1) / row[key] / 1e9
    best = timed_rows[0] if timed_rows else {}
    print(f"{name:16s} bf16 {row['bf16_ms'] * 1e3:6.1f} us  kernel {row['kernel_ms'] * 1e3:6.1f} us "
          f"({row['kernel_tb_s']:.2f} TB/s, err {row['kernel_rel_err']:.1e})  inductor "
          f"{row.get('inductor_ms', float('nan')) * 1e3:6.1f}  best tile {best.get('tile')} w{best.get('warps')} "
          f"{best.get('ms', float('nan')) * 1e3:6.1f} us", flush=True)
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--inductor", action="store_true")
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args()
    deadline = time.perf_counter() + args.budget_s
    import triton

    result = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
              "shapes": {}}
    for name, (n, k) in SHAPES.items():
        try:
            result["shapes"][name] = shape_row(name, n, k, args.inductor, deadline)
        except Exception:
            result["shapes"][name] = {"error": traceback.format_exc()[-2000:]}
            print(name, result["shapes"][name]["error"], flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    layers = {}
    for layer, names in LAYER.items():
        rows = [result["shapes"].get(n, {}) for n in names]
        if all("kernel_ms" in r for r in rows):
            layers[layer] = {key: sum(r[key] for r in rows) * 1e3 for key in ("bf16_ms", "kernel_ms")}
            if all(r.get("sweep_best") for r in rows):
                layers[layer]["sweep_best_us"] = sum(r["sweep_best"][0]["ms"] for r in rows) * 1e3
            if all("inductor_ms" in r for r in rows):
                layers[layer]["inductor_us"] = sum(r["inductor_ms"] for r in rows) * 1e3
    result["layers_us"] = layers
    print(json.dumps(layers, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
