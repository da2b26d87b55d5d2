"""Where the cells of a batch run: one interface, two engines.

- :class:`LocalEngine` (the default): one worker per visible GPU of this host (``CUDA_VISIBLE_DEVICES`` set to
  its GPU for each cell), or ``--workers N`` on a CPU host. Needs nothing beyond exporter.
- :class:`DaskEngine`: the cells as tasks on a ``dask.distributed`` cluster, by address (``tcp://HOST:8786``),
  or started here: ``local`` (a ``LocalCluster`` of ``--workers`` processes) or ``local-cuda`` (dask-cuda's
  ``LocalCUDACluster``, a worker per GPU). Workers must see the plan's checkpoints and the ``--out`` folder at the
  same paths (a shared file system), and run one cell at a time (``--nthreads 1``: dask-cuda's default).

An engine runs every cell it is given and returns one outcome per cell (:func:`.cell.run_cell`'s dict). A cell
whose process or worker is lost mid-run is run once more (on another worker where the engine can choose); when
``stop`` is set, running cells are stopped as Ctrl-C stops a convert and cells not yet started are not run. A
Ray engine would be one more module with the same ``run``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Protocol

from ..errors import EXIT_INTERNAL, EXIT_SIGTERM, EnvironmentProblem, UsageError, describe
from .cell import INTERRUPTED, LOST, NOT_RUN, log_name, run_cell
from .plan import Cell

Tell = Callable[[str, Cell, dict[str, Any] | None], None]  # ("start" | "retry" | "done", cell, outcome)
MAX_ATTEMPTS = 2  # a lost cell is run once more


def not_run(cell: Cell, why: str = "the batch was stopped before this cell started") -> dict[str, Any]:
    return {"name": cell.name, "status": NOT_RUN, "exit_code": None, "error": why, "attempt": 0, "worker": None,
            "started": None, "run_s": None, "replaced": False, "log": None}


def _brief(outcome: dict[str, Any]) -> dict[str, Any]:
    """A lost attempt as the summary keeps it."""
    return {k: outcome.get(k) for k in ("attempt", "worker", "started", "run_s", "error")}


class Engine(Protocol):
    kind: str
    workers: int

    def describe(self) -> dict[str, Any]: ...

    def run(self, cells: list[Cell], root: Path, env: dict[str, str], tell: Tell,
            stop: threading.Event) -> dict[str, dict[str, Any]]: ...

    def close(self) -> None: ...


def visible_gpus() -> list[str]:
    """This host's GPUs as ``CUDA_VISIBLE_DEVICES`` names them, without importing torch: that variable when set,
    else ``nvidia-smi -L``, else none."""
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named is not None:
        entries = [e.strip() for e in named.split(",") if e.strip()]
        return [] if entries[:1] == ["-1"] else entries
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


class LocalEngine:
    """Worker slots on this host, each a thread that runs one cell process at a time (on its GPU, if any)."""

    kind = "local"

    def __init__(self, workers: int | None = None, gpus: list[str] | None = None):
        self.gpus = visible_gpus() if gpus is None else gpus
        if workers is not None and workers < 1:
            raise UsageError(f"--workers {workers} is not a number of workers", "give --workers 1 or more")
        if self.gpus:
            if workers is not None and workers > len(self.gpus):
                raise UsageError(f"--workers {workers} asks for more workers than this host's {len(self.gpus)} "
                                 "GPU(s), and each cell has a GPU of its own",
                                 f"give --workers {len(self.gpus)} or fewer")
            self.slots: list[str | None] = list(self.gpus[: workers or len(self.gpus)])
        else:
            self.slots = [None] * (workers or 1)
        self.workers = len(self.slots)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "workers": self.workers, "gpus": [g for g in self.slots if g is not None],
                "scheduler": None}

    def run(self, cells: list[Cell], root: Path, env: dict[str, str], tell: Tell,
            stop: threading.Event) -> dict[str, dict[str, Any]]:
        queue: deque[tuple[Cell, int, int | None]] = deque((cell, 1, None) for cell in cells)  # (cell, attempt, avoid)
        free = list(range(self.workers))
        running: dict[Future, tuple[Cell, int, int]] = {}
        results: dict[str, dict[str, Any]] = {}
        lost: dict[str, list[dict[str, Any]]] = {}
        with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="exporter-cell") as pool:
            while queue or running:
                if stop.is_set():
                    while queue:
                        cell = queue.popleft()[0]
                        results[cell.name] = not_run(cell)
                for slot in list(free):
                    item = next((i for i in queue if i[2] != slot or self.workers == 1), None)
                    if item is None:
                        continue
                    queue.remove(item)
                    free.remove(slot)
                    cell, attempt, _ = item
                    gpu = self.slots[slot]
                    cell_env = {**env, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else
                                          {"EXPORTER_BATCH_SLOT": f"slot{slot}"})}
                    tell("start", cell, None)
                    running[pool.submit(run_cell, cell, root, cell_env, stop.is_set, attempt)] = (cell, attempt, slot)
                done, _ = wait(list(running), timeout=0.5, return_when=FIRST_COMPLETED)
                for future in done:
                    cell, attempt, slot = running.pop(future)
                    free.append(slot)
                    try:
                        outcome = future.result()
                    except Exception as exc:  # a bug in running the cell: recorded, the others go on
                        outcome = {**not_run(cell, describe(exc)), "status": "failed", "exit_code": EXIT_INTERNAL}
                    if outcome["status"] == LOST and attempt < MAX_ATTEMPTS and not stop.is_set():
                        tell("retry", cell, outcome)
                        lost.setdefault(cell.name, []).append(_brief(outcome))
                        queue.appendleft((cell, attempt + 1, slot))
                        continue
                    results[cell.name] = {**outcome, "lost_attempts": lost.get(cell.name, [])}
                    tell("done", cell, outcome)
        return results

    def close(self) -> None:
        pass


def _next_attempt(folder: Path, cell: Cell) -> int:
    """Count this start of ``cell`` in a file under the batch folder (the scheduler re-runs a task whose worker
    died without telling the client): 1 for the first start."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (cell.name.replace("/", "--") + ".count")
    with open(path, "a+", encoding="utf-8") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        count = len(handle.read().split()) + 1
        handle.write(f"{count}\n")
    return count


def dask_cell(cell: Cell, root: str, env: dict[str, str], stop_name: str, attempts: str) -> dict[str, Any]:
    """A cell as a Dask task: counts its start (more than two: its worker was lost twice, the cell is not run
    again), polls the batch's stop event while its process runs."""
    from distributed import Event, get_worker  # noqa: PLC0415 - the optional [batch] dependency, on the worker

    with contextlib.suppress(Exception):
        env = {**env, "EXPORTER_BATCH_SLOT": f"dask-{get_worker().name}"}
    event = Event(stop_name)
    if event.is_set():
        return not_run(cell)
    attempt = _next_attempt(Path(attempts), cell)
    if attempt > MAX_ATTEMPTS:
        return {**not_run(cell, f"its worker was lost {attempt - 1} times; not run again"), "status": LOST,
                "exit_code": EXIT_INTERNAL, "attempt": attempt - 1}
    checked = {"at": 0.0, "set": False}

    def stop() -> bool:
        if not checked["set"] and time.monotonic() - checked["at"] > 1.0:
            checked["at"] = time.monotonic()
            with contextlib.suppress(Exception):
                checked["set"] = event.is_set()
        return bool(checked["set"])

    return run_cell(cell, root, env, stop, attempt)


class DaskEngine:
    """The cells as tasks on a dask.distributed cluster (by address, or a local one started here)."""

    kind = "dask"

    def __init__(self, scheduler: str, workers: int | None = None):
        try:
            from distributed import Client, LocalCluster  # noqa: PLC0415 - the optional [batch] dependency
        except ImportError:
            raise EnvironmentProblem("--scheduler needs dask.distributed, which is not installed",
                                     "pip install 'exporter[batch]' (or leave out --scheduler to run on this "
                                     "host)") from None
        self.scheduler = scheduler
        self.cluster: Any = None
        if scheduler in ("local", "local-cuda"):  # its scheduler and nannies live here: their log is not ours
            logging.getLogger("distributed").setLevel(logging.ERROR)
        if scheduler == "local":
            self.cluster = LocalCluster(n_workers=workers or 1, threads_per_worker=1, processes=True,
                                        memory_limit=0, dashboard_address=None)
        elif scheduler == "local-cuda":
            try:
                from dask_cuda import LocalCUDACluster  # noqa: PLC0415 - optional, GPU hosts only
            except ImportError:
                raise EnvironmentProblem("--scheduler local-cuda needs dask-cuda, which is not installed",
                                         "pip install dask-cuda, or use --scheduler local") from None
            self.cluster = LocalCUDACluster(threads_per_worker=1, memory_limit=0, dashboard_address=None,
                                            **({"n_workers": workers} if workers else {}))
        elif workers is not None:
            raise UsageError("--workers is for this host or a cluster started here; a cluster at an address "
                             "has the workers it was started with", "leave out --workers, or use --scheduler local")
        try:
            if self.cluster is None:
                knock(scheduler)  # a refused address fails now, not after the client's 30 s of retries
            self.client = Client(self.cluster or scheduler, timeout="30s")
        except (OSError, TimeoutError, ValueError) as exc:
            self.close()
            raise EnvironmentProblem(f"cannot reach the Dask scheduler at {scheduler} ({describe(exc, 200)})",
                                     "start it (dask scheduler; dask worker ADDRESS --nthreads 1) or check the "
                                     "address") from None
        info = self.client.scheduler_info(n_workers=-1) if _takes_n_workers(self.client) else \
            self.client.scheduler_info()
        self.worker_threads = {addr: w.get("nthreads", 1) for addr, w in info.get("workers", {}).items()}
        self.workers = len(self.worker_threads)
        if not self.workers:
            self.close()
            raise EnvironmentProblem(f"the Dask cluster at {scheduler} has no workers",
                                     "start workers (dask worker ADDRESS --nthreads 1) before the batch")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "workers": self.workers, "gpus": [],
                "scheduler": "local-cuda" if self.scheduler == "local-cuda" else
                "local" if self.scheduler == "local" else self.scheduler,
                "threads_per_worker": sorted(set(self.worker_threads.values()))}

    def run(self, cells: list[Cell], root: Path, env: dict[str, str], tell: Tell,
            stop: threading.Event) -> dict[str, dict[str, Any]]:
        from distributed import Event  # noqa: PLC0415 - the optional [batch] dependency

        batch_id = uuid.uuid4().hex[:12]
        stop_name = f"exporter-batch-stop-{batch_id}"
        attempts = root / ".batch" / f"attempts-{batch_id}"
        stop_event = Event(stop_name, client=self.client)
        submitted = 0

        def submit(cell: Cell) -> Any:
            nonlocal submitted
            submitted += 1
            return self.client.submit(dask_cell, cell, str(root), env, stop_name, str(attempts),
                                      key=f"exporter-cell-{batch_id}-{submitted}", pure=False)

        futures: dict[Any, Cell] = {}
        started = time.time()
        for cell in cells:
            futures[submit(cell)] = cell
            tell("start", cell, None)
        results: dict[str, dict[str, Any]] = {}
        lost: dict[str, list[dict[str, Any]]] = {}
        told_stop = False
        try:
            while futures:
                if stop.is_set() and not told_stop:  # running cells stop; those not started return at once
                    told_stop = True
                    stop_event.set()
                done = [future for future in futures if future.done()]
                if not done:
                    time.sleep(0.2)
                for future in done:
                    cell = futures.pop(future)
                    outcome = self._outcome(future, cell, root, started)
                    if outcome["status"] == LOST and outcome.get("attempt", 0) < MAX_ATTEMPTS and not stop.is_set():
                        tell("retry", cell, outcome)
                        lost.setdefault(cell.name, []).append(_brief(outcome))
                        futures[submit(cell)] = cell
                        continue
                    results[cell.name] = {**outcome, "lost_attempts": lost.get(cell.name, [])}
                    tell("done", cell, outcome)
        finally:
            shutil.rmtree(attempts, ignore_errors=True)
        return results

    @staticmethod
    def _outcome(future, cell: Cell, root: Path, since: float) -> dict[str, Any]:
        if future.status == "cancelled":  # the cluster dropped it (a worker closing on a signal, say)
            log = root / "logs" / log_name(cell.name)
            if log.is_file() and log.stat().st_mtime >= since:  # it had started: its process ends with its worker
                return {**not_run(cell, "stopped while it ran (its worker closed); nothing was published"),
                        "status": INTERRUPTED, "exit_code": EXIT_SIGTERM, "log": str(log.relative_to(root))}
            return not_run(cell)
        try:
            return future.result()
        except Exception as exc:
            killed = type(exc).__name__ == "KilledWorker"
            return {**not_run(cell, ("its worker died: " if killed else "the task failed: ") + describe(exc, 300)),
                    "status": LOST if killed else "failed", "exit_code": EXIT_INTERNAL,
                    "attempt": MAX_ATTEMPTS if killed else 1}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if getattr(self, "client", None) is not None:
                self.client.close()
        with contextlib.suppress(Exception):
            if self.cluster is not None:
                self.cluster.close()


def _takes_n_workers(client) -> bool:
    import inspect  # noqa: PLC0415 - only for this signature check

    return "n_workers" in inspect.signature(client.scheduler_info).parameters


def knock(address: str, timeout_s: float = 5.0) -> None:
    """Open (and close) a TCP connection to a ``tcp://host:port`` (or ``host:port``) scheduler address: OSError
    when nothing listens there (refused, unknown host, unreachable). Other transports are left to the client."""
    import socket  # noqa: PLC0415
    from urllib.parse import urlsplit  # noqa: PLC0415

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
        pass


def open_engine(scheduler: str | None, workers: int | None) -> Engine:
    return LocalEngine(workers) if scheduler is None else DaskEngine(scheduler, workers)


__all__ = ["DaskEngine", "Engine", "LocalEngine", "MAX_ATTEMPTS", "dask_cell", "not_run", "open_engine",
           "visible_gpus"]
