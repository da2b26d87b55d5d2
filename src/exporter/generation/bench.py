"""Timing a generation: prefill latency, per-token decode latency, tokens/s, and the decode's bandwidth.

The decode step of a decoder at small batch reads every weight and the whole static cache once per token
and does little arithmetic: its limit is memory bandwidth. ``bytes_per_token`` counts what one step must
read (the weights once, an embedding table only where a tied head reads it whole, the KV cache of every
layer); divided by the step's time it is the achieved bandwidth, and divided by the device's measured copy
bandwidth (``copy_bandwidth``) it is the time limit the step is held against. On CUDA the decode is also
replayed from a CUDA graph (its inputs are fixed-address buffers: ``DecoderStep``), which removes the launch
overhead of every kernel; a step that cannot be captured is timed without, and the reason is kept. On CUDA the
kernels one decode step launches are counted too (``measure/launches.py``: a step, a layer, the top by time).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn as nn

from ..errors import describe
from ..measure import launches
from ..measure.bench import Timing, repeat
from ..targets.aoti_loader import capture
from .driver import Steps


def timed(fn: Callable[[], Any], device: str, warmup: int, rounds: int, per: int = 1) -> dict[str, Any]:
    """``rounds`` timed calls of ``fn`` after ``warmup`` (:func:`exporter.measure.bench.repeat`), per step of
    ``per`` steps a call."""
    times = repeat(fn, rounds, device, warmup)
    return Timing.of([t / per for t in times]).brief()


def _median(fn: Callable[[], Any], device: str, warmup: int, rounds: int) -> float:
    return Timing.of(repeat(fn, rounds, device, warmup)).median_ms


def weight_bytes(model: nn.Module, leave_out: nn.Module | None = None) -> int:
    """Bytes a decode step reads of the model's parameters and buffers: each storage once (tied weights are read
    once), an embedding table's only where something else reads it whole (a tied head). A step gathers one row
    of a table per token, not the table: counting an untied 128k-vocabulary table read whole put an 8B-shaped
    slice at 123% of the copy bandwidth. fp8 weights count their one byte each (the storages' own sizes).
    ``leave_out``: a submodule the step never runs (an encoder-decoder's encoder, whose keys and values the
    decode step reads from the cache); a tensor it shares with a module the step runs still counts."""
    skipped = {id(m) for m in leave_out.modules()} if leave_out is not None else set()
    read: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding) or id(module) in skipped:
            continue
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                read[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(read.values())


def copy_bandwidth(device: str, megabytes: int = 1024) -> float | None:
    """Bytes per second a device-to-device copy of ``megabytes`` moves (read + write), best of 10; None on CPU."""
    if not device.startswith("cuda"):
        return None
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = repeat(lambda: dst.copy_(src), 10, device, warmup=3)
    return 2 * src.numel() / (min(times) / 1e3)


def time_decode(out: dict[str, Any], decode_all: Callable[[Callable[[], Any]], None], eager_step: Callable[[], Any],
                fresh: Callable[[], Any], call: Callable[[Any], Any], device: str, rounds: int,
                graph: bool) -> dict[str, Any]:
    """The decode steps of ``out`` (its ``tokens``) timed as they run (``decode_all(eager_step)``), then, on CUDA and
    where ``graph`` asks, replayed from a CUDA graph of ``call`` on a ``fresh()`` decode step (a step that cannot be
    captured is timed without, and the reason kept); the best of the two per token, and tokens/s."""
    tokens, batch = out["tokens"], out["batch"]
    out["decode"] = timed(lambda: decode_all(eager_step), device, 1, rounds, per=tokens)
    out["decode"]["cuda_graph"] = False
    if graph and device.startswith("cuda"):
        try:
            graphed = fresh()
            cuda_graph = capture(lambda: call(graphed))
            replayed = timed(lambda: decode_all(cuda_graph.replay), device, 1, rounds, per=tokens)
            out["decode_graph"] = {**replayed, "cuda_graph": True}
        except Exception as exc:  # timed without the graph; the reason is reported
            out["decode_graph"] = {"cuda_graph": False, "error": describe(exc)}
            torch.cuda.synchronize()
    best = out["decode"]["median_ms"]
    if out.get("decode_graph", {}).get("cuda_graph"):
        best = min(best, out["decode_graph"]["median_ms"])
    out["decode_best_ms"] = best
    out["tokens_per_s"] = batch * 1e3 / best
    return out


def time_steps(steps: Steps, prompt: Any, timing: dict[str, Any]) -> dict[str, Any]:
    """The prefill over ``prompt`` (a family's prompt: ``driver.Feed``) and ``timing["tokens"]`` decode steps after
    it, each timed as the setup's ``timing`` says, with the bandwidth of the weights and the cache read a token."""
    device, batch, feed = steps.device, prompt.batch, prompt.feed(steps)
    tokens = max(1, min(timing["tokens"], steps.cache_length - feed.start))
    out: dict[str, Any] = {"batch": batch, "prompt": prompt.length, "tokens": tokens}
    with torch.inference_mode():
        out["prefill"] = timed(feed.prefill, device, timing["warmup"], timing["rounds"])
        token = torch.zeros(batch, 1, dtype=torch.long, device=device)
        where = torch.tensor([feed.start], device=device)

        def decode_all(step: Callable[[], Any]) -> None:
            for t in range(tokens):
                where.fill_(feed.start + t)
                step()

        decode = steps.decode_for(batch)
        out["decode_program"] = "batch 1" if decode is not steps.decode else "dynamic batch"
        where.fill_(feed.start)  # counted before any CUDA graph captures the program (measure/launches.py)
        counted = launches.count(lambda: decode(*feed.args(token, where)), getattr(steps.layout, "layers", None))
        if counted is not None:
            out["kernels"] = counted
        time_decode(out, decode_all, lambda: decode(*feed.args(token, where)), lambda: steps.fresh_for(batch),
                    lambda step: step(*feed.args(token, where)), device, timing["rounds"], timing["cuda_graph"])
    out["bandwidth"] = bandwidth(out, timing["weight_bytes"] + feed.bytes, timing.get("copy_bytes_per_s"))
    return out


def time_eager_generate(model: nn.Module, inputs: dict[str, Any], tokens: int, device: str, rounds: int,
                        max_seconds: float = 0.0) -> dict[str, Any]:
    """transformers' ``generate`` (greedy, its default cache) given ``inputs`` (its keyword arguments, the prompt's
    values first, on ``device``): prefill = one new token; per token = the rest. With ``max_seconds`` > 0 the rounds
    are cut (to one at least) so that the timing takes about that long: the eager model is only the baseline, and a
    slow one must not hold a convert for minutes."""
    hf: Any = model  # a transformers PreTrainedModel

    def run(n: int) -> None:
        hf.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.inference_mode():
        t0 = time.perf_counter()
        run(tokens)  # the warm-up, and the measure of what one round costs
        once = time.perf_counter() - t0
        if max_seconds > 0:
            rounds = max(1, min(rounds, int(max_seconds / max(2 * once, 1e-9))))
        prefill = _median(lambda: run(1), device, 1, rounds)
        many = _median(lambda: run(tokens), device, 0, rounds)
    per_token = max(many - prefill, 0.0) / max(tokens - 1, 1)
    values = next(iter(inputs.values()))
    batch = int(values.shape[0])
    return {"batch": batch, "prompt": int(values.shape[-1]), "tokens": tokens, "rounds": rounds,
            "prefill": {"median_ms": prefill}, "decode": {"median_ms": per_token}, "decode_best_ms": per_token,
            "tokens_per_s": batch * 1e3 / per_token if per_token > 0 else None}


def time_runs(steps: Steps, prompt: Any, timing: dict[str, Any]) -> dict[str, Any]:
    """The steps timed at batch 1 (the prompt's first row, unpadded) and at the recipe's batch; with a decode program
    of batch 1, batch 1 once more with the program of any batch (``batch_1_dynamic``: what the tuned program buys)."""
    runs = [("batch_1", prompt.row(0), steps), ("batch", prompt, steps)]
    if steps.decode_one is not None:
        runs.append(("batch_1_dynamic", prompt.row(0), replace(steps, decode_one=None, fresh_decode_one=None)))
    return {label: time_steps(which_steps, which, timing) for label, which, which_steps in runs}


def bandwidth(timing: dict[str, Any], bytes_per_token: int, copy_bytes_per_s: float | None) -> dict[str, Any]:
    """Achieved bytes/s of the decode, and the fraction of the copy bandwidth it reaches."""
    seconds = timing["decode_best_ms"] / 1e3
    achieved = bytes_per_token / seconds if seconds > 0 else None
    return {"bytes_per_token": bytes_per_token, "achieved_bytes_per_s": achieved,
            "limit_ms": bytes_per_token / copy_bytes_per_s * 1e3 if copy_bytes_per_s else None,
            "fraction_of_copy": achieved / copy_bytes_per_s if achieved and copy_bytes_per_s else None}
