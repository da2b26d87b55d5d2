"""Recipes: named, versioned run settings parsed into frozen, typed objects.

A recipe is a TOML file. Parsing checks every key and value and reports every
problem at once; unknown keys are errors, so a typo never silently falls back
to a default. The defaults live here and nowhere else.

Built-in recipes ship in the wheel as ``exporter/recipes/*.toml`` and, in a
source checkout, live in the top-level ``recipes/`` folder.
"""

from __future__ import annotations

import difflib
import importlib.resources
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..outdir import public_path
from ..targets import NAMES as TARGETS
from . import sections
from .parse import check_combination, parse_recipe
from .sections import *  # noqa: F403 - the typed sections are the package's names too
from .sections import Recipe, parse_dim_option, recipe_problems

__all__ = [*sections.__all__, "TARGETS", "apply_settings", "builtin_dir", "builtin_names", "builtin_path",
           "check_combination", "load_recipe", "parse_recipe", "public_source", "recipe_from_dict", "resolve_recipe"]


# --------------------------------------------------------------------------- lookup


def builtin_dir() -> Path:
    """The folder of built-in recipes: inside the installed package, else the checkout's recipes/."""
    packaged = Path(str(importlib.resources.files("exporter"))) / "recipes"
    if packaged.is_dir():
        return packaged
    checkout = Path(__file__).resolve().parents[3] / "recipes"
    return checkout


def public_source(recipe: Recipe) -> str:
    """Where a recipe came from, as a published report shows it: a built-in's name, or a public path."""
    if not recipe.source:
        return ""
    source = Path(recipe.source)
    folder = builtin_dir()
    if source.is_absolute() and folder.is_dir() and source.resolve().is_relative_to(folder.resolve()):
        return f"{recipe.name} (built-in)"
    return public_path(source)


def builtin_names() -> list[str]:
    folder = builtin_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.rglob("*.toml"))


def builtin_path(name: str) -> Path | None:
    folder = builtin_dir()
    matches = sorted(folder.rglob(f"{name}.toml")) if folder.is_dir() else []
    return matches[0] if matches else None


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a built-in recipe by name, or a recipe file by path: TOML, or the ``recipe.json`` a run wrote."""
    text = str(name_or_path)
    path = Path(text)
    looks_like_path = text.endswith((".toml", ".json")) or "/" in text or "\\" in text
    if not looks_like_path:
        found = builtin_path(text)
        if found is None:
            names = builtin_names()
            near = difflib.get_close_matches(text, names, n=3, cutoff=0.4)
            hint = f"did you mean {', '.join(near)}?" if near else f"built-in recipes are: {', '.join(names)}"
            raise RecipeError(f"unknown recipe {text!r}",
                              f"{hint} (or pass the path of a .toml recipe file)")
        path, name = found, text
    else:
        if not path.is_file():
            raise RecipeError(f"recipe file {text} does not exist", "check the path, or pass a built-in recipe name")
        name = path.stem
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise RecipeError(f"recipe {path} is not valid JSON ({exc})",
                              "fix the syntax at the position named") from None
        if not isinstance(data, dict):
            raise RecipeError(f"recipe {path} is not a JSON object", "pass a recipe.json written by exporter convert")
        return recipe_from_dict(data, source=str(path))
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe {path} is not valid TOML ({exc})", "fix the syntax at the position named") from None
    return parse_recipe(data, name=name, source=str(path))


def recipe_from_dict(data: dict[str, Any], source: str = "recipe.json") -> Recipe:
    """The Recipe a ``recipe.json`` (``Recipe.to_dict()``) holds, checked by the same parser as a TOML file."""
    return parse_recipe(_as_table(data), name=str(data.get("name") or Path(source).stem), source=source)


def _as_table(data: dict[str, Any]) -> dict[str, Any]:
    """``Recipe.to_dict()``'s shape turned into the TOML file's (what :func:`parse_recipe` reads)."""
    table: dict[str, Any] = {k: v for k, v in data.items() if k not in ("name", "source", "inputs") and v is not None}
    for section in ("model", "runtime", "targets", "numerics", "bench", "report", "generation", "quantize", "trust"):
        if isinstance(table.get(section), dict):
            table[section] = {k: v for k, v in table[section].items() if v is not None}
    inputs = data.get("inputs")
    if isinstance(inputs, dict):
        converted: dict[str, Any] = {k: v for k, v in inputs.items() if k not in ("dims", "tensors")}
        dims = inputs.get("dims")
        if isinstance(dims, list) and all(isinstance(d, dict) for d in dims):
            # [{name, size, min, max}] in JSON, a table of tables in TOML
            converted["dims"] = {str(d.get("name")): {k: v for k, v in d.items() if k != "name"} for d in dims}
        elif dims is not None:
            converted["dims"] = dims
        if inputs.get("tensors"):
            converted["tensor"] = inputs["tensors"]
        table["inputs"] = converted
    elif inputs is not None:
        table["inputs"] = inputs
    return table


_SETTING = re.compile(r"^([a-z_]+)\.([A-Za-z_][A-Za-z0-9_.]*)=(.*)$", re.S)


def _setting_value(text: str, current: Any) -> Any:
    """A ``--set`` value: a TOML value (``1e-6``, ``true``, ``["a", "b"]``), a comma-separated list where the
    key holds a list, ``SIZE[:MIN:MAX]`` for a dim, and otherwise the text itself (``bfloat16``)."""
    if isinstance(current, list) and not text.lstrip().startswith("["):
        return [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_settings(recipe: Recipe, settings: tuple[str, ...]) -> Recipe:
    """``--set section.key=value`` (repeatable) on top of ``recipe``, checked by the recipe file's parser."""
    if not settings:
        return recipe
    table = _as_table(json.loads(json.dumps(recipe.to_dict())))  # the shape recipe.json has: lists, not tuples
    hint = "write --set section.key=value, e.g. --set numerics.atol=1e-6 (docs/recipes.md lists every key)"
    given: dict[tuple[str, str], str] = {}
    for text in settings:
        match = _SETTING.match(text)
        if not match:
            raise RecipeError(f"--set {text!r} is not section.key=value", hint)
        section, key, value = match.groups()
        before = given.setdefault((section, key), value)
        if before.strip() != value.strip():  # neither may silently win
            raise RecipeError(f"--set {section}.{key} is given twice ({before!r} and {value!r})",
                              f"give --set {section}.{key}=... once")
        if section not in table:
            table[section] = {}
        if not isinstance(table[section], dict):
            raise RecipeError(f"--set {text!r}: {section} is not a section", hint)
        if section == "inputs" and key.startswith("dims."):
            name = key[len("dims."):]
            table["inputs"].setdefault("dims", {}).update(parse_dim_option(f"{name}={value}"))
            continue
        table[section][key] = _setting_value(value, table[section].get(key))
    problems = recipe_problems("given with --set", hint)
    return parse_recipe(table, name=recipe.name, source=recipe.source, problems=problems)


def _refuse_dims_set_twice(dims: tuple[str, ...], settings: tuple[str, ...]) -> None:
    """``--dim NAME=...`` and ``--set inputs.dims.NAME=...`` giving one dim two different sizes: refused, as an
    option given twice with two values is (neither silently wins); the same size given both ways is allowed."""
    if not dims:
        return
    by_set: dict[str, str] = {}
    for text in settings:
        match = _SETTING.match(text)
        if match and match.group(1) == "inputs" and match.group(2).startswith("dims."):
            by_set[match.group(2)[len("dims."):]] = match.group(3)
    for text in dims:
        parsed = parse_dim_option(text)
        name = next(iter(parsed))
        if name in by_set and parse_dim_option(f"{name}={by_set[name]}")[name] != parsed[name]:
            raise RecipeError(f"--dim {text!r} and --set inputs.dims.{name}={by_set[name]} both size dim {name}",
                              f"give one of them: --dim {name}=SIZE[:MIN:MAX]")


def resolve_recipe(recipe: str | Path | Recipe, factory: str | None = None, dims: tuple[str, ...] = (),
                   tensors: tuple[str, ...] = (), rewrite: bool = True, targets: tuple[str, ...] = (),
                   settings: tuple[str, ...] = (), task: str | None = None, combination: bool = True) -> Recipe:
    """The recipe (a name, a path or a Recipe) with the command line's ``--set`` overrides, then its factory,
    input declarations, ``--target`` selection and ``--no-rewrite`` (``rewrite=False``; True keeps the
    recipe's own setting). Torch is not needed: the command line checks all of it before loading torch.
    ``--target`` and ``--set targets.build=`` both choosing the targets is refused, and so are ``--dim`` and
    ``--set inputs.dims.`` giving one dim two sizes: neither silently wins."""
    if targets and any(s.split("=", 1)[0].strip() == "targets.build" for s in settings):
        raise RecipeError("--target and --set targets.build=... both choose the targets to build",
                          "give one of them: --target NAME (repeatable) or --set targets.build=NAME,NAME")
    _refuse_dims_set_twice(dims, settings)
    loaded = apply_settings(recipe if isinstance(recipe, Recipe) else load_recipe(recipe), settings)
    resolved = loaded.with_factory(factory).with_inputs(dims, tensors).with_targets(targets).with_task(task)
    if combination:  # exporter check builds nothing: it refuses [quantize] itself, whatever the targets
        check_combination(resolved, "given on the command line")
    return resolved if rewrite else resolved.with_rewrite(False)
