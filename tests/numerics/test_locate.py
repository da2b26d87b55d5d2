"""Divergence localisation on small modules: replay on the recorded float64 inputs names the module that diverges."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from exporter.modelio import Signature, make_io_module
from exporter.numerics.locate import locate, record_reference
from exporter.numerics.module_checks import compare


class Block(nn.Module):
    def __init__(self, dim=16, skew=1.0):
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.skew = skew  # 1.0: correct; anything else is a defect in the block's own code, outside its children

    def forward(self, x):
        return self.norm(x + torch.tanh(self.fc(x)) * self.skew)


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def io(model):
    return make_io_module(model.eval(), Signature(("x",), ("output",)))


def test_a_changed_weight_is_named_at_its_linear():
    torch.manual_seed(0)
    original = io(Stack())
    broken = copy.deepcopy(original)
    with torch.no_grad():
        broken.model.blocks[1].fc.weight[0, 0] += 0.5
    found = locate(original, broken, [torch.randn(2, 5, 16)], "cpu", "float32", 2.0, 1e-6, label="test")
    assert found["module"] == "blocks.1.fc" and found["found_by"] == "replay"
    first = found["replay"]["first_divergent"]
    assert first["class"] == "Linear" and first["input_error"]["rmse"] < 1e-6
    assert "first divergent module blocks.1.fc" in found["summary"]


def test_a_defect_in_a_blocks_own_code_names_the_block_not_its_children():
    torch.manual_seed(0)
    original = io(Stack())
    broken = copy.deepcopy(original)
    broken.model.blocks[2].skew = 1.01
    found = locate(original, broken, [torch.randn(2, 5, 16)], "cpu", "float32", 2.0, 1e-6, label="test")
    assert found["module"] == "blocks.2"
    assert found["replay"]["modules_checked"] == 9  # blocks 0 and 1 (3 calls each), block 2's fc and norm, itself


def test_nothing_is_found_when_the_counterpart_is_sound():
    torch.manual_seed(0)
    original = io(Stack())
    found = locate(original, copy.deepcopy(original), [torch.randn(2, 5, 16)], "cpu", "float32", 2.0, 1e-6,
                   label="test")
    assert found["module"] is None and found["replay"]["first_divergent"] is None
    assert "no module diverges on its own" in found["summary"]


def test_recording_is_in_float64_in_completion_order_and_bounded():
    torch.manual_seed(0)
    original = io(Stack())
    calls, note = record_reference(original, [torch.randn(2, 5, 16)])
    assert [c.path for c in calls][:4] == ["blocks.0.fc", "blocks.0.norm", "blocks.0", "blocks.1.fc"]
    assert calls[0].args[0].dtype == torch.float64 and note == ""
    assert next(original.parameters()).dtype == torch.float32  # cast back after recording
    few, note = record_reference(original, [torch.randn(2, 5, 16)], max_bytes=4000)
    assert 0 < len(few) < len(calls) and "recording stopped" in note


def test_outputs_line_up_when_one_side_returns_none():
    """Eager attention returns its weights where SDPA returns None: the tensor both produce is still compared."""
    ref = (torch.ones(3, dtype=torch.float64), torch.ones(2, dtype=torch.float64))
    good = compare(ref, (torch.ones(3), torch.ones(2)), (torch.ones(3), None), 2.0, 1e-6)
    assert good["passed"]
    bad = compare(ref, (torch.ones(3), torch.ones(2)), (torch.full((3,), 2.0), None), 2.0, 1e-6)
    assert not bad["passed"] and bad["rmse"] == 1.0
