"""The tolerance policy: k times the eager model's own error at that precision, plus a floor."""

from __future__ import annotations

import math

import pytest
import torch

from exporter.numerics.tolerance import FALSE_FAILURE, check_output, judge, metrics, sampling_factor


def test_metrics_of_identical_and_scaled():
    ref = torch.randn(100, dtype=torch.float64)
    same = metrics(ref, ref.clone())
    assert same["max_abs"] == 0 and same["rmse"] == 0 and math.isclose(same["cosine"], 1.0)
    half = metrics(ref, ref * 0.5)
    assert math.isclose(half["rel_l2"], 0.5, rel_tol=1e-9)
    assert math.isclose(half["max_rel"], 0.5, rel_tol=1e-9)


def test_rule_passes_float32_rounding_and_fails_a_real_error():
    torch.manual_seed(0)
    ref = torch.randn(64, 64, dtype=torch.float64)
    eager = ref.float()  # the eager model's own error: float32 rounding
    fine = (ref + 1e-8 * torch.randn_like(ref)).float()
    broken = (ref + 1e-3 * torch.randn_like(ref)).float()
    assert check_output("y", 0, ref, eager, fine, k=2.0, atol=1e-6).passed
    bad = check_output("y", 0, ref, eager, broken, k=2.0, atol=1e-6)
    assert not bad.passed and "rmse" in bad.reason


def test_scale_of_the_bar_follows_the_baseline():
    """A bf16 candidate as wrong as the bf16 eager model passes; the same error against a float32 bar fails."""
    torch.manual_seed(1)
    ref = torch.randn(256, dtype=torch.float64)
    bf16 = ref.to(torch.bfloat16)
    assert check_output("y", 0, ref, bf16, bf16, k=3.0, atol=0.0).passed
    assert not check_output("y", 0, ref, ref.float(), bf16, k=3.0, atol=0.0).passed


def test_nan_always_fails_and_shape_mismatch_fails():
    ref = torch.ones(4, dtype=torch.float64)
    cand = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    result = check_output("y", 0, ref, ref.float(), cand, k=1e9, atol=1e9)
    assert not result.passed and "NaN" in result.reason
    assert not check_output("y", 0, ref, ref, torch.ones(5), k=2, atol=1).passed


def test_integer_outputs_must_match_exactly():
    ref = torch.tensor([1, 2, 3])
    assert check_output("ids", 0, ref, ref, ref.clone(), 2, 0).passed
    assert not check_output("ids", 0, ref, ref, torch.tensor([1, 2, 4]), 2, 0).passed


def test_judge_keeps_worst_sample_and_all_failures():
    ref = [[torch.zeros(4, dtype=torch.float64)], [torch.zeros(4, dtype=torch.float64)]]
    base = [[torch.zeros(4)], [torch.zeros(4)]]
    cand = [[torch.full((4,), 1e-7)], [torch.full((4,), 1.0)]]
    verdict = judge("onnx", ("y",), ref, base, cand, k=2.0, atol=1e-5, baseline_label="eager")
    assert not verdict.passed
    assert verdict.worst[0].sample == 1
    assert [f.sample for f in verdict.failures] == [1]
    assert verdict.to_dict()["failures"][0]["output"] == "y"


def _judged(name: str, passed: bool, replays: str | None = None):
    from exporter.results import NUMERICS_FAILED, CandidateNumerics, VariantResult

    result = VariantResult("aoti", name, replays=replays)
    result.numerics = CandidateNumerics(name, passed, 5.0, 0.0, "eager (cuda, bfloat16)",
                                        grid={"checked": True, "passed": passed, "points": []},
                                        locate=None if passed else {"module": "model.layers.1.self_attn"})
    if not passed:
        result.fail(NUMERICS_FAILED, "grid point sequence=512: rmse over the bar")
    return result


def test_a_variant_replaying_a_failed_artifact_fails_with_it():
    """aoti:cuda-graph is judged at the samples only; the package it replays failed on the grid: it fails too,
    with the package's localisation, and a replay of a package that passed keeps its own verdict."""
    from exporter.numerics.validation import inherit_verdicts
    from exporter.results import NUMERICS_FAILED, OK

    package, graphed = _judged("aoti", False), _judged("aoti:cuda-graph", True, replays="aoti")
    graphed.numerics.grid = {"checked": False, "passed": True, "points": []}
    inherit_verdicts([package, graphed])
    assert graphed.status == NUMERICS_FAILED and "runs the aoti artifact" in graphed.error
    assert graphed.numerics.passed is False
    assert graphed.numerics.locate == {"module": "model.layers.1.self_attn"}
    assert graphed.numerics.grid["passed"] is False

    package, graphed = _judged("aoti", True), _judged("aoti:cuda-graph", True, replays="aoti")
    inherit_verdicts([package, graphed])
    assert graphed.status == OK and graphed.numerics.passed

    # failed on its own (the program proof of the package it replays, seen on the GPU) and not localised: the
    # package's localisation is its own too; its own error stays
    package, graphed = _judged("aoti", False), _judged("aoti:cuda-graph", True, replays="aoti")
    graphed.fail(NUMERICS_FAILED, "the program computed in float64 computes another function")
    inherit_verdicts([package, graphed])
    assert graphed.error == "the program computed in float64 computes another function"
    assert graphed.numerics.locate == {"module": "model.layers.1.self_attn"}


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64, 1000, 4000, 4001, 10**6])
def test_the_sampling_factor_is_the_f_distributions_quantile(n):
    stats = pytest.importorskip("scipy.stats")
    expected = stats.f.ppf(1 - FALSE_FAILURE, n, n) ** 0.5
    assert math.isclose(sampling_factor(n), expected, rel_tol=1e-4)


@pytest.mark.parametrize("n", [1, 4])
def test_a_candidate_as_accurate_as_eager_on_a_tiny_output_passes(n):
    """On one or four values, two equally accurate models' errors differ by large factors by chance: k alone
    fails a third (n = 1) or a tenth (n = 4) of such candidates; k * s(n) fails about FALSE_FAILURE of them."""
    generator = torch.Generator().manual_seed(n)
    trials = 4000
    ref = torch.randn(trials, n, dtype=torch.float64, generator=generator)
    eager = ref + 1e-7 * torch.randn(trials, n, dtype=torch.float64, generator=generator)
    candidate = ref + 1e-7 * torch.randn(trials, n, dtype=torch.float64, generator=generator)
    failed = sum(not check_output("y", 0, r, e, c, k=2.0, atol=0.0).passed
                 for r, e, c in zip(ref, eager, candidate))
    plain = float((((candidate - ref).square().mean(1) > (2 * (eager - ref)).square().mean(1))).double().mean())
    assert plain > (0.25 if n == 1 else 0.08)  # what the rule without s(n) did
    assert failed <= 5  # FALSE_FAILURE * trials = 0.4 expected


def test_a_defect_on_a_large_output_still_fails():
    torch.manual_seed(0)
    ref = torch.randn(64, 64, dtype=torch.float64)
    eager = ref + 1e-7 * torch.randn_like(ref)
    assert sampling_factor(ref.numel()) < 1.06
    check = check_output("y", 0, ref, eager, ref + 2.5e-7 * torch.randn_like(ref), k=2.0, atol=0.0)
    assert not check.passed
    tiny = check_output("y", 0, ref[:1, :1], eager[:1, :1], ref[:1, :1] + 1.0, k=2.0, atol=0.0)
    assert not tiny.passed and "s(1)=6.37e+03" in tiny.reason  # a gross error on one value still fails
