"""Target ``compile``: torch.compile of the rewritten model, one variant per recipe mode.

Benchmark and numerics only: no file is written. Each mode compiles in its own
child process (rebuilt from the checkpoint) as it loads, while convert builds the
other targets; its compile time is the first call's time. ``reduce-overhead`` and
``max-autotune`` capture CUDA graphs, which pay off when shapes are static
(``compile_dynamic = false``, the default).
"""

from __future__ import annotations

import time

import torch

from ..attention_backend import backend_context
from ..dtypes import torch_dtype
from ..measure.kernels import hook
from ..prepare import from_source, place
from ..rewrite.transformers_masks import positions_from_model, trivial_masks_skipped
from .context import BuildContext, Built
from .spec import Loaded, RunnerSpec


def build(ctx: BuildContext) -> list[Built]:
    built = []
    for mode in ctx.settings.targets.compile_modes:
        name = f"compile:{mode}"
        spec = RunnerSpec(name, "compile", ctx.device, ctx.dtype, source=ctx.source,
                          options=(("mode", mode), ("dynamic", ctx.settings.targets.compile_dynamic)),
                          attention_backend=ctx.settings.attention_backend)
        built.append(Built("compile", name, spec, notes=["no file: a benchmark variant; build time is the first call"],
                           static_shapes=True))
    return built


def load(spec: RunnerSpec) -> Loaded:
    prepared = from_source(spec.model_source())
    module = place(prepared.rewritten, spec.device, spec.dtype)
    compiled = torch.compile(module, mode=spec.option("mode"), dynamic=bool(spec.option("dynamic")))
    info: dict = {"mode": spec.option("mode"), "dynamic": bool(spec.option("dynamic"))}

    own_positions = positions_from_model(prepared.rewritten)

    def call(args):
        with backend_context(spec.attention_backend, spec.device), trivial_masks_skipped(own_positions):
            if "compile_s" not in info:
                t0 = time.perf_counter()
                out = compiled(*args)
                if spec.device.startswith("cuda"):
                    torch.cuda.synchronize()
                info["compile_s"] = time.perf_counter() - t0
                return list(out)
            return list(compiled(*args))

    # Compile now, at load: the process loads while convert builds the other targets, so the compile overlaps
    # them instead of following them. The inputs are the stored sample 0, as the first timed call would see.
    example = [(t.to(torch_dtype(spec.dtype)) if t.is_floating_point() else t).to(spec.device)
               for t in prepared.example]
    with torch.inference_mode():
        call(example)
    return Loaded(call, spec.device, torch_dtype(spec.dtype), info, hooks={"kernels": hook(spec.device)})
