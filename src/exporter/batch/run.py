"""The verb ``batch``: every cell of a plan converted, on this host's GPUs or a Dask cluster, and summarised."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import junit as junit_mod
from ..errors import EXIT_SIGINT, EXIT_SIGTERM, OutputError, UsageError, worst_code
from ..outdir import lock_file, public_path
from ..results import RunResult
from . import summary as summary_mod
from .cell import NOT_RUN, SKIPPED, Hashes, finished
from .engines import Engine, LocalEngine, open_engine, visible_gpus
from .plan import Cell, Plan, load_plan


class BatchResult(RunResult):
    """What ``batch`` returns: ``RunResult`` with batch.json's content as its report (``summary``)."""

    @property
    def summary(self) -> dict[str, Any]:
        return self.report

    @property
    def passed(self) -> bool:
        return self.exit_code == 0


def default_out(plan: Path) -> Path:
    return Path("artifacts") / plan.stem


THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cell_env(cache: Path) -> dict[str, str]:
    """What every cell's process is given: the compile caches the cells share (Inductor's, and the package cache
    of :mod:`exporter.targets.package_cache`), and this process's thread counts: a Dask worker sets
    ``OMP_NUM_THREADS=1`` and its kin for itself, which would leave a cell's CPU work on one thread
    (``""``: the variable is removed for the cell)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "EXPORTER_PACKAGE_CACHE": str(cache / "exporter-packages")}
    for name in THREAD_VARIABLES:
        env[name] = os.environ.get(name, "")
    return env


@contextlib.contextmanager
def batch_lock(root: Path) -> Iterator[None]:
    """One batch at a time writes a batch folder (a second would interleave its summary with the first's)."""
    state = root / ".batch"
    try:
        state.mkdir(parents=True, exist_ok=True)
        fd = lock_file(state / "lock", OutputError(f"the batch folder {root} is being written by another exporter "
                                                   "batch", "wait for it to finish, or pass another --out"))
    except OSError as exc:
        raise OutputError(f"cannot write the batch folder {root}: {exc.strerror}",
                          "pass a writable --out folder") from None
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, received: list[int]) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` (the engines stop every cell) instead of ending this process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _keep_clear(root: Path, loaded: Plan) -> None:
    """The batch folder (its state, logs and summaries beside the cells) must not be a checkpoint, nor lie inside a
    checkpoint's folder: refused before anything is written."""
    from ..outdir import checkpoint_guard  # noqa: PLC0415

    for cell in loaded.cells:
        guarded, is_folder = checkpoint_guard(cell.checkpoint)
        if root == guarded or (is_folder and root.is_relative_to(guarded)):
            where = "is" if root == guarded else "lies inside"
            raise OutputError(f"batch folder {root} {where} the checkpoint {'folder ' if is_folder else ''}"
                              f"{guarded} of cell {cell.name}: its logs and summaries would mix with the "
                              "checkpoint's files", "choose an --out outside every checkpoint's folder")


def batch(plan: str | Path, out: str | Path | None = None, *, workers: int | None = None,
          scheduler: str | None = None, junit: str | Path | None = None, compile_cache: str | Path | None = None,
          tell: Callable[[str], None] | None = None, engine: Engine | None = None) -> BatchResult:
    """Convert every cell of ``plan`` (a TOML file, docs/batch.md) into ``out`` and summarise.

    The plan is checked whole first (:class:`~exporter.errors.PlanError`, nothing run). A cell whose folder already
    holds its passed run (same recipe and options, same checkpoint bytes, same exporter and torch) is not run
    again. The others run on ``engine`` (default: this host's GPUs, one cell each, or ``workers`` on a CPU host;
    ``scheduler``: a Dask cluster, ``local`` or ``local-cuda``), sharing one Inductor compile cache
    (``compile_cache``, default ``out/.compile-cache``). ``batch.json``, ``batch.md`` and the ``junit`` file say
    how each cell ended; the exit code is 0 when every cell passed, else the worst cell's
    (:data:`~exporter.errors.BATCH_PRECEDENCE`)."""
    say = tell or (lambda line: None)
    plan_path = Path(plan)
    local_gpus = len(visible_gpus()) if scheduler is None and engine is None else None
    loaded: Plan = load_plan(plan_path, local_gpus=local_gpus)
    root = Path(out) if out is not None else default_out(plan_path)
    if junit is not None:
        junit_mod.check_writable(junit)
    if workers is not None and workers < 1:
        raise UsageError(f"--workers {workers} is not a number of workers", "give --workers 1 or more")
    if workers is not None and scheduler not in (None, "local", "local-cuda"):
        raise UsageError("--workers is for this host or a cluster started here; a cluster at an address has the "
                         "workers it was started with", "leave out --workers, or use --scheduler local")
    if engine is None and scheduler is None:
        engine = LocalEngine(workers)  # refuses more workers than GPUs before anything is written
    root = root.resolve()
    _keep_clear(root, loaded)
    cache = Path(compile_cache).resolve() if compile_cache else root / ".compile-cache"
    outcomes: dict[str, dict[str, Any]] = {}
    hashes = Hashes()
    todo: list[Cell] = []
    for cell in loaded.cells:
        done, why = finished(cell, root, hashes)
        if done:
            outcomes[cell.name] = {"name": cell.name, "status": SKIPPED, "exit_code": 0, "error": "",
                                   "attempt": 0, "worker": None, "started": None, "run_s": None,
                                   "replaced": False, "log": None, "note": why}
            say(f"{cell.name}: {why}; not run again")
        else:
            if why:
                say(f"{cell.name}: run again ({why})")
            todo.append(cell)
    counter = {"done": 0}

    def progress(event: str, cell: Cell, outcome: dict[str, Any] | None) -> None:
        if event == "start":
            return
        if event == "retry":
            say(f"{cell.name}: {outcome['error'] if outcome else 'lost'}; running it again")
            return
        counter["done"] += 1
        assert outcome is not None
        run_s = f" in {outcome['run_s']:.1f} s" if outcome.get("run_s") is not None else ""
        error = f": {outcome['error']}" if outcome.get("error") and outcome["status"] != "passed" else ""
        say(f"[{counter['done']}/{len(todo)}] {cell.name}: {outcome['status']}{run_s}"
            f"{' on ' + outcome['worker'] if outcome.get('worker') else ''}{error}")

    t_engine = time.perf_counter()
    if engine is None and todo:
        engine = open_engine(scheduler, workers)  # a Dask cluster is reached (or started) only with work
    engine_start_s = time.perf_counter() - t_engine
    if todo and engine is not None:
        say(f"{len(todo)} cell(s) to run on {engine.kind} ({engine.workers} worker(s)), {len(outcomes)} done earlier")
    try:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"cannot create the batch folder {root}: {exc.strerror}",
                              "pass a writable --out") from None
        with batch_lock(root):
            data, cells, stopped_by, exit_code = _run_and_summarise(
                loaded, plan_path, root, cache, engine, todo, outcomes, progress, engine_start_s, junit,
                {"kind": "dask", "workers": workers or 1, "gpus": [], "scheduler": scheduler})
    finally:
        if engine is not None:
            engine.close()
    if stopped_by:
        stopped = sum(1 for c in cells if c["status"] == "interrupted")
        unstarted = sum(1 for c in cells if c["status"] == NOT_RUN)
        problems = [f"interrupted by {stopped_by}: {stopped} running cell(s) stopped (nothing of them was published), "
                    f"{unstarted} not run. Fix: run the plan again to finish it (cells that passed are not run again)"]
    else:
        problems = [f"{c['name']}: {c['error']}" for c in cells if c["status"] not in ("passed", SKIPPED)]
    return BatchResult(root, data, exit_code, problems)


def _run_and_summarise(loaded: Plan, plan_path: Path, root: Path, cache: Path, engine: Engine | None,
                       todo: list[Cell], outcomes: dict[str, dict[str, Any]], progress, engine_start_s: float,
                       junit, idle: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]], str | None, int]:
    """Run ``todo`` on ``engine`` (SIGINT and SIGTERM stop it), then write batch.json, batch.md and JUnit."""
    stop = threading.Event()
    received: list[int] = []
    t0 = time.perf_counter()
    if todo and engine is not None:
        with stop_on_signals(stop, received):
            outcomes.update(engine.run(todo, root, cell_env(cache), progress, stop))
    description = engine.describe() if engine is not None else idle
    wall_s = time.perf_counter() - t0
    cells = []
    for cell in loaded.cells:
        outcome = outcomes.get(cell.name) or {"name": cell.name, "status": NOT_RUN, "exit_code": None,
                                              "error": "not run", "attempt": 0}
        cells.append({**cell.to_dict(), "checkpoint": public_path(cell.checkpoint), **outcome,
                      "out": cell.name, "report": summary_mod.cell_figures(root, cell.name)})
    stopped_by = signal.Signals(received[0]).name if received else None
    codes = [c["exit_code"] for c in cells if c["exit_code"] is not None]
    exit_code = (EXIT_SIGINT if received[0] == signal.SIGINT else EXIT_SIGTERM) if received else \
        worst_code(codes)
    data = summary_mod.assemble(
        {"path": public_path(plan_path), "description": loaded.description,
         "created": datetime.now(timezone.utc).isoformat(timespec="seconds")},
        description, cells, wall_s, exit_code, stopped_by, public_path(cache))
    data["timings"]["engine_start_s"] = round(engine_start_s, 3)
    summary_mod.write(root, data, junit)
    return data, cells, stopped_by, exit_code


__all__ = ["BatchResult", "batch", "default_out"]
