"""Which proofs convert's exported program gets on the GPU, for small transformers decoders (random weights).

    PYTHONPATH=src python3 benchmarks/gpu_program_proof.py gpt2 llama     # writes $OUT/program-proof.json

Each model is built from its config, converted with ``h100-bf16`` (the exported program only, a short benchmark),
and each proof's verdict and summary printed: a proof that was not run says so and why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import transformers

import exporter
from exporter.recipe import load_recipe

MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=1024, bos_token_id=0, eos_token_id=0)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=128, max_position_embeddings=4096)),
}


def main(names: list[str]) -> int:
    recipe = load_recipe("h100-bf16")
    recipe = dataclasses.replace(recipe, bench=dataclasses.replace(recipe.bench, warmup=1, rounds=1, iterations=2),
                                 targets=dataclasses.replace(recipe.targets, build=("exported_program",)))
    found = {"gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
             "torch": torch.__version__, "transformers": transformers.__version__, "models": {}}
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            torch.manual_seed(0)
            MODELS[name]().save_pretrained(Path(work) / name)
            result = exporter.convert(Path(work) / name, recipe, Path(work) / f"{name}-out")
            entry = next(a for a in result.report["artifacts"] if a["name"] == "exported_program")
            proofs = {k: {"passed": (v or {}).get("passed"), "summary": (v or {}).get("summary")}
                      for k, v in (entry.get("proofs") or {}).items()}
            found["models"][name] = {"exit_code": result.exit_code, "status": entry["status"], "proofs": proofs}
            for proof, verdict in proofs.items():
                print(f"{name} {proof}: {verdict['passed']}: {verdict['summary']}")
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "program-proof.json").write_text(json.dumps(found, indent=1))
    ran = all(m["proofs"].get("program", {}).get("passed") is not None for m in found["models"].values())
    return 0 if ran else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or list(MODELS)))
