"""On the GPU machine: prefill of the whole Llama-3.1-8B shape (32 layers, random weights) as an AOTInductor
package, bf16 against h100-fp8's rowwise fp8 (every linear but the head), in one process.

    PYTHONPATH=src:benchmarks python3 benchmarks/gpu_fp8_prefill.py [--layers 32] [--batch 8] [--seq 2048]

Each model's forward (input_ids and an attention mask, logits out) is exported with the shapes static, lowered as
exporter lowers a program (core ATen, SDPA kept), compiled by AOTInductor with its weights apart (as exporter
builds a package above 4 GiB) and timed replayed from a CUDA graph (median of 5 rounds). Not the whole convert: no
gate, no reference (a whole 8B convert in fp8 does not fit one call; docs/quantization.md gives the judged runs).
Writes $OUT/prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from gpu_decode_probe import build_model, reexec_with_preload
from gpu_fp8_layer import timed


class Forward(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def build(model, args, name: str, result: dict, out: Path) -> None:
    from exporter.targets.aoti import program_tensors
    from exporter.targets.aoti_loader import load_package
    from exporter.targets.exported_program import decomposition_table

    ids = torch.randint(0, 128256, (args.batch, args.seq), device="cuda")
    mask = torch.ones(args.batch, args.seq, dtype=torch.long, device="cuda")
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(Forward(model), (ids, mask), strict=False).run_decompositions(
            decomposition_table())
    row: dict = {"export_s": time.perf_counter() - t0,
                 "scaled_mm_nodes": sum(1 for n in program.graph.nodes if "_scaled_mm" in str(n.target))}
    path = Path(f"/tmp/prefill-{name}.pt2")
    t0 = time.perf_counter()
    torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs={
        "cpp.vec_isa_ok": False, "aot_inductor.package_constants_in_so": False})
    row["build_s"] = time.perf_counter() - t0
    constants = dict(program_tensors(program))
    row["weights_gb"] = sum(t.numel() * t.element_size() for t in constants.values()) / 1e9
    runner = load_package(path, constants=constants)
    with torch.inference_mode():
        logits = runner(ids, mask)  # before the capture: a captured container runs only inside its graph
        logits = (logits[0] if isinstance(logits, (list, tuple)) else logits)[:, -1].float()
        row["last_logits_rms"] = float(logits.pow(2).mean().sqrt())
        row["aoti_graph_ms"] = timed(runner, ids, mask, iters=10)
    result[name] = row
    print(name, json.dumps(row), flush=True)
    (out / "prefill.json").write_text(json.dumps(result, indent=1))
    runner = program = constants = None
    path.unlink(missing_ok=True)
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    reexec_with_preload()
    from exporter.quantize.transform import quantize_model

    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": f"llama8b, {args.layers} layers", "batch": args.batch, "seq": args.seq,
                    "torch": torch.__version__, "device": torch.cuda.get_device_name()}
    model = build_model("llama8b", args.layers)
    build(model, args, "bf16", result, out)
    quantize_model(model, "fp8-rowwise", keep_originals=False)
    torch.cuda.empty_cache()
    build(model, args, "fp8-rowwise", result, out)
    if "bf16" in result and "fp8-rowwise" in result:
        result["fp8_speedup"] = result["bf16"]["aoti_graph_ms"] / result["fp8-rowwise"]["aoti_graph_ms"]
    (out / "prefill.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
