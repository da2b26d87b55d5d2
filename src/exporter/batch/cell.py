"""One cell of a batch: ``exporter convert`` in a process of its own, and whether an earlier run already did it.

A cell runs as the command line runs (``python -m exporter convert ...``, supervised), in a process group of
its own, with its output and errors in ``logs/<cell>.log`` under the batch folder. Its folder is published by
convert itself (staged, then renamed into place), so a cell stopped or killed at any moment leaves nothing
half-written. This module imports no torch: it runs in the batch process and on every Dask worker.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import EXIT_INTERNAL, EXIT_SIGINT, EXIT_SIGTERM
from ..outdir import sha256_file
from .plan import Cell

STOP_GRACE_S = 120.0  # a stopped cell's convert removes its staging folder and exits within this
LOCK_WAIT_S = 60.0  # a retried cell waits this long for the lost attempt's process to let go of its folder

PASSED, FAILED, LOST, INTERRUPTED, SKIPPED, NOT_RUN = "passed", "failed", "lost", "interrupted", "skipped", "not run"


def log_name(cell_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "--", cell_name).strip("-") + ".log"


def _die_with_parent() -> None:
    """In the cell's process: SIGTERM when the thread that started it (the batch, a Dask worker) dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie (dead, not yet reaped: an orphan in a container
    whose first process reaps nothing) holds no lock and writes nothing, so it does not count; ``killpg(pgid, 0)``
    alone would take it for alive."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    states = _group_states(pgid)
    return True if states is None else any(state != "Z" for state in states)


def _group_states(pgid: int) -> list[str] | None:
    """The states (``R``, ``S``, ``Z``...) of the processes in group ``pgid``, from /proc (None: no /proc)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return None
    states = []
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if len(fields) > 2 and fields[2] == str(pgid):
            states.append(fields[0])
    return states


def _end_group(pgid: int, first: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """Stop every process left in the cell's group (a convert whose supervising process was killed), and wait
    until none is left, so the next attempt finds its folder free."""
    if not _group_alive(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, first)
    deadline = time.monotonic() + grace_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def wait_for_folder(out: Path, timeout_s: float = LOCK_WAIT_S) -> None:
    """Wait until no run holds ``out``'s lock (the lock convert takes beside its output folder)."""
    lock = out.parent / f".{out.name}.lock"
    if not lock.exists():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                return  # convert will say who holds it
        finally:
            os.close(fd)
        time.sleep(0.2)


def last_error(log: Path) -> str:
    """The last ``error:`` line the cell's convert printed, without the prefix."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    found = [line[len("error: "):].strip() for line in lines if line.startswith("error: ")]
    return found[-1] if found else ""


def worker_name(env: Mapping[str, str] | None = None) -> str:
    """``host:gpuN`` (the first GPU the cell sees), or ``host:SLOT`` for a CPU slot of this host, or ``host:cpu``."""
    seen: Mapping[str, str] = os.environ if env is None else env
    gpus = (seen.get("CUDA_VISIBLE_DEVICES") or "").split(",")[0].strip()
    where = f"gpu{gpus}" if gpus and gpus != "-1" else seen.get("EXPORTER_BATCH_SLOT") or "cpu"
    return f"{socket.gethostname()}:{where}"


def read_report(out: Path) -> dict[str, Any] | None:
    if not (out / "manifest.json").is_file():
        return None
    try:
        return json.loads((out / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def run_cell(cell: Cell, root: str | Path, env: dict[str, str] | None = None,
             stop: Callable[[], bool] | None = None, attempt: int = 1) -> dict[str, Any]:
    """Run ``cell`` into ``root/cell.name`` and say how it ended (``status``: passed, failed, lost, interrupted).

    ``env``: variables for the cell's process (the shared compile cache, its GPU; ``""`` removes one);
    ``stop``: polled while the cell runs; when it turns true the cell is stopped as Ctrl-C stops a convert
    (nothing published).
    ``lost``: the cell's own process was killed from outside (its worker died), which the caller may retry."""
    root = Path(root)
    out = root / cell.name
    log = root / "logs" / log_name(cell.name)
    log.parent.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    wait_for_folder(out)
    argv = [sys.executable, "-m", "exporter", *cell.convert_args(out)]
    replaced = out.exists()
    argv += ["--overwrite"] if replaced else []
    started = datetime.now(timezone.utc)
    cell_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v != "" or k not in (env or {})}
    worker = worker_name(cell_env)
    t0 = time.perf_counter()
    stopped = False
    with open(log, "w" if attempt == 1 else "a", encoding="utf-8") as handle:
        handle.write(f"# attempt {attempt} on {worker} at {started.isoformat(timespec='seconds')}\n")
        handle.flush()
        child = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env=cell_env, start_new_session=True,
                                 preexec_fn=_die_with_parent)
        while True:
            try:
                code = child.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop is not None and not stopped and stop():
                    stopped = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(child.pid, signal.SIGINT)
    _end_group(child.pid)
    run_s = time.perf_counter() - t0
    report = read_report(out)
    manifest = out / "manifest.json"
    fresh = report is not None and manifest.stat().st_mtime >= started.timestamp() - 1
    outcome: dict[str, Any] = {"name": cell.name, "attempt": attempt, "worker": worker,
                               "started": started.isoformat(timespec="seconds"), "run_s": round(run_s, 3),
                               "replaced": replaced, "log": str(log.relative_to(root))}
    if stopped:
        return {**outcome, "status": INTERRUPTED, "exit_code": EXIT_SIGINT,
                "error": "stopped before it finished; nothing was published"}
    if code < 0 or code in (EXIT_SIGINT, EXIT_SIGTERM):
        how = _signal_name(-code) if code < 0 else f"exit {code}"
        return {**outcome, "status": LOST, "exit_code": EXIT_INTERNAL if code < 0 else code,
                "error": f"the cell's process was stopped from outside ({how}) before it finished; nothing was "
                         "published"}
    if code == 0 and fresh and report is not None and report.get("passed"):
        return {**outcome, "status": PASSED, "exit_code": 0, "error": ""}
    problems = (report or {}).get("problems") or [] if fresh else []
    error = last_error(log) or (problems[0] if problems else "") or f"convert ended with exit code {code}"
    return {**outcome, "status": FAILED, "exit_code": code or EXIT_INTERNAL, "error": error}


class Hashes:
    """SHA-256 of checkpoint files, each hashed once per batch (many cells share one checkpoint)."""

    def __init__(self) -> None:
        self.known: dict[tuple[str, int, int], str] = {}

    def __call__(self, path: Path) -> str:
        info = path.stat()
        key = (str(path), info.st_size, info.st_mtime_ns)
        if key not in self.known:
            self.known[key] = sha256_file(path)
        return self.known[key]

    def many(self, paths: list[Path]) -> list[str]:
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
            return list(pool.map(self, paths))


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def finished(cell: Cell, root: Path, hashes: Hashes) -> tuple[bool, str]:
    """Whether ``root/cell.name`` already holds this cell's passed run: its manifest lists every file at its size,
    and records the same recipe (every option the plan gives the cell), the same checkpoint bytes (SHA-256) and
    the same exporter and torch. The reason when not (``""`` for a folder that does not exist)."""
    out = root / cell.name
    if not out.exists():
        return False, ""
    try:
        manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False, "its folder holds no complete run"
    if not manifest.get("passed") or manifest.get("exit_code") != 0:
        return False, "its earlier run did not pass"
    recorded = dict(manifest.get("recipe") or {})
    recorded.pop("source", None)
    if recorded != cell.recipe_dict:
        return False, "the recipe or the cell's options changed"
    for entry in manifest.get("files", []):
        path = out / entry["path"]
        if not path.is_file() or path.stat().st_size != entry.get("bytes"):
            return False, f"{entry['path']} is missing or changed"
    versions = manifest.get("versions") or {}
    for package in ("exporter", "torch"):
        now = _version(package)
        if versions.get(package) and now and versions[package].split("+")[0] != now.split("+")[0]:
            return False, f"{package} changed ({versions[package]} then, {now} now)"
    files = [(cell.checkpoint if cell.checkpoint.is_file() else cell.checkpoint / e["path"], e)
             for e in manifest.get("checkpoint", [])]
    if not files or any(not p.is_file() or p.stat().st_size != e.get("bytes") for p, e in files):
        return False, "the checkpoint changed"
    if hashes.many([p for p, _ in files]) != [e.get("sha256") for _, e in files]:
        return False, "the checkpoint changed"
    return True, "finished in an earlier run (manifest, recipe and checkpoint match)"


__all__ = ["PASSED", "FAILED", "LOST", "INTERRUPTED", "SKIPPED", "NOT_RUN", "Hashes", "finished", "log_name",
           "run_cell", "worker_name"]
