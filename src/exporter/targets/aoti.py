"""Target ``aoti``: an AOTInductor package (``model.aoti.pt2``) compiled from the exported program.

Loading a package runs native code; on some machines it crashed the process
inside std::regex until the compiler's libstdc++ was preloaded (see
exporter.targets.toolchain). Every artifact is loaded in a child process, so a crash
fails this target only.
"""

from __future__ import annotations

import time

import torch

from ..attention_backend import backend_context
from ..inputs import TORCH_DTYPES
from ..measure.kernels import hook
from .spec import BuildContext, Built, Loaded, RunnerSpec
from .toolchain import aoti_preload

FILE = "model.aoti.pt2"


def build(ctx: BuildContext) -> list[Built]:
    t0 = time.perf_counter()
    path = ctx.staging / FILE
    with backend_context(ctx.recipe.runtime.attention_backend, ctx.device):
        torch._inductor.aoti_compile_and_package(ctx.program, package_path=str(path))
    preload = aoti_preload()
    spec = RunnerSpec("aoti", "aoti", ctx.device, ctx.dtype, path=str(path),
                      options=(("ld_preload", preload),), attention_backend=ctx.recipe.runtime.attention_backend)
    notes = list(ctx.notes)
    notes += [f"loaded with LD_PRELOAD={preload} (see docs/gpu.md: AOTI packages can crash on load otherwise)"] \
        if preload else []
    return [Built("aoti", "aoti", spec, path, [path], time.perf_counter() - t0, notes=notes,
                  graph={"ld_preload": preload})]


def load(spec: RunnerSpec) -> Loaded:
    runner = torch._inductor.aoti_load_package(spec.file())

    def call(args):
        out = runner(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    hint = "an AOTInductor package records its SDPA calls only when compiled with cpp.enable_kernel_profile"
    return Loaded(call, spec.device, TORCH_DTYPES[spec.dtype], hooks={"kernels": hook(spec.device, hint)})
