"""Why each fused SDPA backend can or cannot run on a model's attention calls, as PyTorch itself decides it.

The rewritten model is run once under a ``TorchFunctionMode`` that records every
``scaled_dot_product_attention`` call (the Python function and the ATen op a rewritten
graph calls). For each distinct call signature (shapes, dtypes, mask, causal flag,
grouped-query flag) PyTorch's own checks are asked, in debug mode:

- ``torch.backends.cuda.can_use_flash_attention`` / ``can_use_efficient_attention`` /
  ``can_use_cudnn_attention``: whether the kernel accepts the call; the reasons are the
  warnings PyTorch emits in debug mode (dtype, head dim, mask kind, GPU architecture, ...);
- ``torch._fused_sdp_choice`` under the recipe's backend preference: the backend the
  dispatcher picks for that call, the same choice Inductor bakes into an AOTInductor package.

These checks exist for CUDA tensors only. On the CPU the result says so: PyTorch's CPU
kernels are its own flash implementation and math, and no preference applies.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings
from typing import Any, Callable

import torch
from torch.backends.cuda import (
    SDPAParams,
    can_use_cudnn_attention,
    can_use_efficient_attention,
    can_use_flash_attention,
)
from torch.overrides import TorchFunctionMode

from ..attention_backend import backend_context
from ..rewrite.probe import is_sdpa, sdpa_arguments

CHECKS = ("flash", "efficient", "cudnn")
_CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}  # at::SDPBackend values


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "none"
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


class _SdpaCalls(TorchFunctionMode):
    """Records the arguments of each distinct SDPA call (by signature) and how often it was made."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple, dict[str, Any]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sdpa(func):
            call = sdpa_arguments(args, kwargs)
            key = (_describe(call["query"]), _describe(call["key"]), _describe(call["value"]),
                   _describe(call["attn_mask"]), bool(call["is_causal"]), bool(call["enable_gqa"]),
                   float(call["dropout_p"]))
            if key in self.calls:
                self.calls[key]["count"] += 1
            else:
                self.calls[key] = {"count": 1, "args": call}
        return func(*args, **kwargs)


_CPP_WARNING = re.compile(r"Warning: (.*?)(?: \(function \w+\))?\s*$")


@contextlib.contextmanager
def _native_stderr(lines: list[str]):
    """Collect what native code writes to file descriptor 2 (c10's warnings) into ``lines``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines.extend(sink.read().decode("utf-8", "replace").splitlines())


def _check(fn: Callable, params) -> tuple[bool, list[str]]:
    """Ask one ``can_use_*`` check in debug mode. Its reasons are c10 warnings: written to stderr by native
    code when no Python warning handler is installed (as for these bindings), else Python warnings."""
    native: list[str] = []
    with warnings.catch_warnings(record=True) as caught, _native_stderr(native):
        warnings.simplefilter("always")
        ok = bool(fn(params, True))
    reasons: list[str] = []
    texts = [str(w.message) for w in caught]
    texts += [m.group(1) for line in native if (m := _CPP_WARNING.search(line))]
    for text in texts:
        text = " ".join(text.split())
        if text and text not in reasons:
            reasons.append(text)
    return ok, reasons


def explain_call(call: dict[str, Any], preference: str = "auto") -> dict[str, Any]:
    """PyTorch's verdict on one SDPA call: per backend ``{"usable", "reasons"}``, and the backend it picks."""

    q, k, v, mask = call["query"], call["key"], call["value"], call["attn_mask"]
    params = SDPAParams(q, k, v, mask, float(call["dropout_p"]), bool(call["is_causal"]), bool(call["enable_gqa"]))
    backends = {}
    for name, fn in zip(CHECKS, (can_use_flash_attention, can_use_efficient_attention, can_use_cudnn_attention)):
        ok, reasons = _check(fn, params)
        backends[name] = {"usable": ok, "reasons": [] if ok else reasons}
    with backend_context(preference, str(q.device)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            picked = _CHOICE.get(int(torch._fused_sdp_choice(
                q, k, v, mask, float(call["dropout_p"]), bool(call["is_causal"]),
                scale=call["scale"], enable_gqa=bool(call["enable_gqa"]))), "unknown")
        except Exception as exc:  # an op PyTorch rejects for every backend
            picked = f"none ({type(exc).__name__})"
    return {"picked": picked, "backends": backends}


def explain(call_module: Callable[[], Any], device: str, preference: str = "auto") -> dict[str, Any]:
    """Run ``call_module`` once, then explain the backend choice of each distinct SDPA call it made."""
    if not device.startswith("cuda"):
        return {"device": device, "preference": preference, "calls": [],
                "note": "CPU: PyTorch runs its own flash kernel or math; backend checks and preferences are CUDA-only"}
    recorder = _SdpaCalls()
    with torch.inference_mode(), recorder:
        call_module()
    calls = []
    for key, entry in recorder.calls.items():
        q, k, v, mask, causal, gqa, _ = key
        verdict = explain_call(entry["args"], preference)
        calls.append({"query": q, "key": k, "value": v, "mask": mask, "is_causal": causal, "enable_gqa": gqa,
                      "calls": entry["count"], **verdict})
    return {"device": device, "preference": preference, "calls": calls}


def why_not(choice: dict[str, Any] | None, backend: str) -> str:
    """PyTorch's first reason ``backend`` could not run, from :func:`explain`'s result ("" if none recorded)."""
    for call in (choice or {}).get("calls", []):
        verdict = call.get("backends", {}).get(backend)
        if verdict and not verdict["usable"]:
            return verdict["reasons"][0] if verdict["reasons"] else f"{backend}: PyTorch gave no reason"
    return ""


def hook(device: str, preference: str) -> Callable[..., dict[str, Any]]:
    """``Loaded.hooks["sdpa_choice"]`` for a torch module run in this process."""

    def sdpa_choice(session, sample) -> dict[str, Any]:
        args = session.prepare(sample)
        return explain(lambda: session.loaded.call(args), device, preference)

    return sdpa_choice


__all__ = ["explain", "explain_call", "why_not", "hook", "CHECKS"]
