#!/usr/bin/env bash
# On the GPU machine: an encoder-decoder (random weights, bf16) converted for generation on h100-bf16: the prefill
# (encoder + first decoder step, cross-attention keys and values written once) and the decode step, exported program
# and AOTI, judged step by step against the float64 reference and timed against transformers' generate(); then
# `exporter verify` on the folder and `exporter generate --target aoti` from it.
#   bash benchmarks/gpu_seq2seq.sh t5|whisper [CONVERT OPTIONS...]   # one 10-minute call per model
#   LAYERS=2 bash benchmarks/gpu_seq2seq.sh t5   # the same widths with 2 encoder and 2 decoder layers (a smoke)
#   t5: a t5-small shape (6 + 6 layers, d_model 512, 8 heads, vocab 32128), --task text2text-generation
#   whisper: a whisper-base shape (6 + 6 layers, d_model 512, 8 heads, 80 mel bins x 3000 frames, vocab 51865),
#            --task automatic-speech-recognition
# $OUT/summary.md: the report's tables; $OUT/seq2seq.tar.gz: report.md, report.json and the logs.
set -u
model=${1:-t5}; shift || true
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; work=/tmp/seq2seq; rm -rf "$work"; mkdir -p "$work"
{
  echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "model: $model shape${LAYERS:+, $LAYERS + $LAYERS layers}, random weights; $(date -u +%F)"
} | tee "$OUT/summary.md"
start=$(date +%s)
python3 - "$model" "$work/model" "${LAYERS:-6}" <<'PY'
import sys, torch, transformers
torch.manual_seed(0)
layers = int(sys.argv[3])
if sys.argv[1] == "t5":
    config = transformers.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=layers, num_heads=8,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)
else:
    config = transformers.WhisperConfig(vocab_size=51865, d_model=512, encoder_layers=layers, decoder_layers=layers,
                                        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=2048,
                                        decoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=1500,
                                        max_target_positions=448, decoder_start_token_id=50258, pad_token_id=50257,
                                        bos_token_id=50257, eos_token_id=50257, suppress_tokens=None,
                                        begin_suppress_tokens=None)
    model = transformers.WhisperForConditionalGeneration(config)
model.to(torch.bfloat16).save_pretrained(sys.argv[2])
PY
echo "checkpoint written in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
task=text2text-generation; extra=()
# Whisper's decoder has 448 positions: the recipe's 512-slot cache would be refused
[ "$model" = whisper ] && task=automatic-speech-recognition && extra=(--set generation.max_cache_len=448)
start=$(date +%s)
timeout "${LIMIT:-460}" python3 -m exporter convert "$work/model" --recipe h100-bf16 --task "$task" \
  -t exported_program -t aoti --out "$work/gen" "${extra[@]}" "$@" > "$work/stdout.txt" 2> "$work/stderr.txt"
echo "## convert: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
cat "$work/gen/report.md" >> "$OUT/summary.md" 2>/dev/null || tail -30 "$work/stderr.txt" | tee -a "$OUT/summary.md"
grep -v "Writing model" "$work/stderr.txt" | tail -25
start=$(date +%s)
python3 -m exporter verify "$work/gen" > "$work/verify.txt" 2>&1
echo "## exporter verify: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
tail -5 "$work/verify.txt" | tee -a "$OUT/summary.md"
start=$(date +%s)
if [ "$model" = whisper ]; then
  python3 -c 'import sys, torch; from safetensors.torch import save_file; torch.manual_seed(1); save_file({"mel": torch.randn(1, 80, 3000)}, sys.argv[1])' "$work/mel.safetensors"
  source=(--input-features "$work/mel.safetensors")
else
  source=(--input-ids 37,423,19,8,1782,5,1)
fi
python3 -m exporter generate "$work/gen" --target aoti "${source[@]}" --max-new-tokens 16 --json \
  > "$work/generate.json" 2> "$work/generate.txt"
echo "## exporter generate --target aoti: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
cat "$work/generate.json" | tee -a "$OUT/summary.md"; tail -5 "$work/generate.txt"
tar czf "$OUT/seq2seq.tar.gz" -C "$work" stdout.txt stderr.txt verify.txt generate.json gen/report.md gen/report.json \
  gen/logs gen/generation.json 2>/dev/null
ls "$OUT"
