"""Which attention kernels actually ran in an artifact, read from the profiler.

One call of the artifact is profiled (after one warm-up call) and the event names
are classified:

- **SDPA backend** per call: ``flash``, ``efficient``, ``cudnn``, ``math`` or ``other``, from
  the ATen op that SDPA dispatched to (a CPU-side record, the same name on every device),
  else from an AOTInductor C-shim record, else from the GPU kernels' names;
- **explicit softmax kernels**: attention that did not run fused (or the math backend).

Names and where they were checked:

- ATen ops ``aten::_scaled_dot_product_flash_attention_for_cpu`` (CPU flash) and
  ``aten::_scaled_dot_product_attention_math`` (math): seen on the CPU with torch 2.13;
  ``aten::_scaled_dot_product_cudnn_attention``: seen on an H200 with torch 2.11. The other CUDA
  ones (``…_flash_attention``, ``…_efficient_attention``) follow the same naming in
  ``native_functions.yaml`` but were not seen on a GPU here.
- AOTInductor packages call kernels through C shims, which the profiler records only when
  the package was compiled with ``inductor_configs={"cpp.enable_kernel_profile": True}``
  (e.g. ``aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu``: seen on the CPU).
  Without it an AOTI package on the CPU shows no SDPA record, and the result says so
  (``source: "none"``) rather than guessing.
- GPU kernel names, used only when no ATen or shim record exists (an AOTInductor package on the
  GPU): cuDNN's fused attention contains ``cudnn`` together with ``sdpa``, ``fmha``, ``fprop`` or
  ``flash`` (seen on an H200: ``cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_…``);
  not seen here: FlashAttention-2 as vendored by PyTorch (``flash_fwd`` / ``pytorch_flash``) and
  memory-efficient attention (``fmha_cutlassF``, ``mem_efficient``, ``attention_kernel``).
- Softmax: an ATen softmax op and the GPU kernel it launches count as one; kernels are counted
  only where no op was recorded (Inductor's fused ``triton_…_softmax_…`` kernels in a package).
- onnxruntime is not seen by torch's profiler: its own profiler lists the ONNX ops each
  node ran (``Attention`` vs ``Softmax``); which implementation the ``Attention`` kernel
  chose inside onnxruntime is not recorded there.
"""

from __future__ import annotations

import collections
import json
import os
import re
import tempfile
from typing import Any, Callable, Iterable

import torch
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from ..errors import describe, failure_reason
from ..results import FAILED
from .backend_choice import why_not

BACKENDS = ("flash", "efficient", "cudnn", "math", "other")
TOP = 5  # the ops (kernels on a GPU) that took the most time in the profiled call, kept for the report

ATEN_SDPA = {
    "_scaled_dot_product_flash_attention_for_cpu": "flash",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_attention_math": "math",
    "_scaled_dot_product_attention_math_for_mps": "math",
    "_scaled_dot_product_fused_attention_overrideable": "other",
}
SHIM = re.compile(r"^aoti_torch_[a-z]+_(_scaled_dot_product_\w+?)(?:_out)?$")
DEVICE_KERNELS = (  # (backend, all of these substrings, lower-case); only the cudnn names were seen on a GPU here
    ("flash", ("flash_fwd",)),
    ("flash", ("pytorch_flash",)),
    ("efficient", ("fmha_cutlassf",)),
    ("efficient", ("mem_efficient",)),
    ("efficient", ("attention_kernel",)),
    ("cudnn", ("cudnn", "sdpa")),
    ("cudnn", ("cudnn", "fmha")),
    ("cudnn", ("cudnn", "flash")),
)  # not ("cudnn", "fprop"): cuDNN's convolutions are "...cudnn::Kernel<...fprop...>" too
ATEN_SOFTMAX = {"aten::_softmax", "aten::_masked_softmax"}  # the leaves: aten::softmax and _safe_softmax call these


def _aten_backend(name: str) -> str | None:
    if name.startswith("aten::"):
        return ATEN_SDPA.get(name[len("aten::"):])
    match = SHIM.match(name)
    return ATEN_SDPA.get(match.group(1)) if match else None


def _device_backend(name: str) -> str | None:
    low = name.lower()
    for backend, parts in DEVICE_KERNELS:
        if all(p in low for p in parts):
            return backend
    return None


def _is_softmax(name: str, device_kernel: bool) -> bool:
    low = name.lower()
    if "scaled_dot_product" in low or "attention" in low:
        return False
    if name.startswith("aten::"):
        return name in ATEN_SOFTMAX
    if name.startswith("aoti_torch_"):
        return "softmax" in low and not low.endswith("_backward")
    return "softmax" in low and (device_kernel or "fused" in low or low.startswith(("triton", "graph_", "cpp_")))


def classify(events: Iterable[tuple[str, bool]], device: str = "cpu") -> dict[str, Any]:
    """Backends and softmax kernels from (event name, ran on a GPU) pairs of one call."""
    ops: collections.Counter = collections.Counter()
    shims: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    evidence: collections.Counter = collections.Counter()
    softmax_ops = softmax_kernels = 0  # an ATen softmax op and the GPU kernel it launches are one softmax
    for name, on_device in events:
        backend = None if on_device else _aten_backend(name)
        if backend is not None:
            (ops if name.startswith("aten::") else shims)[backend] += 1
            evidence[name] += 1
        elif on_device and (backend := _device_backend(name)) is not None:
            kernels[backend] += 1
            evidence[name] += 1
        if _is_softmax(name, on_device):
            if name.startswith(("aten::", "aoti_torch_")):
                softmax_ops += 1
            else:
                softmax_kernels += 1
            evidence[name] += 1
    softmax = softmax_ops or softmax_kernels
    for source, counts in (("aten ops", ops), ("aoti shims", shims), ("device kernels", kernels)):  # noqa: B007 - read after the loop
        if counts:
            break
    else:
        source, counts = "none", collections.Counter()
    result = {"device": device, "source": source, "sdpa_calls": sum(counts.values()),
              "backends": {b: counts[b] for b in BACKENDS if counts[b]}, "softmax_kernels": softmax,
              "evidence": dict(sorted(evidence.items()))}
    if source == "none":
        result["note"] = ("no SDPA kernel recorded" + (f"; {softmax} explicit softmax kernel(s): attention ran unfused"
                                                        if softmax else ""))
    elif source == "device kernels":
        result["note"] = "classified from GPU kernel names; no ATen record of the SDPA op"
    return result


def quiet_profiler() -> None:
    """The profiler's own ``profiler_start``/``profiler_stop`` lines on stderr: off (Kineto reads its log level when
    first used), for the command line and the Python API alike; ``EXPORTER_DEBUG=1`` keeps them."""
    if os.environ.get("EXPORTER_DEBUG") != "1":
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def profile(call: Callable[[], Any], device: str = "cpu", warmup: int = 1) -> dict[str, Any]:
    """Run ``call`` ``warmup`` times, then once under ``torch.profiler``, and classify what ran."""
    quiet_profiler()
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    with torch.inference_mode():
        for _ in range(warmup):
            call()
        if cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with torch_profile(activities=activities) as prof:
            call()
            if cuda:
                torch.cuda.synchronize()
    events = []
    for event in prof.events():
        kind = getattr(event, "device_type", None)
        on_device = kind is not None and kind != torch.autograd.DeviceType.CPU
        events.append((event.name, on_device))
    result = classify(events, device)
    result["top"] = top_by_time(prof.key_averages(), cuda)
    return result


def top_by_time(averages, on_device: bool) -> list[dict[str, Any]]:
    """The ``TOP`` entries of a profile by self time (device time on a GPU), with their share of the total."""
    def self_us(event) -> float:
        if on_device:
            return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) or 0.0)
        return float(getattr(event, "self_cpu_time_total", 0.0) or 0.0)

    timed = [(self_us(e), e) for e in averages if self_us(e) > 0]
    total = sum(t for t, _ in timed) or 1.0
    timed.sort(key=lambda item: item[0], reverse=True)
    return [{"name": e.key, "self_ms": round(t / 1000, 4), "share": round(t / total, 3), "calls": e.count}
            for t, e in timed[:TOP]]


def _session_args(session, sample) -> list[torch.Tensor]:
    if sample is not None:
        return session.prepare(sample)
    if session.bench_args is None:
        raise RuntimeError("kernels: pass a sample, or set the benchmark input first")
    return session.bench_args


def hook(device: str, hint: str = "") -> Callable[..., dict[str, Any]]:
    """``Loaded.hooks["kernels"]`` for a target run by torch: ``fn(session, sample=None) -> dict``."""

    def kernels(session, sample=None) -> dict[str, Any]:
        args = _session_args(session, sample)
        result = profile(lambda: session.loaded.call(args), device)
        if hint and result["source"] == "none":
            result["note"] += f" ({hint})"
        return result

    return kernels


def onnxruntime_profile(path: str, provider: str, inputs: list[torch.Tensor]) -> dict[str, Any]:
    """Run an ONNX model once (after a warm-up) with onnxruntime's profiler and count the ops its nodes ran."""
    import numpy as np  # noqa: PLC0415 - only with onnxruntime
    import onnxruntime as ort  # noqa: PLC0415 - onnxruntime is needed only for an ONNX artifact

    with tempfile.TemporaryDirectory() as folder:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(folder, "ort")
        session = ort.InferenceSession(path, sess_options=options, providers=[provider])
        feed = {i.name: np.ascontiguousarray(t.detach().cpu().numpy()) for i, t in zip(session.get_inputs(), inputs)}
        session.run(None, feed)
        session.run(None, feed)
        trace = session.end_profiling()
        with open(trace, encoding="utf-8") as handle:
            events = json.load(handle)
    runs = [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]
    per_op = collections.Counter(e.get("args", {}).get("op_name", "?") for e in runs)
    time_us: dict[str, float] = collections.defaultdict(float)
    for event in runs:
        time_us[event.get("args", {}).get("op_name", "?")] += float(event.get("dur", 0)) / 2  # two calls traced
    total = sum(time_us.values()) or 1.0
    top = [{"name": op, "self_ms": round(us / 1000, 4), "share": round(us / total, 3), "calls": per_op[op] // 2}
           for op, us in sorted(time_us.items(), key=lambda item: item[1], reverse=True)[:TOP] if us > 0]
    calls = 2  # the warm-up is in the trace too
    attention = {op: n // calls for op, n in per_op.items()
                 if op in ("Attention", "MultiHeadAttention", "GroupQueryAttention", "PackedAttention")}
    providers = sorted({e.get("args", {}).get("provider", "?") for e in runs})
    return {"device": "cuda" if provider.startswith("CUDA") else "cpu", "source": "onnxruntime profile",
            "sdpa_calls": sum(attention.values()),
            "backends": {f"onnxruntime {op}": n for op, n in sorted(attention.items())},
            "softmax_kernels": per_op.get("Softmax", 0) // calls,
            "evidence": {op: n // calls for op, n in sorted(per_op.items())}, "providers": providers, "top": top,
            "note": "which implementation onnxruntime's Attention kernel chose is not in its profile"}


def onnxruntime_hook(path: str, provider: str) -> Callable[..., dict[str, Any]]:
    """``Loaded.hooks["kernels"]`` for the onnx target."""

    def kernels(session, sample=None) -> dict[str, Any]:
        return onnxruntime_profile(path, provider, _session_args(session, sample))

    return kernels


__all__ = ["classify", "profile", "hook", "onnxruntime_profile", "onnxruntime_hook", "BACKENDS"]


def audit_kernels(live: dict[str, Any], sample, results, preferred: str) -> tuple[Any, Any]:
    """Which attention kernels each variant actually ran (one profiled call each), and why: PyTorch's own
    verdict on each SDPA call of the rewritten model (``backend_choice``). A note goes on each variant that ran
    something other than the preferred backend, or the math backend.

    Returns (eager's kernels, the verdict). The audit explains; it fails a variant only when its process died
    while profiled (a crash is a finding, at every stage).
    """
    by_name = {r.name: r for r in results}
    eager = None
    try:
        choice = live["rewritten"].call("sdpa_choice", sample)
    except Exception as exc:
        choice = {"error": describe(exc), "calls": []}
    for name, runner in live.items():
        result = by_name.get(name)
        try:
            found = runner.call("kernels", sample)
        except Exception as exc:
            found = None
            process = getattr(runner, "process", None)
            if result is not None and process is not None and process.poll() is not None:
                result.fail(FAILED, f"attention kernels: {failure_reason(exc)}")
            elif result is not None:
                result.notes.append(f"attention kernels not recorded: {failure_reason(exc)}")
        if name == "eager":
            eager = found
            continue
        if result is None or found is None:
            continue
        result.info["kernels"] = found
        ran = set(found.get("backends") or {})
        if preferred != "auto" and ran and preferred not in ran:
            why = why_not(choice, preferred)
            result.notes.append(f"attention backend: {preferred} was preferred, {', '.join(sorted(ran))} ran"
                                + (f" ({why})" if why else ""))
        elif "math" in ran:
            why = "; ".join(f"{b}: {w}" for b in ("flash", "cudnn", "efficient") if (w := why_not(choice, b)))
            result.notes.append("attention ran on the math backend" + (f" ({why})" if why else ""))
    return eager, choice
