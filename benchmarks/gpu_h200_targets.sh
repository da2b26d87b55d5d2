#!/usr/bin/env bash
# On the GPU machine: issue 48's decode targets where they are set (an H200), three 10-minute calls.
#   PART=8b bash benchmarks/gpu_h200_targets.sh      # the whole 32-layer Llama-3.1-8B shape's decode program of
#       batch 1 as exporter builds it, bf16 then fp8 weight-only with the head in fp8 (FP8_HEAD=1; HEAD=bf16 for the
#       default recipe's bf16 head), each replayed from a CUDA graph and profiled: $OUT/probe/decode-probe.{md,json}
#   PART=small bash benchmarks/gpu_h200_targets.sh   # the Llama-3.2-1B and Qwen2-0.5B shapes through the product
#       (exporter convert --task text-generation -t aoti --set generation.decode_batch_1=true, judged and timed;
#       convert wall included): $OUT/llama1b/, $OUT/qwen05b/ (summary.md, generation.tar.gz)
#   PART=families bash benchmarks/gpu_h200_targets.sh  # issue 46's smoke of each generation family (gpu_families.sh)
# Each part prints the card first; figures are the card's that ran them.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
case "${PART:-8b}" in
  8b)
    if [ "${HEAD:-fp8}" = fp8 ]; then export FP8_HEAD=1; fi
    PART=probe bash benchmarks/gpu_fp8_fused.sh ;;
  small)
    for shape in llama1b qwen05b; do
      OUT="$OUT/$shape" SHAPE=$shape TARGETS=aoti CHECKS=0 LIMIT="${LIMIT:-270}" bash benchmarks/gpu_generation.sh \
        --set generation.decode_batch_1=true | grep -i "exit code\|ms/token\|decode_batch_1\|machine" | head -12
    done ;;
  families)
    bash benchmarks/gpu_families.sh ;;
esac
