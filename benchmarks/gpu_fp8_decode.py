"""On the GPU machine: where a batch-1 (and batch-8) decode step of the Llama-3.1-8B shape spends its time in
bf16 and in fp8, and which fp8 form reads its weights at the bandwidth limit.

    python3 benchmarks/gpu_fp8_decode.py OUT.json

One decoder layer (the real GEMM shapes: q 4096x4096, k/v 4096x1024, o 4096x4096, gate/up 4096x14336, down
14336x4096), input ``[B, 1, 4096]``, no cache (the products of a decode step), compiled with torch.compile and
timed from a CUDA graph. The batch is compiled dynamic (as the decode program exports it: 1 to the recipe's batch)
and, for the Inductor variants that need it, static. Forms of the fp8 linear:

- ``fp8-rowwise``: the activation quantized per token, ``_scaled_mm`` (what h100-fp8 builds).
- ``wo-dequant``: weight-only, the weight dequantized to bf16 before a bf16 product (Float8WeightOnlyConfig).
- ``wo-cast``: weight-only, ``(x @ w_fp8.to(bf16).T) * scale`` (the cast alone before the product, the scale
  after), under Inductor's default mode, its coordinate-descent GEMV decomposition (static batch 1) and
  max-autotune (Triton templates with the cast fused as a prologue).
- ``wo-reduce``: weight-only written as ``(x[..., None, :] * w_fp8.to(bf16)).sum(-1) * scale`` (what Inductor's
  coordinate-descent decomposition makes of a product whose batch is statically 1), here with the batch dynamic,
  as exporter's decode programs export it.

``FORMS=first python3 benchmarks/gpu_fp8_decode.py OUT.json`` runs the first table
(docs/runs/h100-fp8-decode-forms.json); the default runs the second, the reduction form with a dynamic batch
(docs/runs/h100-fp8-decode.json). docs/quantization.md reads both. Run with ``PYTHONPATH=src:benchmarks`` (and
torchao's wheel on the path for the peer check).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback

import torch
from gpu_fp8_layer import llama8b_layer, peer
from gpu_fp8_layer import timed as layer_timed

from exporter.quantize import fp8 as fp8_module
from exporter.quantize.transform import quantize_model

WEIGHT_BYTES_BF16 = 2 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 4096 * 14336 * 3)


def timed(fn, iters=200):
    """gpu_fp8_layer's CUDA-graph timing, at more replays: a decode layer takes a tenth of a millisecond."""
    return layer_timed(fn, iters=iters)


def form(layer, name):
    if name == "bf16":
        return layer
    mod = copy.deepcopy(layer)
    scheme = "fp8-rowwise" if name == "fp8-rowwise" else "fp8-weight-only"
    quantize_model(mod, scheme)
    if name.startswith("wo-"):
        for sub in mod.modules():
            if isinstance(sub, fp8_module.Fp8Linear):
                sub.weight_only_form = name
    return mod


def patch_forms():
    """Route the weight-only forward through the form each probe module names (default: the module's own)."""
    original = fp8_module.Fp8Linear.forward

    def forward(self, x):
        which = getattr(self, "weight_only_form", None)
        if which == "wo-dequant":
            return x @ self.dequantized_weight(x.dtype).t()
        if which == "wo-cast":
            return (x @ self.qweight.to(x.dtype).t()) * self.scales.t().to(x.dtype)
        if which == "wo-reduce":  # what Fp8Linear exports for a symbolic batch of few rows (dynamo aside)
            return (x.unsqueeze(-2) * self.qweight.to(x.dtype)).sum(-1) * self.scales.t().to(x.dtype)
        return original(self, x)

    fp8_module.Fp8Linear.forward = forward


def run_variant(layer, rotary, name, batch, mode, dynamic):
    import torch._inductor.config as inductor_config
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    mod = form(layer, name)
    x = torch.randn(batch, 1, 4096, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
    cos_sin = rotary(x, pos)
    patches = {"coordinate_descent_tuning": mode == "coordinate-descent"}
    if mode == "max-autotune":
        patches.update({"max_autotune": True, "max_autotune_gemm_backends": "TRITON,ATEN"})
    with inductor_config.patch(patches):
        compiled = torch.compile(mod, dynamic=dynamic)
        t0 = time.perf_counter()
        with torch.inference_mode():
            if dynamic:  # compiled on a batch of 2 marked dynamic (1 to 8), then run at the batch timed
                x2 = torch.randn(2, 1, 4096, device="cuda", dtype=torch.bfloat16)
                torch._dynamo.mark_dynamic(x2, 0, min=1, max=8)
                compiled(x2, position_embeddings=rotary(x2, pos[:1].expand(2, 1)), attention_mask=None,
                         is_causal=False)
            compiled(x, position_embeddings=cos_sin, attention_mask=None, is_causal=False)
            compile_s = time.perf_counter() - t0
            ms = timed(lambda: compiled(x, position_embeddings=cos_sin, attention_mask=None, is_causal=False))
            out = compiled(x, position_embeddings=cos_sin, attention_mask=None, is_causal=False)
            ref = mod(x, position_embeddings=cos_sin, attention_mask=None, is_causal=False)
    out = out[0] if isinstance(out, tuple) else out
    ref = ref[0] if isinstance(ref, tuple) else ref
    diff = float((out.float() - ref.float()).norm() / ref.float().norm())
    weight_bytes = WEIGHT_BYTES_BF16 if name == "bf16" else WEIGHT_BYTES_BF16 // 2
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return {"ms": ms, "compile_s": compile_s, "graphs_compiled": graphs, "weights_tb_s": weight_bytes / ms / 1e9,
            "rel_l2_vs_eager": diff}


def main(path):
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        result["peer"] = peer()
    except Exception as exc:  # noqa: BLE001
        result["peer"] = {"error": repr(exc)}
    print("torchao peer", result["peer"], flush=True)
    patch_forms()
    layer, rotary = llama8b_layer()
    plan = [
        ("bf16", 1, "default", True), ("fp8-rowwise", 1, "default", True), ("wo-dequant", 1, "default", True),
        ("wo-cast", 1, "default", True), ("bf16", 8, "default", True),
        ("bf16", 1, "coordinate-descent", False), ("wo-cast", 1, "coordinate-descent", False),
        ("wo-cast", 1, "max-autotune", True), ("bf16", 1, "max-autotune", True), ("wo-cast", 8, "max-autotune", True),
    ] if os.environ.get("FORMS") == "first" else [
        ("bf16", 1, "default", True), ("wo-reduce", 1, "default", True), ("wo-reduce", 1, "coordinate-descent", True),
        ("bf16", 8, "default", True), ("wo-reduce", 8, "default", True), ("wo-reduce", 8, "coordinate-descent", True),
    ]
    rows = []
    for name, batch, mode, dynamic in plan:
        key = f"{name} B={batch} {mode}{' dynamic' if dynamic else ' static'}"
        try:
            entry = run_variant(layer, rotary, name, batch, mode, dynamic)
        except Exception as exc:  # noqa: BLE001 - one failed variant is a figure too
            entry = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            traceback.print_exc()
        entry.update({"form": name, "batch": batch, "mode": mode, "dynamic": dynamic})
        rows.append(entry)
        print(key, json.dumps(entry), flush=True)
        result["rows"] = rows
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
