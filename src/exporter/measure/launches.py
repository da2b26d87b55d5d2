"""How many kernels one call launches on the GPU, and where its device time goes, read from the profiler.

A decode step at batch 1 is bound by its launches as much as by its bytes: every kernel costs a few
microseconds of launch and gap even replayed from a CUDA graph, so the number of kernels a step launches
(and how many a layer) is reported beside its time (docs/generation.md). The step is called directly, not
from its CUDA graph: a graph replays the same kernels, and an AOTInductor container whose run was captured
cannot run outside the graph again, so the count is taken before any capture.

Counted: every device activity of a call that is not a copy or a fill (``Memcpy …``, ``Memset …``, counted
apart as ``copies``), averaged over ``calls`` calls after ``warmup`` calls. On a machine without CUDA nothing
is counted (``None``): a CPU program runs its fused loops in the calling thread, with nothing to launch.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable

import torch

from .kernels import quiet_profiler

TOP = 5  # the kernels that took the most device time, kept for the report
COPIES = ("Memcpy", "Memset")


def launches(events: Iterable[tuple[str, int, float]], calls: int, layers: int | None = None) -> dict[str, Any]:
    """From (name, times run, device µs in all) of each device activity over ``calls`` calls: kernels a call (and
    a layer, given ``layers``), copies a call, device ms a call, and the ``TOP`` kernels by device time."""
    count: collections.Counter = collections.Counter()
    time_us: dict[str, float] = collections.defaultdict(float)
    copies = 0
    for name, runs, us in events:
        if name.startswith(COPIES):
            copies += runs
            continue
        count[name] += runs
        time_us[name] += us
    per_call = sum(count.values()) / calls
    top = sorted(time_us, key=lambda name: time_us[name], reverse=True)[:TOP]
    return {"per_step": per_call, "per_layer": per_call / layers if layers else None, "copies": copies / calls,
            "device_ms": sum(time_us.values()) / calls / 1e3,
            "top": [{"name": name[:120], "per_step": count[name] / calls, "ms": time_us[name] / calls / 1e3}
                    for name in top]}


def count(call: Callable[[], Any], layers: int | None = None, calls: int = 5, warmup: int = 2) -> dict[str, Any] | None:
    """:func:`launches` of ``call`` run ``calls`` times under ``torch.profiler`` (CUDA activities only), after
    ``warmup`` calls; None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415 - only where there is a GPU

    quiet_profiler()
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    events = [(e.key, e.count, float(e.device_time_total)) for e in prof.key_averages() if e.device_time_total > 0]
    return launches(events, calls, layers)


__all__ = ["launches", "count"]
