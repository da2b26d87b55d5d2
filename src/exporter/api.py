"""The library verbs: ``convert`` (the whole pipeline) and ``inspect``.

convert: load -> inputs -> float64 reference -> rewrite attention -> export
targets -> validate numerics -> benchmark -> report. Everything the CLI does is
one call here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import interrupts
from . import report as report_mod
from .checkpoint import load_model
from .checkpoint.files import Checkpoint
from .environment import check_compiler, check_machine, folder_of
from .errors import CheckpointError, ExporterError
from .inputs import plan_inputs
from .measure.memory import TreeMemory, peak_rss_bytes
from .modelio import Signature, discover_outputs
from .outdir import OutputFolder, copy_model_files, disk_full, model_name, os_problem, path_from, public_command
from .pipeline import ConvertRun
from .prepare import original_module
from .progress import Progress
from .quiet import quiet_libraries
from .recipe import GENERATION_TASKS, Recipe, resolve_recipe
from .report.assemble import checkpoint_dtypes
from .results import RunResult
from .rewrite import rewrite_attention

ConvertResult = RunResult  # what convert returns (``exporter.check_artifact`` returns the same)


TREE_BOUND_EXTRA = 4 * 2**30  # GPU recipes: the process tree within 1.3 x the checkpoint + 4 GiB (docs/convert-time.md)


def memory_section(recipe: Recipe, checkpoint_bytes: int, tree: TreeMemory) -> dict[str, Any]:
    """The report's ``memory``: the convert process's own peak and the whole process tree's, sampled."""
    section: dict[str, Any] = {"convert_peak_rss_bytes": peak_rss_bytes(), "checkpoint_bytes": checkpoint_bytes,
                               "tree": tree.to_dict()}
    if recipe.runtime.device != "cpu":
        bound = int(1.3 * checkpoint_bytes + TREE_BOUND_EXTRA)
        section["tree_bound_bytes"] = bound
        section["tree_within_bound"] = tree.peak_pss <= bound
    return section


def default_out(checkpoint: str | Path, recipe: Recipe) -> Path:
    suffix = ("" if recipe.runtime.rewrite_attention else "-no-rewrite") + \
        ("-generation" if recipe.model.task in GENERATION_TASKS else "")
    return Path("artifacts") / model_name(Path(checkpoint)) / f"{recipe.name}{suffix}"


def convert(checkpoint: str | Path, recipe: str | Path | Recipe = "cpu-fp32", out: str | Path | None = None, *,
            model: str | None = None, inputs: str | Path | None = None, allow_drift: bool = False,
            allow_pickle: bool = False, overwrite: bool = False, progress: Progress | None = None,
            dims: tuple[str, ...] = (), tensors: tuple[str, ...] = (), rewrite: bool = True,
            targets: tuple[str, ...] = (), settings: tuple[str, ...] = (), task: str | None = None,
            command: list[str] | None = None) -> ConvertResult:
    """Run the whole pipeline on ``checkpoint`` and return the report; files land in ``out``.

    ``dims`` and ``tensors`` declare inputs as the command line's ``--dim`` and ``--input`` do;
    ``rewrite=False`` is ``--no-rewrite`` (attention audited, left as written: to measure the rewrite);
    ``targets`` is ``--target``, a subset of the recipe's targets; ``task`` is ``--task``
    (``text-generation``: prefill and decode programs over a static KV cache, docs/generation.md);
    ``settings`` are ``--set section.key=value``
    overrides; ``command`` is the command line to record in the report (the CLI passes its own).
    Raises ExporterError for user mistakes (before anything is written) and for interrupts; target
    and numerics failures are reported in the result (``exit_code``), not raised.
    """
    progress = progress or Progress(enabled=False)
    recipe_obj = resolve_recipe(recipe, model, dims, tensors, rewrite, targets, settings, task)
    check_machine(recipe_obj)
    check_compiler(recipe_obj)
    checkpoint = Path(checkpoint)
    if not checkpoint.exists():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist", "check the path")
    final = Path(out) if out is not None else default_out(checkpoint, recipe_obj)
    with interrupts.watch(), quiet_libraries(), OutputFolder(final, overwrite=overwrite,
                                                             keep_clear=checkpoint) as folder:
        run = ConvertRun(checkpoint, recipe_obj, folder.staged, inputs, allow_drift, allow_pickle, progress)
        try:
            with TreeMemory(stage=lambda: progress.current) as tree:
                opened: Checkpoint | None
                if recipe_obj.model.task in GENERATION_TASKS:
                    from .generation.run import convert_generation  # noqa: PLC0415

                    data, opened = convert_generation(checkpoint, recipe_obj, folder.staged, allow_drift,
                                                      allow_pickle, progress)
                    manifest_inputs = {"checkpoint_files": list(opened.files),
                                       "recipe": run.manifest_inputs()["recipe"]}
                else:
                    data = run.execute()
                    manifest_inputs = run.manifest_inputs()
                    opened = run.loaded.checkpoint if run.loaded else None
            unchanged(opened)
            if opened is not None:
                data["model"]["folder_files"] = copy_model_files(opened.root, folder.staged)
            data["memory"] = memory_section(recipe_obj, data["model"]["checkpoint_bytes"], tree)
            data["run"] = {"command": public_command(command) if command else None, "settings": list(settings)}
            data["model"]["checkpoint"] = path_from(folder.final, checkpoint)  # from where the report will be
            report_mod.write_all(folder.staged, data, manifest_inputs)
        except ExporterError:
            raise
        except Exception as exc:
            full = disk_full(exc)
            if full is not None:
                raise os_problem(full, folder_of(full, folder.final)) from None
            raise
        finally:
            run.close()
        published = folder.publish()
    return ConvertResult(published, data, data["exit_code"], data.get("problems", []))


def unchanged(opened) -> None:
    """Refuse to publish artifacts made from a checkpoint that changed while it was read (a sync or download
    writing over it): the reference and the artifacts may then come from different weights."""
    changed = opened.changed() if opened is not None else []
    if changed:
        raise CheckpointError(f"the checkpoint changed while it was being read ({', '.join(p.name for p in changed)} "
                              "was rewritten during the convert); nothing was published",
                              "convert again once the checkpoint is complete (copy it first if something syncs "
                              "or downloads into it)")


def inspect(checkpoint: str | Path, recipe: str | Path | Recipe = "cpu-fp32", *, model: str | None = None,
            inputs: str | Path | None = None, allow_pickle: bool = False, dims: tuple[str, ...] = (),
            tensors: tuple[str, ...] = ()) -> dict[str, Any]:
    """Architecture, parameter count, dtypes and attention sites of a checkpoint, without exporting."""
    recipe_obj = resolve_recipe(recipe, model, dims, tensors)
    loaded = load_model(checkpoint, recipe_obj.model.factory, allow_pickle, recipe_obj.model.pipeline)
    plan = plan_inputs(loaded.model, recipe_obj.inputs, inputs)
    outputs = discover_outputs(loaded.model, plan.samples[0], recipe_obj.model.outputs)
    signature = Signature(plan.names, outputs)
    original = original_module(loaded, signature)
    _, audit = rewrite_attention(original, [plan.samples[0][n] for n in plan.names])
    return {
        "schema_version": 1,
        "command": "inspect",
        "checkpoint": str(checkpoint),
        "files": [str(f) for f in loaded.checkpoint.files],
        "format": loaded.checkpoint.format,
        "bytes": loaded.checkpoint.nbytes,
        "architecture": loaded.architecture.name,
        "architecture_source": loaded.architecture.source,
        "parameters": sum(p.numel() for p in loaded.model.parameters()),
        "tensors": len(loaded.checkpoint.entries),
        "dtypes": checkpoint_dtypes(loaded.checkpoint),
        "inputs": {n: list(t.shape) for n, t in plan.samples[0].items()},
        "outputs": list(outputs),
        "attention": audit.to_dict(),
    }
