"""The program proof's parts on their own: the float64 reference with its casts promoted, the float64 twin of a
program, and the rounding check's stated power."""

from __future__ import annotations

import math

import pytest
import torch

from exporter.numerics.program64 import PROGRAM_BAR, detached, promote_graph, run_twin
from exporter.numerics.promote import PromoteCasts
from exporter.numerics.tolerance import POWER, detectable_ratio, sampling_factor, widened


class Softmax32(torch.nn.Module):
    """Attention written as transformers' eager attention does: the softmax taken in float32, cast back."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        scores = self.proj(x) @ x.transpose(-1, -2) * 0.25
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        return (weights @ x).float().to(x.dtype) + x.to(torch.bfloat16).to(x.dtype) * 0


def test_a_float64_run_keeps_float64_where_the_model_names_float32():
    torch.manual_seed(0)
    model = Softmax32().double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    with torch.no_grad():
        written = model(x)
        with PromoteCasts():
            promoted = model(x)
        exact = (torch.softmax(model.proj(x) @ x.transpose(-1, -2) * 0.25, dim=-1) @ x)
    assert float((written - exact).abs().max()) > 1e-9  # float32 softmax (and the bf16 cast) as written
    assert float((promoted - exact).abs().max()) < 1e-13  # every cast promoted: float64 throughout


def test_the_twin_of_a_bfloat16_program_runs_in_float64_on_the_checkpoints_weights():
    torch.manual_seed(0)
    model = Softmax32()
    tensors = dict(model.state_dict())
    x = torch.randn(2, 8, 16)
    program = torch.export.export(model.to(torch.bfloat16), (x.to(torch.bfloat16),))
    reference_model = Softmax32()
    reference_model.load_state_dict(tensors)
    with torch.no_grad(), PromoteCasts():
        reference = [[reference_model.double()(x.double())]]
    copy = detached(program)
    proof, _ = run_twin(copy, tensors, "cpu", lambda m, a: [m(*a)], [[x]], reference, ("out",))
    assert proof.passed and proof.worst < 1e-13 and proof.by_name == 2 and not proof.kept, proof
    assert program.state_dict["proj.weight"].dtype == torch.bfloat16  # detached: the program itself untouched
    assert promote_graph(detached(program).graph_module.graph) > 0  # the program names bfloat16 and float32
    scaled = {**tensors, "proj.weight": tensors["proj.weight"] * 1.001}  # a program computing another function
    proof, _ = run_twin(detached(program), scaled, "cpu", lambda m, a: [m(*a)], [[x]], reference, ("out",))
    assert not proof.passed and proof.worst > 100 * PROGRAM_BAR


@pytest.mark.parametrize("k, n", [(2.0, 64), (3.0, 1024), (1.5, 16384)])
def test_the_stated_power_is_the_rate_at_which_the_rule_fails_that_ratio(k, n):
    """Draw the candidate's and eager's errors as the rule assumes (independent normal, the candidate's
    ``detectable_ratio`` times larger): the rule fails it in 95% of draws, and in far fewer at half that."""
    generator = torch.Generator().manual_seed(0)
    ratio = detectable_ratio(k, n)
    assert ratio > widened(k, n) > k and math.isclose(detectable_ratio(k, 10 ** 9), k, rel_tol=1e-3)

    def fail_rate(true_ratio: float) -> float:
        draws = 4000
        eager = torch.randn(draws, n, generator=generator, dtype=torch.float64).square().mean(1).sqrt()
        candidate = true_ratio * torch.randn(draws, n, generator=generator, dtype=torch.float64).square().mean(1).sqrt()
        return float((candidate > k * sampling_factor(n) * eager).double().mean())

    assert abs(fail_rate(ratio) - POWER) < 0.02
    assert fail_rate(1.0) < 0.01
