"""A thin parent for ``exporter convert``: the run itself in a child process, so that its death is told, too.

A convert that dies outright (the kernel's out-of-memory killer, a segfault in a native library, SIGBUS when
a memory-mapped checkpoint is truncated by a sync writing over it) can print nothing and clean nothing itself.
The command line therefore runs the convert as ``python -m exporter convert ...`` in a child and only waits for
it: the child inherits the terminal (its output and exit code are the command's), tells the parent on a pipe
which staging folder it writes, which stage it is in and which checkpoint files it read (:func:`report`), and
when it dies by a signal the parent removes the staging folder and prints one ``error:`` line that says what
happened (:func:`explain`). SIGINT and SIGTERM sent to the parent are passed on to the child, which stops as
it always does (exit 130 or 143, nothing published). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EXIT_ENVIRONMENT, EXIT_INTERNAL, EXIT_USAGE

ENV = "EXPORTER_SUPERVISOR_FD"  # set in the child: the pipe it reports on
SUPERVISED = ("convert",)  # the commands that write an output folder


def report(kind: str, *values: object) -> None:
    """Tell the supervising parent (if any) one fact: ``staging PATH``, ``stage NAME``,
    ``checkpoint PATH SIZE MTIME_NS``."""
    fd = os.environ.get(ENV)
    if not fd:
        return
    line = json.dumps([kind, *[str(v) for v in values]]) + "\n"
    with contextlib.suppress(OSError, ValueError):
        os.write(int(fd), line.encode("utf-8"))


def snapshot(path: Path) -> tuple[int, int] | None:
    """A file's size and modification time, or None when it is gone."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns


@dataclass
class Heard:
    """What the child said before it ended."""

    staging: list[str] = field(default_factory=list)  # gone once published (renamed into place)
    stage: str | None = None
    checkpoint: dict[str, tuple[int, int]] = field(default_factory=dict)

    def hear(self, line: str) -> None:
        try:
            kind, *values = json.loads(line)
        except ValueError:
            return
        if kind == "staging" and values:
            self.staging.append(values[0])
        elif kind == "stage" and values:
            self.stage = values[0]
        elif kind == "checkpoint" and len(values) == 3:
            self.checkpoint[values[0]] = (int(values[1]), int(values[2]))

    def changed(self) -> list[str]:
        """The checkpoint files that are no longer what the child read (rewritten, truncated or gone)."""
        return [path for path, seen in self.checkpoint.items() if snapshot(Path(path)) != seen]


def explain(returncode: int, heard: Heard) -> tuple[str, int]:
    """The one line (with its fix) and the exit code for a child that died by signal ``-returncode``."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    during = f" during {heard.stage}" if heard.stage else ""
    changed = heard.changed()
    if changed:
        files = ", ".join(Path(p).name for p in changed[:3])
        return (f"the checkpoint changed while it was being read ({files} was rewritten or truncated{during}; the "
                f"convert stopped with {name}); nothing was published. Fix: convert again once the checkpoint is "
                "complete (copy it first if something syncs or downloads into it)", EXIT_USAGE)
    if name == "SIGKILL":
        return (f"the convert process was killed (SIGKILL){during}, most often by the kernel's out-of-memory "
                "killer; nothing was published. Fix: free host memory or use a machine with more (report.json's "
                "memory section of a smaller run shows what a convert takes)", EXIT_ENVIRONMENT)
    return (f"the convert process crashed with {name}{during}; nothing was published. Fix: rerun with "
            "EXPORTER_DEBUG=1 and report the crash with the command line", EXIT_INTERNAL)


def _die_with_parent() -> None:
    """In the child: SIGTERM when the supervising parent dies (Linux), so no convert runs on unsupervised."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def supervise(argv: list[str]) -> int:
    """Run ``exporter ARGV`` in a child and wait; its exit code, or one explained for a death by signal."""
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, **{ENV: str(write_fd)})
    child = subprocess.Popen([sys.executable, "-m", "exporter", *argv], env=env, pass_fds=(write_fd,),
                             preexec_fn=_die_with_parent)
    os.close(write_fd)
    heard = Heard()

    def listen() -> None:
        with os.fdopen(read_fd, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                heard.hear(line)

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()

    def forward(signum, _frame) -> None:
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # pragma: no cover - SIGINT is forwarded, not raised
                continue
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    listener.join(timeout=5)
    if code >= 0:
        return code
    for staging in heard.staging:
        shutil.rmtree(staging, ignore_errors=True)
    message, exit_code = explain(code, heard)
    print(f"error: {message}.", file=sys.stderr)
    return exit_code


__all__ = ["ENV", "SUPERVISED", "Heard", "explain", "report", "snapshot", "supervise"]
