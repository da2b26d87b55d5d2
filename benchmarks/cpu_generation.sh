#!/usr/bin/env bash
# On the CPU: a small Llama-shaped decoder (random weights, float32) converted with --task text-generation on
# cpu-fp32 with every generation target (exported program, AOTI, ONNX), judged step by step against the float64
# reference and timed against transformers' generate(); then `exporter generate` from each target.
#   bash benchmarks/cpu_generation.sh [OUT_DIR] [CONVERT OPTIONS...]     # about 10 minutes on 2 cores
# OUT_DIR (default /tmp/cpu-generation): the converted folder, summary.md (the report's tables and timings).
set -u
out=${1:-/tmp/cpu-generation}; shift || true
rm -rf "$out"; mkdir -p "$out"
python - "$out/model" <<'PY'
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(num_hidden_layers=8, hidden_size=512, intermediate_size=1408,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                                  max_position_embeddings=2048, tie_word_embeddings=False)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
PY
{
  echo "machine: $(nproc) CPU cores, $(python -c 'import platform; print(platform.processor() or platform.machine())')"
  python -c 'import torch, transformers, onnxruntime; print("torch", torch.__version__, "transformers", transformers.__version__, "onnxruntime", onnxruntime.__version__)'
} | tee "$out/summary.md"
start=$(date +%s)
python -m exporter convert "$out/model" --recipe cpu-fp32 --task text-generation \
  -t exported_program -t aoti -t onnx --out "$out/gen" "$@" > "$out/stdout.txt" 2> "$out/stderr.txt"
echo "## convert: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$out/summary.md"
cat "$out/gen/report.md" >> "$out/summary.md" 2>/dev/null || tail -30 "$out/stderr.txt"
for target in exported_program aoti onnx; do
  start=$(date +%s)
  python -m exporter generate "$out/gen" --target "$target" --input-ids 1,2,3,4,5,6,7,8 --max-new-tokens 16 --json \
    > "$out/generate-$target.json" 2> "$out/generate-$target.txt"
  echo "## exporter generate --target $target: exit code $? in $(( $(date +%s) - start )) s: $(cat "$out/generate-$target.json")" \
    | tee -a "$out/summary.md"
done
sed -n '/## Timing/,/^## Attention/p' "$out/summary.md"
