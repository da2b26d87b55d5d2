"""Target ``aoti``: an AOTInductor package (``model.aoti.pt2``) compiled from the exported program.

Loading a package runs native code; on some machines it crashed the process
inside std::regex until the compiler's libstdc++ was preloaded (see
exporter.targets.toolchain). Every artifact is loaded in a child process, so a crash
fails this target only.

For ``--task text-generation`` it compiles the decoder's two programs (``prefill.aoti.pt2``,
``decode.aoti.pt2``) without their weights, which are written once in ``generation.aoti.weights.safetensors``
and handed to both at load (``aoti_loader.load_package``'s ``weights`` and ``constants``): one copy of the
weights on disk and on the device, not one per program (:func:`build_decoder`, :func:`load_decoder`).
With ``generation.decode_batch_1`` a third package, ``decode1.aoti.pt2``, holds the decode program exported for a
batch of exactly one row, compiled with Inductor's coordinate-descent tuning (:data:`BATCH_1_CONFIGS`): with
the row count static, each product of one row by a weight becomes a reduction kernel whose block sizes are
tuned to it, instead of a matrix-product call sized for any batch. It reads the same weights file.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from safetensors.torch import load_file

from ..dtypes import torch_dtype
from ..measure.kernels import hook
from ..modelio import import_spec_types, named_call
from ..outdir import save_named_tensors
from . import aoti_loader, compile_apart, package_cache
from .aoti_loader import CudaGraphed, load_package
from .compile_apart import Job, build_context, compile_all
from .context import BuildContext, Built, DecoderPrograms
from .exported_program import core_aten
from .exported_program import decoder_attention as decoder_attention
from .package_cache import compile_package
from .spec import DecoderLoaded, Loaded, RunnerSpec
from .toolchain import aoti_preload

if TYPE_CHECKING:
    from .spec import BuildSettings

FILE = "model.aoti.pt2"
LOADER = "aoti_loader.py"  # a copy of exporter/targets/aoti_loader.py: loads the package without a compiler
# Above this, the weights go beside the package in a safetensors file (``aoti_loader.weights_beside``) instead of
# inside its library: written in slices from the GPU, where Inductor's own packaging holds every weight in host
# memory (two copies with torch 2.11; docs/convert-time-notes.md). ``aoti_loader.load_package`` hands them
# to the package at load. EXPORTER_AOTI_WEIGHTS_APART_ABOVE (bytes) overrides the threshold.
WEIGHTS_APART_ABOVE_BYTES = 4 * 2**30


def weights_apart_above() -> int:
    return int(os.environ.get("EXPORTER_AOTI_WEIGHTS_APART_ABOVE", WEIGHTS_APART_ABOVE_BYTES))


def program_tensors(program) -> list[tuple[str, torch.Tensor]]:
    """Every weight, buffer and tensor constant of an exported program, by the name its package asks for."""
    named = {**program.state_dict, **{k: v for k, v in program.constants.items() if isinstance(v, torch.Tensor)}}
    return sorted(named.items())


def build(ctx: BuildContext) -> list[Built]:
    t0 = time.perf_counter()
    path = ctx.staging / FILE
    configs: dict[str, Any] = {}
    program = core_aten(ctx)
    weights = sum(t.numel() * t.element_size() for t in program.state_dict.values())
    apart = weights > weights_apart_above()
    if apart:
        configs["aot_inductor.package_constants_in_so"] = False
    with build_context(ctx.device, ctx.settings.attention_backend, batch_1=False):  # as a decoder's packages
        cached = compile_package(program, path, configs, ctx.device,
                                 {"attention_backend": ctx.settings.attention_backend})
    written = [path]
    if apart:
        weights_file = Path(aoti_loader.weights_beside(str(path)))
        save_named_tensors(weights_file, program_tensors(program))
        written.append(weights_file)
    loader = ctx.staging / LOADER
    shutil.copyfile(aoti_loader.__file__, loader)
    preload = aoti_preload()
    spec = RunnerSpec("aoti", "aoti", ctx.device, ctx.dtype, path=str(path),
                      options=(("ld_preload", preload),), attention_backend=ctx.settings.attention_backend)
    notes = list(ctx.notes)
    notes += [f"loaded with the compiler's libstdc++ preloaded ({os.path.basename(preload)}, the one this process "
              "maps already; docs/gpu.md: on some GPU machines packages crashed on load without it)"] if preload else []
    notes.append(f"{LOADER} beside it loads the package in a server without a C++ compiler (docs/convert-time.md)")
    if apart:
        notes.append(f"weights ({weights / 2**30:.1f} GiB) in {written[-1].name} beside the package, handed to it "
                     f"at load by {LOADER} (torch's own loader needs them inside)")
    if cached == "reused":
        notes.append(f"package reused from the package cache ({package_cache.ENV}): an earlier build compiled the same "
                     "program, weights and options with this toolchain on this device; judged like a fresh build")
    build_s = time.perf_counter() - t0
    built = [Built("aoti", "aoti", spec, path, [*written, loader], build_s, notes=notes,
                   graph={"ld_preload": os.path.basename(preload) if preload else None,
                          "inductor_configs": configs, "package_cache": cached})]
    if ctx.settings.targets.aoti_cuda_graph and ctx.device.startswith("cuda") and apart:
        notes.append(f"{GRAPHED} not built: {weights / 2**30:.1f} GiB of weights (over "
                     f"{weights_apart_above() / 2**30:.0f} GiB) would be loaded again by its own process, and a "
                     "model this size spends its time in kernels, not in launching them")
    elif ctx.settings.targets.aoti_cuda_graph and ctx.device.startswith("cuda"):
        # loaded into the aoti variant's process (one process per artifact kind: one CUDA context fewer)
        graphed = RunnerSpec(GRAPHED, "aoti", ctx.device, ctx.dtype, path=str(path), source=ctx.source,
                             options=(("ld_preload", preload), ("cuda_graph", True), ("host", "aoti")),
                             attention_backend=ctx.settings.attention_backend)
        built.append(Built("aoti", GRAPHED, graphed, build_s=build_s, static_shapes=True, replays="aoti", notes=[
            f"the aoti package replayed from a CUDA graph ({LOADER}: CudaGraphed), captured at the samples' shapes: "
            "a benchmark variant, judged at the samples, not on the grid; build time is the package's, the "
            "capture is in its load time"]))
    return built


GRAPHED = "aoti:cuda-graph"
MAX_GRAPHS = 4  # shapes one CUDA-graph variant captures (each holds an instance of the package on the GPU)


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def load(spec: RunnerSpec) -> Loaded:
    if spec.option("cuda_graph"):
        return _load_graphed(spec)
    import_spec_types(spec.option("imports"))  # a foreign program's ModelOutput types, registered first
    runner = load_package(spec.file())
    inner = named_call(runner, spec.option("keywords"), spec.option("outputs"),
                                spec.option("positional", 0)) if spec.option("named") else None

    def call(args):
        return inner(args) if inner is not None else _as_list(runner(*args))

    return Loaded(call, spec.device, torch_dtype(spec.dtype), hooks={"kernels": hook(spec.device, HINT)})


HINT = "an AOTInductor package records its SDPA calls only when compiled with cpp.enable_kernel_profile"


def _load_graphed(spec: RunnerSpec) -> Loaded:
    """The package replayed from CUDA graphs, one per input shape it is called with (at most ``MAX_GRAPHS``),
    the first captured at load on the stored sample 0 (the capture is part of the load time)."""
    path = spec.file()
    graphs: dict[tuple, CudaGraphed] = {}
    info: dict[str, Any] = {"cuda_graph": True, "captured": []}

    def call(args):
        key = tuple((tuple(t.shape), t.dtype) for t in args)
        graphed = graphs.get(key)
        if graphed is None:
            if len(graphs) >= MAX_GRAPHS:
                raise RuntimeError(f"{GRAPHED} holds {MAX_GRAPHS} captured shapes already: it is a static-shape "
                                   "variant")
            graphed = graphs[key] = CudaGraphed(path, args)
            info["captured"].append([list(shape) for shape, _ in key])
        return _as_list(graphed(*args))

    source, dtype = spec.model_source(), torch_dtype(spec.dtype)
    stored = load_file(source.example_file)
    example = [stored[f"0.{name}"] for name in source.inputs]
    with torch.inference_mode():
        call([(t.to(dtype) if t.is_floating_point() else t).to(spec.device) for t in example])
    return Loaded(call, spec.device, torch_dtype(spec.dtype), info, hooks={"kernels": hook(spec.device, HINT)})


DECODER_WEIGHTS = "generation.aoti.weights.safetensors"  # the weights of both decoder programs, once
# the decode program of batch 1: Inductor tunes each kernel's block sizes by coordinate descent (Triton kernels;
# on the CPU it changes nothing). docs/generation.md: "A decode program for one row"
BATCH_1_CONFIGS = {"coordinate_descent_tuning": True}
# and on a GPU launches independent Triton kernels as one (combo_kernels: a layer's rotary kernels and cache
# writes): the 1B's step on an H100 148 -> 116 kernels, 1.146 -> 1.096 ms/token, the same logits
# (benchmarks/gpu_decode_probe.py --only 12,13; docs/runs/h100-decode-probe-combo.md)
BATCH_1_GPU_CONFIGS = {"combo_kernels": True}


def shared_tensors(prefill: list[tuple[str, torch.Tensor]],
                   decode: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The constants of both programs, each name once. Both come from one module, so a name they share is one
    weight; one that differed between them (a constant traced differently) could not be shared, and is refused."""
    merged = dict(prefill)
    for name, tensor in decode:
        mine = merged.setdefault(name, tensor)
        if mine is not tensor and (mine.shape != tensor.shape or mine.dtype != tensor.dtype
                                   or not torch.equal(mine, tensor)):
            raise RuntimeError(f"the prefill and decode programs hold different values for constant {name!r}: "
                               "their weights cannot be shared")
    return sorted(merged.items())


def build_decoder(programs: DecoderPrograms, settings: BuildSettings, files: tuple[Path, ...]) -> list[Path]:
    """Both packages without their weights (and the decode package of batch 1 where ``files`` names a third), the
    weights once beside them, and the loader."""
    device = settings.device
    staging = files[0].parent
    compiled = [programs.prefill, programs.decode] + ([programs.decode_one] if len(files) > 2 else [])
    tensors = program_tensors(compiled[0])
    for program in compiled[1:]:
        tensors = shared_tensors(tensors, program_tensors(program))
    configs: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
    batch_1 = {**configs, **BATCH_1_CONFIGS, **(BATCH_1_GPU_CONFIGS if device != "cpu" else {})}
    extra = {"attention_backend": settings.attention_backend}
    # compiled at once, each after the first in a process of its own (compile_apart: EXPORTER_BUILD_JOBS)
    outcomes = compile_all([Job(program, path, batch_1 if index == 2 else configs, extra, batch_1=index == 2)
                            for index, (program, path) in enumerate(zip(compiled, files))],
                           device, settings.attention_backend)
    programs.build_notes["aoti"] = [how_compiled(files, outcomes, device)]
    weights = staging / DECODER_WEIGHTS
    save_named_tensors(weights, tensors)
    loader = staging / LOADER
    shutil.copyfile(aoti_loader.__file__, loader)
    return [*files, weights, loader]


def how_compiled(files: tuple[Path, ...], outcomes: list[dict[str, Any]], device: str) -> str:
    """The report's note on how a decoder's packages were compiled (``compile_apart.compile_all``'s outcomes)."""
    reused = [f.name for f, o in zip(files, outcomes) if o["cache"] == "reused"]
    apart = [f.name for f, o in zip(files, outcomes) if o["apart"]]
    here = [f.name for f, o in zip(files, outcomes) if not o["apart"] and o["cache"] != "reused"]
    parts = [f"{', '.join(here)} compiled here"] if here else []
    parts += [f"{', '.join(apart)} at the same time, each in a process of its own"] if apart else []
    parts += [f"{', '.join(reused)} reused from the package cache ({package_cache.ENV})"] if reused else []
    return "; ".join(parts) + f" ({compile_apart.ENV}={compile_apart.jobs_at_once(device)})"


def load_decoder(files: tuple[Path, ...]) -> DecoderLoaded:
    prefill_file, decode_file = files[:2]
    weights = str(prefill_file.parent / DECODER_WEIGHTS)
    prefill = load_package(prefill_file, weights=weights)

    def instance(path: Path) -> Callable[[], Any]:
        return lambda: load_package(path, weights=weights, constants=prefill.constants)

    one = files[2] if len(files) > 2 else None
    return DecoderLoaded(prefill, instance(decode_file)(), instance(decode_file),
                         decode_one=instance(one)() if one is not None else None,
                         fresh_decode_one=instance(one) if one is not None else None)
