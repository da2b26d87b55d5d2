#!/usr/bin/env bash
# exporter batch on one GPU (the figures in docs/batch.md):
#  1. the shared compile cache: one model's AOTInductor package built by two cells in turn, the second compiling
#     with the cache the first filled (build_s of each, from their report.json);
#  2. a plan of 3 tiny models x 2 recipes (h100-bf16, cpu-fp32) through dask-cuda's LocalCUDACluster, every folder
#     verified, then the plan run again (every cell finished, none run).
#   bash benchmarks/gpu_batch.sh   (writes under $OUT; dask, distributed and dask-cuda carried as wheels)
set -u
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
W=/tmp/batch
mkdir -p "$OUT" $W
python3 -m exporter.testing.random_models $W/models --size tiny --only gpt2,bert,vit > /dev/null
python3 -m exporter.testing.random_models $W/models --size medium --only bert > /dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, dask, distributed, dask_cuda; print('torch', torch.__version__, 'dask', dask.__version__, \
'distributed', distributed.__version__, 'dask-cuda', dask_cuda.__version__)"

cat > $W/cache.toml <<'EOF'
description = "one model's AOTInductor package built twice: the second cell compiles with the first's cache"
[[run]]
checkpoint = "models/bert-medium"
recipe = "h100-bf16"
targets = ["aoti"]
out = "{model}/first"
[[run]]
checkpoint = "models/bert-medium"
recipe = "h100-bf16"
targets = ["aoti"]
out = "{model}/second"
EOF
/usr/bin/time -f "cache batch wall: %e s" timeout 240 python3 -m exporter batch $W/cache.toml --out $W/cache \
  --workers 1 > "$OUT/cache-batch.md" 2> "$OUT/cache-batch.err"
echo "cache batch exit $?"; tail -4 "$OUT/cache-batch.err"
python3 - <<'PY'
import json
for name in ("first", "second"):
    try:
        r = json.load(open(f"/tmp/batch/cache/bert-medium/{name}/report.json"))
    except OSError:
        print(name, "no report"); continue
    print(name, {a["name"]: round(a["build_s"] or 0, 1) for a in r["artifacts"]}, "convert", r["timings_s"]["total"],
          "s, passed", r["passed"], "package cache", [a["graph"].get("package_cache") for a in r["artifacts"]
                                                      if a["name"] == "aoti"])
PY
du -sh $W/cache/.compile-cache

cat > $W/plan.toml <<'EOF'
description = "three tiny models under a GPU and a CPU recipe"
[matrix]
checkpoints = ["models/gpt2-tiny", "models/bert-tiny", "models/vit-tiny"]
recipes = ["h100-bf16", "cpu-fp32"]
targets = ["exported_program", "aoti"]
set = ["bench.rounds=3"]
EOF
/usr/bin/time -f "dask batch wall: %e s" timeout 330 python3 -m exporter batch $W/plan.toml --out $W/plan \
  --scheduler local-cuda --junit "$OUT/plan-junit.xml" > "$OUT/plan-batch.md" 2> "$OUT/plan-batch.err"
echo "dask batch exit $?"; grep -v "^\s*$" "$OUT/plan-batch.err" | grep -v "distributed\.\|dask_cuda\|^  " | tail -12
for d in $W/plan/*/*/; do python3 -m exporter verify "$d" > /dev/null 2>&1; echo "verify ${d#$W/plan/} exit $?"; done
/usr/bin/time -f "rerun wall: %e s" python3 -m exporter batch $W/plan.toml --out $W/plan --scheduler local-cuda \
  -q > /dev/null 2> "$OUT/rerun.err"
echo "rerun exit $?"; tail -2 "$OUT/rerun.err"
cp $W/plan/batch.json "$OUT/plan-batch.json"; cp $W/cache/batch.json "$OUT/cache-batch.json" 2>/dev/null
python3 -c "
import json; d = json.load(open('$W/plan/batch.json')); print('rerun counts', d['counts'], d['timings'])"
