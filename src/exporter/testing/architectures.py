"""Tiny random-weight models of the transformers architectures teams ship, for the coverage table.

Each :class:`Arch` builds its model from a config (two layers, hidden size 64 or so, random weights: no model
hub) and names the task exporter converts it for and the task ``optimum-cli export onnx`` is given for the same
folder. ``scripts/architecture_coverage.py`` converts every one of them and writes ``docs/architectures.md``;
``tests/test_architectures.py`` runs the exported-program part for every row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
VOCAB = 512


@dataclass(frozen=True)
class Arch:
    name: str  # the row's name
    kind: str  # encoder | decoder | encoder-decoder | vision | audio
    build: Callable[[], Any]  # a transformers model with random weights, eager attention
    optimum_task: str  # what optimum-cli export onnx is asked for
    generation: str | None = None  # exporter's generation task where the architecture has one

    def save(self, folder: Path, seed: int = 0) -> Path:
        torch.manual_seed(seed)
        model = self.build().eval()
        model.save_pretrained(folder)
        return folder


def _tf():
    import transformers

    return transformers


def _eager(config):
    config._attn_implementation = "eager"
    return config


def _text(config_cls: str, model_cls: str, **kwargs) -> Callable[[], Any]:
    def build():
        tf = _tf()
        config = getattr(tf, config_cls)(**kwargs)
        return getattr(tf, model_cls)(_eager(config))

    return build


TOKENS = dict(bos_token_id=1, eos_token_id=2)  # inside the tiny vocabulary (the configs' defaults are not)
DECODER = dict(SMALL, vocab_size=VOCAB, max_position_embeddings=256, num_key_value_heads=2, **TOKENS)


def _decoders() -> list[Arch]:
    rows = [
        ("llama", "LlamaConfig", "LlamaForCausalLM", DECODER),
        ("mistral", "MistralConfig", "MistralForCausalLM", DECODER),
        ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", DECODER),
        ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(DECODER, head_dim=16)),
        ("gemma", "GemmaConfig", "GemmaForCausalLM", dict(DECODER, head_dim=16)),
        ("gemma2", "Gemma2Config", "Gemma2ForCausalLM", dict(DECODER, head_dim=16, sliding_window=64)),
        ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", dict(DECODER, head_dim=16, sliding_window=64)),
        ("phi3", "Phi3Config", "Phi3ForCausalLM", dict(DECODER, pad_token_id=0)),
        ("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                        n_positions=256, **TOKENS)),
        ("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", dict(SMALL, vocab_size=VOCAB,
                                                                  max_position_embeddings=256)),
        ("gpt-j", "GPTJConfig", "GPTJForCausalLM", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                        n_positions=256, rotary_dim=8, **TOKENS)),
        ("opt", "OPTConfig", "OPTForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                    ffn_dim=128, word_embed_proj_dim=64, vocab_size=VOCAB,
                                                    max_position_embeddings=256, pad_token_id=0, **TOKENS)),
        ("falcon", "FalconConfig", "FalconForCausalLM", dict(hidden_size=64, num_hidden_layers=2,
                                                             num_attention_heads=4, vocab_size=VOCAB)),
        ("bloom", "BloomConfig", "BloomForCausalLM", dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB)),
        ("stablelm", "StableLmConfig", "StableLmForCausalLM", DECODER),
        ("mixtral", "MixtralConfig", "MixtralForCausalLM", dict(DECODER, num_local_experts=4,
                                                                num_experts_per_tok=2)),
        ("qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(DECODER, num_experts=4, num_experts_per_tok=2,
                                                                    moe_intermediate_size=64,
                                                                    shared_expert_intermediate_size=64)),
    ]
    return [Arch(name, "decoder", _text(config, model, **kwargs), "text-generation", "text-generation")
            for name, config, model, kwargs in rows]


def _encoders() -> list[Arch]:
    bert = dict(SMALL, vocab_size=VOCAB, max_position_embeddings=258)
    rows: list[tuple[str, str, str, dict[str, Any]]] = [
        ("bert", "BertConfig", "BertModel", bert),
        ("roberta", "RobertaConfig", "RobertaModel", dict(bert, pad_token_id=1)),
        ("xlm-roberta", "XLMRobertaConfig", "XLMRobertaModel", dict(bert, pad_token_id=1)),
        ("deberta-v2", "DebertaV2Config", "DebertaV2Model", dict(bert, relative_attention=True,
                                                                 position_buckets=32, pos_att_type=["p2c", "c2p"])),
        ("electra", "ElectraConfig", "ElectraModel", dict(bert, embedding_size=32)),
        ("albert", "AlbertConfig", "AlbertModel", dict(bert, embedding_size=32)),
        ("mpnet", "MPNetConfig", "MPNetModel", dict(bert, pad_token_id=1)),
        ("modernbert", "ModernBertConfig", "ModernBertModel", dict(SMALL, vocab_size=VOCAB,
                                                                   max_position_embeddings=256,
                                                                   global_attn_every_n_layers=2,
                                                                   local_attention=16, pad_token_id=0,
                                                                   cls_token_id=1, sep_token_id=2, **TOKENS)),
        ("distilbert", "DistilBertConfig", "DistilBertModel", dict(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                                                                   hidden_dim=128, max_position_embeddings=256)),
    ]
    return [Arch(name, "encoder", _text(config, model, **kwargs), "feature-extraction")
            for name, config, model, kwargs in rows]


def _seq2seq() -> list[Arch]:
    t5 = dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    bart: dict[str, Any] = dict(
                vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
                pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    rows: list[tuple[str, str, str, dict[str, Any]]] = [
        ("t5", "T5Config", "T5ForConditionalGeneration", t5),
        ("mt5", "MT5Config", "MT5ForConditionalGeneration", t5),
        ("bart", "BartConfig", "BartForConditionalGeneration", bart),
        ("pegasus", "PegasusConfig", "PegasusForConditionalGeneration", dict(bart, decoder_start_token_id=0,
                                                                             pad_token_id=0, eos_token_id=1)),
        ("marian", "MarianConfig", "MarianMTModel", dict(bart, decoder_start_token_id=VOCAB - 1,
                                                         pad_token_id=VOCAB - 1, eos_token_id=0)),
        ("whisper", "WhisperConfig", "WhisperForConditionalGeneration",
         dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
              max_source_positions=64, max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None)),
    ]
    tasks = {name: "automatic-speech-recognition" if name == "whisper" else "text2text-generation" for name, *_ in rows}
    return [Arch(name, "encoder-decoder", _text(config, model, **kwargs), tasks[name], tasks[name])
            for name, config, model, kwargs in rows]


def _vision() -> list[Arch]:
    vit = dict(SMALL, image_size=32, patch_size=8)
    rows: list[tuple[str, str, str, dict[str, Any]]] = [
        ("vit", "ViTConfig", "ViTModel", vit),
        ("deit", "DeiTConfig", "DeiTModel", vit),
        ("beit", "BeitConfig", "BeitModel", dict(vit, use_relative_position_bias=True)),
        ("dinov2", "Dinov2Config", "Dinov2Model", vit),
        ("swin", "SwinConfig", "SwinModel", dict(image_size=32, patch_size=4, embed_dim=32, depths=[1, 1],
                                                 num_heads=[2, 4], window_size=4)),
        ("convnext", "ConvNextConfig", "ConvNextModel", dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                                                             image_size=32)),
    ]
    arches = [Arch(name, "vision", _text(config, model, **kwargs), "feature-extraction")
              for name, config, model, kwargs in rows]
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=64)
    image = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                 patch_size=8)

    def clip():
        tf = _tf()
        return tf.CLIPModel(_eager(tf.CLIPConfig(text_config=dict(text, pad_token_id=1, bos_token_id=0,
                                                                  eos_token_id=2), vision_config=image,
                                                 projection_dim=32)))

    def siglip():
        tf = _tf()
        return tf.SiglipModel(_eager(tf.SiglipConfig(text_config=dict(text, **TOKENS), vision_config=image)))

    return arches + [Arch("clip", "vision", clip, "zero-shot-image-classification"),
                     Arch("siglip", "vision", siglip, "zero-shot-image-classification")]


def _audio() -> list[Arch]:
    audio = dict(SMALL, conv_dim=(32, 32), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
                 num_conv_pos_embedding_groups=4, vocab_size=32)
    return [Arch("wav2vec2", "audio", _text("Wav2Vec2Config", "Wav2Vec2Model", **audio), "feature-extraction"),
            Arch("hubert", "audio", _text("HubertConfig", "HubertModel", **audio), "feature-extraction")]


ARCHITECTURES: tuple[Arch, ...] = tuple(_encoders() + _decoders() + _seq2seq() + _vision() + _audio())


def by_name(name: str) -> Arch:
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise KeyError(f"no architecture {name!r}; known: {', '.join(a.name for a in ARCHITECTURES)}")


__all__ = ["Arch", "ARCHITECTURES", "by_name"]
