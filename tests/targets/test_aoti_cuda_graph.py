"""The AOTInductor package replayed from a CUDA graph (``aoti_loader.CudaGraphed``, the ``aoti:cuda-graph``
variant of a recipe with ``targets.aoti_cuda_graph``). A CUDA graph needs a CUDA GPU: these tests run only there
(the recipe's refusal on a CPU recipe is pinned in test_recipe.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import exporter
from exporter.recipe import load_recipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_graphed_package_matches_the_package_and_refuses_other_shapes(tmp_path):
    from exporter.targets.aoti_loader import CudaGraphed, load_package
    from exporter.targets.toolchain import aoti_preload

    preload = aoti_preload()
    if preload and preload not in os.environ.get("LD_PRELOAD", ""):
        pytest.skip(f"AOTI packages need LD_PRELOAD={preload} in this process here (convert's children have it)")
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda().eval()
    x = torch.randn(4, 64, device="cuda")
    path = torch._inductor.aoti_compile_and_package(torch.export.export(model, (x,)),
                                                    package_path=str(tmp_path / "m.pt2"))
    plain, graphed = load_package(path), CudaGraphed(path, [x])
    for _ in range(3):
        y = torch.randn(4, 64, device="cuda")
        assert torch.equal(graphed(y), plain(y))
    with pytest.raises(ValueError, match="captured for inputs"):
        graphed(torch.randn(5, 64, device="cuda"))


def test_convert_judges_and_times_the_graphed_variant(tiny_models, tmp_path):
    recipe = load_recipe("h100-bf16")
    recipe = dataclasses.replace(recipe, bench=dataclasses.replace(recipe.bench, warmup=1, rounds=1, iterations=2),
                                 targets=dataclasses.replace(recipe.targets, build=("aoti",)))
    result = exporter.convert(tiny_models["llama"], recipe, tmp_path / "llama")
    variants = {a["name"]: a for a in result.report["artifacts"]}
    assert result.exit_code == 0, result.problems
    graphed = variants["aoti:cuda-graph"]
    assert graphed["status"] == "ok" and graphed["numerics"]["passed"]
    assert graphed["numerics"]["grid"]["checked"] is False and variants["aoti"]["numerics"]["grid"]["checked"]
    assert graphed["bench"]["median_ms"] > 0 and graphed["info"]["captured"]
