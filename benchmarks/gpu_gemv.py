"""``exporter::gemv`` against what Inductor writes for the same products of a decode step at batch 1, alone.

Run on the GPU machine: ``PYTHONPATH=src python3 benchmarks/gpu_gemv.py OUT.json [shape ...]``.
``SWEEP=llama8b FP8=1 ... OUT.json llama8b``: sweep that shape's tiles too, and each launch again with the weight in
fp8 with its row scales (fp8 weight-only), the sweep only (labels ``fp8 <part>``); ``INDUCTOR=0``: no Inductor
form.

For the products of one decoder layer and the head of the Llama-3.2-1B, Qwen2-0.5B and Llama-3.1-8B shapes (bf16,
one row), each with what a layer does around it, as transformers' Llama writes it:

- ``qkv``: RMSNorm, then the fused q/k/v product;
- ``o``: the o-projection, then the residual add;
- ``mlp``: RMSNorm, the fused gate/up product, ``silu(gate) * up``, the down projection, the residual add;
- ``head``: the final RMSNorm, then the vocabulary's product.

Each is timed three ways: compiled by Inductor as the decode program of batch 1 is (``coordinate_descent_tuning``,
static shapes: Inductor fuses the norm, the activation and the add into its reductions as it does in the package);
cuBLAS (eager ``F.linear`` with the same surroundings in eager ops, for scale); and ``exporter::gemv`` (the
``mlp`` as two launches: norm + gate/up + activation, then down + residual) at the tile ``gemv.config`` chooses and
over a sweep of tiles (the 1B's and the 0.5B's). Times are µs a call from a CUDA graph of calls that cycle
through enough copies of the weights to overflow the L2 (a weight read again from the L2 would flatter every
form), the median of 20 replays; each form's relative error against float64 is beside it, and the weights' bytes
over the time (TB/s).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from exporter.kernels import gemv as G

# hidden, q/k/v rows, intermediate, vocabulary
SHAPES = {"llama1b": (2048, 2048 + 2 * 512, 8192, 128256), "qwen05b": (896, 896 + 2 * 128, 4864, 151936),
          "llama8b": (4096, 4096 + 2 * 1024, 14336, 128256)}
CALLS = 48
# the shapes whose tiles are swept (the 8B's are timed at config() alone unless SWEEP names it)
SWEPT = tuple(os.environ.get("SWEEP", "llama1b,qwen05b").split(","))
FP8 = os.environ.get("FP8") == "1"
L2_FLUSH_BYTES = 256 << 20  # copies of the weights per graph: at least this many bytes read (the H100/H200 L2 is 50 MB)
EPS = 1e-5
TILES = [(bn, bk, w) for bn in (1, 2, 4, 8) for bk, w in ((512, 2), (1024, 2), (1024, 4), (2048, 4), (2048, 8))]
if os.environ.get("TILES"):  # e.g. TILES=1/512/2,2/1024/2: the sweep's tiles
    TILES = [tuple(int(v) for v in t.split("/")) for t in os.environ["TILES"].split(",")]  # type: ignore[misc]
# rows that no long power of two divides (the 0.5B's 896, 4864): short steps that divide them, more rows a program
ODD_TILES = [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (128, 256) for w in (2, 4)]


def graph_us(calls: list[Callable[[], Any]]) -> float:
    """Microseconds a call, the calls (one per weight copy) repeated to ``CALLS`` in one CUDA graph."""
    seq = [calls[i % len(calls)] for i in range(CALLS)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in seq:
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


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def block_qkv(x, nw, w):
    return F.linear(rms(x, nw), w)


def block_o(a, w, r):
    return r + F.linear(a, w)


def block_mlp(x, nw, wgu, wd):
    gate, up = F.linear(rms(x, nw), wgu).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, wd)


def block_head(x, nw, w):
    return F.linear(rms(x, nw), w)


def ref_mlp(x, nw, wgu, wd):
    m = G.reference(x, wgu, nw, EPS, glu=True)
    return G.reference(m, wd, residual=x)


def _qkv_or_head(x, nw, w):
    return torch.ops.exporter.gemv(x, w, nw, EPS)


def _o(a, w, r):
    return torch.ops.exporter.gemv(a, w, residual=r)


def _mlp(x, nw, wgu, wd):
    return torch.ops.exporter.gemv(torch.ops.exporter.gemv(x, wgu, nw, EPS, True), wd, residual=x)


KERNEL_FORMS = {"qkv": _qkv_or_head, "o": _o, "mlp": _mlp, "head": _qkv_or_head}


def timed(row: dict[str, Any], label: str, fn: Callable[..., Any], args: Callable[[list], tuple],
          sets: list[list[torch.Tensor]], ref: torch.Tensor, nbytes: int) -> None:
    """``fn``'s error and time over the weight copies ``sets`` into ``row``."""
    try:
        row["error"][label] = rel(fn(*args(sets[0])), ref)
        us = graph_us([functools.partial(lambda ws: fn(*args(ws)), ws) for ws in sets])
        row["us"][label] = us
        row["tbps"][label] = nbytes / us / 1e6
    except Exception as exc:  # noqa: BLE001 - a form that fails is noted, the rest still run
        row["error"][label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().reshape(-1) - ref.reshape(-1)).norm() / ref.norm())


def measure(shape: str, done: Callable[[dict[str, Any]], None]) -> None:
    hidden, qkv, inter, vocab = SHAPES[shape]
    dev, bf = "cuda", torch.bfloat16

    def weight(n, k):
        return (torch.randn(n, k, device=dev) / k ** 0.5).to(bf)

    x = torch.randn(1, 1, hidden, device=dev).to(bf)
    a = torch.randn(1, 1, hidden, device=dev).to(bf)
    nw = (1 + 0.1 * torch.randn(hidden, device=dev)).to(bf)
    blocks = {
        "qkv": ([(qkv, hidden)], block_qkv, lambda ws: (x, nw, *ws), lambda ws: G.reference(x, ws[0], nw, EPS)),
        "o": ([(hidden, hidden)], block_o, lambda ws: (a, *ws, x), lambda ws: G.reference(a, ws[0], residual=x)),
        "mlp": ([(2 * inter, hidden), (hidden, inter)], block_mlp, lambda ws: (x, nw, *ws),
                lambda ws: ref_mlp(x, nw, *ws)),
        "head": ([(vocab, hidden)], block_head, lambda ws: (x, nw, *ws), lambda ws: G.reference(x, ws[0], nw, EPS)),
    }
    for name, (dims, eager, args, reference) in blocks.items():
        nbytes = sum(n * k * 2 for n, k in dims)
        copies = max(1, min(16, -(-L2_FLUSH_BYTES // nbytes)))
        sets = [[weight(n, k) for n, k in dims] for _ in range(copies)]
        ref = reference(sets[0])
        compiled = torch.compile(eager, dynamic=False, options={"coordinate_descent_tuning": True})
        row: dict[str, Any] = {"shape": shape, "block": name, "weights_mb": nbytes / 1e6, "copies": copies,
                               "us": {}, "error": {}, "tbps": {}}

        timed(row, "cublas_eager", eager, args, sets, ref, nbytes)
        if os.environ.get("INDUCTOR", "1") == "1":  # INDUCTOR=0: the sweep without Inductor's compile of each block
            timed(row, "inductor", compiled, args, sets, ref, nbytes)
        timed(row, "gemv", KERNEL_FORMS[name], args, sets, ref, nbytes)
        # the sweep: each launch of the block at one tile (the mlp's two launches swept apart)
        sweep: dict[str, Any] = {}
        launches = ([("gate_up", 2 * inter, hidden), ("down", hidden, inter)] if name == "mlp"
                    else [(name, dims[0][0], dims[0][1])])
        for part, n, k in launches + ([("fp8 " + p, n, k) for p, n, k in launches] if FP8 else []):
            fp8 = part.startswith("fp8 ")
            weights = [weight(n, k) for _ in range(max(1, min(16, -(-L2_FLUSH_BYTES // (n * k * (1 if fp8 else 2))))))]
            scales = None
            if fp8:  # weight-only fp8: the weights in float8_e4m3fn, one float32 scale a row
                scales = weights[0].float().abs().amax(1) / 448
                weights = [(w.float() / scales[:, None]).to(torch.float8_e4m3fn) for w in weights]
            part = part.removeprefix("fp8 ")
            glu, normed, res = part == "gate_up", part in ("qkv", "head", "gate_up"), part in ("o", "down")
            src = torch.randn(k, device=dev).to(bf)
            out = torch.empty(n // 2 if glu else n, device=dev, dtype=bf)
            resid = torch.randn(out.numel(), device=dev).to(bf) if res else None
            norm = (1 + 0.1 * torch.randn(k, device=dev)).to(bf) if normed else None
            best = None
            tiles = TILES + (ODD_TILES if k % 1024 else [])
            label = f"fp8 {part}" if fp8 else part
            chosen = G.config(n // 2 if glu else n, k, glu, fp8=fp8)
            for bn, bk, warps in [chosen, *tiles] if shape in SWEPT else [chosen]:
                if bk > max(16, 1 << (k - 1).bit_length()) or f"{label} {bn}/{bk}/{warps}" in sweep:
                    continue

                try:
                    us = graph_us([functools.partial(G.launch, src, w, out, norm, EPS, glu, resid, None, bn, bk, warps,
                                                     scales=scales)
                                   for w in weights])
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is noted
                    sweep[f"{label} {bn}/{bk}/{warps}"] = str(exc).splitlines()[0][:100]
                    continue
                sweep[f"{label} {bn}/{bk}/{warps}"] = us
                if best is None or us < best[1]:
                    best = (f"{bn}/{bk}/{warps}", us)
            nbytes_part = n * k * (1 if fp8 else 2)
            row.setdefault("sweep_best", {})[label] = {
                "tile": best[0] if best else None, "us": best[1] if best else None,
                "tbps": nbytes_part / best[1] / 1e6 if best else None, "config": list(chosen),
                "config_us": sweep.get(f"{label} {chosen[0]}/{chosen[1]}/{chosen[2]}")}
        row["sweep"] = sweep
        done(row)
        print(json.dumps({k: row[k] for k in ("shape", "block", "weights_mb", "us", "tbps", "error", "sweep_best")}),
              flush=True)
        del sets
        torch.cuda.empty_cache()


def copy_tbps() -> float:
    """The device's copy bandwidth (read + write) over 1 GiB, for scale."""
    src = torch.empty(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 2 / graph_us([lambda: dst.copy_(src)]) / 1e6


def main() -> int:
    shapes = [a for a in sys.argv[2:]] or list(SHAPES)
    out: dict[str, Any] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
                           "date": time.strftime("%Y-%m-%d"), "calls_per_graph": CALLS, "rows": []}
    out["copy_tbps"] = copy_tbps()
    print(json.dumps({"gpu": out["gpu"], "copy_tbps": out["copy_tbps"]}), flush=True)
    torch.manual_seed(0)

    def done(row: dict[str, Any]) -> None:  # written after each row: a call cut short keeps what it measured
        out["rows"].append(row)
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)

    for shape in shapes:
        measure(shape, done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
