"""The command line: one-line errors with documented exit codes, help with examples, lean imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from exporter.cli import cli
from exporter.testing.cli import run_cli as exporter_cli


def run_cli(*args, env=None, cwd=None):
    return exporter_cli(list(args), cwd, {**os.environ, **(env or {})}, timeout=600)


def test_recipes_list_and_show():
    runner = CliRunner()
    listed = runner.invoke(cli, ["recipes", "list"])
    assert listed.exit_code == 0
    assert "cpu-fp32" in listed.output and "h100-bf16" in listed.output
    shown = runner.invoke(cli, ["recipes", "show", "h100-bf16"])
    assert shown.exit_code == 0 and 'dtype = "bfloat16"' in shown.output


def test_help_ends_with_examples():
    out = CliRunner().invoke(cli, ["convert", "--help"]).output
    assert "Examples:" in out and "exporter convert model.safetensors --recipe h100-bf16" in out
    assert "Exit codes:" in out


def commands(group, path=()):
    for name, command in group.commands.items():
        yield (*path, name), command
        if hasattr(command, "commands"):
            yield from commands(command, (*path, name))


def test_every_help_ends_with_its_exit_codes():
    found = [path for path, _ in commands(cli)]
    assert ("recipes", "list") in found and ("verify",) in found
    for path in [(), *found]:
        out = CliRunner().invoke(cli, [*path, "--help"]).output
        assert "Exit codes: 0" in out.split("Options:")[-1], f"exporter {' '.join(path)} --help:\n{out}"


def test_the_groups_help_lists_every_exit_code_and_generate_lists_its_own():
    from exporter.errors import EXIT_CODES, EXIT_INTERNAL

    top = " ".join(CliRunner().invoke(cli, ["--help"]).output.split())
    for code in EXIT_CODES:
        if code.code != EXIT_INTERNAL:
            assert f"{code.code} {code.short}" in top, top
    generate = " ".join(CliRunner().invoke(cli, ["generate", "--help"]).output.split())
    codes = generate.split("Exit codes:")[-1]
    assert "6 integrity failure" in codes and "3 numerics" not in codes, codes


def test_the_recorded_command_always_names_the_recipe():
    """run.command in report.json: the recipe is recorded even when it was the default (defaults can change)."""
    from exporter.commandline import typed_command

    ctx = cli.commands["convert"].make_context("convert", ["model.safetensors", "-t", "aoti"])
    assert typed_command(ctx) == ["exporter", "convert", "model.safetensors", "--recipe", "cpu-fp32",
                                  "--target", "aoti"]


def test_progress_lines_never_wrap_off_a_terminal(capsys):
    """A CI log is not a terminal: a long stage line stays one line (rich would fold it at 80 columns)."""
    from exporter.progress import Progress

    progress = Progress()
    with progress.stage("load", "/" + "very-long-folder-name/" * 10 + "model.safetensors"):
        pass
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and all("model.safetensors" in line and len(line) > 200 for line in lines), lines


def test_the_package_shows_its_verbs():
    import exporter

    assert {"convert", "inspect", "check_artifact", "verify", "validate_folder", "load_recipe"} <= set(dir(exporter))


def test_recipes_list_json_is_versioned_and_matches_its_schema():
    jsonschema = pytest.importorskip("jsonschema")
    from exporter.report import command_schema

    listed = CliRunner().invoke(cli, ["recipes", "list", "--json"])
    data = json.loads(listed.output)
    jsonschema.validate(data, command_schema("recipes"))
    assert data["schema_version"] == 1 and {"cpu-fp32", "h100-bf16"} <= {r["name"] for r in data["recipes"]}


@pytest.mark.parametrize("args, code, fragment", [
    (["convert", "/nonexistent/model.safetensors"], 2, "does not exist"),
    (["convert", "x.safetensors", "--recipe", "cpu-fp23"], 2, "did you mean cpu-fp32"),
    (["convert", "x.safetensors", "--model", "not a factory"], 2, "package.module:function"),
    (["convert", ".", "--recipe", "h100-bf16"], 5, "no usable GPU"),
    (["convert", "--bogus"], 2, "No such option"),
])
def test_user_errors_are_one_line_with_exit_codes(args, code, fragment, tmp_path):
    result = run_cli(*args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1
    assert not (tmp_path / "artifacts").exists()


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("convert", "/nonexistent/model.safetensors", env={"EXPORTER_DEBUG": "1"}, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" in result.stderr


def test_inspect_lists_attention_sites(tiny_models):
    jsonschema = pytest.importorskip("jsonschema")
    from exporter.report import command_schema

    result = run_cli("inspect", str(tiny_models["llama"]), "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    jsonschema.validate(data, command_schema("inspect"))
    assert data["architecture"] == "LlamaForCausalLM"
    assert data["parameters"] > 0 and data["dtypes"] == {"float32": len([1 for _ in range(data["tensors"])])}
    assert data["attention"]["found"] == 2
    assert {s["location"] for s in data["attention"]["sites"]} == {"model.layers.0.self_attn",
                                                                   "model.layers.1.self_attn"}
    text = run_cli("inspect", str(tiny_models["gpt2"]))
    assert "GPT2LMHeadModel" in text.stdout and "transformer.h.1.attn" in text.stdout
    assert "[rewritable]" in text.stdout and "[rewritten]" not in text.stdout  # inspect rewrites nothing


def test_help_imports_no_torch_or_backends():
    code = ("import sys; from exporter.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch', 'onnx', 'onnxruntime', 'transformers', 'torch_tensorrt')\n"
            "         if m in sys.modules]\n"
            "print('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "HEAVY []" in out


@pytest.mark.parametrize("extra, fragment", [
    (["--recipe", "cpu-fp3"], "did you mean cpu-fp32"),
    (["--set", "numerics.atoll=1"], "did you mean 'atol'"),
    (["--dim", "batch=two"], "is not NAME=SIZE"),
    (["--input", "tokens:int64"], "is not NAME:DTYPE:SHAPE"),
    (["--target", "aot"], "did you mean 'aoti'"),
    (["--target", "aoti", "--set", "targets.build=onnx"], "both choose the targets"),
    (["--recipe", "cpu-fp32", "--recipe", "h100-bf16"], "--recipe is given twice"),
    (["--out", "a", "--out=b"], "--out is given twice"),
    (["--set", "numerics.k=2", "--set", "numerics.k=3"], "--set numerics.k is given twice"),
    (["--dim", "batch=2", "--dim", "batch=3"], "--dim batch is given twice"),
    (["--dim", "batch=2", "--set", "inputs.dims.batch=3"], "both size dim batch"),
])
def test_a_mistake_in_an_option_is_told_before_torch_loads(extra, fragment, tiny_models, tmp_path):
    """Every small grammar is checked by the command line itself: the mistake, its fix, and no torch import
    (a typo costs a fraction of a second: benchmarks/typo_timing.py prints the times)."""
    code = ("import sys; from exporter.cli import _run\n"
            "try:\n    _run(sys.argv[1:])\nexcept SystemExit as exc:\n    print('EXIT', exc.code)\n"
            "print('TORCH', 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, "convert", str(tiny_models["gpt2"]), *extra],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "EXIT 2" in done.stdout and "TORCH False" in done.stdout, done.stdout + done.stderr
    assert fragment in done.stderr and done.stderr.count("error:") == 1


def test_an_option_given_twice_is_refused_only_where_the_two_differ():
    """Click keeps the last of two values silently; exporter refuses two different values of one option and
    lets a repeat of the same value, and the repeatable options, through."""
    import click

    from exporter.commandline import repeated_options

    command = cli.commands["convert"]
    ctx = click.Context(command)

    def problem(*args):
        return repeated_options(command, ctx, ["ckpt", *args])

    assert problem("--recipe", "cpu-fp32", "-r", "cpu-fp32") is None
    assert problem("--recipe=cpu-fp32", "--recipe", "cpu-fp32", "-t", "aoti", "-t", "onnx") is None
    assert problem("-q", "-q") is None
    assert "--recipe is given twice (--recipe 'cpu-fp32' and -r 'h100-bf16')" in problem(
        "--recipe", "cpu-fp32", "-r", "h100-bf16")
    assert problem("--", "--recipe", "a", "--recipe", "b") is None  # after "--": arguments, not options
    assert problem("--set", "--recipe", "--recipe", "x") is None  # "--recipe" as --set's value, then once


def test_generate_names_the_target_it_could_mean(tmp_path):
    done = run_cli("generate", str(tmp_path), "-t", "exported_progam", "--input-ids", "1")
    assert done.returncode == 2 and "did you mean 'exported_program'" in done.stderr


@pytest.mark.slow
def test_convert_command_end_to_end(tiny_models, tmp_path):
    recipe = tmp_path / "quick.toml"
    recipe.write_text('schema_version = 1\n[targets]\nbuild = ["exported_program", "onnx"]\n'
                      '[bench]\nwarmup = 1\nrounds = 2\niterations = 2\n')
    result = run_cli("convert", str(tiny_models["vit"]), "--recipe", str(recipe), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["passed"] and report["recipe"]["name"] == "quick"
    out = tmp_path / "artifacts" / "vit" / "quick"
    assert (out / "manifest.json").is_file() and (out / "model.onnx").is_file()
    again = run_cli("convert", str(tiny_models["vit"]), "--recipe", str(recipe), cwd=tmp_path)
    assert again.returncode == 5 and "already holds a run" in again.stderr and "--overwrite" in again.stderr


@pytest.mark.slow
def test_custom_factory_with_inputs_declared_on_the_command_line(factory_checkpoint, tmp_path):
    path, factory = factory_checkpoint
    module_dir = str(__import__("importlib").import_module(factory.split(":")[0]).__file__).rsplit("/", 1)[0]
    recipe = tmp_path / "quick.toml"
    recipe.write_text('schema_version = 1\n[targets]\nbuild = ["exported_program", "onnx"]\n'
                      '[bench]\nwarmup = 1\nrounds = 1\niterations = 2\n')
    result = run_cli("convert", str(path), "--model", factory, "--recipe", str(recipe), "--out", str(tmp_path / "out"),
                     "--dim", "batch=2:1:8", "--dim", "sequence=12:2:64",
                     "--input", "tokens:int64:batch,sequence:0:100", "--input", "features:float32:batch,sequence,32",
                     "--json", env={"PYTHONPATH": module_dir}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["inputs"]["names"] == ["tokens", "features"]
    assert report["inputs"]["shapes"] == {"tokens": [2, 12], "features": [2, 12, 32]}
    assert report["inputs"]["dynamic"]["tokens"]["1"] == {"dim": "sequence", "min": 2, "max": 64}
    assert all(a["status"] == "ok" for a in report["artifacts"])
    bad = run_cli("convert", str(path), "--model", factory, "--input", "tokens:int99:batch", cwd=tmp_path,
                  env={"PYTHONPATH": module_dir})
    assert bad.returncode == 2 and "'int99' is not one of" in bad.stderr and "--dim/--input" in bad.stderr


def test_report_md_is_drawn_on_a_terminal_and_left_as_markdown_when_piped(capsys):
    import io

    from rich.console import Console

    from exporter.commandline import show_markdown

    text = "# exporter report\n\n| variant | median ms |\n| --- | --- |\n| onnx | 0.62 |\n"
    screen = io.StringIO()
    show_markdown(text, Console(file=screen, force_terminal=True, width=100))
    drawn = screen.getvalue()
    assert "| --- |" not in drawn and "onnx" in drawn and "─" in drawn  # a drawn table, not Markdown
    show_markdown(text, Console(file=io.StringIO(), force_terminal=False))
    assert capsys.readouterr().out.strip() == text.strip()  # piped: the Markdown itself, every column kept
