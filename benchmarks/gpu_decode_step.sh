#!/usr/bin/env bash
# On the GPU machine, one 10-minute call: each layer's rotary embedding and cache write folded into its attention
# kernel (kernels/decode_step_attention.py, generation.decode_step_kernel), measured two ways.
#   bash benchmarks/gpu_decode_step.sh
# 1. benchmarks/gpu_decode_probe.py --only 13,15,16: the Llama-3.2-1B shape's decode program of batch 1 as built
#    before (variant 13), with the fold (15), and with the fold but the slices merged apart (16), each compiled
#    with AOTInductor, replayed from a CUDA graph and profiled (ms/token, kernels a step, logits against the
#    eager step): $OUT/decode-probe.{md,json}.
# 2. Through the product, a 2-layer slice of the same shape: exporter convert --task text-generation -t aoti with
#    generation.decode_batch_1 (the fold on by default), then exporter verify and exporter generate --target aoti
#    (benchmarks/gpu_generation.sh): $OUT/summary.md, $OUT/generation.tar.gz.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${PROBE_LIMIT:-330}" python3 benchmarks/gpu_decode_probe.py --only 13,15,16 --no-eager \
  --budget-s "${PROBE_BUDGET:-250}" > "$OUT/probe-stdout.txt" 2>&1
echo "probe: exit $?"
grep -v "^\s*$" "$OUT/probe-stdout.txt" | grep -i "decode_step\|error\|Traceback" | head -20
SHAPE=llama1b LAYERS=2 TARGETS=aoti LIMIT="${CONVERT_LIMIT:-180}" CHECKS="${CHECKS:-1}" bash benchmarks/gpu_generation.sh \
  --set generation.decode_batch_1=true
