"""Write transformers models with random weights as safetensors + config.json (no model hub needed).

    python -m exporter.testing.random_models OUT_DIR [--size tiny|medium] [--only gpt2,llama,vit,bert]

Used for GPU runs, probes and demos; the tests build their own tiny models in fixtures.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SIZES = {
    "tiny": dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=1000, image=32, patch=8),
    "medium": dict(layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096, vocab=32000, image=224, patch=16),
}


def build(name: str, s: dict):
    import transformers as tf

    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"],
                                                vocab_size=s["vocab"], n_positions=4096, bos_token_id=0,
                                                eos_token_id=0))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"],
                                                  num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                                                  intermediate_size=s["ffn"], vocab_size=s["vocab"],
                                                  max_position_embeddings=4096))
    if name == "vit":
        return tf.ViTModel(tf.ViTConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"],
                                        num_attention_heads=s["heads"], intermediate_size=s["ffn"],
                                        image_size=s["image"], patch_size=s["patch"]))
    if name == "bert":
        return tf.BertModel(tf.BertConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"],
                                          num_attention_heads=s["heads"], intermediate_size=s["ffn"],
                                          vocab_size=s["vocab"]))
    raise ValueError(f"unknown model {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--only", default="gpt2,llama,vit,bert")
    args = parser.parse_args()
    torch.manual_seed(0)
    for name in args.only.split(","):
        model = build(name, SIZES[args.size])
        folder = args.out / f"{name}-{args.size}"
        model.save_pretrained(folder)
        print(folder)


if __name__ == "__main__":
    main()
