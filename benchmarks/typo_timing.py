"""How long a typo on the command line takes to be told: each mistake in an option is found before torch loads.

    python benchmarks/typo_timing.py [--runs 5]

Runs ``exporter convert CHECKPOINT`` with one mistake at a time (a recipe name, a ``--set`` key, a ``--dim``, an
``--input``, a ``--target``, conflicting ``--target`` and ``--set targets.build``), each ``--runs`` times in a
fresh process, and prints the median and slowest wall time of each, with the exit code and the error line. The
checkpoint is a tiny random-weight GPT-2 written first (no model hub).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TYPOS = [
    ("a recipe name", ["--recipe", "cpu-fp3"]),
    ("a --set key", ["--set", "numerics.atoll=1e-6"]),
    ("a --dim", ["--dim", "batch=two"]),
    ("an --input", ["--input", "tokens:int64"]),
    ("a --target", ["--target", "aot"]),
    ("--target and --set targets.build", ["--target", "aoti", "--set", "targets.build=onnx"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        checkpoint = Path(work) / "gpt2"
        subprocess.run([sys.executable, "-m", "exporter.testing.random_models", work, "--size", "tiny",
                        "--only", "gpt2"], check=True, capture_output=True)
        checkpoint = Path(work) / "gpt2-tiny"
        print("| mistake | exit | median s | slowest s | error line |")
        print("| --- | --- | --- | --- | --- |")
        for label, extra in TYPOS:
            times, done = [], None
            for _ in range(args.runs):
                t0 = time.perf_counter()
                done = subprocess.run([sys.executable, "-m", "exporter", "convert", str(checkpoint), *extra,
                                       "--out", str(Path(work) / "out")], capture_output=True, text=True)
                times.append(time.perf_counter() - t0)
            assert done is not None
            line = next((ln for ln in done.stderr.splitlines() if ln.startswith("error:")), "")
            print(f"| {label} | {done.returncode} | {statistics.median(times):.2f} | {max(times):.2f} | "
                  f"{line[:90]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
