#!/usr/bin/env bash
# On the GPU machine, one 10-minute call: a generation convert's AOTInductor programs compiled at once (each after
# the first in a process of its own: targets/compile_apart.py) against one after the other, the same convert twice.
#   bash benchmarks/gpu_build_jobs.sh            # the Qwen2-0.5B shape, -t aoti, generation.decode_batch_1
#   SHAPE=llama1b JOBS=3 bash benchmarks/gpu_build_jobs.sh
# Each run has Inductor's and Triton's caches of its own (nothing compiled by the other is reused); the programs at
# once run first, so the one after the other finds the machine warmer. $OUT/jobs<N>/summary.md and its tarball.
set -u
OUT=${OUT:-/tmp/out}
for jobs in "${JOBS:-3}" 1; do
  rm -rf "/tmp/inductor-$jobs" "/tmp/triton-$jobs"
  TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$jobs" TRITON_CACHE_DIR="/tmp/triton-$jobs" EXPORTER_BUILD_JOBS=$jobs \
    OUT="$OUT/jobs$jobs" SHAPE=${SHAPE:-qwen05b} TARGETS=aoti CHECKS=0 LIMIT="${LIMIT:-280}" \
    bash benchmarks/gpu_generation.sh --set generation.decode_batch_1=true > "$OUT/jobs$jobs.txt" 2>&1
  echo "== EXPORTER_BUILD_JOBS=$jobs"
  grep -h "machine\|exit code\|^Stages\|compiled here\|ms/token\|^| aoti" "$OUT/jobs$jobs/summary.md" | cut -c1-400 | head -12
done
