"""The program proof's parts on their own: the float64 reference with its casts promoted, the float64 twin of a
program, and the rounding check's stated power."""

from __future__ import annotations

import math

import pytest
import torch

from exporter.numerics import program64
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


class HeadsViewed(torch.nn.Module):
    """Attention as transformers writes it: SDPA, then the heads transposed back and *viewed* as one row, which
    only the fused kernels' output layout allows without a copy."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).view(b, s, 16)


def test_the_twin_runs_where_float64_attention_lays_its_output_out_otherwise(monkeypatch):
    """On CUDA a bfloat16 program is traced with flash attention, whose output, its heads transposed back, views
    as one row; in float64 SDPA takes the math kernel, whose output does not (GPT-2 and Llama on an H100: the
    program proof was "not run"). The twin reshapes where the traced graph viewed; here the math kernel is
    forced on the CPU, where float64 would otherwise take the CPU's flash kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = HeadsViewed()
    tensors = dict(model.state_dict())
    x = torch.randn(2, 8, 16)
    program = torch.export.export(model.to(torch.bfloat16), (x.to(torch.bfloat16),))
    assert any(n.target == torch.ops.aten.view.default for n in program.graph.nodes)
    reference_model = HeadsViewed()
    reference_model.load_state_dict(tensors)
    with torch.no_grad():
        reference = [[reference_model.double()(x.double())]]
    with sdpa_kernel(SDPBackend.MATH):
        proof, _ = run_twin(detached(program), tensors, "cpu", lambda m, a: [m(*a)], [[x]], reference, ("out",))
        assert proof.passed and proof.worst < 1e-13, proof
        monkeypatch.setattr(program64, "relax_views", lambda graph: 0)  # the graph's views as traced
        with pytest.raises(RuntimeError, match="view size"):
            run_twin(detached(program), tensors, "cpu", lambda m, a: [m(*a)], [[x]], reference, ("out",))
