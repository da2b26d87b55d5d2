"""``DecoderStep`` over the static cache: a left-padded row generates what its unpadded prompt does, finite."""

from __future__ import annotations

import torch

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
    prompt = Prompt(torch.ones(1, 6, dtype=torch.long), torch.ones(1, 6, dtype=torch.long))
    assert time_eager_generate(model, prompt, 4, "cpu", rounds=3, max_seconds=1e-6)["rounds"] == 1
    assert time_eager_generate(model, prompt, 4, "cpu", rounds=3)["rounds"] == 3
