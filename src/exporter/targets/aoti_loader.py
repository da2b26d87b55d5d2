"""Load an AOTInductor package in milliseconds, with no C++ compiler: ``load_package(path)``.

This file needs only torch; ``exporter convert`` puts a copy of it beside every AOTInductor package it
builds (``aoti_loader.py``), so a server can load the package the same way::

    from aoti_loader import load_package
    model = load_package("model.aoti.pt2")
    outputs = model(**tokens)  # by name, in any order; or by position: model(input_ids, attention_mask)

For inputs of one shape, ``CudaGraphed`` replays the package from a CUDA graph (no launch overhead per
kernel: what a small batch needs)::

    from aoti_loader import CudaGraphed
    graphed = CudaGraphed("model.aoti.pt2", [input_ids, attention_mask])  # captured at these shapes
    outputs = graphed(input_ids, attention_mask)  # copied into the graph's inputs, replayed

A prefill and a decode package of one decoder share one weights file and one copy of the weights::

    prefill = load_package("prefill.aoti.pt2", weights="generation.aoti.weights.safetensors")
    decode = load_package("decode.aoti.pt2", weights="generation.aoti.weights.safetensors",
                          constants=prefill.constants)

A large model's package is built without its weights; they are in ``model.aoti.weights.safetensors`` beside
it, and ``load_package`` reads them (memory-mapped, straight to the package's device) and hands them over.

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
        self.constants: dict[str, torch.Tensor] = {}  # weights handed to a package built without them
        in_spec, out_spec = loader.get_call_spec()
        self._in = pytree.treespec_loads(in_spec)
        self._out = pytree.treespec_loads(out_spec)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        spec = self._in
        if args and spec.type is tuple and spec.num_children == 2 and not spec.child(0).num_children:
            # a package taking keywords (as exporter builds them), called by position: bound in order
            kwargs = {**dict(zip(spec.child(1).context, args)), **kwargs}
            args = ()
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


def weights_beside(path: str) -> str:
    """Where a package built without its weights keeps them (``model.aoti.weights.safetensors``)."""
    return (path[:-len(".pt2")] if path.endswith(".pt2") else path) + ".weights.safetensors"


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def read_weights(path: str, names: list[str], device: str) -> dict[str, torch.Tensor]:
    """The tensors ``names`` of a safetensors file, memory-mapped and moved to ``device`` one at a time (only
    torch is needed: a server may not have the safetensors package)."""
    import json  # noqa: PLC0415 - only packages built without their weights need these
    import mmap  # noqa: PLC0415
    import struct  # noqa: PLC0415

    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable tensors
    start = 8 + length
    missing = [name for name in names if name not in header]
    if missing:
        raise RuntimeError(f"{path} lacks the package's constant(s) {missing[:5]}")
    out = {}
    for name in names:
        entry = header[name]
        begin, end = entry["data_offsets"]
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=start + begin)
        tensor = flat.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        out[name] = tensor.to(device) if device != "cpu" else tensor
    return out


def load_package(path: str | os.PathLike, model_name: str = "model", device_index: int = -1,
                 weights: str | os.PathLike | None = None, constants: dict[str, torch.Tensor] | None = None) -> Any:
    """The package at ``path`` (a file), ready to call. A package built without its weights gets them from
    ``weights`` (a safetensors file; by default the one beside it, ``weights_beside``), handed to the loader as
    they are (no copy is kept). ``constants``: tensors already on the device, by name, used in place of reading
    them (another package's ``.constants``: two packages of one model, a prefill and a decode step, then share
    one copy of the weights)."""
    path = os.fspath(path)
    try:
        cls: Any = torch._C._aoti.AOTIModelPackageLoader  # a private binding, typed loosely
        metadata = cls.load_metadata_from_package(path, model_name)
        for problem in mismatches(metadata, device_index):
            log.warning("AOTInductor package built for another host (%s)", problem)
        model = CompiledModel(cls(path, model_name, False, 1, device_index))
        file = os.fspath(weights) if weights is not None else weights_beside(path)
        if os.path.isfile(file) or constants:
            device = metadata.get("AOTI_DEVICE_KEY", "cpu")
            if device != "cpu":
                device = f"{device}:{device_index if device_index >= 0 else torch.cuda.current_device()}"
            names = list(model.loader.get_constant_fqns())
            given = {name: constants[name] for name in names if constants and name in constants}
            missing = [name for name in names if name not in given]
            model.constants = {**given, **(read_weights(file, missing, device) if missing else {})}
            model.loader.load_constants(model.constants, False, True, True)  # user-managed: used in place
        return model
    except (AttributeError, TypeError) as exc:  # the private binding changed: the public loader, probe off
        log.warning("direct AOTInductor load unavailable (%r); using torch's loader", exc)
        import torch._inductor.config as config  # noqa: PLC0415 - the fallback only
        from torch._inductor.package import load_package as torch_load_package  # noqa: PLC0415

        with config.patch({"cpp.vec_isa_ok": False}):
            return torch_load_package(path, model_name, False, 1, device_index)


def capture(call: Any) -> Any:
    """``call`` captured in a ``torch.cuda.CUDAGraph``, after three warm-up calls on a side stream.

    The capture is relaxed: an AOTInductor container asks whether its previous run's event has finished
    (``cudaEventQuery``) before each run, which the default capture mode forbids ("operation failed due to a
    previous error during capture"). A container whose run was captured cannot run outside the graph again:
    capture an instance of its own (``CudaGraphed`` does), and keep it alive while the graph replays: a container
    frees its memory when it goes, and a replay would then read freed memory (an illegal address)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="relaxed"):
        call()
    return graph


class CudaGraphed:
    """A package replayed from a CUDA graph, for inputs of the shapes and dtypes of ``example_inputs``.

    It loads its own instance of the package (``load_package``; a captured container runs only inside its
    graph), copies ``example_inputs`` into fixed input buffers and captures one run. A call copies its inputs
    into those buffers and replays: every kernel of the package in one launch. The outputs it returns are the
    graph's own buffers, overwritten by the next call (as ``torch.compile(mode="reduce-overhead")``'s are):
    clone what must outlive it. Inputs of another shape or dtype are refused (capture another instance)."""

    def __init__(self, path: str | os.PathLike, example_inputs: list[torch.Tensor], device_index: int = -1):
        self.model = load_package(path, device_index=device_index)
        device = torch.device("cuda", device_index) if device_index >= 0 else torch.device("cuda")
        self.inputs = [t.detach().to(device).clone() for t in example_inputs]
        self.outputs: Any = None

        def run() -> None:
            self.outputs = self.model(*self.inputs)

        self.graph = capture(run)

    def signature(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(tuple(t.shape), t.dtype) for t in self.inputs]

    def __call__(self, *args: torch.Tensor) -> Any:
        given = [(tuple(t.shape), t.dtype) for t in args]
        if given != self.signature():
            raise ValueError(f"this CUDA graph was captured for inputs {self.signature()}, got {given}: "
                             "capture another CudaGraphed for these shapes")
        for buffer, value in zip(self.inputs, args):
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs


__all__ = ["load_package", "CompiledModel", "CudaGraphed", "capture", "mismatches", "weights_beside"]
