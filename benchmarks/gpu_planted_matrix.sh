#!/usr/bin/env bash
# The planted-defect matrix on the GPU machine (bf16, h100-bf16), the trained model built there.
#   COLUMNS="pt2" bash benchmarks/gpu_planted_matrix.sh        (a user's programs, exporter check; ~6 min)
#   COLUMNS="convert" SEEDS=0 bash benchmarks/gpu_planted_matrix.sh   (exporter convert's own artifacts)
#   DEFECTS="scale" ...                                                (only those defects, beside the clean row)
# writes under $OUT (default /tmp/out); one call of the device tool each
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
rm -rf /tmp/aotinductor_* /tmp/matrix-bf16
COLUMN_ARGS=""
for c in ${COLUMNS:-pt2}; do COLUMN_ARGS="$COLUMN_ARGS --column $c"; done
for d in ${DEFECTS:-}; do COLUMN_ARGS="$COLUMN_ARGS --defect $d"; done
export PYTHONPATH=src EXPORTER_CACHE=/tmp/exporter-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> "$OUT/gpu.txt"
time python3 benchmarks/planted_matrix.py /tmp/matrix-bf16 --recipe h100-bf16 --seeds "${SEEDS:-2}" $COLUMN_ARGS \
  > "$OUT/matrix-bf16.log" 2>&1
echo "exit $?" >> "$OUT/matrix-bf16.log"
cp /tmp/matrix-bf16/matrix.json /tmp/matrix-bf16/matrix.md "$OUT/" 2>/dev/null
tail -20 "$OUT/matrix-bf16.log"
