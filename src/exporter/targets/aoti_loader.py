"""Load an AOTInductor package in milliseconds, with no C++ compiler: ``load_package(path)``.

This file needs only torch; ``exporter convert`` puts a copy of it beside every AOTInductor package it
builds (``aoti_loader.py``), so a server can load the package the same way::

    from aoti_loader import load_package
    model = load_package("model.aoti.pt2")
    outputs = model(input_ids, attention_mask)

Why: ``torch._inductor.aoti_load_package`` asks Inductor for the host's "device information" before it
builds the package loader, only to log a warning when it differs from the build machine's. That
includes the CPU's vector instruction sets, found by compiling a test program with g++ for each
candidate set and running each in a new Python process: ten compiles and ten processes on an AMX CPU,
18 to 50 s for every cold start, for CUDA packages too (measured with torch 2.11 and 2.13; PyTorch
issue #191715). Nothing stored in the package avoids it. This loader builds torch's own package loader
(``torch._C._aoti.AOTIModelPackageLoader``) directly and checks the advisory facts that cost nothing
(platform, machine, GPU compute capability). If that private binding is missing or has changed, it
falls back to torch's public loader with the vector-set probe switched off.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
from typing import Any

import torch
import torch.utils._pytree as pytree

log = logging.getLogger(__name__)


class CompiledModel:
    """Calls a loaded package like the module it was compiled from (the semantics of torch's
    ``AOTICompiledModel``, without importing Inductor)."""

    def __init__(self, loader: Any):
        self.loader = loader
        in_spec, out_spec = loader.get_call_spec()
        self._in = pytree.treespec_loads(in_spec)
        self._out = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            from torch.export._tree_utils import reorder_kwargs  # noqa: PLC0415 - only for keyword calls

            kwargs = reorder_kwargs(kwargs, self._in)
        flat = [x for x in pytree.tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.loader.boxed_run(flat), self._out)


def mismatches(metadata: dict[str, str], device_index: int = -1) -> list[str]:
    """What the package says it was built for that this host is not (platform, machine, GPU capability)."""
    here = {"AOTI_PLATFORM": sys.platform, "AOTI_MACHINE": platform.machine()}
    if metadata.get("AOTI_DEVICE_KEY") == "cuda" and torch.version.hip is None and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device_index if device_index >= 0 else None)
        here["AOTI_COMPUTE_CAPABILITY"] = str(major * 10 + minor)
    return [f"{key}: package {metadata[key]}, host {value}" for key, value in here.items()
            if key in metadata and metadata[key] != value]


def load_package(path: str | os.PathLike, model_name: str = "model", device_index: int = -1) -> Any:
    """The package at ``path`` (a file), ready to call."""
    path = os.fspath(path)
    try:
        cls: Any = torch._C._aoti.AOTIModelPackageLoader  # a private binding, typed loosely
        for problem in mismatches(cls.load_metadata_from_package(path, model_name), device_index):
            log.warning("AOTInductor package built for another host (%s)", problem)
        return CompiledModel(cls(path, model_name, False, 1, device_index))
    except (AttributeError, TypeError) as exc:  # the private binding changed: the public loader, probe off
        log.warning("direct AOTInductor load unavailable (%r); using torch's loader", exc)
        import torch._inductor.config as config  # noqa: PLC0415 - the fallback only
        from torch._inductor.package import load_package as torch_load_package  # noqa: PLC0415

        with config.patch({"cpp.vec_isa_ok": False}):
            return torch_load_package(path, model_name, False, 1, device_index)


__all__ = ["load_package", "CompiledModel", "mismatches"]
