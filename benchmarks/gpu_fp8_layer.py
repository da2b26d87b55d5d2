"""On the GPU machine: fp8 against bf16 for one Llama-3.1-8B decoder layer and the head, and the arithmetic checked
against torchao's own rowwise fp8 (where torchao imports).

    python3 benchmarks/gpu_fp8_layer.py OUT.json

1. torchao peer: a 4096 -> 14336 linear quantized by torchao's ``Float8DynamicActivationFloat8WeightConfig(PerRow())``
   and by exporter's transform: fp8 weights and scales compared bit for bit, outputs compared.
2. Dense ceilings: bf16 ``mm`` and fp8 ``_scaled_mm`` (rowwise scales) at 8192^3.
3. One decoder layer of the 8B shape at 8 x 2048 (prefill) and 1 x 1 (a decode step's products, no cache), bf16
   and fp8, each compiled with torch.compile (default mode) and timed from a CUDA graph; the
   per-token figure of a 32-layer model follows as 32 x layer + head (the head stays bf16 in both).
"""

from __future__ import annotations

import json
import sys
import time

import torch
import transformers

from exporter.quantize.fp8 import Fp8Linear, quantize_weight
from exporter.quantize.transform import quantize_model
from exporter.targets.aoti_loader import capture


def timed(fn, *args, iters=50):
    """ms per call of ``fn(*args)``: captured in a CUDA graph (``aoti_loader.capture``: warm-up on a side stream,
    relaxed capture, which an AOTInductor package needs), replayed ``iters`` times, median of 5 rounds."""
    graph = capture(lambda: fn(*args))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            graph.replay()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) / iters)
    return sorted(samples)[len(samples) // 2]


def peer() -> dict:
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        return {"torchao": f"not importable: {exc}"}
    import torchao
    torch.manual_seed(0)
    linear = torch.nn.Linear(4096, 14336, bias=False, device="cuda", dtype=torch.bfloat16)
    ours = Fp8Linear.from_linear(linear, "fp8-rowwise")
    theirs = torch.nn.Sequential(torch.nn.Linear(4096, 14336, bias=False, device="cuda", dtype=torch.bfloat16))
    theirs[0].weight.data.copy_(linear.weight.data)
    quantize_(theirs, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    w = theirs[0].weight
    qdata, scale = w.qdata, w.scale
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        a, b = ours(x), theirs(x)
    return {"torchao": torchao.__version__,
            "weights_equal": bool(torch.equal(qdata.view(torch.uint8), ours.qweight.view(torch.uint8))),
            "scales_equal": bool(torch.equal(scale.reshape(-1).float(), ours.scales.reshape(-1))),
            "outputs_max_abs_diff": float((a.float() - b.float()).abs().max()),
            "outputs_equal": bool(torch.equal(a, b))}


def ceilings() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    qa, sa = quantize_weight(a)
    qb, sb = quantize_weight(b)
    bf = timed(lambda: a @ b.t(), iters=20)
    f8 = timed(lambda: torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16,
                                       use_fast_accum=True), iters=20)
    flops = 2 * n ** 3
    return {"bf16_tflops": flops / bf / 1e9, "fp8_tflops": flops / f8 / 1e9}


def llama8b_layer():
    """One decoder layer of the Llama-3.1-8B shape (bf16, SDPA, seeded) and its rotary embedding, on the GPU."""
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=4096, intermediate_size=14336,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      max_position_embeddings=8192, rope_theta=500000.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        layer = transformers.models.llama.modeling_llama.LlamaDecoderLayer(config, 0).to(torch.bfloat16).eval()
        rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    return layer, rotary


def layers(result: dict) -> None:
    layer, rotary = llama8b_layer()
    head = torch.nn.Linear(4096, 128256, bias=False, dtype=torch.bfloat16, device="cuda")
    for name, (batch, seq) in {"prefill_8x2048": (8, 2048), "decode_1x1": (1, 1)}.items():
        x = torch.randn(batch, seq, 4096, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(seq, device="cuda")[None].expand(batch, seq)
        cos_sin = rotary(x, pos)

        entry: dict = {}
        for scheme in ("bf16", "fp8-rowwise"):
            mod = layer
            if scheme != "bf16":
                import copy
                mod = copy.deepcopy(layer)
                quantize_model(mod, scheme)
            compiled = torch.compile(mod, dynamic=False)
            t0 = time.perf_counter()
            with torch.inference_mode():
                entry[f"{scheme}_layer_ms"] = timed(lambda c=compiled, a=x, e=cos_sin: c(
                    a, position_embeddings=e, attention_mask=None, is_causal=True))
            entry[f"{scheme}_compile_and_time_s"] = time.perf_counter() - t0
        with torch.inference_mode():
            entry["head_ms"] = timed(lambda a=x: head(a))
        for scheme in ("bf16", "fp8-rowwise"):
            entry[f"{scheme}_32_layers_ms"] = 32 * entry[f"{scheme}_layer_ms"] + entry["head_ms"]
        entry["layer_speedup"] = entry["bf16_layer_ms"] / entry["fp8-rowwise_layer_ms"]
        entry["model_speedup_32_layers"] = entry["bf16_32_layers_ms"] / entry["fp8-rowwise_32_layers_ms"]
        result[name] = entry
        print(name, json.dumps(entry), flush=True)


if __name__ == "__main__":
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["peer"] = peer()
    print("peer", result["peer"], flush=True)
    result["ceilings"] = ceilings()
    print("ceilings", result["ceilings"], flush=True)
    layers(result)
    with open(sys.argv[1], "w") as handle:
        json.dump(result, handle, indent=2)
