"""A decoder written by hand that follows the decoder contract (``exporter.testing.generation_models``) converts,
and a planted defect in its cache update fails the gate at every decode step."""

from __future__ import annotations

import json

import pytest
import torch

import exporter


@pytest.fixture
def factory_decoder(tmp_path):
    from safetensors.torch import save_model

    from exporter.testing import generation_models

    def make(cache_bug: bool):
        folder = tmp_path / ("buggy" if cache_bug else "clean")
        folder.mkdir()
        torch.manual_seed(3)
        save_model(generation_models.build(), str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"cache_bug": cache_bug}))
        return folder

    return make


def test_factory_decoder_follows_the_contract(factory_decoder, tmp_path):
    result = exporter.convert(factory_decoder(False), "cpu-fp32", tmp_path / "out", task="text-generation",
                              model="exporter.testing.generation_models:build", targets=("exported_program", "onnx"))
    assert result.exit_code == 0, result.problems
    for entry in result.report["artifacts"]:
        assert entry["numerics"]["tokens_identical"] and entry["programs"]["decode"] == {"sdpa": 2, "softmax": 0}


def test_planted_cache_update_defect_fails_the_gate(factory_decoder, tmp_path):
    """The decode step writes keys where the values belong: prefill is right, every decode step is wrong."""
    result = exporter.convert(factory_decoder(True), "cpu-fp32", tmp_path / "out", task="text-generation",
                              model="exporter.testing.generation_models:build", targets=("exported_program", "onnx"))
    assert result.exit_code == 3 and not result.report["passed"]
    for variant in (result.report["rewritten"], *result.report["artifacts"]):
        steps = variant["numerics"]["steps"]
        assert steps[0]["passed"]  # the prefill's logits: the cache was written right
        assert not any(s["passed"] for s in steps[1:])  # every decode step reads the corrupted values
        assert variant["status"] == "numerics_failed"
