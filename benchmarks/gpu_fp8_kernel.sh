#!/usr/bin/env bash
# On the GPU machine, one call: the fp8 matrix-vector kernel (exporter::fp8_gemv) against bf16 cuBLAS per linear of
# the Llama-3.1-8B shape with a sweep of its tiles (benchmarks/gpu_fp8_gemv.py), then the decode program of batch 1
# on LAYERS layers of that shape, fp8 weight-only with the kernel (projections fused, then unfused) and with
# Inductor's own form, each timed from a CUDA graph and profiled (benchmarks/gpu_decode_probe.py).
#   bash benchmarks/gpu_fp8_kernel.sh          # $OUT/gemv.json, $OUT/probe/decode-probe.{md,json}
#   LAYERS=32 FORMS=kernel ONLY=8 BF16=1 ...   # the whole 8B shape, bf16 against the kernel
set -u
export PYTHONPATH=src:benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/probe"
rm -rf /tmp/aotinductor_* /tmp/probe-*.pt2
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
if [ "${GEMV:-1}" = 1 ]; then
  timeout "${GEMV_LIMIT:-170}" python3 benchmarks/gpu_fp8_gemv.py "$OUT/gemv.json" --budget-s "${SWEEP_S:-100}" 2>&1 \
    | grep -v -i warn
fi
skip=(--skip-bf16); [ "${BF16:-0}" = 1 ] && skip=()
OUT="$OUT/probe" timeout "${PROBE_LIMIT:-330}" python3 benchmarks/gpu_decode_probe.py --shape llama8b \
  --layers "${LAYERS:-2}" --only "${ONLY:-8,9}" --fp8 --fp8-forms "${FORMS:-kernel,inductor}" "${skip[@]}" \
  --no-eager --budget-s "${PROBE_S:-250}" 2>&1 | grep -v -i warn | grep -v '^ *$' | tail -60
echo "probe exit: ${PIPESTATUS[0]}"
ls -la "$OUT" "$OUT/probe"
