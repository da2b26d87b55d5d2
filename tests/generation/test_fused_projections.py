"""generation.fuse_projections: the linears that read one tensor (q, k, v; gate, up) exported as one matrix
product. Found by what one forward call feeds them; the model computes the same outputs; the concatenated
weight is the only copy; the model is restored on exit; switched off, the generation programs keep every linear
as it is. The fused default (programs passing the gate with the reference's tokens, prefill and decode sharing the
fused weights) is pinned by tests/generation/."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import exporter
from exporter.generation.fused_projections import Projection, find_groups, fused_projections

transformers = pytest.importorskip("transformers")


def tiny_llama(tie: bool = True):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(config).eval()


def test_groups_are_q_k_v_and_gate_up_of_each_layer_and_outputs_are_unchanged():
    model = tiny_llama()
    ids = torch.randint(0, 300, (2, 7))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        expected = model(ids).logits
    with fused_projections(model, lambda: model(ids)) as groups:
        found = sorted(tuple(g.names) for g in groups)
        assert found == sorted([tuple(f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv") for i in range(2)]
                               + [(f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj")
                                  for i in range(2)])
        assert isinstance(model.model.layers[0].self_attn.k_proj, Projection)
        # the concatenated weight is a parameter once (owned by the group's first member)
        fused = [n for n, _ in model.named_parameters() if "fused" in n]
        assert len(fused) == 4 and all(n.endswith(("q_proj.fused.weight", "gate_proj.fused.weight")) for n in fused)
        with torch.no_grad():
            inside = model(ids).logits
        torch.testing.assert_close(inside, expected, rtol=1e-5, atol=1e-5)
    assert isinstance(model.model.layers[0].self_attn.k_proj, nn.Linear)  # restored
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]), name
    # no second copy: each restored linear's weight is a view into its group's concatenated weight
    q, k = model.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.k_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()


def test_a_tied_or_repeated_linear_is_never_fused():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
            self.c.weight = nn.Parameter(self.c.weight)  # c reads x too, but is called twice
            self.d = nn.Linear(8, 8)
            self.e = nn.Linear(8, 8)
            self.e.weight = self.d.weight  # d and e read x, but share their weight

        def forward(self, x):
            return self.a(x) + self.b(x), self.c(x) + self.c(x), self.d(x) + self.e(x)

    model = Shared()
    groups = find_groups(model, lambda: model(torch.randn(3, 8)))
    assert [g.names for g in groups] == [["a", "b"]]


def test_fusion_off_exports_the_linears_as_they_are(tmp_path):
    """generation.fuse_projections=false: every linear keeps its own weight and the gate still passes (the fused
    default is pinned by tests/generation/)."""
    folder = tmp_path / "llama"
    tiny_llama().save_pretrained(folder)
    result = exporter.convert(folder, "cpu-fp32", tmp_path / "out", task="text-generation",
                              targets=("exported_program",), settings=("generation.fuse_projections=false",))
    assert result.exit_code == 0 and result.report["passed"], result.report["problems"]
    entry = result.report["artifacts"][0]
    assert entry["numerics"]["tokens_identical"] and entry["fused_projections"] == []
    decode = torch.export.load(str(result.out / "decode.pt2"))
    weights = [s.target for s in decode.graph_signature.input_specs if s.kind.name == "PARAMETER"]
    assert sum(name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for name in weights) == 6
    assert not any(name.endswith("fused.weight") for name in weights)


def test_fp8_weight_only_linears_fuse_only_when_asked_and_keep_one_copy():
    """Weight-only fp8 linears (the decode program of batch 1 asks for them): their fp8 weights and per-row scales
    are concatenated, the group computes one fp8 product, each member's output is unchanged, and on exit each
    member's fp8 weight and scales are views of the concatenated ones."""
    from exporter.quantize.fp8 import Fp8Linear
    from exporter.quantize.transform import quantize_model

    model = tiny_llama().to(torch.bfloat16)
    quantize_model(model, "fp8-weight-only", keep_originals=False)
    ids = torch.randint(0, 300, (1, 5))
    with torch.no_grad():
        expected = model(ids).logits
    with fused_projections(model, lambda: model(ids)) as groups:
        assert groups == []  # nn.Linear only by default: the fp8 linears stay apart
    with fused_projections(model, lambda: model(ids), (nn.Linear, Fp8Linear)) as groups:
        assert sorted(len(g.names) for g in groups) == [2, 2, 3, 3]
        fused = model.model.layers[0].self_attn.q_proj.fused.fp8
        assert isinstance(fused, Fp8Linear) and tuple(fused.qweight.shape) == (64 + 2 * 32, 64)
        with torch.no_grad():
            inside = model(ids).logits
        assert torch.equal(inside, expected)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.k_proj, Fp8Linear)  # restored
    def storage(t):
        return t.untyped_storage().data_ptr()

    assert storage(attention.q_proj.qweight) == storage(attention.v_proj.qweight)
    assert storage(attention.q_proj.scales) == storage(attention.k_proj.scales)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
