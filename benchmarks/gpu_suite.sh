#!/usr/bin/env bash
# The GPU performance suite (benchmarks/gpu_suite.py) on the GPU machine, one device call per group of models:
#   bash benchmarks/gpu_suite.sh gpt2 bert          # $OUT/<model>.json and $OUT/log.txt
#   bash benchmarks/gpu_suite.sh vit handwritten
#   bash benchmarks/gpu_suite.sh llama1b
# Then, here: python benchmarks/gpu_suite.py --write-doc docs/BENCHMARKS.md docs/runs/suite-*.json
# Inductor's caches live in /tmp/exporter-suite/inductor-cache: a later call on the same (still warm) machine
# reuses them; each model's JSON records the cache directory, and the log says whether it was empty at the start.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/suite-out}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/exporter-suite/inductor-cache
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "inductor cache: $(du -sh "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null | cut -f1 || echo empty) at the start"
} 2>&1 | tee -a "$out/log.txt"
python3 benchmarks/gpu_suite.py "$@" --out "$out" --timeout "${CONVERT_LIMIT:-400}" 2>&1 \
  | grep -v -e "Writing model shards" -e "Loading weights" | tee -a "$out/log.txt"
