"""The float64 reference: the original model (eager attention) run on the CPU in float64.

The model is cast in place and cast back afterwards, tensor by tensor, so no
second copy of the module is built. Where a float64 copy would not fit in the
host's free memory the reference is run in float32 and the report says so.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn

from .inputs import cast_sample
from .modelio import IOModule

Outputs = list[torch.Tensor]


@dataclass
class Reference:
    outputs: list[Outputs]
    dtype: str
    flops: int  # forward FLOPs of sample 0, counted by torch.utils.flop_counter
    note: str = ""


@contextlib.contextmanager
def cast_in_place(model: nn.Module, dtype: torch.dtype, device: str = "cpu"):
    """Cast every floating parameter and buffer to ``dtype`` on ``device``; restore each on exit."""
    originals = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        originals[name] = (tensor.dtype, tensor.device)
    model.to(device=device)
    if dtype is not None:
        model.to(dtype=dtype)
    try:
        yield model
    finally:
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            original_dtype, original_device = originals.get(name, (tensor.dtype, tensor.device))
            if tensor.dtype != original_dtype or tensor.device != original_device:
                owner, _, leaf = name.rpartition(".")
                module = model.get_submodule(owner) if owner else model
                restored = tensor.data.to(device=original_device, dtype=original_dtype)
                if leaf in module._parameters:
                    module._parameters[leaf].data = restored
                else:
                    module._buffers[leaf] = restored


def _reference_dtype(model: nn.Module) -> tuple[torch.dtype, str]:
    try:
        import psutil

        available = psutil.virtual_memory().available
    except Exception:
        return torch.float64, ""
    floating = sum(t.numel() for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point())
    if floating * 8 > 0.7 * available:
        return torch.float32, (f"reference run in float32: a float64 copy ({floating * 8 / 2**30:.1f} GiB) "
                               f"would not fit in free memory ({available / 2**30:.1f} GiB)")
    return torch.float64, ""


def run_reference(io: IOModule, samples: list[dict[str, torch.Tensor]], count_flops: bool = True) -> Reference:
    """Outputs of ``io`` (which must hold the original, non-rewritten model) in float64 on the CPU."""
    dtype, note = _reference_dtype(io)
    outputs: list[Outputs] = []
    flops = 0
    with cast_in_place(io, dtype), torch.inference_mode():
        for index, sample in enumerate(samples):
            args = cast_sample(sample, dtype)
            if index == 0 and count_flops:
                from torch.utils.flop_counter import FlopCounterMode

                counter = FlopCounterMode(display=False)
                with counter:
                    result = io(*args)
                flops = int(counter.get_total_flops())
            else:
                result = io(*args)
            outputs.append([t.detach().clone() for t in result])
    return Reference(outputs, str(dtype).replace("torch.", ""), flops, note)
