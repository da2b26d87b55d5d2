"""Target ``aoti``: an AOTInductor package (``model.aoti.pt2``) compiled from the exported program.

Loading a package runs native code; on some machines it crashed the process
inside std::regex until the compiler's libstdc++ was preloaded (see
exporter.targets.toolchain). Every artifact is loaded in a child process, so a crash
fails this target only.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config as inductor_config

from ..attention_backend import backend_context
from ..inputs import TORCH_DTYPES
from ..measure.kernels import hook
from ..outdir import save_named_tensors
from . import aoti_loader
from .aoti_loader import load_package
from .exported_program import core_aten
from .spec import BuildContext, Built, Loaded, RunnerSpec
from .toolchain import aoti_preload

FILE = "model.aoti.pt2"
LOADER = "aoti_loader.py"  # a copy of exporter/targets/aoti_loader.py: loads the package without a compiler
# Above this, the weights go beside the package in a safetensors file (``aoti_loader.weights_beside``) instead of
# inside its library: written in slices from the GPU, where Inductor's own packaging holds every weight in host
# memory (two copies with torch 2.11; benchmarks/convert_time_notes.md). ``aoti_loader.load_package`` hands them
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
    with contextlib.ExitStack() as stack:
        stack.enter_context(backend_context(ctx.recipe.runtime.attention_backend, ctx.device))
        if ctx.device != "cpu":
            # Inductor probes the CPU's vector instruction sets (a g++ compile and a Python process per set)
            # for the C++ it would write for CPU kernels; a CUDA graph has none worth vectorising.
            stack.enter_context(inductor_config.patch({"cpp.vec_isa_ok": False}))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    written = [path]
    if apart:
        weights_file = Path(aoti_loader.weights_beside(str(path)))
        save_named_tensors(weights_file, program_tensors(program))
        written.append(weights_file)
    loader = ctx.staging / LOADER
    shutil.copyfile(aoti_loader.__file__, loader)
    preload = aoti_preload()
    spec = RunnerSpec("aoti", "aoti", ctx.device, ctx.dtype, path=str(path),
                      options=(("ld_preload", preload),), attention_backend=ctx.recipe.runtime.attention_backend)
    notes = list(ctx.notes)
    notes += [f"loaded with LD_PRELOAD={preload} (see docs/gpu.md: AOTI packages can crash on load otherwise)"] \
        if preload else []
    notes.append(f"{LOADER} beside it loads the package in a server without a C++ compiler (docs/convert-time.md)")
    if apart:
        notes.append(f"weights ({weights / 2**30:.1f} GiB) in {written[-1].name} beside the package, handed to it "
                     f"at load by {LOADER} (torch's own loader needs them inside)")
    return [Built("aoti", "aoti", spec, path, [*written, loader], time.perf_counter() - t0, notes=notes,
                  graph={"ld_preload": preload, "inductor_configs": configs})]


def load(spec: RunnerSpec) -> Loaded:
    runner = load_package(spec.file())

    def call(args):
        out = runner(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    hint = "an AOTInductor package records its SDPA calls only when compiled with cpp.enable_kernel_profile"
    return Loaded(call, spec.device, TORCH_DTYPES[spec.dtype], hooks={"kernels": hook(spec.device, hint)})
