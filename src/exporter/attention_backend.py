"""The recipe's SDPA backend preference, applied where kernels are chosen (eager runs and compiles on CUDA).

``auto`` leaves PyTorch's own order. A named backend is put first in the
priority order and the others stay allowed, so a shape or dtype the preferred
kernel cannot take still runs; which kernel actually ran is read from the
profiler and reported, so a fallback is never silent.
"""

from __future__ import annotations

import contextlib

from torch.nn.attention import SDPBackend, sdpa_kernel

NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}
ORDER = ("cudnn", "flash", "efficient", "math")


def backend_context(preference: str, device: str):
    if preference == "auto" or not device.startswith("cuda"):
        return contextlib.nullcontext()
    ordered = [preference] + [b for b in ORDER if b != preference]
    backends = [getattr(SDPBackend, NAMES[b]) for b in ordered]
    try:
        return sdpa_kernel(backends, set_priority=True)
    except TypeError:  # older torch without set_priority
        return sdpa_kernel(backends)


__all__ = ["backend_context"]
