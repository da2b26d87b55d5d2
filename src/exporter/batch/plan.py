"""A batch plan: checkpoints x recipes, read from TOML and checked whole before anything runs.

.. code-block:: toml

    [[run]]                       # one cell
    checkpoint = "models/gpt2"    # relative to the plan file
    recipe = "h100-bf16"          # a built-in name, or a .toml path relative to the plan file
    task = "text-generation"      # optional: what --task takes
    targets = ["aoti"]            # optional: what --target takes, repeated
    set = ["bench.rounds=5"]      # optional: what --set takes, repeated
    model = "mypkg.models:build"  # optional: a factory, as --model takes
    out = "{model}/{recipe}-gen"  # optional: the folder under --out; {model}, {recipe}, {task}

    [matrix]                      # every checkpoint under every recipe, the same optional keys
    checkpoints = ["models/bert", "models/vit"]
    recipes = ["h100-bf16", "cpu-fp32"]

Every problem is found in one pass (unknown keys with a did-you-mean, missing checkpoints, recipes that do not
load, ``--set`` values the recipe refuses, two cells writing one folder) and told together, like a recipe
file's. Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import json
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlanError, Problems, RecipeError
from ..outdir import model_name
from ..recipe import TASKS, Recipe, resolve_recipe
from ..targets import NAMES as TARGET_NAMES

DEFAULT_OUT = "{model}/{recipe}"
PLACEHOLDERS = ("model", "recipe", "task")
CELL_KEYS = ("task", "targets", "set", "model", "out")
RUN_KEYS = ("checkpoint", "recipe", *CELL_KEYS)
MATRIX_KEYS = ("checkpoints", "recipes", *CELL_KEYS)
TOP_KEYS = ("schema_version", "description", "run", "matrix")


@dataclass(frozen=True)
class Cell:
    """One convert of the plan: what ``exporter convert`` is given, and where its folder goes."""

    name: str  # the folder under --out, which is also the cell's name in every summary
    checkpoint: Path  # absolute
    recipe: str  # a built-in name, or an absolute .toml path
    recipe_name: str
    device: str  # the resolved recipe's runtime.device
    task: str | None = None
    targets: tuple[str, ...] = ()
    settings: tuple[str, ...] = ()
    model: str | None = None
    origin: str = ""  # where the plan defines it: "run[2]" or "matrix (models/bert x cpu-fp32)"
    recipe_dict: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def convert_args(self, out: Path) -> list[str]:
        """The arguments after ``exporter`` that run this cell into ``out``."""
        args = ["convert", str(self.checkpoint), "--recipe", self.recipe, "--out", str(out)]
        args += ["--task", self.task] if self.task else []
        for target in self.targets:
            args += ["--target", target]
        for setting in self.settings:
            args += ["--set", setting]
        args += ["--model", self.model] if self.model else []
        return args

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "checkpoint": str(self.checkpoint), "recipe": self.recipe_name,
                "task": self.task, "targets": list(self.targets), "set": list(self.settings), "model": self.model,
                "origin": self.origin}


@dataclass(frozen=True)
class Plan:
    path: Path
    cells: tuple[Cell, ...]
    description: str = ""


def _unknown(table: dict, known: tuple[str, ...], where: str, problems: Problems) -> None:
    for key in table:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            problems.add(f"{where}.{key}" if where else key,
                         "unknown key" + (f" (did you mean {near[0]!r}?)" if near else f" (keys: {', '.join(known)})"))


def _string(table: dict, key: str, where: str, problems: Problems, required: bool = False) -> str | None:
    value = table.get(key)
    if value is None:
        if required:
            problems.add(where, f"{key} is required")
        return None
    if not isinstance(value, str) or not value.strip():
        problems.add(f"{where}.{key}", f"expected a non-empty string, got {value!r}")
        return None
    return value


def _strings(table: dict, key: str, where: str, problems: Problems, required: bool = False) -> tuple[str, ...]:
    value = table.get(key)
    if value is None:
        if required:
            problems.add(where, f"{key} is required (a list of strings)")
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        problems.add(f"{where}.{key}", f"expected a list of non-empty strings, got {value!r}")
        return ()
    if required and not value:
        problems.add(f"{where}.{key}", "is empty")
    return tuple(value)


def _recipe_ref(text: str, folder: Path) -> str:
    """A recipe as the plan names it: a built-in name stays a name, a path is taken from the plan's folder."""
    looks_like_path = text.endswith((".toml", ".json")) or "/" in text or "\\" in text
    return str((folder / text).resolve()) if looks_like_path else text


def _render_out(pattern: str, values: dict[str, str], where: str, problems: Problems) -> str | None:
    try:
        fields = [name for _, name, _, _ in string.Formatter().parse(pattern) if name is not None]
    except ValueError as exc:
        problems.add(f"{where}.out", f"{pattern!r} is not a folder pattern ({exc})")
        return None
    unknown = [name for name in fields if name not in PLACEHOLDERS]
    if unknown:
        problems.add(f"{where}.out", f"{{{unknown[0]}}} is not a placeholder (use {{model}}, {{recipe}}, {{task}})")
        return None
    rendered = pattern.format(**values)
    parts = Path(rendered).parts
    if Path(rendered).is_absolute() or ".." in parts or not parts or rendered.strip() in ("", "."):
        problems.add(f"{where}.out", f"{pattern!r} must name a folder inside --out (relative, without '..')")
        return None
    return Path(rendered).as_posix()


def load_plan(path: str | Path, *, local_gpus: int | None = None) -> Plan:
    """Read and check ``path``; every problem is raised at once as :class:`PlanError` (exit 2).

    ``local_gpus``: the GPUs of the host that will run the cells (None: cells run elsewhere, e.g. on a Dask
    cluster); a CUDA recipe on a host with none is a problem of the plan, told before anything runs."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan {path} does not exist", "check the path of the plan file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PlanError(f"plan {path} is not valid TOML ({exc})", "fix the syntax at the position named") from None
    problems = Problems(f"plan {path}", PlanError, "correct the plan file (docs/batch.md lists every key)")
    folder = path.resolve().parent
    _unknown(data, TOP_KEYS, "", problems)
    if data.get("schema_version", 1) != 1:
        problems.add("schema_version", f"{data['schema_version']!r} is not a known version; write 1")
    entries: list[tuple[str, dict[str, Any]]] = []  # (origin, keys of one cell)
    runs = data.get("run", [])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        problems.add("run", "expected an array of tables ([[run]])")
        runs = []
    for index, run in enumerate(runs, 1):
        where = f"run[{index}]"
        _unknown(run, RUN_KEYS, where, problems)
        checkpoint = _string(run, "checkpoint", where, problems, required=True)
        recipe = _string(run, "recipe", where, problems, required=True)
        if checkpoint and recipe:
            entries.append((where, {**run, "checkpoint": checkpoint, "recipe": recipe}))
    matrix = data.get("matrix")
    if matrix is not None:
        if not isinstance(matrix, dict):
            problems.add("matrix", "expected a table ([matrix])")
        else:
            _unknown(matrix, MATRIX_KEYS, "matrix", problems)
            common = {k: matrix[k] for k in CELL_KEYS if k in matrix}
            checkpoints = _strings(matrix, "checkpoints", "matrix", problems, required=True)
            recipes = _strings(matrix, "recipes", "matrix", problems, required=True)
            for checkpoint in checkpoints:
                for recipe in recipes:
                    entries.append((f"matrix ({checkpoint} x {recipe})",
                                    {**common, "checkpoint": checkpoint, "recipe": recipe}))
    if not entries and not problems.items:
        problems.add("plan", "lists no cells; add [[run]] tables or a [matrix]")
    cells = [cell for cell in (_cell(origin, entry, folder, problems, local_gpus) for origin, entry in entries)
             if cell is not None]
    _distinct(cells, problems)
    description = data.get("description")
    if description is not None and not isinstance(description, str):
        problems.add("description", f"expected a string, got {description!r}")
    problems.raise_if_any()
    return Plan(path, tuple(cells), description or "")


def _cell(where: str, entry: dict[str, Any], folder: Path, problems: Problems,
          local_gpus: int | None) -> Cell | None:
    before = len(problems.items)
    checkpoint = (folder / entry["checkpoint"]).resolve()
    if not checkpoint.exists():
        problems.add(f"{where}.checkpoint", f"{entry['checkpoint']} does not exist (paths are relative to the "
                                            "plan file)")
    task = _string(entry, "task", where, problems)
    if task is not None and task not in TASKS:
        problems.add(f"{where}.task", f"{task!r} is not one of {', '.join(TASKS)}")
    targets = _strings(entry, "targets", where, problems)
    for target in targets:
        if target not in TARGET_NAMES:
            near = difflib.get_close_matches(target, TARGET_NAMES, n=1, cutoff=0.5)
            problems.add(f"{where}.targets", f"{target!r} is not a target" +
                         (f" (did you mean {near[0]!r}?)" if near else f"; targets are {', '.join(TARGET_NAMES)}"))
    settings = _strings(entry, "set", where, problems)
    model = _string(entry, "model", where, problems)
    pattern = _string(entry, "out", where, problems) or DEFAULT_OUT
    recipe_ref = _recipe_ref(entry["recipe"], folder)
    try:  # also when an option above is wrong, so that the recipe's own problems are told in the same pass
        recipe: Recipe = resolve_recipe(recipe_ref, model if model and ":" in model else None, (), (), True,
                                        tuple(t for t in targets if t in TARGET_NAMES), settings,
                                        task if task in TASKS else None)
    except RecipeError as exc:
        if "given with --set" in exc.message or "given with --target" in exc.message:  # the cell's set / targets
            key = "set" if "--set" in exc.message else "targets"
            problems.add(f"{where}.{key}", exc.message.split("problem(s): ", 1)[-1].replace("--target", "targets"))
        else:
            problems.add(f"{where}.recipe", exc.message + (f": {exc.hint.rstrip('.')}" if exc.hint else ""))
        return None
    if len(problems.items) > before:
        return None
    if local_gpus == 0 and recipe.runtime.device == "cuda":
        problems.add(f"{where}.recipe", f"{recipe.name} runs on CUDA and this host has no GPU (run the plan on a GPU "
                                        "host, or on a cluster with --scheduler)")
        return None
    values = {"model": model_name(checkpoint), "recipe": recipe.name, "task": recipe.model.task}
    name = _render_out(pattern, values, where, problems)
    if name is None:
        return None
    recipe_dict = json.loads(json.dumps(recipe.to_dict()))
    recipe_dict.pop("source", None)
    return Cell(name=name, checkpoint=checkpoint, recipe=recipe_ref, recipe_name=recipe.name,
                device=recipe.runtime.device, task=task, targets=targets, settings=settings, model=model,
                origin=where, recipe_dict=recipe_dict)


def _distinct(cells: list[Cell], problems: Problems) -> None:
    """Two cells never share a folder, and no cell's folder lies inside another's."""
    seen: dict[str, Cell] = {}
    for cell in cells:
        if cell.name in seen:
            problems.add(cell.origin, f"writes {cell.name}, as {seen[cell.name].origin} does; give one of them an "
                                      "out pattern of its own (e.g. out = \"{model}/{recipe}-{task}\")")
        seen.setdefault(cell.name, cell)
    names = sorted(seen)
    for outer in names:
        for inner in names:
            if inner != outer and inner.startswith(outer + "/"):
                problems.add(seen[inner].origin, f"writes {inner}, inside {outer} where {seen[outer].origin} writes; "
                                                 "give them folders side by side")


__all__ = ["Cell", "Plan", "DEFAULT_OUT", "load_plan"]
