"""The error tree. Each class carries the exit code the CLI returns for it.

A user mistake is reported as one line: what is wrong, and how to fix it.
The CLI's ``main`` is the only place that turns these into output; library
callers catch :class:`ExporterError` and read ``exit_code`` / ``hint``.

Exit codes (documented in docs/exit-codes.md):

==  ==========================================================================
0   success: every target built and passed numerics
1   internal error (a bug in exporter; run with EXPORTER_DEBUG=1 and report it)
2   usage or input error: bad option, recipe, checkpoint, config or inputs file
3   numerics failure: a candidate's error exceeded the recipe's tolerance
4   target failure: a target could not be built, loaded or run
5   environment or output error: missing dependency or device, output folder
    not writable or in use, disk full
6   integrity failure (exporter verify): no manifest, or a file missing, changed
    or not listed in it
130 interrupted by SIGINT; 143 terminated by SIGTERM
==  ==========================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_NUMERICS = 3
EXIT_TARGET = 4
EXIT_ENVIRONMENT = 5
EXIT_INTEGRITY = 6
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


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
        import signal

        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}; no manifest was written, so the output is incomplete",
                         "run the command again")
        self.signum = signum
        self.exit_code = 128 + signum
