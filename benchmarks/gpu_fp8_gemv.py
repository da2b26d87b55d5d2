"""On the GPU machine: the fp8 weight-only product of one row (a batch-1 decode step's linears), three ways, at
the Llama-3.1-8B and Llama-3.2-1B shapes, replayed from a CUDA graph over enough copies of each weight that
none is read from L2:

- ``bf16``: ``F.linear`` on the bf16 weight (cuBLAS), the bytes fp8 halves;
- ``inductor``: exporter's unfused form (``weight_only_product``) under torch.compile with coordinate-descent
  tuning and static shapes (what the decode program of batch 1 compiles today);
- ``triton``: ``fp8_gemv_kernel``'s kernel (beside this script) at every tile and split of a small sweep, and at the
  tile ``fp8_gemv.config`` chooses.

Then ``exporter::fp8_gemv`` exported with ``torch.export``, compiled by AOTInductor, loaded back and compared.

    PYTHONPATH=src:benchmarks python3 benchmarks/gpu_fp8_gemv.py OUT.json

Measured once (docs/quantization.md, "A hand-written kernel"): the kernel does not beat Inductor's own
reduction over a whole layer, so exporter does not ship it; it stays here with the figures it made.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback

import fp8_gemv_kernel as fp8_gemv
import torch
import torch.nn.functional as F
from gpu_fp8_layer import timed

from exporter.quantize import fp8

SHAPES = {  # name: (N, K); fused: the products exporter fuses (q, k, v; gate, up)
    "8b.qkv_fused": (6144, 4096), "8b.q": (4096, 4096), "8b.kv": (1024, 4096), "8b.o": (4096, 4096),
    "8b.gateup_fused": (28672, 4096), "8b.gate": (14336, 4096), "8b.down": (4096, 14336),
    "1b.qkv_fused": (3072, 2048), "1b.o": (2048, 2048), "1b.gateup_fused": (16384, 2048), "1b.down": (2048, 8192),
}
LAYER = {"8b": ["8b.qkv_fused", "8b.o", "8b.gateup_fused", "8b.down"],
         "8b_unfused": ["8b.q", "8b.kv", "8b.kv", "8b.o", "8b.gate", "8b.gate", "8b.down"],
         "1b": ["1b.qkv_fused", "1b.o", "1b.gateup_fused", "1b.down"]}
TILES = [(4, 1024), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 128), (32, 256)]
SPLITS = [1, 2, 4, 8]
WARPS = [4, 8]


def graph_time(calls, rounds=20):
    """ms per call: every call captured once in a CUDA graph (gpu_fp8_layer's timing), replayed ``rounds`` times."""
    return timed(lambda: [c() for c in calls], iters=rounds) / len(calls)


def triton_call(x, qw, s, out, block_n, block_k, split, warps):
    n, k = qw.shape
    parts = torch.empty((split, n), dtype=torch.float32, device=x.device)

    def call():
        fp8_gemv._fp8_gemv_kernel[(n // block_n, split)](x.reshape(k), qw, parts, n, k, k // split,
                                                         BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
        torch.mul(parts.sum(0), s.reshape(n), out=out)
    return call


def shape_row(name, n, k):
    copies = max(4, math.ceil(400e6 / (n * k)))
    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k) for _ in range(copies)]
    quant = [fp8.quantize_weight(w) for w in weights]
    row = {"shape": [n, k], "copies": copies, "fp8_mb": n * k / 1e6}
    row["bf16_ms"] = graph_time([lambda w=w: F.linear(x, w) for w in weights])
    ref = (x.double() @ fp8.dequantize(*quant[0], torch.float64).t())
    compiled = torch.compile(fp8.weight_only_product, dynamic=False, options={"coordinate_descent_tuning": True})
    t0 = time.perf_counter()
    got = compiled(x, *quant[0])
    row["inductor_compile_s"] = time.perf_counter() - t0
    row["inductor_rel_err"] = float((got.double() - ref).norm() / ref.norm())
    row["inductor_ms"] = graph_time([lambda q=q: compiled(x, *q) for q in quant])
    sweep = []
    out = torch.empty(n, dtype=torch.float32, device="cuda")
    for block_n, block_k in TILES:
        for split in SPLITS:
            if n % block_n or k % (block_k * split):
                continue
            for warps in WARPS:
                try:
                    calls = [triton_call(x, qw, s, out, block_n, block_k, split, warps) for qw, s in quant]
                    ms = graph_time(calls)
                    calls[0]()
                    err = float((out.double() - ref.reshape(n)).norm() / ref.norm())
                    sweep.append({"tile": [block_n, block_k], "split": split, "warps": warps, "ms": ms,
                                  "rel_err": err})
                except Exception as exc:
                    sweep.append({"tile": [block_n, block_k], "split": split, "warps": warps,
                                  "error": f"{type(exc).__name__}: {exc}"[:300]})
    timed = [s for s in sweep if "ms" in s]
    row["triton_best"] = min(timed, key=lambda s: s["ms"]) if timed else None
    row["triton_sweep"] = sweep
    if fp8_gemv.eligible(x, quant[0][0]):
        op = torch.ops.exporter.fp8_gemv
        row["op_config"] = list(fp8_gemv.config(n, k))
        row["op_ms"] = graph_time([lambda q=q: op(x, *q) for q in quant])
        got = op(x, *quant[0])
        row["op_rel_err"] = float((got.double() - ref).norm() / ref.norm())
    for key in ("bf16_ms", "inductor_ms", "op_ms"):
        if key in row:
            row[key.replace("_ms", "_tb_s")] = n * k * (2 if key == "bf16_ms" else 1) / row[key] / 1e9
    if row.get("triton_best"):
        row["triton_best_tb_s"] = n * k / row["triton_best"]["ms"] / 1e9
    print(f"{name:16s} bf16 {row['bf16_ms']:.4f} ms  inductor {row['inductor_ms']:.4f}  "
          f"triton best {row['triton_best'] and row['triton_best']['ms']:.4f} {row['triton_best']}  "
          f"op {row.get('op_ms')}", flush=True)
    return row


class OneLinear(torch.nn.Module):
    def __init__(self, n, k):
        super().__init__()
        qw, s = fp8.quantize_weight(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k))
        self.register_buffer("qweight", qw)
        self.register_buffer("scales", s)

    def forward(self, x):
        return torch.ops.exporter.fp8_gemv(torch.nn.functional.silu(x), self.qweight, self.scales) * 2


def aoti_round_trip(tmp="/tmp/fp8_gemv.pt2"):
    model = OneLinear(14336, 4096)
    x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    program = torch.export.export(model, (x,), strict=False)
    nodes = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    t0 = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(program, package_path=tmp)
    compile_s = time.perf_counter() - t0
    loaded = torch._inductor.aoti_load_package(path)
    got, want = loaded(x), model(x)
    ms = graph_time([lambda: loaded(x)] * 8)
    return {"nodes": nodes, "compile_s": compile_s, "max_abs_diff": float((got - want).abs().max()),
            "ms": ms}


def main(path):
    result = {"torch": torch.__version__, "triton": fp8_gemv.triton.__version__ if fp8_gemv.AVAILABLE else None,
              "device": torch.cuda.get_device_name(), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        try:
            result["shapes"][name] = shape_row(name, n, k)
        except Exception:
            result["shapes"][name] = {"error": traceback.format_exc()[-2000:]}
            print(name, result["shapes"][name]["error"], flush=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    layers = {}
    for layer, names in LAYER.items():
        rows = [result["shapes"].get(n, {}) for n in names]
        if all("bf16_ms" in r for r in rows):
            layers[layer] = {key: sum(r[key] for r in rows) for key in ("bf16_ms", "inductor_ms")}
            if all(r.get("triton_best") for r in rows):
                layers[layer]["triton_best_ms"] = sum(r["triton_best"]["ms"] for r in rows)
            if all("op_ms" in r for r in rows):
                layers[layer]["op_ms"] = sum(r["op_ms"] for r in rows)
    result["layers"] = layers
    print(json.dumps(layers, indent=1), flush=True)
    try:
        result["aoti"] = aoti_round_trip()
    except Exception:
        result["aoti"] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(result["aoti"], indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
