#!/usr/bin/env bash
# On the GPU machine: attention written behind layout ops (heads folded into the batch, bmm, views around the
# softmax) converted with h100-bf16, and what dynamic batch and sequence dims cost an AOTI artifact.
#   bash benchmarks/gpu_layout_proof.sh            # one 10-minute call
# Runs, each in a fresh process (the model: python3 -m exporter.testing.handwritten_gpt --size base --layout flattened):
#   dynamic     h100-bf16 as shipped, exported_program + aoti, batch 8 (1..8) x sequence 1024 (16..2048), grid on
#   static      the same model with batch 8 and sequence 1024 fixed, aoti only, grid off
#   no-rewrite  --no-rewrite, aoti only, grid off: what the rewrite buys for this layout
#   heads-static  the heads-first spelling (docs/gpu.md's earlier run) with static dims, aoti only, grid off
# $OUT/layout-proof.tar.gz holds every report.md/report.json and the logs' tails; $OUT/summary.md the tables.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; work=/tmp/layout-proof; rm -rf "$work"; mkdir -p "$work"
echo "machine: $(uname -r); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" | tee "$OUT/summary.md"
python3 -m exporter.testing.handwritten_gpt /tmp/hw-flat --size base --layout flattened
python3 -m exporter.testing.handwritten_gpt /tmp/hw-heads --size base --layout heads
sed 's/^grid = true.*/grid = false/' recipes/h100-bf16.toml > /tmp/h100-bf16-nogrid.toml
INPUTS=(--model exporter.testing.handwritten_gpt:build --input input_ids:int64:batch,sequence:0:8192
        --input attention_mask:int64:batch,sequence --overwrite)
DYNAMIC=(--dim batch=8:1:8 --dim sequence=1024:16:2048); STATIC=(--dim batch=8 --dim sequence=1024)
convert() {  # name timeout_s checkpoint args...
  local name=$1 limit=$2 ckpt=$3; shift 3
  local start; start=$(date +%s)
  timeout "$limit" python3 -m exporter convert "$ckpt" "${INPUTS[@]}" "$@" --out "$work/$name" \
    > "$work/$name.stdout.txt" 2> "$work/$name.stderr.txt"
  echo "## $name: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
  grep -E "^\| (eager|rewritten|exported|aoti|compile)" "$work/$name/report.md" 2>/dev/null | tee -a "$OUT/summary.md"
  grep -E "slower|rewrote|skipped" "$work/$name/report.md" 2>/dev/null | head -8 | tee -a "$OUT/summary.md"
  tail -3 "$work/$name.stderr.txt"
}
convert dynamic 270 /tmp/hw-flat --recipe h100-bf16 "${DYNAMIC[@]}" -t exported_program -t aoti
convert static 120 /tmp/hw-flat --recipe /tmp/h100-bf16-nogrid.toml "${STATIC[@]}" -t aoti
convert no-rewrite 90 /tmp/hw-flat --recipe /tmp/h100-bf16-nogrid.toml "${STATIC[@]}" -t aoti --no-rewrite
convert heads-static 90 /tmp/hw-heads --recipe /tmp/h100-bf16-nogrid.toml "${STATIC[@]}" -t aoti
for run in static no-rewrite heads-static; do
  [ -f "$work/$run/report.json" ] && [ -f "$work/dynamic/report.json" ] && {
    echo "### dynamic vs $run" >> "$OUT/summary.md"
    python3 scripts/compare_reports.py "$work/dynamic/report.json" "$work/$run/report.json" \
      --labels dynamic "$run" >> "$OUT/summary.md" 2>&1; }
done
grep -A8 "SDPA backend choice" "$work/dynamic/report.md" >> "$OUT/summary.md" 2>/dev/null
(cd "$work" && tar czf "$OUT/layout-proof.tar.gz" --exclude='*.pt2' --exclude='*.so' --exclude='*.onnx*' \
  --exclude='*.safetensors' --exclude='reference' */report.md */report.json */report.png *.txt 2>/dev/null)
cat "$OUT/summary.md"
