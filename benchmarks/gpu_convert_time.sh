#!/usr/bin/env bash
# The convert-time benchmark on the GPU machine; writes convert-time-<model>.json and log.txt under $OUT.
#   bash benchmarks/gpu_convert_time.sh gpt2,llama1b            # the default recipe, every target it lists
#   bash benchmarks/gpu_convert_time.sh llama8b exported_program,aoti 280
# Then, here: python benchmarks/convert_time.py --write-doc <the JSON files>  (writes docs/convert-time.md)
set -uo pipefail
cd "$(dirname "$0")/.."
models=${1:-gpt2,llama1b}
targets=${2:-}
timeout=${3:-0}
out=${OUT:-/tmp/convert-time}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  df -h /tmp | tail -1
  free -g | head -2
} 2>&1 | tee "$out/log.txt"
python3 benchmarks/convert_time.py --models "$models" --targets "$targets" --timeout "$timeout" --out "$out" \
  --work /tmp/exporter-bench 2>&1 | grep -v "Writing model shards" | tee -a "$out/log.txt"
