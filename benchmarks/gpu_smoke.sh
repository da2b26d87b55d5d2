#!/usr/bin/env bash
# First call on a GPU machine: what is there, does an AOTI package load, does the pipeline run.
#   bash benchmarks/gpu_smoke.sh   (writes under $OUT)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
uname -r; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'PY'
import torch, importlib.metadata as md
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
for p in ("transformers", "onnx", "onnxruntime", "onnxscript", "safetensors", "click", "rich", "psutil"):
    try: print(p, md.version(p))
    except Exception as e: print(p, "MISSING")
import onnxruntime as ort; print("ort providers", ort.get_available_providers())
PY
# Does an AOTI package load here? (child process: a segfault must not stop this script)
python3 - <<'PY'
import torch, subprocess, sys, tempfile, os
d = tempfile.mkdtemp()
m = torch.nn.Linear(64, 64).cuda().to(torch.bfloat16)
ep = torch.export.export(m, (torch.randn(8, 64, device="cuda", dtype=torch.bfloat16),))
p = torch._inductor.aoti_compile_and_package(ep, package_path=os.path.join(d, "lin.pt2"))
code = f"import torch; r=torch._inductor.aoti_load_package({p!r}); x=torch.randn(8,64,device='cuda',dtype=torch.bfloat16); print('aoti load ok', r(x).shape)"
res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print("aoti child rc", res.returncode, res.stdout.strip(), res.stderr.strip()[-300:])
PY
python3 -m exporter.testing.random_models /tmp/models --size tiny --only llama
time python3 -m exporter convert /tmp/models/llama-tiny --recipe h100-bf16 --out "$OUT/llama-tiny" 2>&1 | tail -40
cp -r "$OUT/llama-tiny/logs" "$OUT/logs" 2>/dev/null; ls "$OUT"
