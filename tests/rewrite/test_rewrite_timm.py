"""timm_fused_attention: timm attention with fused_attn off takes timm's own SDPA path.

timm needs torchvision at import; PyPI's torchvision wheel does not load beside torch 2.13.0+cpu (its C++
ops fail to register), so on such a machine the positive test is skipped with that reason. The negative
test runs everywhere.
"""

from __future__ import annotations

import pytest
import torch

from exporter.rewrite import REWRITTEN, rewrite_attention, timm_fused_attention
from exporter.rewrite.graph_facts import count_graph_ops
from exporter.testing import attention_zoo as zoo

REASON = "timm not importable here (it needs torchvision, whose PyPI wheel does not load beside this torch)"


def test_rule_does_not_apply_to_models_without_timm_modules():
    io = zoo.io_module(zoo.build(zoo.BY_NAME["prescaled_q"]))
    assert not timm_fused_attention.applies(io)


def test_vision_transformer_with_fused_attention_off_is_switched_on():
    try:
        import timm
        from timm.layers import Attention
    except Exception:
        pytest.skip(REASON)
    from exporter.modelio import Signature, make_io_module

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=0).eval()
    for module in model.modules():
        if isinstance(module, Attention):
            module.fused_attn = False
    io = make_io_module(model, Signature(("pixel_values",), ("output",)))
    pixels = torch.randn(2, 3, 32, 32)
    rewritten, audit = rewrite_attention(io, [pixels])
    assert audit.count(REWRITTEN) == 2 and all(s.rule == timm_fused_attention.RULE for s in audit.sites)
    assert all(not m.fused_attn for m in model.modules() if isinstance(m, Attention))  # the original is untouched
    program = torch.export.export(rewritten, (pixels,), strict=False)
    assert count_graph_ops(program.graph)["sdpa"] == 2
    with torch.inference_mode():
        assert torch.allclose(io(pixels)[0], rewritten(pixels)[0], atol=1e-5)
