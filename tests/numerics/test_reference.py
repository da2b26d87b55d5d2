"""The float64 reference's per-module upcast: each module's weights in float64 only while it runs."""

from __future__ import annotations

import copy

import torch
from torch import nn

from exporter.numerics.reference import upcast_while_running


def _table_dtypes(model: nn.Module) -> list[torch.dtype]:
    """The dtype of every embedding table as its forward starts (a hook registered after the upcast's runs after
    it: what the forward itself reads)."""
    seen: list[torch.dtype] = []
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            module.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    return seen


def test_an_embedding_gathers_from_its_own_table_and_its_rows_equal_the_float64_tables():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 32), nn.LayerNorm(32), nn.Linear(32, 8)).eval()
    ids = torch.randint(0, 1000, (3, 11))
    with torch.inference_mode():
        whole = copy.deepcopy(model).double()(ids)
        with upcast_while_running(model, torch.float64):
            seen = _table_dtypes(model)
            upcast = model(ids)
    assert upcast.dtype == torch.float64 and torch.equal(upcast, whole)  # bit for bit the float64 model's
    assert seen == [torch.float32]  # the table was not cast whole to read 33 rows of it
    assert model[0].weight.dtype == torch.float32 and model[2].weight.dtype == torch.float32  # put back


def test_an_embedding_that_renormalises_its_table_is_cast_whole_as_any_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 8, max_norm=1.0), nn.Linear(8, 4)).eval()
    ids = torch.randint(0, 50, (2, 5))
    with torch.inference_mode():
        with upcast_while_running(model, torch.float64):
            seen = _table_dtypes(model)
            out = model(ids)
    assert out.dtype == torch.float64 and seen == [torch.float64]
