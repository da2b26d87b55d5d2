"""The precompiled C++ header of an AOTInductor build on the CPU, kept or lost between processes.

Two fresh processes in turn, each with a temporary folder of its own (as a convert's children have) and one shared
``TORCHINDUCTOR_CACHE_DIR``, each compiles an AOTInductor package of a tiny GPT-2 (other weights in the second, so
the package cache would not help); the second's compile time is what every later build pays. ``--mode lost`` leaves
torch's default (the header under the temporary folder, lost with it), ``--mode kept`` is exporter's
(``targets.package_cache.shared_headers``). Prints one line per process.

    python benchmarks/aoti_header_cache.py --mode lost
    python benchmarks/aoti_header_cache.py --mode kept
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import sys, tempfile, time
import torch, transformers
from exporter.targets import package_cache
if sys.argv[1] == "lost":
    package_cache.shared_headers = lambda: None
torch.manual_seed(int(sys.argv[2]))
config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, use_cache=False)
model = transformers.GPT2LMHeadModel(config).eval()
program = torch.export.export(model, (torch.ones(2, 16, dtype=torch.long),), strict=False)
t0 = time.perf_counter()
package_cache.compile_package(program, tempfile.gettempdir() + "/model.pt2", {}, "cpu")
print(f"{time.perf_counter() - t0:.1f}")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("lost", "kept"), required=True)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="inductor-cache-")
    try:
        for process in (1, 2):
            scratch = tempfile.mkdtemp(prefix="child-tmp-")
            env = {**os.environ, "TMPDIR": scratch, "TORCHINDUCTOR_CACHE_DIR": cache}
            env.pop("EXPORTER_PACKAGE_CACHE", None)
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, args.mode, str(process)], env=env,
                                  capture_output=True, text=True, check=True)
            print(f"{args.mode}: process {process}: AOTI compile {done.stdout.strip().splitlines()[-1]} s, "
                  f"whole process {time.perf_counter() - t0:.1f} s", flush=True)
            shutil.rmtree(scratch, ignore_errors=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
