"""Float64 that stays float64: :class:`PromoteCasts` promotes the casts a model names for its precision.

The float64 reference (``numerics/reference.py``) and the program proof's float64 twin (``numerics/program64.py``)
both need a model's own ``float32``/``bfloat16``/``float16`` to mean float64 while they run.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

LOW = (torch.float32, torch.bfloat16, torch.float16)
_CASTS = {"float", "half", "bfloat16"}


class PromoteCasts(TorchFunctionMode):
    """While active, a float32, bfloat16 or float16 the model names (``dtype=``, ``.to(torch.float32)``,
    ``.float()``) means float64: a model run in float64 stays in float64 (transformers' eager attention takes
    its softmax in float32 otherwise, ~1e-7 of rounding in a "float64" reference)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") in LOW:
            kwargs["dtype"] = torch.float64
        if getattr(func, "__name__", "") in _CASTS and args and isinstance(args[0], torch.Tensor):
            return args[0].to(torch.float64) if args[0].is_floating_point() or func.__name__ == "float" else \
                func(*args, **kwargs)
        # a dtype passed by position; ``a in LOW`` on a tensor would compare it with each dtype (tens of
        # microseconds a call, most of a small model's float64 run)
        args = tuple(torch.float64 if isinstance(a, torch.dtype) and a in LOW else a for a in args)
        return func(*args, **kwargs)


__all__ = ["LOW", "PromoteCasts"]
