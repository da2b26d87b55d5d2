"""On the GPU machine, one call: sweep ``exporter::gemv``'s tiles at one shape's products, bf16 and fp8 weight-only
(``benchmarks/gpu_gemv.py`` with ``SWEEP`` and ``FP8``), then build and time that shape's decode program of batch 1
with each product at its best tile (``benchmarks/gpu_decode_probe.py`` variant 15, bf16 then fp8), so the tiles a
new ``gemv.config`` rule would choose are measured in the whole step before the rule is written.

    LD_PRELOAD=... SWEEP=llama8b FP8=1 INDUCTOR=0 TILES=... PYTHONPATH=src:benchmarks \\
        python3 benchmarks/gpu_gemv_tiles.py OUT_DIR [--layers 32]

Writes OUT_DIR/gemv.json (the sweep), OUT_DIR/tiles.json (the best tile per product) and OUT_DIR/decode-probe.*.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gpu_decode_probe
import gpu_gemv

from exporter.kernels import gemv as G


def main() -> int:
    gpu_decode_probe.reexec_with_preload()  # before sys.argv is rewritten below
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    shape = os.environ.get("SWEEP", "llama8b")
    layers = sys.argv[3] if len(sys.argv) > 3 and sys.argv[2] == "--layers" else "32"
    sys.argv = [sys.argv[0], str(out / "gemv.json"), shape]
    gpu_gemv.main()
    rows = json.loads((out / "gemv.json").read_text())["rows"]
    hidden, qkv, inter, vocab = gpu_gemv.SHAPES[shape]
    parts = {"qkv": (qkv, hidden, False), "o": (hidden, hidden, False), "gate_up": (inter, hidden, True),
             "down": (hidden, inter, False), "head": (vocab, hidden, False)}
    best: dict[tuple, tuple] = {}
    for row in rows:
        for label, found in row.get("sweep_best", {}).items():
            fp8 = label.startswith("fp8 ")
            n, k, glu = parts[label.removeprefix("fp8 ")]
            if found.get("tile"):
                best[(n, k, glu, fp8)] = tuple(int(v) for v in found["tile"].split("/"))
    (out / "tiles.json").write_text(json.dumps({str(key): tile for key, tile in best.items()}, indent=1))
    print("best tiles:", best, flush=True)
    rule = G.config

    def swept(n: int, k: int, glu: bool = False, fp8: bool = False) -> tuple[int, int, int]:
        return best.get((n, k, glu, fp8)) or rule(n, k, glu, fp8)

    G.config = swept  # the op reads its module's config when it is traced
    os.environ["OUT"] = str(out)
    sys.argv = [sys.argv[0], "--shape", shape, "--layers", layers, "--only", "15", "--fp8", "--fp8-forms", "kernel",
                "--no-eager", "--budget-s", os.environ.get("PROBE_S", "240")]
    gpu_decode_probe.main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
