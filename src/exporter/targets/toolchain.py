"""The C++ toolchain AOTInductor packages are built with, and how to load them safely.

On some machines every AOTInductor package crashed on load: a segfault inside
``std::regex`` (called by ``parse_device_str`` while the model container is
created), for CPU and CUDA packages alike. The process maps the same
libstdc++ the compiler links against, but another library loaded earlier
interposes some of its symbols. Preloading that libstdc++ (``LD_PRELOAD``)
puts its symbols first and the package loads and runs (measured on an H200
machine, kernel 6.18.44-fc-v657-gpu, torch 2.11: segfault without, runs with).

We preload only the very file this process already maps, so the preload can
change symbol lookup order but never the library version.
"""

from __future__ import annotations

import functools
import os
import subprocess


def _cuda_build() -> bool:
    import torch  # noqa: PLC0415 - loaded already wherever a package is

    return torch.version.cuda is not None


def process_libstdcxx() -> set[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8") as handle:
            return {os.path.realpath(line.split()[-1]) for line in handle
                    if "libstdc++.so" in line and line.split()[-1].startswith("/")}
    except OSError:
        return set()


@functools.lru_cache(maxsize=1)
def compiler_libstdcxx() -> str | None:
    """The libstdc++ that Inductor's C++ compiler links against, or None when unknown."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # noqa: PLC0415 - a private API some torch versions lack

        cxx = get_cpp_compiler()
        out = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=30)
    except Exception:
        return None
    path = out.stdout.strip()
    if not path or not os.path.isabs(path) or not os.path.isfile(path):
        return None
    return os.path.realpath(path)


def aoti_preload() -> str | None:
    """What to LD_PRELOAD in a process that loads an AOTInductor package (None: nothing). Only with a CUDA build
    of torch: the crash was seen where the GPU's libraries load first; a CPU build loads packages as they are."""
    if os.environ.get("EXPORTER_AOTI_PRELOAD", "1") == "0" or not _cuda_build():
        return None
    lib = compiler_libstdcxx()
    if lib and lib in process_libstdcxx():
        return lib
    return None
