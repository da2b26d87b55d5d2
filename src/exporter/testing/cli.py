"""``python -m exporter ARGS`` for the tests: the real command line, in a process of its own, forked from a warm
interpreter (:mod:`exporter.forkserver`) where one can be, else started cold.

A forked command is the command: ``python -m exporter`` semantics (``runpy``), its own session, working folder,
environment, stdout and stderr, its exit code (negative: the signal that ended it). Only the imports are the
server's, done once for the whole suite instead of once for each of its hundreds of commands. Its children (the
processes a run loads its artifacts in) start cold, as a user's command's would where it cannot fork.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .. import forkserver


def start_cli(args: list[Any], cwd: str | Path | None = None, env: dict[str, str] | None = None,
              stdout: int | None = None, stderr: int | None = None) -> subprocess.Popen | forkserver.Forked:
    """Start ``python -m exporter ARGS``; its output to the given descriptors (default: discarded)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        out = null if stdout is None else stdout
        return forkserver.start("exporter", [str(a) for a in args], dict(os.environ if env is None else env), out,
                                (), [sys.executable], err=out if stderr is None else stderr,
                                cwd=None if cwd is None else str(cwd), forks=False)
    finally:
        os.close(null)


def run_cli(args: list[Any], cwd: str | Path | None = None, env: dict[str, str] | None = None,
            timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python -m exporter ARGS`` to its end: its exit code, stdout and stderr (text), as ``subprocess.run``
    with ``capture_output=True, text=True`` returns them; past ``timeout`` it is killed and TimeoutExpired raised."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = start_cli(args, cwd, env, out.fileno(), err.fileno())
        try:
            code = process.wait(timeout)
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess([sys.executable, "-m", "exporter", *map(str, args)], code,
                                           out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace"))


__all__ = ["run_cli", "start_cli"]
