"""Does SDPA with an explicit mask compute the right thing on this GPU, per backend and length?

Run on the GPU machine: ``python3 benchmarks/gpu_mask_probe.py OUT.json`` (``PROBE_TINY=1``: a CPU smoke run).

Two levels, each against float64:
- SDPA alone: grouped-query shapes of the Llama-3.2-1B attention (32 query heads, 8 key/value heads expanded to
  32 as transformers' ``repeat_kv`` does when a mask is passed, head dim 64), a causal boolean mask
  ``[batch, 1, S, S]`` (what transformers builds under export), under each backend that takes it, and the
  causal kernel without a mask (what transformers' SDPA path runs in eager mode when nothing is padded).
- A 4-layer model with the 1B model's attention shapes, rewritten and exported as ``exporter convert`` does
  (dynamic batch and sequence), run at 8 x 512 and 4 x 2048 under each backend, against the original model
  in float64; transformers' own SDPA model in bf16 beside it.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from exporter.modelio import Signature, make_io_module  # noqa: E402
from exporter.rewrite import rewrite_attention  # noqa: E402

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def sdpa_level(device: str) -> list[dict]:
    rows = []
    shapes = ((1, 64),) if os.environ.get("PROBE_TINY") else ((8, 512), (4, 1024), (4, 2048), (1, 2048), (4, 2112))
    for batch, seq in shapes:
        g = torch.Generator(device=device).manual_seed(seq)
        q = torch.randn(batch, 32, seq, 64, device=device, dtype=torch.bfloat16, generator=g)
        k = torch.randn(batch, 8, seq, 64, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(batch, 8, seq, 64, device=device, dtype=torch.bfloat16, generator=g)
        k32, v32 = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
        mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril().expand(batch, 1, seq, seq)
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k32.double(), v32.double(),
                                                               attn_mask=mask)
        row: dict = {"batch": batch, "sequence": seq, "masked": {}, "causal_no_mask": {}}
        for name, backend in BACKENDS.items():
            for kind, kwargs in (("masked", {"attn_mask": mask}), ("causal_no_mask", {"is_causal": True})):
                try:
                    with sdpa_kernel([backend]):
                        out = torch.nn.functional.scaled_dot_product_attention(q, k32, v32, **kwargs)
                    row[kind][name] = rel(out, ref)
                except RuntimeError as exc:
                    row[kind][name] = f"refused: {str(exc).splitlines()[0][:80]}"
        with torch.no_grad():
            row["masked"]["default"] = rel(torch.nn.functional.scaled_dot_product_attention(q, k32, v32,
                                                                                            attn_mask=mask), ref)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def model_level(device: str) -> list[dict]:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    tiny = bool(os.environ.get("PROBE_TINY"))  # a smoke run of this script on the CPU
    config = transformers.LlamaConfig(num_hidden_layers=1 if tiny else 4, hidden_size=256 if tiny else 2048,
                                      intermediate_size=512 if tiny else 8192, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=4096,
                                      max_position_embeddings=131072, rope_theta=500000.0)
    model = transformers.LlamaForCausalLM(config).eval()
    signature = Signature(("input_ids", "attention_mask"), ("logits",))
    reference = make_io_module(model, signature, "eager").to(device=device, dtype=torch.float64)

    def inputs(batch, seq):
        g = torch.Generator().manual_seed(batch * seq)
        ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
        return [ids.to(device), torch.ones(batch, seq, dtype=torch.long, device=device)]

    with torch.inference_mode():
        expected = {shape: reference(*inputs(*shape))[0].cpu() for shape in ((8, 512), (4, 2048))}
    reference.to(torch.bfloat16)
    original = make_io_module(model, signature, "eager")
    rewritten, _ = rewrite_attention(original, inputs(8, 512))
    dynamic = torch.export.Dim.DYNAMIC
    t0 = time.perf_counter()
    program = torch.export.export(rewritten, tuple(inputs(8, 512)), strict=False,
                                  dynamic_shapes=({0: dynamic, 1: dynamic}, {0: dynamic, 1: dynamic})).module()
    rows = []
    sdpa_model = make_io_module(model, signature, "sdpa")
    for shape, want in expected.items():
        args = inputs(*shape)
        row: dict = {"shape": list(shape), "export_s": time.perf_counter() - t0}
        with torch.inference_mode():
            row["eager bf16 (eager attention)"] = rel(original(*args)[0].cpu(), want)
            row["transformers sdpa bf16"] = rel(sdpa_model(*args)[0].cpu(), want)
            row["exported program, default backend"] = rel(program(*args)[0].cpu(), want)
            for name, backend in BACKENDS.items():
                try:
                    with sdpa_kernel([backend]):
                        row[f"exported program, {name}"] = rel(program(*args)[0].cpu(), want)
                except RuntimeError as exc:
                    row[f"exported program, {name}"] = f"refused: {str(exc).splitlines()[0][:80]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "none"
    out = {"torch": torch.__version__, "gpu": gpu, "cudnn": torch.backends.cudnn.version(),
           "sdpa": sdpa_level(device), "model": model_level(device)}
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
