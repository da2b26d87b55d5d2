"""What the command line's verbs share: Click parameter types, the rule that a single-valued option is given once,
the command as it could be typed again, and how a result is printed."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import click

from .targets import NAMES as TARGET_NAMES


class TargetName(click.ParamType):
    """A target's name, checked when the command line is read (before torch loads), with a did-you-mean."""

    name = "target"

    def convert(self, value, param, ctx):
        if value in TARGET_NAMES:
            return value
        near = difflib.get_close_matches(str(value), TARGET_NAMES, n=1, cutoff=0.5)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        self.fail(f"{value!r} is not a target{hint}; targets are {', '.join(TARGET_NAMES)}", param, ctx)

    def get_metavar(self, param, ctx=None):
        return "[" + "|".join(TARGET_NAMES) + "]"


def repeated_options(command: click.Command, ctx: click.Context, args: list[str]) -> str | None:
    """The first single-valued option of ``command`` that ``args`` give twice with different values (a flag and
    its ``--no-`` form count as two values), described for the error; ``None`` when there is none. Click keeps
    the last value silently: a script that appends ``--recipe`` to a line that has one already would run
    another recipe than the one it reads first."""
    spellings: dict[str, click.Option] = {}
    for param in command.get_params(ctx):
        if isinstance(param, click.Option) and not (param.multiple or param.count or param.is_eager):
            for spelling in (*param.opts, *param.secondary_opts):
                spellings[spelling] = param
    seen: dict[str, tuple[str, str]] = {}
    tokens = iter(args)
    for token in tokens:
        if token == "--":
            break
        name, eq, inline = token.partition("=") if token.startswith("--") else (token, "", "")
        option = spellings.get(name)
        if option is None:
            continue
        if option.is_flag:
            value = name
        elif eq:
            value = inline
        else:
            value = next(tokens, "")
        assert option.name is not None
        first = seen.setdefault(option.name, (name, value))
        if first[1] != value:
            return (f"{option.opts[0]} is given twice ({first[0]} {first[1]!r} and {name} {value!r}), and only one "
                    f"can hold; give it once" if not option.is_flag else
                    f"{first[0]} and {name} are both given, and only one can hold; give one of them")
    return None


class OnceCommand(click.Command):
    """A command whose single-valued options may be given once (or repeated with the same value)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        problem = repeated_options(self, ctx, list(args))
        if problem:
            raise click.UsageError(problem, ctx=ctx)
        return super().parse_args(ctx, args)


class OnceGroup(click.Group):
    """Every command under it an ``OnceCommand`` (subgroups included)."""

    command_class = OnceCommand
    group_class = type


def typed_command(ctx: click.Context) -> list[str]:
    """The command as it could be typed again: its arguments, the recipe (always: a default can change), then
    every other option not left at its default."""
    parts = ["exporter", str(ctx.info_name)]
    options = []
    for param in ctx.command.params:
        value = ctx.params.get(param.name or "")
        if isinstance(param, click.Argument):
            parts.append(str(value))
        elif isinstance(param, click.Option) and (param.name == "recipe" or (
                value not in (None, False, ()) and value != param.default)):
            flag = max(param.opts, key=len)
            values = (value or ()) if param.multiple else (None,) if param.is_flag else (value,)
            for item in values:
                options += [flag] if item is None else [flag, str(item)]
    return parts + options


def show_result(data: dict, markdown: Path, problems: list[str], as_json: bool) -> None:
    """What convert, check and batch print: the JSON (``--json``) or the Markdown report on stdout, then each
    problem as an ``error:`` line on stderr."""
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        show_markdown(markdown.read_text(encoding="utf-8"))
    for line in problems:
        click.echo(f"error: {line}", err=True)


def show_markdown(text: str, console=None) -> None:
    """report.md on a terminal: headings, tables and emphasis drawn by rich; piped or redirected, the Markdown
    itself (a CI log or a file keeps every column, and renders where Markdown does)."""
    from rich.console import Console
    from rich.markdown import Markdown

    from .report.terminal import fit

    console = console or Console(highlight=False)
    if console.is_terminal:
        console.print(Markdown(fit(text, console.width)))
    else:
        click.echo(text)


def token_rows(texts: tuple[str, ...]) -> list[list[int]]:
    from .errors import InputsError

    rows = []
    for text in texts:
        try:
            rows.append([int(part) for part in text.replace(" ", "").split(",") if part])
        except ValueError:
            raise InputsError(f"--input-ids {text!r} is not a comma-separated list of token ids",
                              "write --input-ids 1,2,3") from None
    return rows


def checked(checkpoint, recipe, factory, dims, tensors, rewrite, targets, settings, task, inputs_file=None,
            combination=True):
    """Everything the command line can check without torch: the recipe with every option applied, the
    checkpoint's and the inputs file's existence (a typo costs a moment, not torch's import)."""
    from .errors import CheckpointError, InputsError
    from .recipe import resolve_recipe

    resolved = resolve_recipe(recipe, factory, dims, tensors, rewrite, targets, settings, task, combination)
    if not Path(checkpoint).exists():
        raise CheckpointError(f"checkpoint {checkpoint} does not exist", "check the path")
    if inputs_file is not None and not Path(inputs_file).is_file():
        raise InputsError(f"inputs file {inputs_file} does not exist", "check the --inputs path")
    return resolved
