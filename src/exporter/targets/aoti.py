"""Target ``aoti``: an AOTInductor package (``model.aoti.pt2``) compiled from the exported program.

Loading a package runs native code; on some machines it crashed the process
inside std::regex until the compiler's libstdc++ was preloaded (see
exporter.targets.toolchain). Every artifact is loaded in a child process, so a crash
fails this target only.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from typing import Any

import torch
import torch._inductor.config as inductor_config

from ..attention_backend import backend_context
from ..inputs import TORCH_DTYPES
from ..measure.kernels import hook
from . import aoti_loader
from .aoti_loader import load_package
from .exported_program import core_aten
from .spec import BuildContext, Built, Loaded, RunnerSpec
from .toolchain import aoti_preload

FILE = "model.aoti.pt2"
LOADER = "aoti_loader.py"  # a copy of exporter/targets/aoti_loader.py: loads the package without a compiler
# Above this, the weights go beside the compiled library in the package (one blob) instead of inside it.
BLOB_ABOVE_BYTES = 4 * 2**30


def build(ctx: BuildContext) -> list[Built]:
    t0 = time.perf_counter()
    path = ctx.staging / FILE
    configs: dict[str, Any] = {}
    program = core_aten(ctx)
    weights = sum(t.numel() * t.element_size() for t in program.state_dict.values())
    if weights > BLOB_ABOVE_BYTES:
        configs.update({"aot_inductor.package_constants_in_so": False,
                        "aot_inductor.package_constants_on_disk_format": "binary_blob"})
    with contextlib.ExitStack() as stack:
        stack.enter_context(backend_context(ctx.recipe.runtime.attention_backend, ctx.device))
        if ctx.device != "cpu":
            # Inductor probes the CPU's vector instruction sets (a g++ compile and a Python process per set)
            # for the C++ it would write for CPU kernels; a CUDA graph has none worth vectorising.
            stack.enter_context(inductor_config.patch({"cpp.vec_isa_ok": False}))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)
    loader = ctx.staging / LOADER
    shutil.copyfile(aoti_loader.__file__, loader)
    preload = aoti_preload()
    spec = RunnerSpec("aoti", "aoti", ctx.device, ctx.dtype, path=str(path),
                      options=(("ld_preload", preload),), attention_backend=ctx.recipe.runtime.attention_backend)
    notes = list(ctx.notes)
    notes += [f"loaded with LD_PRELOAD={preload} (see docs/gpu.md: AOTI packages can crash on load otherwise)"] \
        if preload else []
    notes.append(f"{LOADER} beside it loads the package in a server without a C++ compiler (docs/convert-time.md)")
    return [Built("aoti", "aoti", spec, path, [path, loader], time.perf_counter() - t0, notes=notes,
                  graph={"ld_preload": preload, "inductor_configs": configs})]


def load(spec: RunnerSpec) -> Loaded:
    runner = load_package(spec.file())

    def call(args):
        out = runner(*args)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    hint = "an AOTInductor package records its SDPA calls only when compiled with cpp.enable_kernel_profile"
    return Loaded(call, spec.device, TORCH_DTYPES[spec.dtype], hooks={"kernels": hook(spec.device, hint)})
