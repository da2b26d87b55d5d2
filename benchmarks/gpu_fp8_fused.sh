#!/usr/bin/env bash
# On the GPU machine: fp8 weight-only decode on the same fused kernels as bf16 (exporter::gemv reading the fp8 weight
# with its row scales, the RMSNorm, gated activation and residual add folded in; kernels/decode_products.py).
#   PART=probe bash benchmarks/gpu_fp8_fused.sh   # one call: the whole 32-layer Llama-3.1-8B shape's decode program
#       of batch 1 as exporter builds it (variant 15 of benchmarks/gpu_decode_probe.py), bf16 then fp8 weight-only,
#       each replayed from a CUDA graph and profiled: $OUT/probe/decode-probe.{md,json}
#       (FP8_HEAD=1: the vocabulary head quantized too, as quantize.include_head=true and torchao's quantize_ do)
#   PART=judged bash benchmarks/gpu_fp8_fused.sh  # one call: 2 layers of that shape through the product, fp8
#       weight-only with generation.decode_batch_1, judged, verified and generated from (gpu_decode_batch_1.sh)
set -u
export PYTHONPATH=src:benchmarks PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/probe"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
if [ "${PART:-probe}" = probe ]; then
  rm -rf /tmp/aotinductor_* /tmp/probe-*.pt2
  OUT="$OUT/probe" timeout "${PROBE_LIMIT:-540}" python3 benchmarks/gpu_decode_probe.py --shape llama8b \
    --layers "${LAYERS:-32}" --only "${ONLY:-15}" --fp8 --fp8-forms kernel --no-eager --budget-s "${PROBE_S:-420}" \
    2>&1 | grep -v -i warn | grep -v '^ *$' | tail -40
  echo "probe exit: ${PIPESTATUS[0]}"
else
  RUNS=fp8 LIMIT="${LIMIT:-300}" bash benchmarks/gpu_decode_batch_1.sh
fi
