"""Memory: a process's own peak, a timed variant's peak on its device, and the whole process tree's (sampled)."""

from __future__ import annotations

import contextlib
import resource
import threading
from pathlib import Path
from typing import Any, Callable

import psutil
import torch

from .. import forkserver
from ..errors import shorten
from ..outdir import public_command


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


class TreeMemory:
    """The host memory of this process and every process it started, sampled while a run goes on.

    A background thread reads, every ``interval_s``, each process's resident set (RSS) and its proportional
    set (PSS: a page shared by n processes counts 1/n in each, so libraries mapped by every child and the
    checkpoint's pages are not counted once per process). The peak of the sum is the tree's figure, a
    measurement rather than an estimate; between two samples a short spike can be missed, so the interval
    is short. On a GPU the device memory in use (all processes: free vs. total) is sampled too.
    With ``stage`` (a function naming the stage under way, e.g. ``Progress.current``), each sample also
    counts toward that stage's peaks, so a report can say which stage holds the memory.
    """

    def __init__(self, interval_s: float = 0.2, pid: int | None = None,
                 stage: Callable[[], str | None] | None = None):
        self.interval_s = interval_s
        self.pid = pid  # the tree's root (None: this process)
        self.stage = stage
        self.stages: dict[str, dict[str, Any]] = {}  # stage -> its peaks, in the order the stages came
        self.peak_pss = 0
        self.peak_rss = 0
        self.peak_gpu_used = 0
        self.processes: dict[int, dict[str, Any]] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> TreeMemory:
        self._thread = threading.Thread(target=self._run, name="exporter-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self.sample()  # the end state too

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            tree = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        pss_total = rss_total = root_rss = 0
        for proc in tree:
            try:
                full = proc.memory_full_info()
                rss, pss = int(full.rss), int(getattr(full, "pss", full.rss))
                entry = self.processes.get(proc.pid)
                if entry is None:
                    entry = self.processes[proc.pid] = {"pid": proc.pid, "command": _command(proc),
                                                        "peak_rss_bytes": 0, "peak_pss_bytes": 0}
                entry["peak_rss_bytes"] = max(entry["peak_rss_bytes"], rss)
                entry["peak_pss_bytes"] = max(entry["peak_pss_bytes"], pss)
            except psutil.Error:  # it ended between the listing and the reading
                continue
            pss_total += pss
            rss_total += rss
            root_rss = rss if proc.pid == root.pid else root_rss
        if self.stage is not None:
            name = self.stage() or "between stages"
            entry = self.stages.setdefault(name, {"stage": name, "tree_peak_pss_bytes": 0, "root_peak_rss_bytes": 0})
            entry["tree_peak_pss_bytes"] = max(entry["tree_peak_pss_bytes"], pss_total)
            entry["root_peak_rss_bytes"] = max(entry["root_peak_rss_bytes"], root_rss)
        self.peak_pss = max(self.peak_pss, pss_total)
        self.peak_rss = max(self.peak_rss, rss_total)
        self.samples += 1
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with contextlib.suppress(Exception):
                free, total = torch.cuda.mem_get_info()
                self.peak_gpu_used = max(self.peak_gpu_used, int(total - free))

    def to_dict(self, top: int = 8) -> dict[str, Any]:
        biggest = sorted(self.processes.values(), key=lambda e: e["peak_pss_bytes"], reverse=True)[:top]
        return {"tree_peak_pss_bytes": self.peak_pss, "tree_peak_rss_bytes": self.peak_rss,
                "gpu_peak_used_bytes": self.peak_gpu_used or None, "sampling_interval_s": self.interval_s,
                "samples": self.samples, "processes_seen": len(self.processes), "largest_processes": biggest,
                "stages": list(self.stages.values())}


def _command(proc: psutil.Process) -> str:
    try:
        words = proc.cmdline()
    except psutil.Error:
        return "?"
    text = " ".join(words)
    if "exporter.forkserver" in text:  # the server, or a child forked from it (which keeps its command line)
        return "exporter fork server" if proc.pid in forkserver.server_pids() else "exporter.child"
    if "exporter.child" in text:
        return "exporter.child"
    if "compile_worker" in text or "subproc_pool" in text:
        return "inductor compile worker"
    shown = public_command(words[:4])  # a published report names no folder of this machine
    return shorten(" ".join(Path(w).name if i == 0 else w for i, w in enumerate(shown)), 80)
