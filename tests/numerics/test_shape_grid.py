"""The shape grid: which points are checked, the budget that keeps the float64 reference affordable, and an
artifact that fixed a dim the recipe declared dynamic (flagged from its signature, and failed by running it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from exporter.errors import RecipeError
from exporter.inputs import InputPlan
from exporter.numerics.grid import onnx_signature, plan_grid, program_signature
from exporter.recipe import Dim, NumericsSection, TensorSpec, load_recipe, parse_recipe


def text_plan(batch=Dim("batch", 2, 1, 16), sequence=Dim("sequence", 32, 2, 512)) -> InputPlan:
    specs = (TensorSpec("input_ids", ("batch", "sequence"), "int64", 0, 100),
             TensorSpec("attention_mask", ("batch", "sequence"), "int64", 0, 2))
    return InputPlan(specs=specs, dims=(batch, sequence))


def test_points_cover_min_typical_max_and_awkward_sizes():
    grid = plan_grid(text_plan(), NumericsSection(), seed=0)
    by_name = {p.name: p for p in grid.points}
    assert list(by_name) == ["typical", "batch=1", "batch=7", "batch=16", "sequence=2", "sequence=7", "sequence=129",
                             "sequence=512", "all dims at min"]
    assert by_name["typical"].sizes == {"batch": 2, "sequence": 32}
    assert by_name["sequence=129"].role == "awkward" and by_name["sequence=129"].sizes["batch"] == 2
    # 2 x 512 would be 16x the typical elements: the other dim shrinks to its minimum to fit the budget of 8
    assert by_name["sequence=512"].sizes == {"batch": 1, "sequence": 512}
    assert [s["name"] for s in grid.skipped] == ["all dims at max"]
    assert all(p.elements <= 8 * grid.typical_elements for p in grid.points)
    assert len({p.seed for p in grid.points}) == len(grid.points)  # every point has its own recorded seed
    assert grid.to_dict()["points"][0]["seed"] == 1000


def test_budget_awkward_sizes_and_when_there_is_no_grid():
    tight = plan_grid(text_plan(), NumericsSection(grid_budget=1.0, grid_sizes=(3,)), seed=7)
    names = [p.name for p in tight.points]
    assert "sequence=3" in names and "sequence=7" not in names and "sequence=512" not in names
    assert {s["name"] for s in tight.skipped} == {"sequence=512", "all dims at max"}
    assert next(p for p in tight.points if p.name == "batch=16").sizes == {"batch": 16, "sequence": 2}
    assert tight.points[0].seed == 1007
    assert plan_grid(text_plan(), NumericsSection(grid=False), seed=0) is None
    static = text_plan(Dim("batch", 2, 2, 2), Dim("sequence", 32, 32, 32))
    assert plan_grid(static, NumericsSection(), seed=0) is None


def test_grid_keys_are_checked_in_recipes():
    with pytest.raises(RecipeError) as info:
        parse_recipe({"schema_version": 1, "numerics": {"grid_sizes": [7, 0], "grid_budget": 0.5, "grid": "yes",
                                                        "locat": True}}, "bad", "bad.toml")
    text = str(info.value)
    assert "numerics.grid_sizes" in text and "numerics.grid_budget" in text and "numerics.grid" in text
    assert "did you mean 'locate'" in text
    assert load_recipe("h100-bf16").numerics.grid is True


@pytest.mark.slow
def test_an_artifact_that_fixed_a_dynamic_dim_is_flagged_and_fails_the_grid(factory_checkpoint, write_recipe,
                                                                            tmp_path):
    from conftest import FACTORY_RECIPE
    from exporter.checkpoint import load_model
    from exporter.inputs import plan_inputs
    from exporter.modelio import Signature, discover_outputs
    from exporter.numerics.reference import run_reference
    from exporter.numerics.validation import Validation
    from exporter.prepare import original_module
    from exporter.results import FAILED, OK, VariantResult
    from exporter.runners import RemoteRunner
    from exporter.targets.spec import RunnerSpec

    path, factory = factory_checkpoint
    recipe = load_recipe(write_recipe(FACTORY_RECIPE.format(targets='["exported_program"]'))).with_factory(factory)
    loaded = load_model(path, factory)
    plan = plan_inputs(loaded.model, recipe.inputs)
    signature = Signature(plan.names, discover_outputs(loaded.model, plan.samples[0]))
    original = original_module(loaded, signature)
    samples = [[s[n] for n in plan.names] for s in plan.samples]

    # what an exporter that forgot the dynamic axes produces: every dim fixed at the example's size
    static = torch.export.export(original, tuple(samples[0]), strict=False)
    flagged = program_signature(static, plan)["specialised"]
    assert {(s["input"], s["axis"], s["size"]) for s in flagged} == {
        ("tokens", 0, 2), ("tokens", 1, 12), ("features", 0, 2), ("features", 1, 12)}
    dynamic = torch.export.export(original, tuple(samples[0]), dynamic_shapes=plan.export_dynamic_shapes(),
                                  strict=False)
    assert program_signature(dynamic, plan) == {"specialised": [], "narrowed": []}
    onnx_path = tmp_path / "static.onnx"
    torch.onnx.export(static, (), dynamo=True, input_names=list(plan.names), output_names=list(signature.outputs),
                      verbose=False).save(str(onnx_path))
    assert {(s["input"], s["axis"]) for s in onnx_signature(onnx_path, plan)["specialised"]} == {
        ("tokens", 0), ("tokens", 1), ("features", 0), ("features", 1)}

    program_path = tmp_path / "static.pt2"
    torch.export.save(static, str(program_path))
    reference = run_reference(original, plan.samples)
    validation = Validation(recipe, signature, reference, samples, original, lambda name: tmp_path / f"{name}.log")
    runner = RemoteRunner(RunnerSpec("exported_program", "exported_program", "cpu", "float32", path=str(program_path)))
    try:
        result = VariantResult("exported_program", "exported_program", device="cpu", dtype="float32")
        validation.judge(result, runner)
        assert result.status == OK  # at the one shape it was exported at, it is right
        grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
        validation.check_grid(grid, plan, [(result, runner)],
                              {"exported_program": {**program_signature(static, plan), "signature_source": "test"}})
    finally:
        validation.close()
        runner.close()
    entry = result.numerics.grid
    points = {p["name"]: p for p in entry["points"]}
    assert points["typical"]["passed"] is True
    assert all(p["passed"] is False and p["error"] for name, p in points.items() if name != "typical")
    assert result.status == FAILED and "shape grid" in result.error
    assert len(entry["specialised"]) == 4
    assert any("the artifact fixed it at 12" in note for note in result.notes)


def test_plan_records_seeds():
    plan = dataclasses.replace(text_plan(), seed=3, samples=[{}, {}, {}])
    assert plan.seeds == [3, 4, 5]
    assert dataclasses.replace(plan, seed=None).seeds is None
