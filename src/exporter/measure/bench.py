"""Timing: a monotonic clock on the CPU, CUDA events on the GPU, and interleaved rounds across variants.

:func:`repeat` is the one timing loop (every figure a report holds comes from it, the decode steps of a
generation included) and :class:`Timing` its statistics. Every variant (the eager baseline and each target) is
warmed up, then timed in rounds; within a round each variant runs a burst of iterations, in a rotating order,
so slow drifts of the machine (clocks, caches, other load) spread over all variants instead of favouring
whichever ran first.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from .. import interrupts
from ..errors import RunnerFailed, failure_reason
from ..results import FAILED
from .conditions import differences


def synchronize(device: str) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def repeat(fn: Callable[[], object], count: int, device: str, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``count`` calls of ``fn`` after ``warmup`` untimed calls: CUDA events on a GPU (the
    device's time from the call's first launch to its last), a monotonic clock on the CPU. The garbage collector
    is paused while calls are timed, as ``timeit`` does: a full collection of a process holding large graphs takes
    milliseconds."""
    for _ in range(warmup):
        fn()
    if count <= 0:
        return []
    with _gc_paused():
        return _timed(fn, count, device)


def time_calls(fn: Callable[[], object], count: int, device: str) -> list[float]:
    """One burst: ``count`` calls after one untimed call, which absorbs what switching from another variant costs
    (caches, another process's threads going idle), so each burst measures this variant."""
    return repeat(fn, count, device, warmup=1) if count > 0 else []


@contextlib.contextmanager
def _gc_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _timed(fn: Callable[[], object], count: int, device: str) -> list[float]:
    if device.startswith("cuda"):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(count)]
        torch.cuda.synchronize()
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for _ in range(count):
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class Timing:
    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    min_ms: float
    stdev_ms: float
    runs: int
    p25_ms: float
    p75_ms: float
    max_ms: float
    noise: float  # interquartile range over median: the spread of typical calls, blind to rare outliers

    def brief(self) -> dict[str, Any]:
        """The median, the 90th percentile and how many calls: what a generation step's timing reports."""
        return {"median_ms": self.median_ms, "p90_ms": self.p90_ms, "rounds": self.runs, "noise": self.noise}

    @classmethod
    def of(cls, times: list[float]) -> "Timing":
        median, p25, p75 = statistics.median(times), percentile(times, 0.25), percentile(times, 0.75)
        return cls(median_ms=median, p90_ms=percentile(times, 0.90),
                   p99_ms=percentile(times, 0.99), mean_ms=statistics.fmean(times), min_ms=min(times),
                   stdev_ms=statistics.stdev(times) if len(times) > 1 else 0.0, runs=len(times),
                   p25_ms=p25, p75_ms=p75, max_ms=max(times), noise=(p75 - p25) / median if median > 0 else 0.0)


NOISY = 0.10  # a variant whose interquartile range exceeds 10% of its median is noisy
SPEEDUP_SPREAD = 1.25  # a speedup whose plausible range spans more than 25% is not precise


def speedup(baseline: dict[str, Any], candidate: dict[str, Any]) -> dict[str, Any]:
    """The speedup of ``candidate`` over ``baseline`` (median over median) and what the timings support.

    Its range pairs the quartiles the other way round (baseline p25 / candidate p75 to baseline p75 /
    candidate p25). Where that range straddles 1 there is no telling which is faster: the figure is not supported
    and the report marks it. Where it lies on one side of 1, which is faster is supported; its size is precise
    only where the range spans at most ``SPEEDUP_SPREAD`` (else the notes give the range)."""
    value = baseline["median_ms"] / candidate["median_ms"]
    low = baseline["p25_ms"] / candidate["p75_ms"] if candidate["p75_ms"] > 0 else value
    high = baseline["p75_ms"] / candidate["p25_ms"] if candidate["p25_ms"] > 0 else value
    supported = low > 0 and not low < 1.0 < high
    precise = supported and high / low <= SPEEDUP_SPREAD
    return {"speedup_vs_eager": value, "speedup_range": [low, high], "speedup_supported": supported,
            "speedup_precise": precise}


class Timed(Protocol):
    name: str

    def bench(self, count: int) -> list[float]: ...


SETTLE_S = 0.05


def interleaved(variants: list[Timed], warmup: int, rounds: int, iterations: int,
                on_error: Callable[[Timed, BaseException], None], settle_s: float = SETTLE_S,
                max_seconds: float = 0.0) -> dict[str, list[float]]:
    """Warm each variant up, then time ``rounds`` bursts of ``iterations`` per variant, rotating the order.

    Between bursts the machine is left idle for ``settle_s``: runtimes whose idle
    threads spin (onnxruntime, OpenMP) stop spinning before the next variant runs.
    With ``max_seconds`` > 0, a variant whose calls are slow gets fewer warm-up calls and
    fewer calls per burst (never fewer than one per round), so that its timing takes about
    ``max_seconds`` (an ONNX model on the CPU beside a GPU's milliseconds); the number of
    timed calls is in the result.
    """
    alive = list(variants)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    burst: dict[str, int] = {}
    for variant in list(alive):
        try:
            per_call_s = max(variant.bench(1)[0] / 1000.0, 1e-9)  # after one untimed call
            warm, burst[variant.name] = warmup, iterations
            if max_seconds > 0:
                warm = min(warmup, int(0.25 * max_seconds / per_call_s))
                burst[variant.name] = min(iterations, max(1, int(0.75 * max_seconds / (rounds * per_call_s))))
            variant.bench(warm)
        except Exception as exc:  # a crashed or failing variant drops out; the others go on
            on_error(variant, exc)
            alive.remove(variant)
    for round_index in range(rounds):
        if not alive:
            break
        shift = round_index % len(alive)
        for variant in alive[shift:] + alive[:shift]:
            if variant not in alive:
                continue
            time.sleep(settle_s)
            interrupts.check()
            try:
                times[variant.name].extend(variant.bench(burst[variant.name]))
            except Exception as exc:
                on_error(variant, exc)
                alive.remove(variant)
    return {name: t for name, t in times.items() if t}


def summarize(times: list[float], batch: int, flops: int, peak_tflops: float) -> dict[str, Any]:
    """Latency percentiles, throughput and achieved TFLOP/s (and utilisation when the peak is known)."""
    timing = Timing.of(times)
    entry: dict[str, Any] = dict(vars(timing))
    entry["batch"] = int(batch)
    entry["throughput_per_s"] = batch * 1000.0 / timing.median_ms if timing.median_ms > 0 else None
    if flops:
        tflops = flops / (timing.median_ms / 1000.0) / 1e12
        entry["tflops"] = tflops
        entry["utilisation"] = tflops / peak_tflops if peak_tflops > 0 else None
    return entry


def _top_ops(kernels: dict[str, Any] | None) -> str:
    top = (kernels or {}).get("top") or []
    return ", ".join(f"{t['name']} {t['share']:.0%}" for t in top[:3])


def slower_than_source(results) -> list[str]:
    """Compare every artifact with the rewritten eager model it was built from (same device and dtype):
    ``bench.speedup_vs_rewritten`` on each, and where the artifact is clearly slower (its whole quartile range
    of speedups below 1) a note with the top ops by time of both, and a line for the run's warnings."""
    source = next((r for r in results if r.name == "rewritten"), None)
    if source is None or not (source.bench or {}).get("median_ms"):
        return []
    lines = []
    for result in results:
        bench = result.bench or {}
        if result is source or not bench.get("median_ms") or (result.device, result.dtype) != (source.device,
                                                                                              source.dtype):
            continue
        versus = speedup(source.bench, bench)
        value, (low, high) = versus["speedup_vs_eager"], versus["speedup_range"]
        bench["speedup_vs_rewritten"] = value
        bench["slower_than_rewritten"] = high < 1.0
        if not bench["slower_than_rewritten"]:
            continue
        note = (f"slower than the rewritten eager model it was built from: {bench['median_ms']:.3g} ms against "
                f"{source.bench['median_ms']:.3g} ms ({value:.2f}×, between {low:.2f}× and {high:.2f}×)")
        mine, theirs = _top_ops(result.info.get("kernels")), _top_ops(source.info.get("kernels"))
        if mine:
            note += f"; its top ops by time: {mine}"
        if theirs:
            note += f"; the rewritten model's: {theirs}"
        result.notes.append(note)
        lines.append(f"{result.name} is slower than the rewritten eager model it was built from ({value:.2f}×)")
    return lines


def run_benchmark(live: dict[str, Any], sample, warmup: int, rounds: int, iterations: int,
                  describe_error: Callable[[BaseException], str],
                  max_seconds: float = 0.0) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Prepare each runner's input, time them interleaved; return (times by name, failure reason by name)."""
    failed: dict[str, str] = {}
    for name, runner in live.items():
        try:
            runner.set_bench_input(sample)
        except Exception as exc:
            failed[name] = describe_error(exc)

    def on_error(variant, exc):
        failed[variant.name] = describe_error(exc)

    variants = [r for n, r in live.items() if n not in failed]
    return interleaved(variants, warmup, rounds, iterations, on_error, max_seconds=max_seconds), failed


def benchmark(live: dict[str, Any], sample, results, settings, device: str, flops: int, batch: int):
    """Time every live variant against the eager baseline; fill each result's ``bench``.

    Returns (the eager baseline's entry, warnings). A variant that fails while timed is failed with the reason.
    """
    by_name = {r.name: r for r in results}
    warnings: list[str] = []
    timings, failed = run_benchmark(live, sample, settings.warmup, settings.rounds, settings.iterations,
                                    failure_reason, settings.max_seconds)
    for name, reason in failed.items():
        if name in by_name:
            by_name[name].fail(FAILED, f"benchmark: {reason}")
        warnings.append(f"{name}: benchmark failed: {reason}")
    eager_bench = None
    for name, runner in live.items():
        if name not in timings:
            continue
        entry = summarize(timings[name], batch, flops, settings.peak_tflops)
        with contextlib.suppress(RunnerFailed):
            entry.update(runner.memory())
        entry["load_s"] = runner.load_s
        if len(timings[name]) < settings.rounds * settings.iterations and name in by_name:
            by_name[name].notes.append(f"timed {len(timings[name])} calls, fewer than bench.rounds x "
                                       f"bench.iterations: its calls are slow (bench.max_seconds = "
                                       f"{settings.max_seconds:g})")
        if name == "eager":
            eager_bench = entry
        else:
            by_name[name].bench = entry
    for result in results:
        if result.bench and eager_bench:
            if result.device == device:
                result.bench.update(speedup(eager_bench, result.bench))
                low, high = result.bench["speedup_range"]
                noise = f"(noise: eager {eager_bench['noise']:.0%}, this {result.bench['noise']:.0%} of the median)"
                if not result.bench["speedup_supported"]:
                    result.notes.append(f"speedup {result.bench['speedup_vs_eager']:.2f}× not supported by the "
                                        f"timings: between {low:.2f}× and {high:.2f}× from the interquartile "
                                        f"ranges {noise}")
                elif not result.bench["speedup_precise"]:
                    result.notes.append(f"speedup {result.bench['speedup_vs_eager']:.2f}×: "
                                        f"{'faster' if low > 1 else 'slower'} than eager in every pairing of the "
                                        f"quartiles, by {low:.2f}× to {high:.2f}× {noise}")
            else:
                result.bench["speedup_vs_eager"] = None
                result.notes.append(f"timed on {result.device}; the eager baseline ran on {device}: no speedup")
            unlike = differences(eager_bench.get("process") or {}, result.bench.get("process") or {})
            if unlike:
                warnings.append(f"{result.name}: timed under other process conditions than eager ({', '.join(unlike)}):"
                                " its speedup compares unlike runs")
        if result.info.get("compile_s") is not None:
            result.build_s = result.info["compile_s"]
    if eager_bench and eager_bench["noise"] > NOISY:
        warnings.append(f"the eager baseline's timings are noisy: interquartile range {eager_bench['noise']:.0%} of "
                        f"the median, slowest call {eager_bench['max_ms'] / eager_bench['median_ms']:.0f}× the "
                        "median; speedups marked ⚠ are not supported (a busy machine? run again on an idle one)")
    return eager_bench, warnings
