"""Plant a real defect in the attention path, convert, and show that the gate fails and names the module.

    python benchmarks/planted_defect.py OUT_DIR [--recipe h100-bf16] [--defect wrong-scale|dropped-mask|transposed-k]
                                             [--model llama|gpt2|bert] [--size tiny|medium] [--target NAME ...]

The defect goes where exporter's rewrite sends attention: transformers' "sdpa" attention function, replaced
through the library's public AttentionInterface (wrong-scale: layer 1 uses softmax scale 1 instead of
head_dim ** -0.5; dropped-mask: the padding mask is ignored; transposed-k: heads and positions of K mixed).
The float64 reference runs the original eager attention, so only the candidates carry the defect.

Writes OUT_DIR/run (the output folder), and OUT_DIR/report.md, report.json, verify.txt and verify.xml
(``exporter verify`` of the folder: it must fail with the numerics code the report recorded). Exits with
convert's exit code (3 expected). On the GPU machine: ``python benchmarks/planted_defect.py /tmp/planted``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path


def defects():
    def wrong_scale(module, q, k, v, mask, kwargs):
        if getattr(module, "layer_idx", None) == 1:
            kwargs = {**kwargs, "scaling": 1.0}
        return q, k, v, mask, kwargs

    def dropped_mask(module, q, k, v, mask, kwargs):
        return q, k, v, None, kwargs

    def transposed_k(module, q, k, v, mask, kwargs):
        return q, k.transpose(1, 2).reshape(k.shape), v, mask, kwargs

    return {"wrong-scale": wrong_scale, "dropped-mask": dropped_mask, "transposed-k": transposed_k}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--recipe", default="h100-bf16")
    parser.add_argument("--defect", default="wrong-scale", choices=sorted(defects()))
    parser.add_argument("--model", default="llama", choices=["llama", "gpt2", "bert"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "medium"])
    parser.add_argument("--target", action="append", default=[], help="build only this target (repeatable)")
    args = parser.parse_args()

    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import exporter
    from exporter.progress import Progress
    from exporter.testing import random_models

    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / f"{args.model}-{args.size}"
    if not model_dir.exists():
        random_models.build(args.model, random_models.SIZES[args.size]).save_pretrained(model_dir)
    defect = defects()[args.defect]

    def attention(module, query, key, value, attention_mask, *rest, **kwargs):
        query, key, value, attention_mask, kwargs = defect(module, query, key, value, attention_mask, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *rest, **kwargs)

    AttentionInterface.register("sdpa", attention)
    run = args.out / "run"
    result = exporter.convert(model_dir, args.recipe, run, overwrite=True, progress=Progress(),
                              targets=tuple(args.target))
    AttentionInterface.register("sdpa", sdpa_attention_forward)
    for name in ("report.md", "report.json"):
        shutil.copy(run / name, args.out / name)
    verify = subprocess.run([sys.executable, "-m", "exporter", "verify", str(run), "--junit",
                             str(args.out / "verify.xml")], capture_output=True, text=True)
    (args.out / "verify.txt").write_text(f"$ exporter verify {run}\n{verify.stdout}{verify.stderr}"
                                         f"exit code {verify.returncode}\n")
    print(f"convert exit code {result.exit_code}; verify exit code {verify.returncode}")
    for variant in [result.report["rewritten"]] + result.report["artifacts"]:
        located = (variant.get("numerics") or {}).get("locate")
        print(f"{variant['name']}: {variant['status']}" + (f" — {located['summary']}" if located else ""))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
