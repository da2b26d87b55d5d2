"""The command line: a thin Click layer over exporter.api."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import click

from .commandline import OnceGroup, TargetName, checked, show_result, token_rows, typed_command
from .errors import EXIT_INTERNAL, EXIT_USAGE, ExporterError, exit_codes_help
from .progress import Progress
from .recipe import TASKS, builtin_names, builtin_path, load_recipe
from .supervisor import ENV as SUPERVISOR_ENV
from .supervisor import SUPERVISED, supervise
from .targets import NAMES as TARGET_NAMES
from .targets import get as get_target

CONVERT_EXAMPLES = """
\b
Examples:
  exporter convert model.safetensors --recipe h100-bf16
  exporter convert ./my-model/ --recipe cpu-fp32 --out build/my-model
  exporter convert weights.safetensors --model mypkg.models:build --recipe my-recipe.toml
  exporter convert weights.safetensors --model mypkg.models:build \\
      --dim batch=2:1:32 --dim sequence=128:16:1024 \\
      --input tokens:int64:batch,sequence:0:32000 --input mask:bool:batch,sequence
  exporter convert ckpt/ --inputs samples.safetensors --allow-drift

\b
""" + exit_codes_help("convert")

INSPECT_EXAMPLES = """
\b
Examples:
  exporter inspect model.safetensors
  exporter inspect ./checkpoint-folder --json

\b
""" + exit_codes_help("read")

RECIPES_EXAMPLES = """
\b
Examples:
  exporter recipes list
  exporter recipes list --json
  exporter recipes show h100-bf16 > my-recipe.toml

\b
""" + exit_codes_help("read")


@click.group(cls=OnceGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog="\b\n" + exit_codes_help("all"))
@click.version_option(package_name="exporter", prog_name="exporter")
def cli() -> None:
    """Turn a trained checkpoint into validated, faster deployable artifacts."""


@cli.command(epilog=CONVERT_EXAMPLES)
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--recipe", "-r", default="cpu-fp32", show_default=True, help="Built-in recipe name or a .toml path.")
@click.option("--out", "-o", type=click.Path(path_type=str), default=None,
              help="Output folder [default: artifacts/<model>/<recipe>].")
@click.option("--model", "-m", "factory", default=None, metavar="MODULE:FUNCTION",
              help="Factory that builds the nn.Module (gets config.json as a dict when present).")
@click.option("--inputs", "inputs_file", type=click.Path(path_type=str), default=None,
              help="Real samples: safetensors or .npz of named tensors.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=SIZE[:MIN:MAX]",
              help="Declare an input dim (dynamic when MIN < MAX); repeatable.")
@click.option("--input", "tensors", multiple=True, metavar="NAME:DTYPE:SHAPE[:LOW:HIGH]",
              help="Declare a model input, SHAPE as comma-separated sizes or dim names; repeatable.")
@click.option("--target", "-t", "targets", multiple=True, type=TargetName(),
              help="Build only this target of the recipe's; repeatable.")
@click.option("--no-rewrite", is_flag=True,
              help="Leave attention as written (sites still audited): the baseline for what the rewrite buys.")
@click.option("--task", type=click.Choice(TASKS), default=None,
              help="What to convert for (default: the recipe's model.task, else forward): text-generation builds a "
                   "decoder's prefill and decode programs over a static KV cache; text2text-generation (T5, BART, "
                   "Marian) and automatic-speech-recognition (Whisper) an encoder-decoder's (docs/generation.md).")
@click.option("--set", "settings", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one recipe key, checked like the recipe file (repeatable), e.g. numerics.atol=1e-6, "
                   "runtime.dtype=bfloat16, targets.build=onnx,aoti, inputs.dims.batch=4:1:32.")
@click.option("--allow-drift", is_flag=True, help="Report numerics failures as warnings (recorded in the report).")
@click.option("--allow-pickle", is_flag=True, help="Load a pickle checkpoint with torch.load(weights_only=True).")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json to stdout.")
def convert(checkpoint, recipe, out, factory, inputs_file, dims, tensors, targets, no_rewrite, task, settings,
            allow_drift, allow_pickle, overwrite, quiet, as_json):
    """Load CHECKPOINT, rewrite attention to SDPA, export, validate numerics, benchmark and report."""
    checked(checkpoint, recipe, factory, dims, tensors, not no_rewrite, targets, settings, task, inputs_file)
    from .api import convert as run_convert
    progress = Progress(enabled=not quiet)
    result = run_convert(checkpoint, recipe, out, model=factory, inputs=inputs_file, allow_drift=allow_drift,
                         allow_pickle=allow_pickle, overwrite=overwrite, progress=progress, dims=dims,
                         tensors=tensors, rewrite=not no_rewrite, targets=targets, settings=settings, task=task,
                         command=typed_command(click.get_current_context()))
    show_result(result.report, result.out / "report.md", result.problems, as_json)
    if result.report.get("allow_drift") and any(a["status"] == "numerics_failed" for a in result.report["artifacts"]
                                                + [result.report["rewritten"]]):
        click.echo("warning: numerics failures were allowed by --allow-drift", err=True)
    click.echo(f"output: {result.out}", err=True)
    sys.exit(result.exit_code)


@cli.command(epilog=INSPECT_EXAMPLES)
@click.argument("checkpoint", type=click.Path(path_type=str))
@click.option("--recipe", "-r", default="cpu-fp32", show_default=True, help="Recipe whose input shapes to use.")
@click.option("--model", "-m", "factory", default=None, metavar="MODULE:FUNCTION", help="Model factory.")
@click.option("--inputs", "inputs_file", type=click.Path(path_type=str), default=None, help="Real samples file.")
@click.option("--dim", "dims", multiple=True, metavar="NAME=SIZE[:MIN:MAX]", help="Declare an input dim.")
@click.option("--input", "tensors", multiple=True, metavar="NAME:DTYPE:SHAPE[:LOW:HIGH]", help="Declare an input.")
@click.option("--allow-pickle", is_flag=True, help="Load a pickle checkpoint with torch.load(weights_only=True).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def inspect(checkpoint, recipe, factory, inputs_file, dims, tensors, allow_pickle, as_json):
    """Show CHECKPOINT's architecture, parameters, dtypes and attention sites, without exporting."""
    checked(checkpoint, recipe, factory, dims, tensors, True, (), (), None, inputs_file)
    from .api import inspect as run_inspect

    data = run_inspect(checkpoint, recipe, model=factory, inputs=inputs_file, allow_pickle=allow_pickle, dims=dims,
                       tensors=tensors)
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    click.echo(f"checkpoint:   {data['checkpoint']} ({data['format']}, {data['bytes']:,} bytes, "
               f"{data['tensors']} tensors)")
    click.echo(f"architecture: {data['architecture']} ({data['architecture_source']})")
    click.echo(f"parameters:   {data['parameters']:,}")
    click.echo(f"dtypes:       {', '.join(f'{k} x{v}' for k, v in data['dtypes'].items())}")
    click.echo(f"inputs:       {', '.join(f'{k} {v}' for k, v in data['inputs'].items())}")
    click.echo(f"outputs:      {', '.join(data['outputs'])}")
    att = data["attention"]
    click.echo(f"attention:    {att['found']} found, {att['rewritten']} rewritable to SDPA, {att['skipped']} skipped")
    for site in att["sites"]:
        props = [k for k in ("causal", "masked", "grouped_query") if site.get(k)]
        extra = f" head_dim={site['head_dim']}" if site.get("head_dim") else ""
        reason = f" — {site['reason']}" if site.get("reason") else ""
        status = "rewritable" if site["status"] == "rewritten" else site["status"]  # inspect changes nothing
        click.echo(f"  {site['location']}: {site['kind']} [{status}] {' '.join(props)}{extra}{reason}")


@cli.group(epilog=RECIPES_EXAMPLES)
def recipes() -> None:
    """List and show the built-in recipes."""


@recipes.command("list", epilog=RECIPES_EXAMPLES)
@click.option("--json", "as_json", is_flag=True, help="Print every recipe, whole, as JSON.")
def recipes_list(as_json):
    """List the built-in recipes."""
    loaded = [load_recipe(name) for name in builtin_names()]
    if as_json:
        click.echo(json.dumps({"schema_version": 1, "command": "recipes", "recipes": [
            {"name": r.name, "device": r.runtime.device, "dtype": r.runtime.dtype, "targets": list(r.targets.build),
             "description": r.description, "recipe": {**r.to_dict(), "source": f"{r.name} (built-in)"}}
            for r in loaded]}, indent=2))
        return
    for recipe in loaded:
        click.echo(f"{recipe.name:<20} {recipe.runtime.device:<5} {recipe.runtime.dtype:<9} {recipe.description}")


@recipes.command("show", epilog=RECIPES_EXAMPLES)
@click.argument("name")
def recipes_show(name):
    """Print a recipe file (built-in NAME or a path) after checking it."""
    recipe = load_recipe(name)
    path = Path(recipe.source) if recipe.source else builtin_path(name)
    click.echo(path.read_text(encoding="utf-8"), nl=False)


VERIFY_EXAMPLES = """
\b
Examples:
  exporter verify artifacts/my-model/cpu-fp32
  exporter verify build/my-model --junit reports/exporter-verify.xml

\b
""" + exit_codes_help("verify")

VALIDATE_EXAMPLES = """
\b
Examples:
  exporter validate artifacts/my-model/cpu-fp32
  exporter validate build/my-model --locate
  exporter validate build/my-model --locate --target onnx --json

\b
""" + exit_codes_help("convert")


@cli.command(epilog=VERIFY_EXAMPLES)
@click.argument("out_dir", type=click.Path(path_type=str))
@click.option("--junit", type=click.Path(path_type=str), default=None,
              help="Write JUnit XML to this file (one testcase per artifact and check).")
@click.option("--allow-native-code", is_flag=True,
              help="Also load an AOTInductor package that an exporter check folder holds (someone else compiled it; "
                   "its shared library runs).")
@click.option("--allow-artifact-pickle", is_flag=True,
              help="Also load a .pt2 that needs unpickling (the pickle's code runs).")
@click.option("--checkpoint", type=click.Path(path_type=str), default=None,
              help="The checkpoint the folder was made from (checked against manifest.json's hashes): also ask the "
                   "weights and program proofs again.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def verify(out_dir, junit, allow_native_code, allow_artifact_pickle, checkpoint, as_json):
    """Release gate: re-hash OUT_DIR against manifest.json, re-run every artifact on the stored reference
    inputs and compare with the stored reference outputs. Needs no checkpoint; with --checkpoint the weights
    and program proofs are asked again. Runs no pickle, and no package another tool compiled, unless allowed
    (docs/check.md, threat model)."""
    from .published.verification import summary
    from .published.verification import verify as run_verify

    result = run_verify(out_dir, junit=junit, allow_native_code=allow_native_code,
                        allow_artifact_pickle=allow_artifact_pickle, checkpoint=checkpoint)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    for line in result.problems:
        click.echo(f"error: {line}", err=True)
    click.echo(summary(result), err=as_json)
    sys.exit(result.exit_code)


GENERATE_EXAMPLES = """
\b
Examples:
  exporter convert CKPT --recipe h100-bf16 --task text-generation --out build/llm
  exporter generate build/llm --target aoti --input-ids 128000,791,6864 --max-new-tokens 32
  exporter generate build/llm -t exported_program --input-ids 1,2,3 --input-ids 4,5 --json
  exporter convert ./t5-small --recipe cpu-fp32 --task text2text-generation --out build/t5
  exporter generate build/t5 -t exported_program --input-ids 37,423,19,1 --max-new-tokens 16
  exporter convert ./whisper-tiny --recipe cpu-fp32 --task automatic-speech-recognition --out build/whisper
  exporter generate build/whisper -t aoti --input-features mel.safetensors

\b
""" + exit_codes_help("generate")


@cli.command(epilog=GENERATE_EXAMPLES)
@click.argument("out_dir", type=click.Path(path_type=str))
@click.option("--target", "-t", "target", required=True, type=TargetName(),
              help="The built target to generate with (exported_program, aoti, onnx).")
@click.option("--input-ids", "input_ids", multiple=True, metavar="1,2,3",
              help="A prompt's token ids (an encoder-decoder's source); repeat for more rows (shorter rows are "
                   "padded).")
@click.option("--input-features", "features", type=click.Path(path_type=str), default=None,
              metavar="FILE.safetensors",
              help="A speech model's source: one tensor [batch, mel, frames] (or [mel, frames]) in a safetensors file.")
@click.option("--max-new-tokens", type=int, default=None, help="Tokens to generate [default: the recipe's new_tokens].")
@click.option("--json", "as_json", is_flag=True, help='Print {"generated": [[new token ids], ...]}.')
def generate(out_dir, target, input_ids, features, max_new_tokens, as_json):
    """Greedy generation from a target of a generation output folder (--task text-generation,
    text2text-generation or automatic-speech-recognition)."""
    import os
    import subprocess

    from .generation.generate import generate_tokens
    from .targets.toolchain import aoti_preload

    preload = aoti_preload() if target in TARGET_NAMES and get_target(target).preload else None
    if preload and preload not in os.environ.get("LD_PRELOAD", ""):
        # an AOTInductor package loads with the compiler's libstdc++ first (targets/toolchain.py): run in a child
        from .runners import CHILD_PYTHON, child_env, scratch_env

        argv = ["generate", out_dir, "--target", target, *[f"--input-ids={t}" for t in input_ids]]
        argv += [f"--max-new-tokens={max_new_tokens}"] if max_new_tokens is not None else []
        argv += [f"--input-features={features}"] if features is not None else []
        argv += ["--json"] if as_json else []
        with scratch_env(child_env(preload)) as env:
            done = subprocess.run([*CHILD_PYTHON, "-m", "exporter", *argv], env=env, check=False)
        sys.exit(done.returncode)
    generated = generate_tokens(out_dir, target, token_rows(input_ids), max_new_tokens, features)
    if as_json:
        click.echo(json.dumps({"generated": generated}))
    else:
        for row in generated:
            click.echo(",".join(str(t) for t in row))


CHECK_EXAMPLES = """
\b
Examples:
  optimum-cli export onnx --model ./my-model --task feature-extraction onnx-out/
  exporter check onnx-out/ --against ./my-model --junit reports/exporter-check.xml
  exporter check model.pt2 --against ./my-model --recipe h100-bf16 --out build/check
  exporter check model.aoti.pt2 --against ./my-model --allow-native-code
  exporter check build/my-model/cpu-fp32 --against ./my-model --allow-native-code

\b
""" + exit_codes_help("convert")


@cli.command(epilog=CHECK_EXAMPLES)
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--against", "checkpoint", required=True, type=click.Path(path_type=str),
              help="The checkpoint the artifact was made from (what convert accepts).")
@click.option("--recipe", "-r", default="cpu-fp32", show_default=True, help="Built-in recipe name or a .toml path.")
@click.option("--out", "-o", type=click.Path(path_type=str), default=None,
              help="Output folder [default: artifacts/<artifact>/check-<recipe>].")
@click.option("--model", "-m", "factory", default=None, metavar="MODULE:FUNCTION",
              help="Factory that builds the nn.Module (gets config.json as a dict when present).")
@click.option("--dim", "dims", multiple=True, metavar="NAME=SIZE[:MIN:MAX]",
              help="Declare an input dim (dynamic when MIN < MAX); repeatable.")
@click.option("--set", "settings", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one recipe key (repeatable), e.g. numerics.atol=1e-6.")
@click.option("--junit", type=click.Path(path_type=str), default=None,
              help="Also write a JUnit XML report: one case per artifact and check.")
@click.option("--allow-pickle", is_flag=True, help="Load a pickle checkpoint with torch.load(weights_only=True).")
@click.option("--allow-native-code", is_flag=True,
              help="Load an AOTInductor package (its shared library runs): only one you trust. "
                   "Recipe: [trust] native_code = true.")
@click.option("--allow-artifact-pickle", is_flag=True,
              help="Load a .pt2 whose weights, constants or objects are pickled (the pickle runs): only one you "
                   "trust. Recipe: [trust] artifact_pickle = true.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output folder.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--json", "as_json", is_flag=True, help="Print report.json to stdout.")
def check(artifact, checkpoint, recipe, out, factory, dims, settings, junit, allow_pickle, allow_native_code,
          allow_artifact_pickle, overwrite, quiet, as_json):
    """Judge ARTIFACT (an ONNX file or Optimum export folder, a torch.export .pt2, an AOTInductor package, a
    transformers exporters folder, an exporter output folder) against the checkpoint it came from, with
    convert's gate: float64 reference, tolerance rule, shape grid, first divergent module, timing. Nothing in
    ARTIFACT is executed unless allowed: no pickle, no compiled package (docs/check.md, threat model)."""
    settings = tuple(settings) + (("trust.native_code=true",) if allow_native_code else ()) + \
        (("trust.artifact_pickle=true",) if allow_artifact_pickle else ())
    checked(checkpoint, recipe, factory, dims, (), True, (), settings, None, combination=False)
    if not Path(artifact).exists():
        from .errors import UsageError

        raise UsageError(f"artifact {artifact} does not exist", "check the path")
    from . import junit as junit_mod
    from .check import check as run_check

    if junit is not None:
        junit_mod.check_writable(junit)
    result = run_check(artifact, checkpoint, recipe, out, model=factory, dims=dims, settings=settings,
                       allow_pickle=allow_pickle, overwrite=overwrite, progress=Progress(enabled=not quiet),
                       command=typed_command(click.get_current_context()))
    if junit is not None:
        from .check.cases import junit_cases

        junit_mod.write(junit, "exporter check", junit_cases(result.report), result.report["timings_s"]["total"])
    show_result(result.report, result.out / "report.md", result.problems, as_json)
    click.echo(f"output: {result.out}", err=True)
    sys.exit(result.exit_code)


BATCH_EXAMPLES = """
\b
Examples:
  exporter batch release.toml
  exporter batch release.toml --out build/release --junit reports/exporter-batch.xml
  exporter batch release.toml --workers 2                  # a CPU host: two cells at a time
  exporter batch release.toml --scheduler local-cuda       # dask-cuda: a worker per GPU
  exporter batch release.toml --scheduler tcp://head:8786  # a Dask cluster

\b
""" + exit_codes_help("batch")


@cli.command(epilog=BATCH_EXAMPLES)
@click.argument("plan", type=click.Path(path_type=str))
@click.option("--out", "-o", type=click.Path(path_type=str), default=None,
              help="Batch folder: each cell's folder inside it, batch.json, batch.md [default: artifacts/<plan>].")
@click.option("--workers", "-w", type=int, default=None,
              help="Cells at a time [default: one per visible GPU; 1 on a CPU host].")
@click.option("--scheduler", default=None, metavar="ADDRESS|local|local-cuda",
              help="Run the cells on a Dask cluster: its scheduler's address, or one started here (local: "
                   "--workers processes; local-cuda: dask-cuda, a worker per GPU).")
@click.option("--compile-cache", type=click.Path(path_type=str), default=None,
              help="Inductor compile cache the cells share [default: OUT/.compile-cache].")
@click.option("--junit", type=click.Path(path_type=str), default=None,
              help="Also write JUnit XML: one case per cell.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines.")
@click.option("--json", "as_json", is_flag=True, help="Print batch.json to stdout.")
def batch(plan, out, workers, scheduler, compile_cache, junit, quiet, as_json):
    """Convert every cell of PLAN (checkpoints x recipes, a TOML file: docs/batch.md), each in a process with a
    GPU of its own, on this host or a Dask cluster; cells an earlier run finished are not run again."""
    from .batch import batch as run_batch

    result = run_batch(plan, out, workers=workers, scheduler=scheduler, junit=junit, compile_cache=compile_cache,
                       tell=None if quiet else lambda line: click.echo(line, err=True))
    show_result(result.summary, result.out / "batch.md", result.problems, as_json)
    click.echo(f"output: {result.out}", err=True)
    sys.exit(result.exit_code)


@cli.command(epilog=VALIDATE_EXAMPLES)
@click.argument("out_dir", type=click.Path(path_type=str))
@click.option("--locate", is_flag=True, help="Find the first divergent module of each failing candidate.")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="Only this variant (repeatable); with --locate it is localised even when it passes.")
@click.option("--checkpoint", type=click.Path(path_type=str), default=None,
              help="The checkpoint, if it moved since convert [default: the path in report.json].")
@click.option("--allow-pickle", is_flag=True, help="Load a pickle checkpoint with torch.load(weights_only=True).")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def validate(out_dir, locate, targets, checkpoint, allow_pickle, quiet, as_json):
    """Validate the artifacts in OUT_DIR again from the checkpoint (baseline, samples, shape grid); with
    --locate, localise divergences. OUT_DIR is not modified."""
    from .published.revalidate import validate_folder

    result = validate_folder(out_dir, locate=locate, targets=tuple(targets), checkpoint=checkpoint,
                             allow_pickle=allow_pickle, progress=Progress(enabled=not quiet))
    if as_json:
        click.echo(json.dumps(result, indent=2, default=str))
    else:
        for entry in result["candidates"]:
            click.echo(f"{entry['name']}: {entry['status']}" + (f" ({entry['error']})" if entry["error"] else ""))
            found = (entry.get("numerics") or {}).get("locate")
            if found:
                click.echo(f"  located: {found['summary']}")
    for line in result["problems"]:
        click.echo(f"error: {line}", err=True)
    sys.exit(result["exit_code"])


def main(argv: list[str] | None = None) -> None:
    """Entry point: run the CLI; turn ExporterError into one line and its exit code.

    Run as the process's own command (``argv`` None: the ``exporter`` script, ``python -m exporter``), the
    process ends as soon as the command has, its exit handlers run and its output flushed: tearing down
    the interpreter's torch, transformers and compiled graphs afterwards cost seconds and did nothing the
    operating system does not do. Called with ``argv`` (tests, other programs), it raises SystemExit.

    As the process's own command, ``exporter convert`` runs under :mod:`exporter.supervisor`: the convert in a
    child, this process waiting to say what happened should the child die outright (``EXPORTER_SUPERVISE=0``
    runs it in this process instead, e.g. under a debugger)."""
    if argv is None and sys.argv[1:2] and sys.argv[1] in SUPERVISED and SUPERVISOR_ENV not in os.environ \
            and os.environ.get("EXPORTER_SUPERVISE", "1") != "0":
        sys.stdout.flush()
        os._exit(supervise(sys.argv[1:]))
    try:
        _run(argv)
    except SystemExit as exc:
        if argv is not None:
            raise
        code = exc.code
    else:
        if argv is not None:
            return
        code = 0
    status = code if isinstance(code, int) else 0 if code is None else 1
    if not isinstance(code, int) and code is not None:
        print(code, file=sys.stderr)
    atexit._run_exitfuncs()  # noqa: SLF001 - what interpreter shutdown would run first
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _run(argv: list[str] | None) -> None:
    debug = os.environ.get("EXPORTER_DEBUG") == "1"
    try:
        cli.main(args=argv, prog_name="exporter", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:  # a bad option or argument: one line, like every other user mistake
        ctx = getattr(exc, "ctx", None)  # usage errors carry the command they were raised for
        command = ctx.command_path if ctx is not None else "exporter"
        message = " ".join(exc.format_message().split())
        message += "" if message.endswith((".", "?", "!")) else "."
        click.echo(f"error: {message} Fix: see '{command} --help' for the options.", err=True)
        sys.exit(EXIT_USAGE)
    except click.exceptions.Abort:
        click.echo("error: aborted", err=True)
        sys.exit(130)
    except ExporterError as exc:
        if debug:
            traceback.print_exc()
        click.echo(f"error: {exc.one_line()}", err=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        click.echo("error: interrupted by SIGINT; no manifest was written, so the output is incomplete", err=True)
        sys.exit(130)
    except Exception as exc:  # a bug: say so in one line unless debugging
        if debug:
            traceback.print_exc()
        else:
            click.echo(f"error: internal error ({type(exc).__name__}: {exc}); "
                       "rerun with EXPORTER_DEBUG=1 and report the traceback", err=True)
        sys.exit(EXIT_INTERNAL)
