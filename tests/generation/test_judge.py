"""The generation verdict: the prefill's step alone, the decode steps pooled, each step still measured and the
failing ones named."""

from __future__ import annotations

import torch

from exporter.generation.judge import decode_bar, judge_steps, step_bars
from exporter.numerics.tolerance import widened

STEPS, BATCH, VOCAB = 8, 2, 256


def draw(sigmas: list[float], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A float64 reference and a float32 candidate whose step ``t`` is off by noise of rms ``sigmas[t]``."""
    generator = torch.Generator().manual_seed(seed)
    reference = torch.randn(STEPS, BATCH, VOCAB, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    noise = torch.randn(STEPS, BATCH, VOCAB, dtype=torch.float64, generator=generator)
    noise = noise / noise.pow(2).mean(dim=(1, 2), keepdim=True).sqrt()  # each step's rms exactly its sigma
    return reference, list((reference + noise * torch.tensor(sigmas, dtype=torch.float64)[:, None, None]).float())


def verdict(eager: list[float], candidate: list[float]) -> dict:
    reference, baseline = draw(eager, 1)
    bars = step_bars(reference, torch.stack(baseline), 2.0, 0.0, 0.0)
    _, logits = draw(candidate, 2)
    tokens = reference.argmax(-1).t()
    return judge_steps("candidate", reference, tokens, logits, None, bars, 2.0, 0.0)


def test_one_step_over_its_own_bar_passes_when_the_decode_steps_together_are_within():
    """Eager lucky at step 3 (half its usual error), the candidate unlucky there (1.5x): 3x eager's at that step,
    1.1x over the decode steps; a position's rounding, not a defect."""
    eager = [1e-4] * STEPS
    eager[3] = 0.5e-4
    candidate = [1e-4] * STEPS
    candidate[3] = 1.5e-4
    result = verdict(eager, candidate)
    assert result["passed"], result["failures"]
    assert result["steps"][3]["over_step_bar"] and result["steps"][3]["passed"]
    assert result["decode"]["passed"] and result["decode"]["steps"] == STEPS - 1
    assert result["worst_ratio"] < 1


def test_a_defect_from_one_decode_step_on_fails_and_is_named_by_its_first_step():
    result = verdict([1e-4] * STEPS, [1e-4] * 3 + [5e-3] * (STEPS - 3))
    assert not result["passed"]
    assert [s["passed"] for s in result["steps"]] == [True, True, True] + [False] * (STEPS - 3)
    assert result["failures"][0].startswith(f"logits, decode steps 1-{STEPS - 1}: rmse")
    assert not result["decode"]["passed"]


def test_a_pool_that_fails_with_no_step_over_its_own_bar_names_its_worst_step():
    """Every decode step 2.2x eager's: each within its own bar (2 x s(512) = 2.36), together over the pool's
    (2 x s(3584) = 2.13)."""
    candidate = [2.2e-4] * STEPS
    candidate[5] = 2.3e-4
    result = verdict([1e-4] * STEPS, candidate)
    assert not result["passed"]
    assert not any(s["over_step_bar"] for s in result["steps"])
    assert [s["step"] for s in result["steps"] if not s["passed"]] == [5]


def test_the_prefill_is_judged_alone():
    candidate = [1e-4] * STEPS
    candidate[0] = 1e-2
    result = verdict([1e-4] * STEPS, candidate)
    assert not result["passed"] and not result["steps"][0]["passed"]
    assert result["decode"]["passed"] and all(s["passed"] for s in result["steps"][1:])


def test_the_pooled_bar_is_the_steps_bars_pooled():
    """From the stored per-step bars alone (what verify has): eager's rms over the steps and the floors' rms."""
    bars = [{"allowed_rmse": widened(2.0, 512) * b + f, "baseline_rmse": b} for b, f in ((1.0, 0.3), (3.0, 0.4))]
    pooled = decode_bar(bars, 2.0, 0.0, 512)
    assert abs(pooled["baseline_rmse"] - 5.0 ** 0.5) < 1e-12
    assert abs(pooled["allowed_rmse"] - (widened(2.0, 1024) * 5.0 ** 0.5 + 0.125 ** 0.5)) < 1e-12
    assert widened(2.0, 1024) < widened(2.0, 512)  # more values, a closer bar
