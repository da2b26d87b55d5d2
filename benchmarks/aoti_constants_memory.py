"""Host memory that saving an exported program and packaging an AOTInductor model add, beyond the weights.

    python benchmarks/aoti_constants_memory.py [--layers 24] [--width 4096]

A model of ``layers`` bf16 ``Linear(width, width)`` (weights only matter here, the graph is trivial) is exported,
saved with ``torch.export.save`` and compiled with ``aoti_compile_and_package`` the way ``exporter`` builds
large models (weights in one blob beside the library), on the CPU; a thread samples the process's RSS every
10 ms and each step prints its peak above the RSS it started from, as a fraction of the weights' bytes.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    peak = [0]

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    program = torch.export.export(model, (torch.zeros(2, args.width, dtype=torch.bfloat16),))
    print(f"torch {torch.__version__}; weights {weights / 2**30:.2f} GiB")
    with tempfile.TemporaryDirectory() as folder:
        steps = {
            "torch.export.save": lambda: torch.export.save(program, str(Path(folder) / "model.pt2")),
            "aoti_compile_and_package, weights in a blob": lambda: torch._inductor.aoti_compile_and_package(
                program, package_path=str(Path(folder) / "model.aoti.pt2"),
                inductor_configs={"aot_inductor.package_constants_in_so": False,
                                  "aot_inductor.package_constants_on_disk_format": "binary_blob"}),
        }
        for name, step in steps.items():
            time.sleep(0.05)
            start = peak[0] = rss_bytes()
            t0 = time.perf_counter()
            step()
            time.sleep(0.05)
            added = peak[0] - start
            print(f"{name}: +{added / 2**30:.2f} GiB at its peak ({added / weights:.2f} x the weights), "
                  f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
