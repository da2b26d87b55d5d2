#!/usr/bin/env bash
# On the GPU machine, one call: a smoke of each generation family through the one corridor, h100-bf16, random
# weights: a decoder (the Llama-3.2-1B shape cut to 2 layers) and an encoder-decoder (the t5-small widths, 2 + 2
# layers), each converted (exported program + AOTI), then `exporter verify` on its folder and `exporter generate
# --target aoti` from it.
#   bash benchmarks/gpu_families.sh   # $OUT/decoder/summary.md, $OUT/t5/summary.md (and each run's tarball)
set -u
OUT=${OUT:-/tmp/out}
OUT="$OUT/decoder" SHAPE=llama1b LAYERS=2 LIMIT=${LIMIT:-220} bash benchmarks/gpu_generation.sh
OUT="$OUT/t5" LAYERS=2 LIMIT=${LIMIT:-220} bash benchmarks/gpu_seq2seq.sh t5
grep -h "exit code" "$OUT"/decoder/summary.md "$OUT"/t5/summary.md
