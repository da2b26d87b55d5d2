"""The weights proof (``numerics/weights.py``): every constant an artifact carries traced to the checkpoint tensor
it came from and compared bit for bit after the declared cast.

Real artifacts: programs ``torch.export`` saved (read back as data by ``targets/program_file.py``) and ONNX models
torch's TorchScript exporter wrote (a Linear's weight stored transposed under an ``onnx::MatMul_N`` name, as
Optimum's exports have it). The proof is exact, so its power does not depend on what the weights mean: a change
of one part in a million of one tensor fails it, in float32 and in bfloat16 alike, where the outputs' bar cannot
see it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from exporter.check.constants import onnx_constants
from exporter.numerics.weights import prove_weights
from exporter.targets.program_file import read_constants


class Block(nn.Module):
    """Embedding, a LayerNorm, a two-layer MLP and a head tied to the embedding."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        return self.head(x + self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


def made(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    model = Block().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)  # a LayerNorm weight that is not all ones
    return model


IDS = torch.randint(0, 64, (2, 8))


def saved_program(model: nn.Module, path) -> dict[str, torch.Tensor]:
    torch.export.save(torch.export.export(model, (IDS,)), str(path))
    return read_constants(path)


def onnx_export(model: nn.Module, path) -> dict[str, torch.Tensor]:
    torch.onnx.export(model, (IDS,), str(path), input_names=["ids"], output_names=["logits"], dynamo=False,
                      opset_version=18)
    return onnx_constants(path)


def planted(model: Block, defect: str) -> Block:
    """A copy of ``model`` with one of the issue's weight defects."""
    bad = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        if defect == "noise":  # 0.5% noise on one Linear
            bad.up.weight += 0.005 * bad.up.weight.std() * torch.randn(bad.up.weight.shape, generator=generator)
        elif defect == "layernorm":  # one LayerNorm weight x 1.01
            bad.norm.weight *= 1.01
        elif defect == "stale":  # one tensor from an earlier training step
            bad.down.weight -= 1e-3 * torch.randn(bad.down.weight.shape, generator=generator)
        elif defect == "one_part_in_a_million":
            bad.down.weight[0, 0] *= 1 + 1e-6
    return bad


def test_a_clean_program_traces_every_constant_by_name(tmp_path):
    model = made()
    proof = prove_weights(saved_program(model, tmp_path / "m.pt2"), dict(model.state_dict()))
    assert proof.passed and proof.by_name == proof.constants and not proof.untraced and not proof.not_found


@pytest.mark.parametrize("defect, weight", [("noise", "up.weight"), ("layernorm", "norm.weight"),
                                            ("stale", "down.weight"), ("one_part_in_a_million", "down.weight")])
def test_a_changed_weight_fails_by_name_with_its_difference(defect, weight, tmp_path):
    model = made()
    proof = prove_weights(saved_program(planted(model, defect), tmp_path / "m.pt2"), dict(model.state_dict()))
    assert not proof.passed and [c.weight for c in proof.changed] == [weight]
    assert proof.changed[0].max_abs > 0 and f"weight {weight} differs from the checkpoint's" in proof.summary()


def test_an_onnx_export_is_traced_through_its_transposed_weights(tmp_path):
    model = made()
    constants = onnx_export(model, tmp_path / "m.onnx")
    assert any(name.startswith("onnx::") for name in constants), sorted(constants)  # W^T under a graph name
    proof = prove_weights(constants, dict(model.state_dict()))
    assert proof.passed and proof.by_content >= 2 and not proof.untraced, proof.to_dict()
    bad = prove_weights(onnx_export(planted(model, "noise"), tmp_path / "bad.onnx"), dict(model.state_dict()))
    (changed,) = bad.changed
    assert (changed.weight, changed.how) == ("up.weight", "transposed") and 0.001 < changed.rel_l2 < 0.01


def test_a_cast_is_the_declared_transform_and_a_defect_below_its_rounding_still_fails(tmp_path):
    """A bfloat16 artifact of a float32 checkpoint equals the checkpoint cast to bfloat16, bit for bit; a
    defect far smaller than bfloat16's rounding still changes some of its values, and fails."""
    model = made()
    clean = saved_program(copy.deepcopy(model).to(torch.bfloat16), tmp_path / "bf16.pt2")
    assert all(t.dtype == torch.bfloat16 for t in clean.values() if t.is_floating_point())
    assert prove_weights(clean, dict(model.state_dict())).passed
    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.up.weight *= 1 + 2e-3  # under bf16's half-ulp (2^-9) for most values, not for all
    proof = prove_weights(saved_program(bad.to(torch.bfloat16), tmp_path / "bad.pt2"), dict(model.state_dict()))
    assert [c.weight for c in proof.changed] == ["up.weight"]


def test_an_artifact_of_another_model_traces_nothing(tmp_path):
    model, other = made(0), made(1)
    proof = prove_weights(saved_program(other, tmp_path / "m.pt2"), dict(model.state_dict()))
    assert not proof.passed and {c.weight for c in proof.changed} >= {"up.weight", "down.weight"}
