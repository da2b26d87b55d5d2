#!/usr/bin/env bash
# On the GPU machine: the hand-written-attention model converted with h100-bf16, with and without the rewrite.
#   bash benchmarks/gpu_rewrite_proof.sh [SIZE=base] [TARGETS="-t exported_program -t aoti"]
#   LAYOUT=flattened: the attention spelled with heads folded into the batch (bmm, views around the softmax)
#   STATIC=1: batch and sequence fixed at 8 x 1024 (no dynamic dims), to set beside a dynamic run
#   LAYOUT=mixed: four spellings of attention in one model, block i taking spelling i % 4 (handwritten_gpt.py)
#   RUNS=rewrite: only the run with the rewrite (its report times every artifact against the rewritten eager model)
#   GRID=0: the rewrite run without the shape grid too (the grid judges more shapes; it does not change timings)
# $OUT gets report.md/report.json of both runs, comparison.md and the logs' tails. The --no-rewrite run uses
# h100-bf16 with grid = false (the grid does not change the timings; both runs fit one 10-minute call).
set -u
SIZE=${1:-base}; TARGETS=${2:--t exported_program -t aoti}; LAYOUT=${LAYOUT:-heads}
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "machine: $(uname -r); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 -m exporter.testing.handwritten_gpt /tmp/hw --size "$SIZE" --layout "$LAYOUT"
DIMS=(--dim batch=8:1:8 --dim sequence=1024:16:2048); [ "${STATIC:-0}" = 1 ] && DIMS=(--dim batch=8 --dim sequence=1024)
ARGS=(--model exporter.testing.handwritten_gpt:build
      --input input_ids:int64:batch,sequence:0:8192 --input attention_mask:int64:batch,sequence
      "${DIMS[@]}" --overwrite)
sed 's/^grid = true.*/grid = false/' recipes/h100-bf16.toml > /tmp/h100-bf16-nogrid.toml
for run in ${RUNS:-rewrite no-rewrite}; do
  extra=(--recipe h100-bf16); [ "${GRID:-1}" = 0 ] && extra=(--recipe /tmp/h100-bf16-nogrid.toml)
  [ "$run" = no-rewrite ] && extra=(--no-rewrite --recipe /tmp/h100-bf16-nogrid.toml)
  start=$(date +%s)
  timeout "${RUN_TIMEOUT:-420}" python3 -m exporter convert /tmp/hw "${ARGS[@]}" $TARGETS "${extra[@]}" --out "/tmp/$run" \
    > "$OUT/$run.stdout.txt" 2> "$OUT/$run.stderr.txt"
  echo "$run: exit code $? in $(( $(date +%s) - start )) s"
  cp "/tmp/$run/report.md" "$OUT/$run.report.md" 2>/dev/null; cp "/tmp/$run/report.json" "$OUT/$run.report.json" 2>/dev/null
  grep -E "^\| (eager|rewritten|exported|aoti|compile)" "/tmp/$run/report.md" 2>/dev/null; tail -4 "$OUT/$run.stderr.txt"
done
[ -f /tmp/no-rewrite/report.json ] && python3 scripts/compare_reports.py /tmp/rewrite/report.json /tmp/no-rewrite/report.json | tee "$OUT/comparison.md"
grep -A8 "SDPA backend choice" /tmp/rewrite/report.md
