"""Every architecture of the coverage table, its fast part: inputs from the config alone, every attention site
rewritten (or left as written for the reason the table gives), and the exported program equal to the float64
model at two shapes of its dynamic range.

The full table (ONNX too, the whole convert, and Optimum beside it) is made by
``scripts/architecture_coverage.py`` into docs/architectures.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from exporter.checkpoint import load_model
from exporter.inputs import plan_inputs
from exporter.modelio import Signature, discover_outputs
from exporter.numerics.grid import plan_grid, point_sample
from exporter.numerics.reference import run_reference
from exporter.prepare import original_module
from exporter.recipe import load_recipe
from exporter.rewrite import rewrite_attention
from exporter.targets.exported_program import decomposition_table, export_module
from exporter.testing.architectures import ARCHITECTURES, Arch

pytest.importorskip("transformers")

# sites left as written, by architecture, with the reason the audit must give (docs/architectures.md says why)
LEFT_AS_WRITTEN = {
    "gemma2": "tanh between q·kᵀ and softmax has no SDPA equivalent",  # score soft-capping
}


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


@pytest.mark.parametrize("arch", ARCHITECTURES, ids=lambda a: a.name)
def test_exported_program_of_every_architecture(arch: Arch, tmp_path):
    import transformers

    transformers.logging.set_verbosity_error()
    recipe = load_recipe("cpu-fp32")
    loaded = load_model(arch.save(tmp_path / arch.name))
    plan = plan_inputs(loaded.model, recipe.inputs)  # nothing declared: every input comes from the config
    outputs = discover_outputs(loaded.model, plan.samples[0])
    signature = Signature(plan.names, outputs)
    original = original_module(loaded, signature)
    example = [plan.samples[0][n] for n in plan.names]

    rewritten, audit = rewrite_attention(original, example)
    skipped = {s.reason for s in audit.sites if s.status == "skipped"}
    if arch.name in LEFT_AS_WRITTEN:
        assert audit.count("rewritten") == 0 and any(LEFT_AS_WRITTEN[arch.name] in r for r in skipped), skipped
    else:
        assert not skipped, skipped
        assert audit.count("rewritten") + audit.count("already_sdpa") == audit.found
    assert audit.found >= (0 if arch.name == "convnext" else 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = export_module(rewritten, example, plan, []).run_decompositions(decomposition_table())
    grid = plan_grid(plan, recipe.numerics, plan.seed)
    points = [plan.samples[0]]
    if grid is not None:
        points.append(point_sample(plan, min(grid.points, key=lambda p: p.elements)))  # every dim at its least
    reference = run_reference(original, points, count_flops=False)
    module = program.module()
    for index, sample in enumerate(points):
        with torch.no_grad():
            got = module(**{n: sample[n] for n in reversed(plan.names)})  # by name, in any order
        got = [got] if isinstance(got, torch.Tensor) else list(got)
        assert len(got) == len(outputs)
        for name, tensor, want in zip(outputs, got, reference.outputs[index]):
            assert torch.isfinite(want).all(), f"{name}: the float64 model itself is not finite"
            assert _rel_l2(tensor, want) < 1e-5, f"{name} at sample {index}: rel. L2 {_rel_l2(tensor, want):.2e}"
