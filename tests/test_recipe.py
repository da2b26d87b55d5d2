"""Recipes: typed, frozen, every problem listed at once, built-ins found after a plain install."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from exporter.errors import RecipeError
from exporter.recipe import builtin_dir, builtin_names, load_recipe, parse_recipe

ROOT = Path(__file__).resolve().parents[1]


def test_every_recipe_file_in_the_tree_validates():
    files = sorted((ROOT / "recipes").rglob("*.toml"))
    assert {"cpu-fp32", "h100-bf16"} <= {f.stem for f in files}
    for path in files:
        recipe = load_recipe(path)
        assert recipe.name == path.stem
        assert recipe.targets.build


def test_builtin_names_match_files():
    assert set(builtin_names()) >= {"cpu-fp32", "h100-bf16"}
    assert builtin_dir().is_dir()


def test_h100_recipe_values():
    recipe = load_recipe("h100-bf16")
    assert (recipe.runtime.device, recipe.runtime.dtype) == ("cuda", "bfloat16")
    assert {"exported_program", "aoti", "onnx", "compile"} <= set(recipe.targets.build)
    assert recipe.targets.compile_modes == ("max-autotune",)
    assert recipe.numerics.multiplier("bfloat16") == 3.0


def test_h100_fp8_times_the_same_generation_as_h100_bf16():
    """fp8 is read against bf16: a text-generation run of each must use the same batch, prompt, cache and steps
    (a missing [generation] section once gave fp8 the defaults, batch 2 over a 64-slot cache, against bf16's 8 over
    512)."""
    assert load_recipe("h100-fp8").generation == load_recipe("h100-bf16").generation


def test_recipe_is_frozen():
    recipe = load_recipe("cpu-fp32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.runtime.device = "cuda"  # type: ignore[misc]


def test_every_problem_is_listed_at_once():
    data = {
        "schema_version": 1,
        "colour": "blue",
        "runtime": {"device": "tpu", "dtype": 3, "atention_backend": "flash"},
        "targets": {"build": ["onnx", "pdf"], "onnx_opset": 12},
        "numerics": {"k": 0.5},
        "inputs": {"dims": {"batch": {"size": 4, "min": 8, "max": 16}}},
    }
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "bad", "bad.toml")
    message = info.value.message
    for fragment in ("colour: unknown key", "runtime.device", "runtime.dtype: expected str",
                     "did you mean 'attention_backend'", "'pdf' is not one of", "onnx_opset", "numerics.k",
                     "min <= size <= max"):
        assert fragment in message, fragment
    assert "8 problem(s)" in message


def test_schema_version_is_required_and_checked():
    with pytest.raises(RecipeError, match="schema_version: required"):
        parse_recipe({}, "x", "x.toml")
    with pytest.raises(RecipeError, match="version 7 is not supported"):
        parse_recipe({"schema_version": 7}, "x", "x.toml")


def test_contradictions_are_rejected():
    with pytest.raises(RecipeError, match="needs device 'cuda'"):
        parse_recipe({"schema_version": 1, "runtime": {"attention_backend": "flash"}}, "x", "x.toml")
    with pytest.raises(RecipeError, match="reduce-overhead"):
        parse_recipe({"schema_version": 1, "targets": {"build": ["compile"], "compile_modes": ["reduce-overhead"]}},
                     "x", "x.toml")
    with pytest.raises(RecipeError, match="targets.aoti_cuda_graph: a CUDA graph needs device 'cuda'"):
        parse_recipe({"schema_version": 1, "targets": {"aoti_cuda_graph": True}}, "x", "x.toml")
    assert load_recipe("h100-bf16").targets.aoti_cuda_graph and not load_recipe("cpu-fp32").targets.aoti_cuda_graph


def test_unknown_name_suggests_close_ones():
    with pytest.raises(RecipeError) as info:
        load_recipe("cpu-fp23")
    assert "did you mean cpu-fp32" in info.value.one_line()


def test_recipe_from_path_and_bad_toml(write_recipe):
    good = write_recipe('schema_version = 1\n[runtime]\ndtype = "float32"\n', "mine.toml")
    assert load_recipe(good).name == "mine"
    bad = write_recipe("schema_version = = 1\n", "broken.toml")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(bad)
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(str(good.parent / "missing.toml"))


def test_declared_tensors_must_use_declared_dims():
    data = {"schema_version": 1, "inputs": {"dims": {"batch": 2},
                                            "tensor": [{"name": "x", "shape": ["batch", "time"]}]}}
    with pytest.raises(RecipeError, match="dim 'time' is not declared"):
        parse_recipe(data, "x", "x.toml")


def test_builtin_recipes_resolve_after_a_plain_install(tmp_path):
    """Build the wheel, install it into an empty folder, and list the recipes from there."""
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True)
    wheel = next(wheels.glob("exporter-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "exporter/recipes/cpu-fp32.toml" in names
    assert "exporter/report/schema.json" in names  # consumers validate reports against the installed schema
    assert {f"exporter/report/{n}.schema.json" for n in ("generation", "verify", "validate", "inspect", "recipes")} \
        <= set(names)
    assert "exporter/py.typed" in names  # type checkers read the package's annotations
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    code = ("import exporter.recipe as r; print(r.builtin_dir()); print(','.join(r.builtin_names())); "
            "print(r.load_recipe('h100-bf16').runtime.device)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[0].startswith(str(target))
    assert "cpu-fp32" in out[1].split(",") and out[2] == "cuda"


def test_recipe_json_is_read_back_by_the_same_parser(tmp_path):
    """``recipe.json`` (what a run writes) is a recipe: the same settings come back, checked like TOML."""
    import json

    original = load_recipe("h100-bf16").with_inputs(("batch=4:1:8",), ("x:float32:batch,16",)).with_targets(("aoti",))
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(original.to_dict()))
    again = load_recipe(path)
    assert dataclasses.replace(again, source="") == dataclasses.replace(original, source="")
    data = original.to_dict()
    data["numerics"]["atoll"] = 1.0
    data["bench"]["warmup"] = "ten"
    path.write_text(json.dumps(data))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "numerics.atoll: unknown key (did you mean 'atol'?)" in str(info.value)
    assert "bench.warmup: expected int" in str(info.value)
    path.write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        load_recipe(path)


def test_set_overrides_are_typed_like_the_recipe_file():
    from exporter.recipe import apply_settings

    base = load_recipe("cpu-fp32")
    changed = apply_settings(base, ("numerics.atol=1e-6", "targets.onnx_opset=21", "runtime.dtype=bfloat16",
                                    "targets.build=onnx,aoti", "inputs.dims.batch=4:1:32", "numerics.k=3",
                                    "report.host=true"))
    assert changed.numerics.atol == 1e-6 and changed.numerics.k == 3.0
    assert changed.targets.onnx_opset == 21 and changed.targets.build == ("onnx", "aoti")
    assert changed.runtime.dtype == "bfloat16" and changed.report.host is True
    batch = changed.inputs.dim("batch")
    assert batch is not None and (batch.size, batch.min, batch.max) == (4, 1, 32)
    assert changed.inputs.dim("sequence") == base.inputs.dim("sequence")
    assert apply_settings(base, ()) is base
    with pytest.raises(RecipeError) as info:
        apply_settings(base, ("numerics.atl=1e-6", "targets.onnx_opset=twenty", "runtime.dtype=float8",
                              "targets.build=onnx,trt"))
    text = str(info.value)
    assert "given with --set has 4 problem(s)" in text
    assert "numerics.atl: unknown key (did you mean 'atol'?)" in text
    assert "targets.onnx_opset: expected int, got str 'twenty'" in text
    assert "runtime.dtype: 'float8' is not one of" in text and "targets.build: 'trt' is not one of" in text
    for bad in ("atol=1e-6", "numerics.atol", "Numerics.atol=1"):
        with pytest.raises(RecipeError, match="is not section.key=value"):
            apply_settings(base, (bad,))
    with pytest.raises(RecipeError, match="NAME=SIZE"):
        apply_settings(base, ("inputs.dims.batch=big",))


def test_a_dim_sized_by_dim_and_by_set_is_refused_where_the_two_differ():
    """--dim batch=2 with --set inputs.dims.batch=3 names two sizes for one dim: refused, neither wins; the same
    size both ways, or two different dims, go through."""
    from exporter.recipe import resolve_recipe

    with pytest.raises(RecipeError, match=r"--dim 'batch=2' and --set inputs.dims.batch=3 both size dim batch"):
        resolve_recipe("cpu-fp32", dims=("batch=2",), settings=("inputs.dims.batch=3",))
    same = resolve_recipe("cpu-fp32", dims=("batch=4:1:32",), settings=("inputs.dims.batch=4:1:32",))
    assert (same.inputs.dim("batch").size, same.inputs.dim("batch").max) == (4, 32)
    apart = resolve_recipe("cpu-fp32", dims=("batch=2",), settings=("inputs.dims.sequence=16",))
    assert (apart.inputs.dim("batch").size, apart.inputs.dim("sequence").size) == (2, 16)


def test_a_batch_1_decode_program_without_its_target_or_task_is_refused():
    """generation.decode_batch_1 asks for a program the aoti target builds for --task text-generation: asked with
    neither, it is refused by name, never silently dropped; a forward run ignores the generation section."""
    from exporter.recipe import resolve_recipe

    on = ("generation.decode_batch_1=true",)
    with pytest.raises(RecipeError, match=r"generation.decode_batch_1: .*aoti target.*add --target aoti"):
        resolve_recipe("cpu-fp32", targets=("exported_program",), settings=on, task="text-generation")
    with pytest.raises(RecipeError, match=r"--task text2text-generation has none yet"):
        resolve_recipe("cpu-fp32", targets=("aoti",), settings=on, task="text2text-generation")
    built = resolve_recipe("cpu-fp32", targets=("aoti",), settings=on, task="text-generation")
    assert built.generation.decode_batch_1
    assert resolve_recipe("cpu-fp32", targets=("exported_program",), settings=on).generation.decode_batch_1
    assert built.generation.decode_attention_kernel  # that program's attention as the kernel, on CUDA, unless told
    off = resolve_recipe("cpu-fp32", targets=("aoti",), settings=on + ("generation.decode_attention_kernel=false",),
                         task="text-generation")
    assert off.generation.decode_batch_1 and not off.generation.decode_attention_kernel
    assert built.generation.decode_gemv_kernel  # its products as exporter::gemv, on CUDA, unless told
    plain = resolve_recipe("cpu-fp32", targets=("aoti",), settings=on + ("generation.decode_gemv_kernel=false",),
                           task="text-generation")
    assert plain.generation.decode_attention_kernel and not plain.generation.decode_gemv_kernel
    assert built.generation.decode_step_kernel  # its rotary embedding and cache write in the attention kernel
    apart = resolve_recipe("cpu-fp32", targets=("aoti",), settings=on + ("generation.decode_step_kernel=false",),
                           task="text-generation")
    assert apart.generation.decode_attention_kernel and not apart.generation.decode_step_kernel


def test_nothing_a_checked_file_holds_runs_unless_a_recipe_or_flag_says_so(tmp_path):
    """[trust] is false in every built-in recipe; --set (what --allow-native-code and --allow-artifact-pickle give)
    turns a key on, typed like the file; recipe.json carries it back."""
    import json

    from exporter.recipe import apply_settings

    for name in builtin_names():
        trust = load_recipe(name).trust
        assert not trust.native_code and not trust.artifact_pickle, name
    opted = apply_settings(load_recipe("cpu-fp32"), ("trust.native_code=true",))
    assert opted.trust.native_code and not opted.trust.artifact_pickle
    with pytest.raises(RecipeError, match="trust.artifact_pickle: expected bool"):
        apply_settings(load_recipe("cpu-fp32"), ("trust.artifact_pickle=yes",))
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(opted.to_dict()))
    assert load_recipe(path).trust == opted.trust
