"""What the generation export stage costs on the CPU, and what the ONNX programs' own decomposition would add.

A tiny Llama (``--task text-generation``) and a tiny T5 (``text2text-generation``), the shapes the test suite
converts, exported as a convert exports them for cpu-fp32 (``Family.export``: the prefill and decode programs
decomposed to core ATen with SDPA kept, and the ONNX programs with the cache in and out, left as exported). Then
the ONNX programs decomposed to core ATen too, as they were before the ONNX exporter's own decomposition was left
as their only one: that time is what each generation convert with ONNX no longer spends.

    PYTHONPATH=src python benchmarks/generation_export_time.py --rounds 3

prints each round and the medians, as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers

from exporter.generation.decoder import DECODER
from exporter.generation.encoder_decoder import ENCODER_DECODER
from exporter.recipe import load_recipe
from exporter.targets.exported_program import decomposition_table


def models() -> dict[str, tuple[torch.nn.Module, object]]:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=1000, max_position_embeddings=512, attn_implementation="sdpa"))
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, tie_word_embeddings=False, attn_implementation="sdpa"))
    return {"llama": (llama.eval(), DECODER), "t5": (t5.eval(), ENCODER_DECODER)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    recipe = load_recipe("cpu-fp32")
    rows: dict[str, dict[str, list[float]]] = {}
    for name, (model, family) in models().items():
        layout = family.probe(model, recipe, True)
        times = rows.setdefault(name, {"export": [], "onnx programs decomposed": []})
        for index in range(args.rounds):
            t0 = time.perf_counter()
            with torch.no_grad():
                programs = family.export(model, layout, recipe, True, past=True, one=False)
            export_s = time.perf_counter() - t0
            assert programs.past is not None, programs.past_error
            t0 = time.perf_counter()
            for program in programs.past:
                program.run_decompositions(decomposition_table())
            decompose_s = time.perf_counter() - t0
            times["export"].append(export_s)
            times["onnx programs decomposed"].append(decompose_s)
            print(f"{name} round {index + 1}: export {export_s:.2f} s; the ONNX programs decomposed to core ATen "
                  f"{decompose_s:.2f} s more", flush=True)
    medians = {name: {key: round(statistics.median(values), 2) for key, values in times.items()}
               for name, times in rows.items()}
    print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                      "threads": torch.get_num_threads(), "medians_s": medians}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
