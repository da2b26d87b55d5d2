#!/usr/bin/env bash
# exporter check on the GPU: a torch.export program a user script made (tiny BERT, bf16, CUDA) judged with
# h100-bf16, then the same program with a wrong attention scale in layer 1 (must exit 3 and name the module).
#   bash benchmarks/gpu_check.sh   (writes under $OUT)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m exporter.testing.random_models /tmp/models --size tiny --only bert
python3 - <<'PY'
import torch
from transformers import BertModel
for name, scale in (("good", None), ("bad", 1.1)):
    model = BertModel.from_pretrained("/tmp/models/bert-tiny", attn_implementation="sdpa").eval().cuda().bfloat16()
    if scale:
        model.encoder.layer[1].attention.self.scaling *= scale
    ids = torch.randint(0, 1000, (2, 16), device="cuda")
    b, s = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)
    program = torch.export.export(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                  dynamic_shapes={"input_ids": {0: b, 1: s}, "attention_mask": {0: b, 1: s}})
    torch.export.save(program, f"/tmp/{name}.pt2")
PY
for name in good bad; do
  /usr/bin/time -f "check $name: %e s" python3 -m exporter check /tmp/$name.pt2 --against /tmp/models/bert-tiny \
    --recipe h100-bf16 --out /tmp/check-$name -q > /tmp/check-$name.md 2> /tmp/check-$name.err
  echo "check $name exit $?"; grep -E "^error|check [a-z]+:" /tmp/check-$name.err
  cp /tmp/check-$name/report.md "$OUT/check-$name.report.md" 2>/dev/null
done
python3 -m exporter verify /tmp/check-good; echo "verify exit $?"
