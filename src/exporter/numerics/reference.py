"""The float64 reference: the original model (eager attention) run on the CPU in float64.

The model is cast in place and cast back afterwards, tensor by tensor, so no
second copy of the module is built. Where a float64 copy would not fit in the
host's free memory the reference is run in float32 and the report says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import psutil
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from ..dtypes import name_of
from ..errors import ReferenceFailed, describe
from ..inputs import cast_sample
from ..modelio import IOModule, cast_in_place
from .promote import PromoteCasts

Outputs = list[torch.Tensor]


@dataclass
class Reference:
    outputs: list[Outputs]  # on ``device``: kept where they were computed, compared there
    dtype: str
    flops: int  # forward FLOPs of sample 0, counted by torch.utils.flop_counter
    note: str = ""
    device: str = "cpu"


@contextlib.contextmanager
def full_float32():
    """float32 matrix products in float32 (no TF32) on the GPU, restored on exit: a float32 baseline must
    carry float32's error, not TF32's."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        torch.set_float32_matmul_precision(precision)


def gathers_exactly(module: nn.Module) -> bool:
    """A plain embedding (no ``max_norm``, which rewrites its table as it reads): the rows it gathers, cast to
    float64 afterwards, are exactly the rows of its table cast first, without casting the whole table on every
    call (a vocabulary's table was the largest cast of a small model's float64 run)."""
    return type(module) is nn.Embedding and module.max_norm is None


@contextlib.contextmanager
def upcast_while_running(model: nn.Module, dtype: torch.dtype):
    """Give each module its own parameters and buffers in ``dtype`` only while its forward runs.

    Peak memory grows by one module's weights in ``dtype`` instead of a copy of the whole model. A module
    whose forward reads another module's weights directly would see them uncast; callers fall back.
    """
    stash: dict[int, list[dict[str, torch.Tensor]]] = {}

    def before(module, args, kwargs):
        saved: dict[str, torch.Tensor] = {}
        # an embedding's rows are cast after the gather instead (``after``)
        for table in () if gathers_exactly(module) else (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None and tensor.is_floating_point() and tensor.dtype != dtype:
                    saved[name] = tensor
                    cast = tensor.detach().to(dtype)
                    table[name] = nn.Parameter(cast, requires_grad=False) if table is module._parameters else cast
        stash.setdefault(id(module), []).append(saved)

    def after(module, args, kwargs, output):
        for name, tensor in stash[id(module)].pop().items():
            (module._parameters if name in module._parameters else module._buffers)[name] = tensor
        if gathers_exactly(module) and isinstance(output, torch.Tensor) and output.is_floating_point():
            return output.to(dtype)
        return None

    with contextlib.ExitStack() as stack:
        for module in model.modules():
            stack.callback(module.register_forward_pre_hook(before, with_kwargs=True).remove)
            stack.callback(module.register_forward_hook(after, with_kwargs=True, always_call=True).remove)
        yield model


def promoted(dtype: torch.dtype):
    """A float64 run stays in float64: the casts the model names for its precision promoted
    (:class:`~exporter.numerics.promote.PromoteCasts`); any other dtype runs as written."""
    return PromoteCasts() if dtype == torch.float64 else contextlib.nullcontext()


def _whole_model_dtype(model: nn.Module, device: str) -> tuple[torch.dtype, str]:
    """float64 when a float64 copy of the model fits in the device's free memory, else float32 (with a note)."""
    try:
        available = (torch.cuda.mem_get_info(torch.device(device))[0] if device.startswith("cuda")
                     else psutil.virtual_memory().available)
    except Exception:
        return torch.float64, ""
    floating = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point())
    if floating * 8 > 0.7 * available:
        return torch.float32, (f"reference run in float32: a float64 copy ({floating * 8 / 2**30:.1f} GiB) "
                               f"would not fit in free memory ({available / 2**30:.1f} GiB)")
    return torch.float64, ""


def _run(io: IOModule, samples, dtype: torch.dtype, count_flops: bool, device: str) -> tuple[list[Outputs], int]:
    outputs: list[Outputs] = []
    flops = 0
    with torch.inference_mode(), promoted(dtype):
        for index, sample in enumerate(samples):
            args = cast_sample(sample, dtype, device)
            if index == 0 and count_flops:
                counter = FlopCounterMode(display=False)
                with counter:
                    result = io(*args)
                flops = int(counter.get_total_flops())
            else:
                result = io(*args)
            outputs.append([t.detach().clone() for t in result])
    return outputs, flops


def run_reference(io: IOModule, samples: list[dict[str, torch.Tensor]], count_flops: bool = True,
                  device: str = "cpu") -> Reference:
    """Outputs of ``io`` (which must hold the original, non-rewritten model) in float64 on ``device``.

    On a GPU recipe the reference runs on the GPU (its float64 is tens of times the CPU's) and its outputs
    stay there, where the candidates are compared with them. First each module is upcast only while it runs
    (no second copy of the weights). If the model does not run that way (a module reading another's
    weights), the whole model is cast in place when a float64 copy fits in the device's memory, else the
    reference runs in float32 and says so.
    """
    where = "the GPU" if device.startswith("cuda") else "the CPU"
    with cast_in_place(io, None, device):  # back where it was afterwards (grid points run mid-pipeline)
        try:
            with upcast_while_running(io, torch.float64):
                outputs, flops = _run(io, samples, torch.float64, count_flops, device)
            return Reference(outputs, "float64", flops, device=device)
        except RuntimeError as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            first = describe(exc, 160)
            dtype, note = _whole_model_dtype(io, device)
            note = (note + "; " if note else "") + f"per-module upcast failed ({first}); whole model cast instead"
        try:
            with cast_in_place(io, dtype, device):
                outputs, flops = _run(io, samples, dtype, count_flops, device)
        except Exception as exc:
            raise ReferenceFailed(f"the original model does not run in {str(dtype).replace('torch.', '')} on "
                                  f"{where} ({describe(exc, 300)}), so no reference can be computed",
                                  "make the model run in float64 (ops without a float64 kernel cannot)") from None
    return Reference(outputs, name_of(dtype), flops, note, device=device)
