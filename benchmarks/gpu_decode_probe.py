"""On the GPU machine: where the AOTI decode step of a 1B decoder spends its time, and what Inductor options buy.

    PYTHONPATH=src python3 benchmarks/gpu_decode_probe.py [--budget-s 420] [--only 1,2,3] [--no-eager] [--blaslt]
    PYTHONPATH=src python3 benchmarks/gpu_decode_probe.py --shape llama8b --layers 2 --only 8 --fp8 --no-eager
        # the program of batch 1 as generation.decode_batch_1 builds it, bf16 then fp8 weight-only (one call)
    ... --only 8,9: and the same program with the projections unfused (Inductor reads a fused gate/up slower)
    ... --shape qwen05b --only 8 --no-eager: the Qwen2-0.5B shape's program of batch 1, profiled
    ... --fp8 --fp8-forms kernel,inductor: the fp8 programs with exporter::fp8_gemv (quantize/fp8_gemv.py; fp8
        projections fused where the variant fuses) and then with Inductor's own form, in one process
    ... --only 8,10 --no-eager: the program of batch 1 as built, then the same with programmatic dependent launch
        (Inductor's triton.enable_pdl), where this torch has it
    ... --only 8,11 --no-eager: the program of batch 1 as built, then the same with its attention as
        exporter::decode_attention (kernels/decode_attention.py: generation.decode_attention_kernel)
    ... --only 11,12 --no-eager: that, then the same with each product of one row, its RMSNorm, activation and
        residual add as exporter::gemv (kernels/decode_products.py)
    ... --only 12,13,14 --no-eager: that, then with Inductor's combo_kernels, then with its aggressive_fusion
    ... --only 13,15,16 --no-eager: variant 13, then the same with each layer's rotary embedding and cache write in
        its attention kernel (kernels/decode_step_attention.py: generation.decode_step_kernel), then that with the
        attention's slices merged by a kernel of their own

(one 10-minute call builds about four variants; docs/runs/h100-bf16-decode-probe-fused.md took two.)
Builds the Llama-3.2-1B-shaped decoder of benchmarks/gpu_generation.sh (random weights, bf16, SDPA), exports its
decode step as ``exporter convert --task text-generation`` does (batch 1..8 dynamic, 512-slot cache), each
variant with or without the projections fused, the batch fixed or not, an SDPA backend preferred, and compiles
it with AOTInductor under the variant's Inductor options; for each: the time per token at batch 1
replayed from a CUDA graph (relaxed capture, as the product times it), the number of kernels one step
launches and the top kernels by time (torch.profiler). The eager model's step replayed from a graph is the
first row. Variants are built in order until the time budget is spent; ``--blaslt`` re-times the first three
packages with cuBLASLt preferred. Writes $OUT/decode-probe.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch


def reexec_with_preload() -> None:
    from exporter.targets.toolchain import aoti_preload

    lib = aoti_preload()
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):
        os.environ["LD_PRELOAD"] = os.pathsep.join(p for p in (lib, os.environ.get("LD_PRELOAD")) if p)
        os.execv(sys.executable, [sys.executable, *sys.argv])


LLAMA = dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
             rope_theta=500000.0)
SHAPES = {"llama1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, tie_word_embeddings=True,
                          **LLAMA),
          "llama8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, tie_word_embeddings=False,
                          **LLAMA),
          # the sizes benchmarks/gpu_generation.sh builds for SHAPE=qwen05b (Qwen2: q/k/v biases, tied 152k head)
          "qwen05b": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                          num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                          rope_theta=1000000.0, tie_word_embeddings=True)}


def build_model(shape: str = "llama1b", layers: int = 0, device: str = "cuda", **config):
    """The shape's model with random weights (seed 0) in bf16; ``config``: more keys for its transformers config."""
    import transformers

    torch.manual_seed(0)
    sizes = dict(SHAPES[shape])
    if layers:
        sizes["num_hidden_layers"] = layers
    config_class, model_class = ((transformers.Qwen2Config, transformers.Qwen2ForCausalLM) if shape.startswith("qwen")
                                 else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    with torch.device(device):
        model = model_class(config_class(**sizes, **config)).to(torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    return model


def save_checkpoint(folder: str, shape: str, layers: str = "0", device: str = "cuda") -> None:
    """The checkpoint benchmarks/gpu_generation.sh converts: ``build_model``'s weights saved with their config."""
    build_model(shape, int(layers), device, torch_dtype="bfloat16").save_pretrained(folder)


def profile_step(call, steps: int = 10) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernels = sum(e.count for e in events) / steps
    top = sorted(events, key=lambda e: -e.device_time_total)[:16]
    return {"kernels_per_step": kernels,
            "kernel_ms_per_step": sum(e.device_time_total for e in events) / steps / 1e3,
            "top": [{"ms": e.device_time_total / steps / 1e3, "count": e.count / steps, "name": e.key[:120]}
                    for e in top]}


def graph_ms(make_call, tokens: int = 200) -> float:
    from exporter.targets.aoti_loader import capture

    call = make_call()  # kept alive while the graph replays: an AOTI container frees its memory when it goes
    graph = capture(call)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(tokens):
            graph.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / tokens * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-s", type=float, default=420.0)
    parser.add_argument("--only", default="", help="comma-separated variant numbers (1-based) to build; all by default")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager model's row")
    parser.add_argument("--blaslt", action="store_true", help="also time the first three packages on cuBLASLt")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the shape's own)")
    parser.add_argument("--fp8", action="store_true",
                        help="after the variants, quantize to fp8 weight-only and build the same variants again")
    parser.add_argument("--fp8-forms", default="kernel",
                        help="the fp8 programs' products: kernel (exporter::fp8_gemv where a program has one row), "
                             "inductor (Inductor's own form), or both comma-separated, built in that order")
    parser.add_argument("--skip-bf16", action="store_true", help="with --fp8: build the fp8 variants only")
    args = parser.parse_args()
    reexec_with_preload()
    start = time.perf_counter()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    from exporter.attention_backend import backend_context
    from exporter.generation.bench import weight_bytes
    from exporter.generation.cache import DecoderStep, probe_layout
    from exporter.targets.aoti_loader import load_package
    from exporter.targets.exported_program import decomposition_table

    model = build_model(args.shape, args.layers)
    step = DecoderStep(model, True)
    layout = probe_layout(model, True, "cuda")
    cache_length, batch = 512, 8
    kv = layout.allocate(1, cache_length, torch.bfloat16, "cuda")
    ids = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    pad = torch.ones(1, cache_length, dtype=torch.long, device="cuda")
    where = torch.tensor([300], device="cuda")
    weights = weight_bytes(model)  # what a step reads: an untied embedding table is gathered, not read
    rows: list[dict] = []
    if not args.no_eager:
        with torch.inference_mode():
            eager: dict = {"variant": "eager model (SDPA), CUDA graph",
                           "graph_ms": graph_ms(lambda: lambda: step(ids, pad, where, kv))}
            eager.update(profile_step(lambda: step(ids, pad, where, kv)))
        rows.append(eager)
        print(json.dumps(eager)[:400], flush=True)

    def export(static_batch: bool, fuse: bool, backend: str, kernel: bool = False, attention: bool = False,
               folded: bool | str = False):
        import contextlib

        from torch import nn

        from exporter.generation.fused_projections import fused_projections
        from exporter.kernels.decode_attention import routed
        from exporter.quantize.fp8 import Fp8Linear
        from exporter.quantize.fp8_gemv import one_row_kernel

        with contextlib.ExitStack() as stack:
            stack.enter_context(backend_context(backend, "cuda"))
            stack.enter_context(one_row_kernel(kernel))
            if attention:
                stack.enter_context(routed())
            if fuse:  # as generation.fuse_projections does: q, k, v and gate, up as one product each
                kinds = (nn.Linear, Fp8Linear) if kernel else (nn.Linear,)
                stack.enter_context(fused_projections(model, lambda: step(ids, pad, where, kv), kinds))
            return export_step(static_batch, folded)

    def export_step(static_batch: bool, folded: bool | str = False):
        example_kv = layout.allocate(1 if static_batch else batch, cache_length, torch.bfloat16, "cuda")
        n = 1 if static_batch else batch
        example = (torch.zeros(n, 1, dtype=torch.long, device="cuda"), torch.ones(n, cache_length, dtype=torch.long,
                   device="cuda"), torch.tensor([256], device="cuda"), example_kv)
        b = torch.export.Dim.DYNAMIC(min=1, max=batch)
        shapes = None if static_batch else ({0: b}, {0: b}, None, [{0: b} for _ in example_kv])
        program = torch.export.export(step, example, dynamic_shapes=shapes, strict=False)
        if folded:  # as export_steps does: before the decomposition, the cache writes still in place
            from exporter.kernels.decode_step_attention import fold

            print(fold(program, merge_in_kernel=folded != "apart").note(), flush=True)
        return program.run_decompositions(decomposition_table())

    autotune = {"max_autotune": True, "coordinate_descent_tuning": True}
    variants = [  # name, batch fixed at 1, projections fused, Inductor options, SDPA backend preferred
        ("AOTI, unfused (batch 1..8)", False, False, {}, "auto"),
        ("AOTI, q/k/v and gate/up fused (generation.fuse_projections, as built)", False, True, {}, "auto"),
        ("AOTI, fused, batch 1, max-autotune + coordinate descent", True, True, autotune, "auto"),
        ("AOTI, fused, batch 1..8, max-autotune + coordinate descent", False, True, autotune, "auto"),
        ("AOTI, batch 1, max-autotune + coordinate descent", True, False, autotune, "auto"),
        ("AOTI, fused, memory-efficient attention first", False, True, {}, "efficient"),
        ("AOTI, fused, FlashAttention first", False, True, {}, "flash"),
        ("AOTI, fused, batch 1, coordinate descent (generation.decode_batch_1, as built)", True, True,
         {"coordinate_descent_tuning": True}, "auto"),
        ("AOTI, unfused, batch 1, coordinate descent", True, False, {"coordinate_descent_tuning": True}, "auto"),
        # programmatic dependent launch: each Triton kernel may start while the one before it finishes its tail
        ("AOTI, fused, batch 1, coordinate descent + PDL (triton.enable_pdl)", True, True,
         {"coordinate_descent_tuning": True, "triton.enable_pdl": True}, "auto"),
        # the attention of each layer as exporter::decode_attention (generation.decode_attention_kernel)
        ("AOTI, fused, batch 1, coordinate descent, exporter::decode_attention", True, True,
         {"coordinate_descent_tuning": True}, "auto", True),
        # and each product with its RMSNorm, activation and residual add as exporter::gemv
        # (kernels/decode_products.py: generation.decode_gemv_kernel)
        ("AOTI, fused, batch 1, coordinate descent, exporter::decode_attention + exporter::gemv", True, True,
         {"coordinate_descent_tuning": True}, "auto", True, True),
        # that, with Inductor's independent kernels launched as one (the rotary kernels of q and k, and the cache
        # writes of k and v, of one layer)
        ("AOTI, fused, batch 1, coordinate descent, exporter::decode_attention + exporter::gemv, combo_kernels",
         True, True, {"coordinate_descent_tuning": True, "combo_kernels": True}, "auto", True, True),
        # that, with Inductor fusing kernels that share no buffer (aggressive_fusion)
        ("AOTI, fused, batch 1, coordinate descent, exporter::decode_attention + exporter::gemv, aggressive_fusion",
         True, True, {"coordinate_descent_tuning": True, "aggressive_fusion": True}, "auto", True, True),
        # variant 13 with each layer's rotary embedding and cache write folded into its attention kernel
        # (kernels/decode_step_attention.py: generation.decode_step_kernel, as built)
        ("AOTI, fused, batch 1, coordinate descent, exporter::decode_step_attention + exporter::gemv, combo_kernels",
         True, True, {"coordinate_descent_tuning": True, "combo_kernels": True}, "auto", True, True, True),
        # that, the slices of each attention merged by a kernel of their own (not by their last program)
        ("AOTI, fused, batch 1, coordinate descent, exporter::decode_step_attention (merge kernel apart) + "
         "exporter::gemv, combo_kernels",
         True, True, {"coordinate_descent_tuning": True, "combo_kernels": True}, "auto", True, True, "apart"),
    ]
    from exporter.targets.aoti import program_tensors

    constants_of: dict[Path, dict] = {}

    def fresh_call(package: Path):
        # a container whose run was captured cannot run outside the graph: each capture gets its own. The weights
        # are not in the package (as the product builds a decoder's): the program's own tensors, used in place
        runner = load_package(package, constants=constants_of[package])
        return lambda: runner(ids, pad, where, kv)

    programs = {}
    packages: dict[str, Path] = {}
    row: dict
    only = {int(n) for n in args.only.split(",") if n}
    runs = [] if args.fp8 and args.skip_bf16 else [("", n, v) for n, v in enumerate(variants, 1)]
    if args.fp8:  # the same variants once more on the model quantized as h100-fp8 + fp8-weight-only builds it
        for form in args.fp8_forms.split(","):
            label = "fp8 weight-only, fp8_gemv kernel: " if form == "kernel" else "fp8 weight-only, Inductor: "
            runs += [(label, n, v) for n, v in enumerate(variants, 1)]
    quantized, weights_fp8 = False, 0
    with torch.inference_mode():  # the eager step's logits: a sanity check of every variant
        eager_logits = step(ids, pad, where, kv).float().clone()
    for prefix, number, (name, static, fuse, configs, backend, *flags) in runs:
        kernel = "kernel" in prefix
        attention = bool(flags and flags[0])
        products = len(flags) > 1 and bool(flags[1])
        folded = flags[2] if len(flags) > 2 else False
        if only and number not in only:
            continue
        if prefix and not quantized:
            from exporter.quantize.transform import quantize_model

            # FP8_HEAD=1: the vocabulary head too (the recipe's quantize.include_head), as torchao's quantize_ does
            quantize_model(model, "fp8-weight-only", keep_originals=False,
                           include_head=os.environ.get("FP8_HEAD") == "1")
            programs.clear()
            quantized = True
            weights_fp8 = weight_bytes(model)
            with torch.inference_mode():  # the quantized eager step's logits: every fp8 program is compared to them
                eager_logits = step(ids, pad, where, kv).float().clone()
        name = prefix + name
        if time.perf_counter() - start > args.budget_s:
            rows.append({"variant": name, "skipped": "time budget spent"})
            continue
        try:
            key = (static, fuse, backend, kernel, attention, products, folded)
            if key not in programs:
                programs[key] = export(static, fuse, backend, kernel, attention, folded)
                if products:
                    from exporter.kernels.decode_products import fuse as fuse_products

                    print(fuse_products(programs[key]).note(), flush=True)
            t0 = time.perf_counter()
            path = Path("/tmp") / f"probe-{len(rows)}.pt2"
            from exporter.targets.compile_apart import int_arrays_declared_where_used

            with backend_context(backend, "cuda"), int_arrays_declared_where_used():
                program = programs[key]
                torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                         inductor_configs={"cpp.vec_isa_ok": False,
                                                                           "aot_inductor.package_constants_in_so":
                                                                           False, **configs})
                constants_of[path] = dict(program_tensors(program))
            build_s = time.perf_counter() - t0
            with torch.inference_mode():
                row = {"variant": name, "build_s": build_s, "graph_ms": graph_ms(functools.partial(fresh_call, path))}
                row.update(profile_step(fresh_call(path)))
                # a sanity check, not the gate: relative L2 of the logits from the (quantized) eager step's
                logits = fresh_call(path)()
                logits = (logits[0] if isinstance(logits, (list, tuple)) else logits).float()
                row["logits_rel_l2_vs_eager"] = float((logits - eager_logits).norm() / eager_logits.norm())
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, the others still run
            row = {"variant": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                   "traceback": traceback.format_exc()[-3000:]}
            print(row["traceback"], flush=True)
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
        if "graph_ms" in row:
            packages[name] = path
        (out / "decode-probe.partial.json").write_text(json.dumps(rows, indent=1))  # a call cut short keeps these
    # the same packages with cuBLASLt behind their matrix products (the extern mm calls ATen's BLAS)
    for name, path in list(packages.items())[:3] if args.blaslt else []:
        if time.perf_counter() - start > args.budget_s + 60:
            break
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            with torch.inference_mode():
                row = {"variant": f"{name}, cuBLASLt", "graph_ms": graph_ms(functools.partial(fresh_call, path))}
                row.update(profile_step(fresh_call(path)))
        except Exception as exc:  # noqa: BLE001
            row = {"variant": f"{name}, cuBLASLt", "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")
        rows.append(row)
        print(json.dumps(row)[:400], flush=True)
    limit_ms = weights / 4.17e12 * 1e3
    fp8_limit_ms = weights_fp8 / 4.17e12 * 1e3 if quantized else None
    (out / "decode-probe.json").write_text(json.dumps({"weights_bytes": weights, "shape": args.shape,
                                                       "layers": args.layers or None,
                                                       "fp8_weights_bytes": weights_fp8 if quantized else None,
                                                       "rows": rows}, indent=1))
    what = f"{args.shape}{f', {args.layers} layers' if args.layers else ''}"
    lines = [f"# Decode step at batch 1 ({what}, bf16, 512-slot cache): weights read {weights / 1e9:.2f} GB, "
             f"copy-bandwidth limit {limit_ms:.2f} ms at 4.17 TB/s"
             + (f"; fp8 weight-only {weights_fp8 / 1e9:.2f} GB, {fp8_limit_ms:.2f} ms" if quantized else ""), "",
             "| variant | graph ms/token | of limit | kernels/step | kernel ms/step | build s | logits vs eager |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        if "graph_ms" in row:
            limit = fp8_limit_ms if row["variant"].startswith("fp8") and fp8_limit_ms else limit_ms
            lines.append(f"| {row['variant']} | {row['graph_ms']:.3f} | {limit / row['graph_ms']:.0%} | "
                         f"{row['kernels_per_step']:.0f} | {row['kernel_ms_per_step']:.3f} | "
                         f"{row.get('build_s', 0):.0f} | {row.get('logits_rel_l2_vs_eager', '')} |")
        else:
            lines.append(f"| {row['variant']} | {row.get('error') or row.get('skipped')} | | | | | |")
    for row in rows:
        if row.get("top"):
            lines += ["", f"## {row['variant']}: top kernels"]
            lines += [f"- {k['ms']:.4f} ms ×{k['count']:.0f} {k['name']}" for k in row["top"]]
    (out / "decode-probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
