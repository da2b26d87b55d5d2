"""A cache of AOTInductor packages, keyed by everything a package is compiled from.

Inductor's own FX graph cache is off in AOT mode (torch's ``compile_fx`` skips it when ``aot_mode``), so a
second convert of the same model compiles its package again, reusing only the kernel-level caches (Triton
kernels, autotuning results, C++ objects). With ``EXPORTER_PACKAGE_CACHE=DIR`` (``exporter batch`` sets it under
its compile cache) a package is stored there once built and reused by any later build whose key matches:

- the exported program as printed (graph, tensor shapes and dtypes, signature, range constraints) and its call
  spec;
- the value of every weight, buffer and constant (SHA-256 of their bytes);
- the Inductor options given, every ``TORCHINDUCTOR_*`` variable but the cache's folder, the attention backend;
- torch's and exporter's versions; the device (GPU name, compute capability, CUDA version; a CPU's model and
  instruction sets, whose vector code the package holds).

A reused package is judged by the same gate as a fresh one (numerics, shape grid, timing); the report says it was
reused. Entries are written whole (a temporary name, then a rename), so a reader never sees half a package.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

ENV = "EXPORTER_PACKAGE_CACHE"
CHUNK_BYTES = 256 * 2**20


def folder() -> Path | None:
    named = os.environ.get(ENV)
    return Path(named) if named else None


def _device_identity(device: str) -> dict[str, Any]:
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        return {"gpu": torch.cuda.get_device_name(index), "capability": list(torch.cuda.get_device_capability(index)),
                "cuda": torch.version.cuda}
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return {"cpu": platform.processor() or platform.machine(), "flags": hashlib.sha256(flags.encode()).hexdigest()}


def _hash_tensor(digest, tensor: torch.Tensor) -> None:
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), CHUNK_BYTES):
        digest.update(flat[start:start + CHUNK_BYTES].cpu().numpy().tobytes())


def key(program, configs: dict[str, Any], device: str, extra: dict[str, Any] | None = None) -> str:
    """The cache key of compiling ``program`` with ``configs`` for ``device`` (module docstring: what it covers)."""
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - only when the cache is on

    try:
        exporter_version = version("exporter")
    except PackageNotFoundError:
        exporter_version = "source"
    digest = hashlib.sha256()
    head = {"torch": torch.__version__, "exporter": exporter_version, "device": _device_identity(device),
            "configs": configs, "extra": extra or {},
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR"}}
    digest.update(json.dumps(head, sort_keys=True, default=str).encode())
    digest.update(str(program).encode())
    digest.update(repr(program.call_spec.in_spec).encode() + repr(program.call_spec.out_spec).encode())
    named = {**program.state_dict, **{k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)}}
    for name, tensor in sorted(named.items()):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        _hash_tensor(digest, tensor)
    return digest.hexdigest()


def fetch(cache: Path, entry: str, path: Path) -> bool:
    """Put the cached package ``entry`` at ``path`` (a hard link where the file system allows, else a copy)."""
    stored = cache / f"{entry}.pt2"
    if not stored.is_file():
        return False
    try:
        os.link(stored, path)
    except OSError:
        try:
            shutil.copyfile(stored, path)
        except OSError:
            return False
    return True


def store(cache: Path, entry: str, path: Path) -> bool:
    """Keep the package at ``path`` as ``entry`` (whole or not at all; a cache that cannot be written is skipped)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{entry}.", suffix=".tmp", dir=cache)
        os.close(fd)
        shutil.copyfile(path, tmp)
        os.replace(tmp, cache / f"{entry}.pt2")
    except OSError:
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(tmp)
        return False
    return True


def shared_headers() -> str | None:
    """Point Inductor's precompiled C++ header at its cache folder (``TORCHINDUCTOR_CACHE_DIR``, which every child
    of a convert is given: ``runners.with_scratch``), and return that folder. Inductor keeps the header under the
    temporary folder (torch's ``default_cache_dir`` follows ``TMPDIR``), and a convert's child has a temporary
    folder of its own, removed when it ends: every AOTInductor build on a CPU compiled torch's header again (a
    150 MB ``.gch``, about 6 s of CPU on a 2-core machine). The header's name is a hash of the compiler, its
    flags and the preprocessed header, so builds with other flags keep their own; Inductor takes a lock to write
    it. Nothing changes where torch no longer has the folder as a module attribute."""
    from torch._inductor import codecache  # noqa: PLC0415

    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root or not hasattr(codecache, "_HEADER_DIR") or not hasattr(codecache, "_HEADER_LOCK_DIR"):
        return None
    headers = os.path.join(root, "precompiled_headers")
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = headers, os.path.join(headers, "locks")
    return headers


def compile_package(program, path: Path, configs: dict[str, Any], device: str,
                    extra: dict[str, Any] | None = None) -> str | None:
    """``aoti_compile_and_package`` through the cache: ``"reused"``, ``"stored"``, or None when the cache is off
    (or could not be written). Inductor's precompiled header is kept where the next build finds it
    (:func:`shared_headers`)."""
    cache = folder()
    entry = key(program, configs, device, extra) if cache is not None else None
    if cache is not None and entry is not None and fetch(cache, entry, path):
        return "reused"
    return compile_keyed(program, path, configs, entry)


def compile_keyed(program, path: Path, configs: dict[str, Any], entry: str | None) -> str | None:
    """Compile ``program`` into ``path`` and keep it in the cache as ``entry`` (its :func:`key`, computed where the
    program was made: a program saved and loaded again in another process prints differently); None: the cache is
    off, or could not be written."""
    shared_headers()
    # a copy: torch adds its own options to the dict it is handed, and a caller that compiles several programs
    # with one dict (a generation's prefill and decode) would key the next program by whether this one compiled
    torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=dict(configs))
    cache = folder()
    if cache is not None and entry is not None and store(cache, entry, path):
        return "stored"
    return None


__all__ = ["ENV", "compile_keyed", "compile_package", "fetch", "folder", "key", "shared_headers", "store"]
