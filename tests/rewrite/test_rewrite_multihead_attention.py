"""torch_multihead_attention: nn.MultiheadAttention asked for weights nobody uses takes PyTorch's own SDPA path;
nn.TransformerEncoderLayer/DecoderLayer are found as already SDPA; a caller that uses the weights is left alone.
Also: the pass that lets onnxruntime run the masks these modules make."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import torch.nn as nn

from exporter.rewrite import ALREADY_SDPA, REWRITTEN, SKIPPED, rewrite_attention, torch_multihead_attention
from exporter.rewrite.graph_facts import count_graph_ops
from exporter.rewrite.onnx_attention_masks import expand_attention_masks
from exporter.testing import attention_zoo as zoo


def rewrite(name):
    model = zoo.build(zoo.BY_NAME[name])
    io = zoo.io_module(model)
    module, audit = rewrite_attention(io, zoo.inputs())
    return model, io, module, audit


def test_multihead_attention_called_for_weights_takes_the_sdpa_path():
    model, io, module, audit = rewrite("mha")
    assert audit.count(REWRITTEN) == 2 and audit.found == 2
    assert [s.location for s in audit.sites] == ["layers.0.attn", "layers.1.attn"]
    assert all(s.rule == torch_multihead_attention.RULE and s.masked and s.head_dim == 8 for s in audit.sites)
    replaced = [m for m in module.modules() if isinstance(m, torch_multihead_attention.SDPAMultiheadAttention)]
    assert len(replaced) == 2
    assert not any(isinstance(m, torch_multihead_attention.SDPAMultiheadAttention) for m in model.modules())
    for new, old in zip(replaced, [layer.attn for layer in model.layers]):
        assert new.in_proj_weight is old.in_proj_weight and new.out_proj is old.out_proj
    before = count_graph_ops(zoo.export_named(io, zoo.inputs()).graph)
    after = count_graph_ops(zoo.export_named(module, zoo.inputs()).graph)
    assert before["softmax"] == 2 and before["sdpa"] == 0
    assert after["sdpa"] == 2 and after["softmax"] == 0
    other = zoo.inputs(3, 17, seed=1)
    with torch.inference_mode():
        assert torch.allclose(model(*other)[0], module(*other)[0], atol=1e-5)


@pytest.mark.parametrize("name, sites, kind", [
    ("mha_no_weights", 2, "nn.MultiheadAttention"),
    ("transformer_encoder", 2, "nn.MultiheadAttention in nn.TransformerEncoderLayer"),
    ("transformer_decoder", 4, "nn.MultiheadAttention in nn.TransformerDecoderLayer"),
])
def test_modules_on_the_sdpa_path_are_found_as_already_sdpa(name, sites, kind):
    _, io, module, audit = rewrite(name)
    assert audit.count(REWRITTEN) == 0 and audit.count(ALREADY_SDPA) == sites
    assert all(s.kind == kind for s in audit.sites)
    assert module is io


def test_caller_that_uses_the_weights_is_left_alone():
    _, io, module, audit = rewrite("mha_weights_used")
    assert audit.count(REWRITTEN) == 0 and audit.count(SKIPPED) == 2
    assert all("uses the attention weights" in s.reason for s in audit.sites)
    assert module is io


def test_rule_does_not_apply_without_multihead_attention():
    io = zoo.io_module(zoo.build(zoo.BY_NAME["matmul_div"]))
    assert not torch_multihead_attention.applies(io)


def test_only_the_modules_whose_weights_are_unused_are_rewritten():
    """One block uses its weights, the other does not: one rewritten, one skipped."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = zoo.MHABlock(use_weights=True)
            self.unused = zoo.MHABlock()

        def forward(self, x, mask):
            return (self.unused(self.used(x, mask), mask),)

    torch.manual_seed(0)
    model = Mixed().eval()
    module, audit = rewrite_attention(zoo.io_module(model), zoo.inputs())
    status = {s.location: s.status for s in audit.sites}
    assert status == {"used.attn": SKIPPED, "unused.attn": REWRITTEN}
    with torch.inference_mode():
        assert torch.allclose(model(*zoo.inputs(3, 9, seed=2))[0], module(*zoo.inputs(3, 9, seed=2))[0], atol=1e-5)


@pytest.mark.parametrize("name, expanded", [("transformer_encoder", 2), ("mha", 2), ("padding_boolean", 0)])
def test_onnx_runs_the_masks_of_torch_modules(name, expanded, tmp_path):
    """(batch, 1, 1, key) padding masks are spelled out over the query length for onnxruntime's Attention kernel;
    the graph rule's own masks already are."""
    import onnx
    import onnxruntime as ort

    model, _, module, _ = rewrite(name)
    program = zoo.export_named(module, zoo.inputs())
    assert expand_attention_masks(program) == expanded
    path = tmp_path / "model.onnx"
    torch.onnx.export(program, (), dynamo=True, opset_version=23, input_names=["x", "mask"], optimize=False,
                      verbose=False).save(str(path))
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["Attention"] == 2 and ops["Softmax"] == 0
    other = zoo.inputs(3, 17, seed=1)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": other[0].numpy(), "mask": other[1].numpy()})[0]
    with torch.inference_mode():
        assert np.allclose(got, model(*other)[0].numpy(), atol=1e-5)
