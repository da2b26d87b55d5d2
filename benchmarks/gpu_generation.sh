#!/usr/bin/env bash
# On the GPU machine: a Llama-3.2-1B-shaped decoder (random weights, bf16) converted with
# --task text-generation on h100-bf16 (exported program + AOTI prefill and decode over a static KV cache),
# judged step by step against the float64 reference and timed against transformers' generate();
# then `exporter verify` on the folder and `exporter generate --target aoti` from it.
#   bash benchmarks/gpu_generation.sh [CONVERT OPTIONS...]   # one 10-minute call; options go to exporter convert
#   SHAPE=llama8b LAYERS=2 RECIPE=h100-fp8 bash benchmarks/gpu_generation.sh   # fp8, a slice of the 8B shape
#   TARGETS="aoti" ... bash benchmarks/gpu_generation.sh   # the targets built (default: exported_program aoti)
#   SHAPE=qwen05b: the Qwen2-0.5B shape (24 layers, hidden 896, 14/2 heads, tied 152k head)
#   CHECKS=0: skip `exporter verify` and `exporter generate` (two runs in one call)
# $OUT/summary.md: the report's tables; $OUT/generation.tar.gz: report.md, report.json and the logs.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; work=/tmp/generation; rm -rf "$work"; mkdir -p "$work"
{
  echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} | tee "$OUT/summary.md"
start=$(date +%s)
SHAPE=${SHAPE:-llama1b}; RECIPE=${RECIPE:-h100-bf16}
echo "shape: $SHAPE${LAYERS:+, $LAYERS layers}; recipe: $RECIPE" | tee -a "$OUT/summary.md"
PYTHONPATH=src:benchmarks python3 -c 'import sys; from gpu_decode_probe import save_checkpoint; save_checkpoint(*sys.argv[1:])' \
  "$work/$SHAPE" "$SHAPE" "${LAYERS:-0}"  # the shapes of benchmarks/gpu_decode_probe.py, one home for them
echo "checkpoint written in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
start=$(date +%s)
timeout "${LIMIT:-480}" python3 -m exporter convert "$work/$SHAPE" --recipe "$RECIPE" --task text-generation \
  $(for t in ${TARGETS:-exported_program aoti}; do printf -- '-t %s ' "$t"; done) --out "$work/gen" "$@" > "$work/stdout.txt" 2> "$work/stderr.txt"
echo "## convert: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
cat "$work/gen/report.md" >> "$OUT/summary.md" 2>/dev/null || tail -30 "$work/stderr.txt" | tee -a "$OUT/summary.md"
grep -v "Writing model" "$work/stderr.txt" | tail -25
if [ "${CHECKS:-1}" = 0 ]; then
  tar czf "$OUT/generation.tar.gz" -C "$work" stdout.txt stderr.txt gen/report.md gen/report.json gen/logs 2>/dev/null
  exit 0
fi
# the folder re-checked in a fresh process, and a generation from the AOTI programs by the CLI
start=$(date +%s)
python3 -m exporter verify "$work/gen" > "$work/verify.txt" 2>&1
echo "## exporter verify: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
tail -15 "$work/verify.txt" | tee -a "$OUT/summary.md"
start=$(date +%s)
python3 -m exporter generate "$work/gen" --target aoti --input-ids 1,2,3,4,5,6,7,8 --input-ids 9,10,11 \
  --max-new-tokens 16 --json > "$work/generate.json" 2> "$work/generate.txt"
echo "## exporter generate --target aoti: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
cat "$work/generate.json" | tee -a "$OUT/summary.md"; tail -5 "$work/generate.txt"
tar czf "$OUT/generation.tar.gz" -C "$work" stdout.txt stderr.txt verify.txt generate.json gen/report.md gen/report.json gen/logs gen/generation.json 2>/dev/null
ls "$OUT"
# where the decode step's time goes, and what Inductor's options buy: benchmarks/gpu_decode_probe.py (its own call)
