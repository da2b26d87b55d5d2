"""On the GPU machine: the three decoder programs of an fp8 weight-only model (prefill, decode, and the decode
program of batch 1 with exporter::fp8_gemv), exported as ``exporter convert --task text-generation`` exports them
(``generation.programs.export_steps``) and each compiled alone by AOTInductor, every failure printed whole.

    PYTHONPATH=src:benchmarks python3 benchmarks/gpu_fp8_programs.py [--layers 2] [--no-fuse]
"""

from __future__ import annotations

import argparse
import time
import traceback
from pathlib import Path

import torch
from gpu_decode_probe import build_model, reexec_with_preload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--no-fuse", action="store_true")
    args = parser.parse_args()
    reexec_with_preload()
    from exporter.generation.cache import DecoderStep, probe_layout
    from exporter.generation.programs import export_steps
    from exporter.quantize.transform import quantize_model
    from exporter.targets.aoti import BATCH_1_CONFIGS
    from exporter.targets.package_cache import compile_package

    model = build_model("llama8b", args.layers)
    quantize_model(model, "fp8-weight-only", keep_originals=False)
    step = DecoderStep(model, True)
    layout = probe_layout(model, True, "cuda")
    t0 = time.perf_counter()
    programs = export_steps(step, layout, 8, 256, 512, torch.bfloat16, "cuda", fuse=not args.no_fuse, one=True)
    print(f"exported in {time.perf_counter() - t0:.1f} s; fused groups {len(programs.fused)}", flush=True)
    for name, program in (("prefill", programs.prefill), ("decode", programs.decode),
                          ("decode_one", programs.decode_one)):  # the order targets.aoti.build_decoder compiles
        configs = {"aot_inductor.package_constants_in_so": False, "cpp.vec_isa_ok": False}
        if name == "decode_one":
            configs.update(BATCH_1_CONFIGS)
        t0 = time.perf_counter()
        try:
            compile_package(program, Path(f"/tmp/fp8-{name}.pt2"), configs, "cuda")
            print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception:  # noqa: BLE001 - printed whole, the next program still compiles
            text = traceback.format_exc()
            print(f"{name}: FAILED after {time.perf_counter() - t0:.1f} s\n{text[-2500:]}", flush=True)
            marker = text.find("error:")
            if marker >= 0:
                print("FIRST ERROR:", text[max(0, marker - 1500):marker + 2500], flush=True)


if __name__ == "__main__":
    main()
