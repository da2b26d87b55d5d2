"""Memory: a process's own peak resident memory, and the peak the timed variant allocated on its device."""

from __future__ import annotations

import resource
from typing import Any

import torch


def peak_rss_bytes() -> int:
    """This process's own peak resident memory.

    Linux's VmHWM belongs to the process's address space and starts afresh at exec; ``ru_maxrss`` would
    also count the parent's memory at the time it forked this process.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_memory(device: str) -> dict[str, Any]:
    """The variant's peak: the CUDA allocator's on a GPU, else the process's peak RSS."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()), "memory_kind": "cuda allocator peak"}
    return {"peak_memory_bytes": peak_rss_bytes(), "memory_kind": "process peak RSS"}


__all__ = ["peak_rss_bytes", "peak_memory"]
