#!/usr/bin/env bash
# exporter convert on the GPU machine: a transformers model from config (random weights), recipe h100-bf16.
#   bash benchmarks/gpu_convert.sh [MODEL=llama] [SIZE=tiny]   (report.md, report.json and logs land in $OUT)
set -u
MODEL=${1:-llama}; SIZE=${2:-tiny}
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "machine: $(uname -r); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
python3 -m exporter.testing.random_models /tmp/models --size "$SIZE" --only "$MODEL" >/dev/null 2>&1
python3 -m exporter convert "/tmp/models/$MODEL-$SIZE" --recipe h100-bf16 --out "/tmp/run" --overwrite > "$OUT/stdout.txt" 2> "$OUT/stderr.txt"
echo "exit code $?"
cp /tmp/run/report.md /tmp/run/report.json "$OUT/" 2>/dev/null
for f in /tmp/run/logs/*.log; do [ -s "$f" ] && tail -c 3000 "$f" > "$OUT/$(basename "$f")"; done 2>/dev/null
grep -E "^\|" "$OUT/report.md"; grep -E "^- \*\*" "$OUT/report.md"; tail -3 "$OUT/stderr.txt"
