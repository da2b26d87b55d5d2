"""Does an AOTInductor package load when its C++ compiler's libstdc++ matches the process's?

On a GPU machine where every AOTI package segfaults on load (in std::regex, called by
parse_device_str while the model container is created), try: the default compiler; the
default build loaded with the compiler's own libstdc++ preloaded; a build with the system g++.

    PYTHONPATH=src python3 benchmarks/aoti_toolchain.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

BUILD = """
import sys, torch
dev = sys.argv[2]
m = torch.nn.Linear(64, 64).to(dev)
ep = torch.export.export(m, (torch.randn(8, 64, device=dev),))
from torch._inductor.cpp_builder import get_cpp_compiler
print("compiler", get_cpp_compiler())
torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1])
"""
LOAD = """
import sys, torch
r = torch._inductor.aoti_load_package(sys.argv[1])
x = torch.randn(8, 64, device=sys.argv[2])
print("ok", tuple(r(x).shape), [l.split()[-1] for l in open('/proc/self/maps') if 'libstdc++' in l][:1])
"""


def run(code, args, env=None, timeout=240):
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})})
    lines = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip() and "Warning" not in ln]
    return res.returncode, " | ".join(lines[-2:])[:300]


def compiler_info(cxx: str) -> str:
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
        lib = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
        return f"{version}; libstdc++ {os.path.realpath(lib)}"
    except Exception as exc:
        return f"unusable ({exc})"


def main() -> None:
    work = tempfile.mkdtemp()
    candidates = [c for c in dict.fromkeys([shutil.which("g++"), "/usr/bin/g++", "/opt/gcc/bin/g++"])
                  if c and os.path.exists(c)]
    for c in candidates:
        print("compiler", c, "->", compiler_info(c))
    import torch  # noqa: F401

    maps = [ln.split()[-1] for ln in open("/proc/self/maps") if "libstdc++" in ln]
    print("process libstdc++", sorted(set(os.path.realpath(m) for m in maps)))
    print("LD_LIBRARY_PATH", os.environ.get("LD_LIBRARY_PATH"))
    for device in ("cuda", "cpu"):
        default = os.path.join(work, f"default-{device}.pt2")
        print(device, "build default", *run(BUILD, [default, device], {"TORCHINDUCTOR_CACHE_DIR": default + ".cache"}))
        print(device, "load default", *run(LOAD, [default, device]))
        for c in candidates:
            lib = os.path.realpath(subprocess.run([c, "-print-file-name=libstdc++.so.6"], capture_output=True,
                                                  text=True).stdout.strip())
            if os.path.isfile(lib):
                print(device, f"load default + LD_PRELOAD={lib}", *run(LOAD, [default, device], {"LD_PRELOAD": lib}))
            path = os.path.join(work, f"{os.path.basename(os.path.dirname(os.path.dirname(c)))}-{device}.pt2")
            rc, text = run(BUILD, [path, device], {"CXX": c, "TORCHINDUCTOR_CACHE_DIR": path + ".cache"})
            print(device, f"build CXX={c}", rc, text)
            if rc == 0:
                print(device, f"load CXX={c} build", *run(LOAD, [path, device]))
        if device == "cpu":
            break


if __name__ == "__main__":
    main()
