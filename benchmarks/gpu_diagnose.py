"""Diagnose two GPU problems in one call: AOTInductor packages that crash on load, and torch.export
of a GQA model with a dynamic sequence dim on CUDA. Prints one line per experiment; details to $OUT.

    PYTHONPATH=src python3 benchmarks/gpu_diagnose.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import traceback

import torch

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "diagnose.log"), "w")


class W(torch.nn.Module):
    """A causal LM called with (input_ids, attention_mask), returning its logits."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def log(*parts):
    print(*parts, file=LOG, flush=True)


def child(code: str, timeout: int = 120) -> tuple[int, str]:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    return res.returncode, (res.stdout + res.stderr).strip()[-600:]


def aoti_variants() -> None:
    work = tempfile.mkdtemp()
    variants = {
        "default": {},
        "no_consts_asm": {"aot_inductor.use_consts_asm_build": False},
        "mmap_weights": {"aot_inductor.force_mmap_weights": True},
        "no_embed_kernels": {"aot_inductor.embed_kernel_binary": False},
        "constants_off_so": {"aot_inductor.package_constants_in_so": False},
        "static_linkage": {"aot_inductor.dynamic_linkage": False},
    }
    for device in ("cpu", "cuda"):
        for name, cfg in variants.items():
            if device == "cpu" and name != "default":
                continue
            path = os.path.join(work, f"{device}-{name}.pt2")
            try:
                m = torch.nn.Linear(64, 64).to(device)
                ep = torch.export.export(m, (torch.randn(8, 64, device=device),))
                torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=cfg)
            except Exception as exc:
                print(f"aoti {device} {name}: BUILD FAILED {type(exc).__name__}: {str(exc)[:200]}")
                continue
            code = textwrap.dedent(f"""
                import torch
                r = torch._inductor.aoti_load_package({path!r})
                x = torch.randn(8, 64, device={device!r})
                print('ok', tuple(r(x).shape))
            """)
            rc, text = child(code)
            print(f"aoti {device} {name}: rc={rc} {text.splitlines()[-1] if text else ''}"[:300])
            log(f"== aoti {device} {name} rc={rc}\n{text}")
    # where does the default one crash?
    path = os.path.join(work, "cuda-default.pt2")
    code = f"import torch; r = torch._inductor.aoti_load_package({path!r}); print('loaded')"
    script = os.path.join(work, "load.py")
    open(script, "w").write(code)
    try:
        res = subprocess.run(["cuda-gdb", "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable, script],
                             capture_output=True, text=True, timeout=180)
        bt = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("#") or "signal" in ln.lower()]
        print("cuda-gdb backtrace:")
        for line in bt[:30]:
            print("   ", line[:220])
        log("== cuda-gdb\n" + res.stdout[-20000:] + res.stderr[-5000:])
    except Exception as exc:
        print("cuda-gdb failed:", exc)


def export_variants() -> None:
    import transformers as tf

    tf.logging.set_verbosity_error()
    cfg = tf.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1000, max_position_embeddings=4096)
    model = tf.LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")

    w = W(model)
    ids = torch.randint(0, 1000, (8, 512), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 400:] = 0
    from torch.export import Dim

    def shapes(b, s):
        return {"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: s}}

    trials = {
        "named_range": lambda: shapes(Dim("batch", min=1, max=64), Dim("sequence", min=16, max=4096)),
        "dim_dynamic": lambda: shapes(Dim.DYNAMIC, Dim.DYNAMIC),
        "dim_auto": lambda: shapes(Dim.AUTO, Dim.AUTO),
        "seq_static": lambda: {"input_ids": {0: Dim("batch", min=1, max=64)},
                               "attention_mask": {0: Dim("batch", min=1, max=64)}},
    }
    for name, make in trials.items():
        try:
            ep = torch.export.export(w, (ids, mask), dynamic_shapes=make(), strict=False)
            ops = {str(n.target) for n in ep.graph.nodes if "attention" in str(n.target)}
            ranges = {str(k): str(v) for k, v in list(ep.range_constraints.items())[:3]}
            print(f"export {name}: ok {sorted(ops)} range_constraints={ranges}"[:300])
        except Exception as exc:
            print(f"export {name}: FAILED {type(exc).__name__}: {' '.join(str(exc).split())[:250]}")
            log(f"== export {name}\n{traceback.format_exc()}")
    try:
        import torch.fx.experimental._config as fxcfg
        with fxcfg.patch(backed_size_oblivious=True):
            torch.export.export(w, (ids, mask), dynamic_shapes=trials["named_range"](), strict=False)
        print("export named_range + backed_size_oblivious: ok")
    except Exception as exc:
        print(f"export named_range + backed_size_oblivious: FAILED {' '.join(str(exc).split())[:200]}")


def onnx_attention_on_ort() -> None:
    import onnxruntime as ort
    import transformers as tf

    cfg = tf.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=1000, max_position_embeddings=4096)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 1000, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0

    path = os.path.join(tempfile.mkdtemp(), "m.onnx")
    prog = torch.onnx.export(W(model), (ids, mask), dynamo=True, opset_version=23, optimize=False,
                             input_names=["input_ids", "attention_mask"], output_names=["logits"])
    prog.save(path)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    out = sess.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    ref = W(model)(ids, mask).detach().numpy()
    print(f"onnx opset 23 Attention on ort {ort.__version__}: max abs err {abs(out - ref).max():.2e}")


if __name__ == "__main__":
    print("kernel", os.uname().release, "torch", torch.__version__)
    for fn in (aoti_variants, export_variants, onnx_attention_on_ort):
        try:
            fn()
        except Exception as exc:
            print(f"{fn.__name__}: FAILED {type(exc).__name__}: {exc}"[:300])
            log(traceback.format_exc())
