"""The error tree, the exit codes, and how an exception is told in one line.

Each error class carries the exit code the CLI returns for it. A user mistake is reported as one line:
what is wrong, and how to fix it. The CLI's ``main`` is the only place that turns these into output;
library callers catch :class:`ExporterError` and read ``exit_code`` / ``hint``.

The exit codes live in :data:`EXIT_CODES` and nowhere else: the CLI's help and docs/exit-codes.md
(``python scripts/error_catalogue.py``) are generated from it.
"""

from __future__ import annotations

import signal
import textwrap
from dataclasses import dataclass

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NUMERICS = 3
EXIT_TARGET = 4
EXIT_ENVIRONMENT = 5
EXIT_INTEGRITY = 6
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


@dataclass(frozen=True)
class ExitCode:
    code: int
    short: str  # a few words, for --help
    meaning: str  # what it means for convert (and validate)
    examples: str = ""
    verify: str = ""  # what it means for exporter verify; empty when verify does not return it


EXIT_CODES: tuple[ExitCode, ...] = (
    ExitCode(EXIT_OK, "passed",
             "every target built and passed numerics (skipped targets, such as `tensorrt` without "
             "`torch_tensorrt`, do not fail a run); also when only numerics failed and `--allow-drift` was given",
             verify="verified: every listed file matches `manifest.json`, the recorded run passed, every artifact "
                    "re-ran within its stored bars"),
    ExitCode(EXIT_INTERNAL, "internal error", "internal error: a bug in exporter",
             "rerun with `EXPORTER_DEBUG=1` and report the traceback; also a convert process that crashed outright "
             "(SIGSEGV, SIGABRT in a native library: the supervising `exporter convert` says so and removes its "
             "staging folder)"),
    ExitCode(EXIT_USAGE, "usage or input error", "usage or input error",
             "unknown option; unknown recipe; recipe with unknown keys or bad values; checkpoint missing, damaged or "
             "not fitting the architecture; no `config.json` and no `--model`; factory that fails; inputs file with "
             "missing names or wrong shapes or dtypes; pickle without `--allow-pickle`; `--target` together with "
             "`--set targets.build`; for `batch`: a plan with problems (every one is listed at once); the checkpoint "
             "changed while convert read it (rewritten in place: refused "
             "before publishing, or SIGBUS told by the supervising process); for `validate`: no "
             "`manifest.json`, an unknown `--target`, the checkpoint missing or changed since convert; for `check`: "
             "an artifact that is missing, not ONNX or `.pt2`, empty, or of another model (an input, size or "
             "output the checkpoint's model does not have)",
             verify="usage: `OUT_DIR` does not exist or is not a folder"),
    ExitCode(EXIT_NUMERICS, "numerics failure", "numerics failure",
             "a candidate's error exceeded `k × eager error + atol` on some output; `report.json` names the target, "
             "the output and the sample",
             verify="numerics difference: an artifact's re-run exceeds the bar stored for some (sample, output), or "
                    "has NaN/Inf where the reference is finite; or the recorded run failed numerics (also when "
                    "`--allow-drift` let it exit 0)"),
    ExitCode(EXIT_TARGET, "target failure", "target failure",
             "a target could not be built, loaded (a crash of its child process included) or run; or the original "
             "model does not run in float64, so no reference exists",
             verify="target failure: an artifact no longer loads or runs; or the recorded run had a target failure"),
    ExitCode(EXIT_ENVIRONMENT, "environment or output error", "environment or output error",
             "a CUDA recipe on a machine without a GPU; transformers not installed for a `config.json` model; output "
             "folder not writable, already holding a run (without `--overwrite`), holding files that are not a run "
             "(even with `--overwrite`), being, holding or lying inside the checkpoint's folder, being written by "
             "another run; not enough disk space for what the weights say the artifacts take (on `--out` or the "
             "temporary folder), the disk filled, `TMPDIR` missing or not writable; the convert process killed "
             "(SIGKILL: the out-of-memory killer)",
             verify="environment: an artifact built for CUDA on a machine without a GPU; the `--junit` file cannot be "
                    "written"),
    ExitCode(EXIT_INTEGRITY, "integrity failure (verify, generate)", "",
             verify="integrity failure: no `manifest.json` (the run never finished); a file missing, changed (SHA-256 "
                    "or size) or not listed; `report.json` or the stored reference changed, or a report without "
                    "per-sample bars"),
    ExitCode(EXIT_SIGINT, "interrupted (SIGINT)", "interrupted by SIGINT", "no `manifest.json` is written"),
    ExitCode(EXIT_SIGTERM, "terminated (SIGTERM)", "terminated by SIGTERM", "no `manifest.json` is written"),
)

# exporter verify: when several codes apply, the first of these wins (a changed file outranks wrong numbers)
VERIFY_PRECEDENCE = (EXIT_INTEGRITY, EXIT_NUMERICS, EXIT_TARGET, EXIT_ENVIRONMENT, EXIT_USAGE)
# exporter batch: the worst cell's code, in this order (a stopped batch, a bug, then as convert and verify rank
# them: wrong numbers outrank a target that could not be built, which outranks a cell that could not run here)
BATCH_PRECEDENCE = (EXIT_SIGINT, EXIT_SIGTERM, EXIT_INTERNAL, EXIT_NUMERICS, EXIT_TARGET, EXIT_ENVIRONMENT,
                    EXIT_USAGE)


def worst_code(codes) -> int:
    """The exit code of a batch whose cells ended with ``codes``: 0 when all are 0, else the worst by
    :data:`BATCH_PRECEDENCE` (a code outside it ranks as an internal error)."""
    failing = [c for c in codes if c != EXIT_OK]
    if not failing:
        return EXIT_OK
    rank = {code: i for i, code in enumerate(BATCH_PRECEDENCE)}
    return min(failing, key=lambda c: rank.get(c, 2))


def exit_codes_help(command: str = "convert") -> str:
    """One paragraph for a command's --help: ``0 passed, 2 usage or input error, ...``."""
    if command == "verify":
        entries = [(EXIT_OK, "verified")] + [(c, next(e.short for e in EXIT_CODES if e.code == c))
                                              for c in VERIFY_PRECEDENCE]
    elif command == "batch":
        entries = [(EXIT_OK, "every cell passed")] + [(c, next(e.short for e in EXIT_CODES if e.code == c))
                                                      for c in BATCH_PRECEDENCE]
        text = ("Exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in entries) +
                "; a batch ends with its worst cell's code, in that order (2 also: the plan has problems).")
        return textwrap.fill(text, width=76) + "\n"
    elif command == "generate":  # reads a folder convert made (checked against its manifest) and runs a program
        entries = [(EXIT_OK, "generated")] + [(c, next(e.short for e in EXIT_CODES if e.code == c))
                                              for c in (EXIT_USAGE, EXIT_TARGET, EXIT_ENVIRONMENT, EXIT_INTEGRITY)]
    elif command == "all":  # the group's help: every code some command returns
        entries = [(e.code, e.short) for e in EXIT_CODES if e.code != EXIT_INTERNAL]
    elif command == "read":  # commands that only read (inspect, recipes): a mistake or what the machine lacks
        entries = [(EXIT_OK, "done")] + [(c, next(e.short for e in EXIT_CODES if e.code == c))
                                         for c in (EXIT_USAGE, EXIT_ENVIRONMENT)]
    else:
        entries = [(e.code, e.short) for e in EXIT_CODES if e.meaning and e.code != EXIT_INTERNAL]
    text = "Exit codes: " + ", ".join(f"{code} {meaning}" for code, meaning in entries) + "."
    return textwrap.fill(text, width=76) + "\n"


def describe(exc: BaseException, limit: int = 400) -> str:
    """``TypeName: message`` on one line, shortened at a word boundary to at most ``limit`` characters
    (an :class:`ExporterError` gives its own line, fix included)."""
    if isinstance(exc, ExporterError):
        text = exc.one_line()
    else:
        message = " ".join(str(exc).split())
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return shorten(text, limit)


def shorten(text: str, limit: int) -> str:
    """``text`` on one line, cut at the last word boundary before ``limit`` characters, with an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: max(limit - 1, 1)]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:(") + "…"


class ExporterError(Exception):
    """Base class: a problem the user can act on."""

    exit_code = EXIT_INTERNAL

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.one_line()

    def one_line(self) -> str:
        text = self.message.rstrip(".")
        if self.hint:
            text += f". Fix: {self.hint.rstrip('.')}."
        else:
            text += "."
        return " ".join(text.split())


class UsageError(ExporterError):
    """Bad command-line usage or a bad value that did not come from a file."""

    exit_code = EXIT_USAGE


class RecipeError(UsageError):
    """A recipe that cannot be found or does not validate."""


class PlanError(UsageError):
    """A batch plan that cannot be read or does not validate (exporter batch)."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be read or does not fit the architecture."""


class ArchitectureError(UsageError):
    """The model's architecture cannot be resolved or built."""


class InputsError(UsageError):
    """Model inputs that are missing, mis-shaped or of the wrong dtype."""


class NumericsError(ExporterError):
    """At least one candidate failed the tolerance policy."""

    exit_code = EXIT_NUMERICS


class TargetError(ExporterError):
    """At least one target could not be built, loaded or run."""

    exit_code = EXIT_TARGET


class ReferenceFailed(ExporterError):
    """The original model cannot be run for the float64 reference, so nothing can be validated."""

    exit_code = EXIT_TARGET


class IntegrityError(ExporterError):
    """An output folder does not match its manifest (exporter verify)."""

    exit_code = EXIT_INTEGRITY


class EnvironmentProblem(ExporterError):
    """The machine or the output location cannot support the run."""

    exit_code = EXIT_ENVIRONMENT


class OutputError(EnvironmentProblem):
    """The output folder cannot be used (not writable, in use, from another run, disk full)."""


class Interrupted(ExporterError):
    """The run was stopped by a signal."""

    def __init__(self, signum: int):
        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}; no manifest was written, so the output is incomplete",
                         "run the command again")
        self.signum = signum
        self.exit_code = 128 + signum


class RunnerFailed(Exception):
    """A variant could not be loaded or run; ``reason`` is one line for the report, ``detail`` for its log."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def failure_reason(exc: BaseException) -> str:
    """One line for the report: a runner's own reason, else the exception described."""
    return exc.reason if isinstance(exc, RunnerFailed) else describe(exc)


class Problems:
    """Every problem of one file or command line gathered, then raised as one ``error`` (``RecipeError``,
    ``PlanError``) that names them all: a user fixes them in one pass, not one run each."""

    def __init__(self, subject: str, error: type[ExporterError], hint: str):
        self.subject, self.error, self.hint = subject, error, hint
        self.items: list[str] = []

    def add(self, where: str, what: str) -> None:
        self.items.append(f"{where}: {what}")

    def raise_if_any(self) -> None:
        if self.items:
            raise self.error(f"{self.subject} has {len(self.items)} problem(s): {'; '.join(self.items)}", self.hint)
