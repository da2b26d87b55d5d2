#!/usr/bin/env bash
# On the GPU machine, one 10-minute call: the decode program of batch 1 (generation.decode_batch_1) on 2 layers
# of the Llama-3.1-8B shape and its untied 128k head, AOTI only, bf16 (h100-bf16) then fp8 weight-only
# (h100-fp8 with quantize.scheme = fp8-weight-only), each a whole `exporter convert --task text-generation`
# judged and timed, then `exporter verify` of the folder (VERIFY=1, the default; both questions for fp8) and
# `exporter generate` with one prompt (which runs the batch-1 program).
#   bash benchmarks/gpu_decode_batch_1.sh        # $OUT/bf16/, $OUT/fp8/: summary.md and generation.tar.gz
#   SHAPE=llama1b LAYERS= ... : another shape (see gpu_generation.sh)
set -u
OUT=${OUT:-/tmp/out}
export SHAPE=${SHAPE:-llama8b} LAYERS=${LAYERS-2} TARGETS=${TARGETS:-aoti} LIMIT=${LIMIT:-250}
for run in ${RUNS:-bf16 fp8}; do
  if [ "$run" = fp8 ]; then recipe=h100-fp8; extra=(--set quantize.scheme=fp8-weight-only); else recipe=h100-bf16; extra=(); fi
  OUT="$OUT/$run" RECIPE=$recipe CHECKS=0 bash benchmarks/gpu_generation.sh --set generation.decode_batch_1=true "${extra[@]}"
  if [ "${VERIFY:-1}" = 1 ]; then
    start=$(date +%s)
    PYTHONPATH=src python3 -m exporter verify /tmp/generation/gen > "$OUT/$run/verify.txt" 2>&1
    echo "## exporter verify: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/$run/summary.md"
    tail -6 "$OUT/$run/verify.txt" | tee -a "$OUT/$run/summary.md"
  fi
  start=$(date +%s)
  PYTHONPATH=src python3 -m exporter generate /tmp/generation/gen --target aoti --input-ids 1,2,3,4,5,6,7,8 \
    --max-new-tokens 16 --json > "$OUT/$run/generate.json" 2> "$OUT/$run/generate.txt"
  echo "## exporter generate --target aoti, one prompt: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/$run/summary.md"
  tail -3 "$OUT/$run/generate.txt"
done
