#!/usr/bin/env bash
# On the GPU machine: h100-fp8 against h100-bf16 on a slice of the Llama-3.1-8B shape (random weights, LAYERS decoder
# layers of the real GEMM shapes, untied 128k head), prefill BATCH x SEQ, one sample, the AOTI package (and its
# CUDA-graph replay); then `exporter verify` of the fp8 folder (both questions again), and
# benchmarks/gpu_fp8_layer.py (torchao peer check, dense ceilings, one layer bf16 vs fp8 at prefill and decode shapes).
#   LAYERS=4 BATCH=8 SEQ=2048 bash benchmarks/gpu_fp8.sh      # about 9 minutes, torchao's wheel in .whl/
#   RECIPES=h100-fp8 bash benchmarks/gpu_fp8.sh                # the fp8 half only
# $OUT/summary.md, $OUT/fp8.json (the figures docs/quantization.md quotes), $OUT/reports.tar.gz.
set -u
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; work=/tmp/fp8; rm -rf "$work"; mkdir -p "$work"
LAYERS=${LAYERS:-4}; BATCH=${BATCH:-8}; SEQ=${SEQ:-2048}
{
  echo "machine: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "slice: $LAYERS layers of the Llama-3.1-8B shape, prefill $BATCH x $SEQ"
} | tee "$OUT/summary.md"
start=$(date +%s)
python3 - "$work/llama8b-slice" "$LAYERS" <<'PY'
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(num_hidden_layers=int(sys.argv[2]), hidden_size=4096, intermediate_size=14336,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=False,
                                  torch_dtype="bfloat16")
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
PY
echo "checkpoint written in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
timeout 170 python3 benchmarks/gpu_fp8_layer.py "$work/layer.json" 2>&1 | grep -v Warning | tail -8
common=(-t aoti --dim "batch=$BATCH" --dim "sequence=$SEQ" --set inputs.samples=1 --set bench.max_seconds=5)
for recipe in ${RECIPES:-h100-bf16 h100-fp8}; do
  start=$(date +%s)
  timeout "${LIMIT:-220}" python3 -m exporter convert "$work/llama8b-slice" --recipe "$recipe" "${common[@]}" \
    --out "$work/$recipe" > "$work/$recipe.stdout" 2> "$work/$recipe.stderr"
  echo "## $recipe convert: exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
  sed -n '1,/^## Shape grid/p' "$work/$recipe/report.md" >> "$OUT/summary.md" 2>/dev/null || \
    tail -20 "$work/$recipe.stderr" | tee -a "$OUT/summary.md"
  grep -v "Writing model" "$work/$recipe.stderr" | tail -8
  [ "$recipe" = h100-bf16 ] && rm -f "$work/$recipe/reference/outputs.safetensors"  # the disk holds one fp64 pair
done
start=$(date +%s)
timeout 120 python3 -m exporter verify "$work/h100-fp8" > "$work/verify.txt" 2>&1
echo "## exporter verify (fp8): exit code $? in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.md"
tail -5 "$work/verify.txt" | tee -a "$OUT/summary.md"
python3 - "$work" "$OUT/fp8.json" <<'PY'
import json, sys, pathlib
work = pathlib.Path(sys.argv[1]); result = {}
for recipe in ("h100-bf16", "h100-fp8"):
    path = work / recipe / "report.json"
    if not path.is_file():
        continue
    r = json.loads(path.read_text())
    variants = {v["name"]: v for v in r["artifacts"]}
    result[recipe] = {"exit_code": r["exit_code"], "total_s": r["timings_s"]["total"] if "timings_s" in r else None,
                      "eager_ms": (r["baseline"]["bench"] or {}).get("median_ms"), "memory": r.get("memory"),
                      "variants": {n: {"status": v["status"], "median_ms": (v["bench"] or {}).get("median_ms"),
                                       "size_bytes": v["size_bytes"], "build_s": v["build_s"]}
                                   for n, v in variants.items()},
                      "quantization": {k: r["quantization"][k] for k in ("passed", "counts", "outputs", "logits",
                                                                          "worst_layers", "problems")}
                      if r.get("quantization") else None}
layer = work / "layer.json"
result["layer"] = json.loads(layer.read_text()) if layer.is_file() else None
pathlib.Path(sys.argv[2]).write_text(json.dumps(result, indent=2))
print(json.dumps(result, indent=1)[:6000])
PY
tar czf "$OUT/reports.tar.gz" -C "$work" h100-bf16/report.md h100-bf16/report.json h100-fp8/report.md \
  h100-fp8/report.json h100-fp8/logs verify.txt h100-bf16.stderr h100-fp8.stderr 2>/dev/null
ls "$OUT"
