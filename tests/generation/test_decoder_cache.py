"""``DecoderStep`` over the static cache: a left-padded row generates what its unpadded prompt does, finite."""

from __future__ import annotations

import torch

from exporter.generation.bench import weight_bytes
from exporter.generation.cache import DecoderStep, probe_layout
from exporter.generation.driver import Prompt, Steps, generate
from exporter.generation.reference import reference_generation
from exporter.modelio import attention_implementation


def test_left_padding_gives_the_unpadded_rows_logits(tiny_models):
    """A left-padded row (its padded queries see nothing) generates what its unpadded prompt does, finite."""
    from exporter.checkpoint import load_model

    loaded = load_model(tiny_models["llama"])
    model = loaded.model.eval()
    with attention_implementation(model, "sdpa"):
        step = DecoderStep(model, True)
        layout = probe_layout(model, True, "cpu")
        steps = Steps(step, step, layout, 32, torch.float32, "cpu")
        ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :7] = 0  # seven pad tokens: five real ones
        ids[1, :7] = 0
        padded, logits = generate(steps, Prompt(ids, mask), 4)
        alone, alone_logits = generate(steps, Prompt(ids[1:, 7:], mask[1:, 7:]), 4)
    assert all(torch.isfinite(x).all() for x in logits)
    assert torch.equal(padded[1:], alone)
    for mine, theirs in zip(logits, alone_logits):
        torch.testing.assert_close(mine[1:], theirs, rtol=1e-4, atol=1e-4)
    with attention_implementation(model, "eager"):
        ref_tokens, _ = reference_generation(model, Prompt(ids, mask), 4, "cpu", True)
    assert torch.equal(ref_tokens, padded)


def test_eager_generate_is_timed_within_its_budget(tiny_models):
    """The eager baseline honours bench.max_seconds: a slow model gets fewer rounds (one at least)."""
    from exporter.checkpoint import load_model
    from exporter.generation.bench import time_eager_generate

    model = load_model(tiny_models["llama"]).model.eval()
    inputs = {"input_ids": torch.ones(1, 6, dtype=torch.long), "attention_mask": torch.ones(1, 6, dtype=torch.long),
              "pad_token_id": 0}
    assert time_eager_generate(model, inputs, 4, "cpu", rounds=3, max_seconds=1e-6)["rounds"] == 1
    timed = time_eager_generate(model, inputs, 4, "cpu", rounds=3)
    assert (timed["rounds"], timed["batch"], timed["prompt"]) == (3, 1, 6)


def test_weight_bytes_count_an_embedding_table_only_where_a_tied_head_reads_it():
    """A decode step gathers one row of an embedding table per token: an untied table is not bytes read, a tied
    one is (the head reads all of it), once."""
    import transformers

    def llama(tied: bool) -> torch.nn.Module:
        config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                          tie_word_embeddings=tied)
        return transformers.LlamaForCausalLM(config)

    untied, tied = llama(False), llama(True)
    table = 1000 * 32 * 4
    def everything(model: torch.nn.Module) -> int:  # parameters (each once) and buffers (rotary frequencies)
        return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    assert weight_bytes(untied) == everything(untied) - table  # head counted, table not
    assert weight_bytes(tied) == everything(tied)  # the shared table once
    assert weight_bytes(tied) == weight_bytes(untied)


def test_weight_bytes_leave_out_an_encoder_but_not_what_the_decoder_shares_with_it():
    """An encoder-decoder's decode step reads the decoder and the head, not the encoder; T5 ties the head to the
    embedding table both halves share, so that table still counts, once."""
    import transformers

    config = transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4, d_kv=8,
                                   vocab_size=500, tie_word_embeddings=True)
    model = transformers.T5ForConditionalGeneration(config)
    encoder = model.get_encoder()
    whole, decoding = weight_bytes(model), weight_bytes(model, encoder)
    encoder_only = sum(p.numel() * 4 for m in encoder.modules() if not isinstance(m, torch.nn.Embedding)
                       for p in m.parameters(recurse=False))  # its tables (tokens, position buckets) never counted
    assert decoding == whole - encoder_only
    assert decoding >= 500 * 32 * 4  # the shared table, read whole by the tied head
