"""transformers_interface: transformers models loaded with eager attention switch to SDPA through the library's
attention interface, and the graph rule does not trace them again."""

from __future__ import annotations

import pytest
import torch

from exporter.modelio import Signature, make_io_module
from exporter.rewrite import ALREADY_SDPA, REWRITTEN, graph_rule, rewrite_attention, transformers_interface
from exporter.rewrite.graph_facts import count_graph_ops
from exporter.rewrite.transformers_masks import trivial_masks_skipped
from exporter.testing import attention_zoo as zoo

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def no_tracing(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the graph rule traced a transformers model the interface rule had rewritten")

    monkeypatch.setattr(graph_rule, "capture", refuse)


def tiny_gpt2():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)).eval()
    return make_io_module(model, Signature(("input_ids", "attention_mask"), ("last_hidden_state",)), "eager")


def tokens(batch, seq):
    ids = torch.randint(0, 1000, (batch, seq), generator=torch.Generator().manual_seed(seq))
    mask = torch.ones_like(ids)
    mask[-1, seq - 3:] = 0
    return [ids, mask]


def test_transformers_model_is_rewritten_once_through_the_interface():
    io = tiny_gpt2()
    module, audit = rewrite_attention(io, tokens(2, 32))
    assert audit.count(REWRITTEN) == 2 and audit.count(ALREADY_SDPA) == 0  # SDPA calls are not listed twice
    assert [s.location for s in audit.sites] == ["h.0.attn", "h.1.attn"]
    assert all(s.rule == transformers_interface.RULE and s.causal for s in audit.sites)
    program = zoo.export_named(module, tokens(2, 32), ("input_ids", "attention_mask"))
    ops = count_graph_ops(program.graph)
    assert ops["sdpa"] == 2 and ops["softmax"] == 0
    other = tokens(3, 17)
    with torch.inference_mode():
        assert torch.allclose(io(*other)[0], program.module()(*other)[0], atol=1e-5)


def test_interface_rule_does_not_apply_to_other_models():
    io = zoo.io_module(zoo.build(zoo.BY_NAME["matmul_div"]))
    assert not transformers_interface.applies(io)


def _sdpa_masks(program) -> list[bool]:
    return [len(n.args) > 3 or n.kwargs.get("attn_mask") is not None for n in program.graph.nodes
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]


def test_an_encoder_without_padding_exports_its_attention_without_a_mask():
    """transformers builds an all-true [batch, 1, S, S] mask when traced (ViT has no padding mask); no fused
    GPU backend takes it, so the rewrite keeps transformers' eager-mode rule: nothing masked, no mask."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    vit = transformers.ViTModel(transformers.ViTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                                       intermediate_size=128, image_size=32, patch_size=8)).eval()
    io = make_io_module(vit, Signature(("pixel_values",), ("last_hidden_state",)), "eager")
    images = torch.randn(2, 3, 32, 32)
    module, audit = rewrite_attention(io, [images])
    assert audit.count(REWRITTEN) == 2
    dynamic = ({0: torch.export.Dim.DYNAMIC},)
    untouched = torch.export.export(module, (images,), dynamic_shapes=dynamic, strict=False)
    assert _sdpa_masks(untouched) == [True, True]  # transformers' own behaviour under export, outside the block
    with trivial_masks_skipped(), trivial_masks_skipped():
        program = torch.export.export(module, (images,), dynamic_shapes=dynamic, strict=False)
    assert _sdpa_masks(program) == [False, False]
    again = torch.export.export(module, (images,), dynamic_shapes=dynamic, strict=False)
    assert _sdpa_masks(again) == [True, True]  # restored after the (nested) blocks
    other = torch.randn(3, 3, 32, 32)
    with torch.inference_mode():
        torch.testing.assert_close(program.module()(other)[0], io(other)[0], atol=1e-5, rtol=1e-5)


def test_a_padding_mask_is_still_passed_to_the_attention():
    module, _ = rewrite_attention(tiny_gpt2(), tokens(2, 32))
    with trivial_masks_skipped():
        program = zoo.export_named(module, tokens(2, 32), ("input_ids", "attention_mask"))
    assert _sdpa_masks(program) == [True, True]


def _sdpa_calls(program) -> list[tuple]:
    return [(n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask"),
             n.args[5] if len(n.args) > 5 else n.kwargs.get("is_causal", False), n.kwargs.get("enable_gqa", False))
            for n in program.graph.nodes
            if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]


def test_a_decoder_without_a_padding_mask_exports_the_causal_kernel():
    """No attention_mask input: SDPA gets is_causal=True and grouped K/V, not a materialised causal mask over
    expanded heads (and transformers is told the model's own positions hold one sequence per row)."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, max_position_embeddings=512)).eval()
    io = make_io_module(llama, Signature(("input_ids",), ("logits",)), "eager")
    ids = torch.randint(0, 100, (2, 32))
    module, _ = rewrite_attention(io, [ids])
    dims = ({0: torch.export.Dim("batch", min=1, max=8), 1: torch.export.Dim("sequence", min=1, max=256)},)
    untouched = torch.export.export(module, (ids,), dynamic_shapes=dims, strict=False)
    assert all(mask is not None for mask, _, _ in _sdpa_calls(untouched))  # transformers' own behaviour
    with trivial_masks_skipped(positions_from_model=True):
        program = torch.export.export(module, (ids,), dynamic_shapes=dims, strict=False)
    assert _sdpa_calls(program) == [(None, True, True)] * 2
    for batch, seq in ((3, 17), (1, 100), (2, 1)):
        other = torch.randint(0, 100, (batch, seq))
        with torch.inference_mode():
            torch.testing.assert_close(program.module()(other)[0], io(other)[0], atol=1e-5, rtol=1e-5)
    with trivial_masks_skipped(positions_from_model=False):  # position_ids an input: they may pack sequences
        packed = torch.export.export(module, (ids,), dynamic_shapes=dims, strict=False)
    assert all(mask is not None for mask, _, _ in _sdpa_calls(packed))
