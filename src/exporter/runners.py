"""Runners, the parent side: one loaded variant (eager model or artifact) that runs samples and timed bursts.

Compiled artifacts are loaded and run in a child process (``RemoteRunner``, served by
:mod:`exporter.child`): a segfault while loading an AOTInductor package, or any other crash, becomes a
failed target with its signal named in the report, and the rest of the run goes on. The parent talks to
each child over a socket, so the benchmark can still interleave all variants. The eager models run in
the parent (``LocalRunner``).

A generation target is judged and timed whole in a child of its own (:func:`run_session`, served by
``python -m exporter.generation.session``): the request and the answer are files, the rest is the same
crash isolation.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch

from . import forkserver, interrupts
from .child import CHUNK_ELEMENTS, WARM_ENV, Channel, Session, chunks
from .dtypes import name_of
from .errors import RunnerFailed, failure_reason, shorten
from .measure.conditions import conditions, inherit
from .measure.memory import peak_memory
from .targets import get as get_target
from .targets.spec import Loaded, RunnerSpec
from .targets.toolchain import aoti_preload

DEFAULT_TIMEOUT_S = 3600.0
Process = Union[subprocess.Popen, forkserver.Forked]  # a child started cold, or forked from the warm server
SESSION_TIMEOUT_S = 3600.0


class LocalRunner:
    def __init__(self, name: str, loaded: Loaded, load_s: float = 0.0):
        self.name = name
        self.session = Session(loaded)
        self.load_s = load_s
        self.info = dict(loaded.info)

    def run(self, samples):
        return self.session.run(samples)

    def begin_stream(self, sample, chunk: int = CHUNK_ELEMENTS) -> Iterator[tuple]:
        """``("outputs", [(shape, dtype)])``, then ``("chunk", index, tensor)`` per flat chunk, on its device."""
        def events():
            outputs = self.session.outputs(sample)
            yield "outputs", [(tuple(t.shape), name_of(t.dtype)) for t in outputs]
            for index, tensor in enumerate(outputs):
                for piece in chunks(tensor, chunk):
                    yield "chunk", index, piece
        return events()

    def set_bench_input(self, sample):
        self.session.set_bench_input(sample)

    def bench(self, count: int) -> list[float]:
        return self.session.bench(count)

    def memory(self) -> dict[str, Any]:
        return {**peak_memory(self.session.loaded.device), "process": conditions()}

    def refresh_info(self) -> dict[str, Any]:
        self.info.update(self.session.loaded.info)
        return self.info

    def call(self, hook: str, *args):
        return self.session.loaded.hooks[hook](self.session, *args)

    def close(self) -> None:
        pass


_STACK = ("frame #", "Exception raised from", "File \"", "Traceback", "^", "~")
_FAILURE = re.compile(r"error|exception|assert|abort|terminate|out of bounds|fault|killed", re.IGNORECASE)


def _log_tail(log: Path | None, limit: int = 300) -> str:
    """The line of the child's output that says why it failed, for the one-line reason: a C++ exception's
    ``what():``, else the last line that reads as an error, else the last line (stack frames skipped)."""
    if not log or not Path(log).is_file():
        return ""
    text = Path(log).read_text(encoding="utf-8", errors="replace")[-65536:]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(_STACK)]
    for line in reversed(lines):
        if line.startswith("what():"):
            return shorten(line[len("what():"):].strip(), limit)
    for line in reversed(lines):
        if _FAILURE.search(line):
            return shorten(line, limit)
    return shorten(lines[-1], limit) if lines else ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        return f"crashed with {({s.value: s.name for s in signal.Signals}).get(-code, f'signal {-code}')}"
    return f"exited with code {code}"


def import_path() -> list[str]:
    """The parent's ``sys.path`` for a child, less the working folder. A child loads files it was handed: a module
    in the folder it was started from must never shadow an installed one (a foreign program's call spec names
    transformers' modules, which the child imports). A user's ``--model`` factory puts the working folder back
    itself (``checkpoint.architecture.import_factory``)."""
    here = os.path.realpath(os.getcwd())
    return [p for p in sys.path if p and os.path.realpath(p) != here]


CHILD_PYTHON = [sys.executable, "-P"]  # -P: the working folder is not put on the child's import path


def child_env(preload: str | None = None) -> dict[str, str]:
    """The environment of a child: the parent's, its ``sys.path`` less the working folder (then any
    ``PYTHONPATH`` entry set since the parent started), passive OpenMP threads, and ``preload``."""
    env = dict(os.environ)
    inherit(env)  # OMP_WAIT_POLICY as this process has it (measure/conditions.py): every variant timed alike
    path = import_path()
    here = os.path.realpath(os.getcwd())
    path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
             if p and p not in path and os.path.realpath(p) != here]
    env["PYTHONPATH"] = os.pathsep.join(path)
    if preload:
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (preload, env.get("LD_PRELOAD")) if p)
    return env


SCRATCH_PREFIX = "exporter-child-"  # + the parent's pid: each child's own temporary folder
_scratch: dict[int, str] = {}  # id of a child's process -> its temporary folder, removed once it has ended
_swept = False


def inductor_cache_dir() -> str:
    """Where Inductor keeps its compile cache when nothing says otherwise (``default_cache_dir`` in torch, which
    follows ``TMPDIR``): a child is given its own ``TMPDIR``, but must share this cache with every other run."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def with_scratch(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """``env`` with ``TMPDIR`` set to a new folder of the child's own, and that folder. An AOTInductor package
    load extracts the package into the temporary folder and only its destructor removes it, which a child that
    ends with ``os._exit`` (or is killed) never runs: removing the child's folder after it ended leaves nothing."""
    sweep_scratch()
    folder = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    env = dict(env)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_cache_dir())
    env["TMPDIR"] = folder
    return env, folder


@contextlib.contextmanager
def scratch_env(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """:func:`with_scratch` for a child run to its end in the block (``subprocess.run``)."""
    env, folder = with_scratch(env)
    try:
        yield env
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def sweep_scratch() -> None:
    """Remove the temporary folders of children whose parent is gone (killed before it could remove them)."""
    global _swept
    if _swept:
        return
    _swept = True
    for folder in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        owner = folder.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if folder.is_dir() and owner.isdigit() and not _alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_child(env: dict[str, str], log: Path | None) -> tuple[Process, Channel]:
    """``python -m exporter.child FD`` in its own session (and temporary folder: :func:`with_scratch`), its output
    appended to ``log``: forked from the warm server (:mod:`exporter.forkserver`) where it can be, else started
    cold, when it imports torch; either way it waits for ``sys.path`` and a spec on the returned channel."""
    env, folder = with_scratch(env)
    parent_sock, child_sock = socket.socketpair()
    out = os.open(log if log else os.devnull, os.O_WRONLY | os.O_APPEND | (os.O_CREAT if log else 0), 0o644)
    try:
        process = forkserver.start("exporter.child", ["{0}"], env, out, (child_sock.fileno(),), CHILD_PYTHON)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        child_sock.close()
        os.close(out)
    _scratch[id(process)] = folder
    return process, Channel(parent_sock.detach())


def kill_child(process: Process) -> None:
    """Stop a child and whatever it started (compile workers share its session); remove its temporary folder."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if process.pid > 0:
                os.killpg(process.pid, signal.SIGKILL)
        process.kill()
        process.wait(5)
    folder = _scratch.pop(id(process), None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


class Spares:
    """Child interpreters started before they are needed.

    A child started cold spends seconds importing torch (and starting CUDA for a GPU recipe; a forked one waits for
    its server's imports once), which the parent used to wait for after each target was built. A spare does that
    while the parent loads, exports and builds; a built target's :class:`RemoteRunner` takes one and loads.
    At most ``keep`` wait at a time (by default one fewer than the CPUs, so that on a small machine their
    imports do not slow the parent), and one taken is replaced while ``expected`` says more will be needed.
    A child that needs its own environment (``LD_PRELOAD``) cannot be a spare: a process's environment is
    fixed once it runs. Spares still waiting at :meth:`close` are stopped.
    """

    def __init__(self, expected: int, log_path: Callable[[str], Path] | None = None, device: str = "cpu",
                 keep: int | None = None):
        self.expected = expected
        self.keep = keep if keep is not None else max(1, (os.cpu_count() or 2) - 1)
        self.log_path = log_path
        self.env = child_env()
        if device.startswith("cuda"):
            self.env[WARM_ENV] = device
        self.waiting: list[tuple[Process, Channel, Path | None]] = []
        self.started = 0
        self._fill()

    def _fill(self) -> None:
        while len(self.waiting) < min(self.keep, self.expected):
            self.started += 1
            log = self.log_path(f"spare-{self.started}") if self.log_path else None
            process, conn = start_child(self.env, log)
            self.waiting.append((process, conn, log))

    def take(self, log: Path | None) -> tuple[Process, Channel, Path | None] | None:
        """A waiting child, its output file renamed to ``log`` (the open file follows), or None if none waits."""
        while self.waiting:
            process, conn, own_log = self.waiting.pop(0)
            if process.poll() is not None:  # it died while waiting (its log, if any, says why): pass it over
                self._discard(process, conn, own_log)
                continue
            self.expected = max(0, self.expected - 1)
            if own_log is not None and log is not None and not log.exists():
                os.replace(own_log, log)
                own_log = log
            self._fill()
            return process, conn, own_log
        return None

    @staticmethod
    def _discard(process: Process, conn: Channel, log: Path | None) -> None:
        kill_child(process)
        conn.close()
        if log is not None and log.exists() and not log.stat().st_size:
            log.unlink()

    def close(self) -> None:
        self.expected = 0
        for waiting in self.waiting:
            self._discard(*waiting)
        self.waiting.clear()


class RemoteRunner:
    """A variant loaded in its own process (``python -m exporter.child``), spoken to over a socket pair.

    A fresh interpreter rather than multiprocessing's spawn: the caller's main
    script is not re-imported in the child, so library users need no
    ``if __name__ == "__main__"`` guard. The child's output goes to ``log``.
    """

    def __init__(self, spec: RunnerSpec, log: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 wait: bool = True, spares: Spares | None = None, host: RemoteRunner | None = None):
        """Start the child (or take one of ``spares``) and send it the spec; with ``wait`` (the default) block
        until it has loaded the variant, else the caller goes on while it loads and calls :meth:`ready` when it
        needs it. With ``host`` the variant is loaded into that runner's process instead (another variant of the
        same artifact: one process per artifact kind); a crash there fails both."""
        self.name = spec.name
        self.spec = spec
        self.timeout_s = timeout_s
        self.info: dict[str, Any] = {}
        self.host = host
        self.process: Process
        self.conn: Channel
        self.log: Path | None
        self.loads: list[RemoteRunner]
        self.failed: RunnerFailed | None = None
        self.load_s: float | None = None
        self.started = time.perf_counter()
        if host is not None:
            self.process, self.conn, self.log = host.process, host.conn, host.log
            self.loads = host.loads  # the replies to loads still to come, in the order they were asked for
            self.loads.append(self)
            self.conn.send(("add", spec))
        else:
            preload = spec.option("ld_preload")
            taken = spares.take(log) if spares is not None and not preload else None
            if taken is None:
                self.process, self.conn = start_child(child_env(preload), log)
                self.log = log
            else:
                self.process, self.conn, self.log = taken
            self.loads = [self]
            self.conn.send((import_path(), spec))
        if wait:
            self.ready()

    def ready(self) -> RemoteRunner:
        """Wait until the child has loaded the variant (at once if it has); raise RunnerFailed if it could not.
        The child answers loads in the order they were asked for: an answer read here may be another variant's
        of the same process, and is kept for it."""
        self._take_loads(until=self)
        if self.failed is not None:
            raise self.failed
        return self

    def _take_loads(self, until: RemoteRunner | None) -> None:
        """Read the answers to the loads this process was asked for, in order, up to ``until``'s (None: all of
        them: a request's answer comes after every load asked for before it)."""
        while self.loads and (until is None or (until.load_s is None and until.failed is None)):
            owner = self.loads[0]
            if owner.host is not None and owner.host.failed is not None:  # the process never got to it
                self.loads.pop(0)
                owner.failed = RunnerFailed(f"load: its process could not load {owner.host.name} "
                                            f"({owner.host.failed.reason})", owner.host.failed.detail)
                continue
            try:
                kind, *rest = owner._receive("load")
            except RunnerFailed as exc:
                self.loads.pop(0)
                owner.failed, owner.load_s = exc, time.perf_counter() - owner.started
                continue
            self.loads.pop(0)
            owner.load_s = rest[0] if kind == "ready" else time.perf_counter() - owner.started
            owner.info = dict(rest[1]) if kind == "ready" else {}

    def _send(self, message: tuple) -> None:
        """A request, addressed to this variant where it shares its process with another; the answers to every
        load asked of the process are read first (they come before this request's)."""
        self._take_loads(until=None)
        self.conn.send(message if self.host is None else ("as", self.name, *message))

    def _exit(self) -> str:
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            return "stopped answering"
        text = _describe_exit(self.process.returncode)
        tail = _log_tail(self.log)
        return f"{text}{' (' + tail + ')' if tail else ''}"

    def _receive(self, what: str):
        deadline = time.monotonic() + self.timeout_s
        while True:
            interrupts.check()
            if self.conn.poll(0.2):
                try:
                    message = self.conn.recv()
                except (EOFError, ConnectionError, OSError):
                    raise RunnerFailed(f"{what}: the child process {self._exit()}") from None
                if message[0] == "error":
                    raise RunnerFailed(f"{what}: {message[1]}", message[2] if len(message) > 2 else "")
                return message
            if self.process.poll() is not None:
                raise RunnerFailed(f"{what}: the child process {self._exit()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RunnerFailed(f"{what}: no answer within {self.timeout_s:.0f} s; the child was stopped")

    def _ask(self, what: str, *message):
        try:
            self._send(message)
        except (BrokenPipeError, ConnectionError, OSError):
            raise RunnerFailed(f"{what}: the child process {self._exit()}") from None
        return self._receive(what)[1]

    def run(self, samples):
        return self._ask("run", "run", samples)

    def begin_stream(self, sample, chunk: int = CHUNK_ELEMENTS) -> Iterator[tuple]:
        """Ask the child to run ``sample`` now (it computes while the caller does other work); the events
        (as :meth:`LocalRunner.begin_stream`'s, chunks on the CPU) are read as the caller iterates."""
        try:
            self._send(("stream", sample, chunk))
        except (BrokenPipeError, ConnectionError, OSError):
            raise RunnerFailed(f"run: the child process {self._exit()}") from None

        def events():
            meta = self._receive("run")[1]
            dtypes = [getattr(torch, d) for _, d in meta]
            yield "outputs", meta
            while True:
                message = self._receive("run")
                if message[0] == "end":
                    return
                _, index, count = message
                try:
                    tensor = self.conn.recv_tensor((count,), dtypes[index])
                except (EOFError, ConnectionError, OSError):
                    raise RunnerFailed(f"run: the child process {self._exit()}") from None
                yield "chunk", index, tensor
        return events()

    def set_bench_input(self, sample) -> None:
        self._ask("benchmark setup", "set_bench_input", sample)

    def bench(self, count: int) -> list[float]:
        return self._ask("benchmark", "bench", count)

    def memory(self) -> dict[str, Any]:
        return self._ask("memory", "memory")

    def refresh_info(self) -> dict[str, Any]:
        self.info.update(self._ask("info", "info"))
        return self.info

    def call(self, hook: str, *args):
        return self._ask(hook, "call", hook, *args)

    def kill(self) -> None:
        """Stop the child and whatever it started (compile workers share its session)."""
        kill_child(self.process)

    def close(self) -> None:
        """Ask the child to quit and wait for it; after SIGINT or SIGTERM, stop it at once. A variant hosted by
        another runner's process leaves that process to its host."""
        if self.host is not None:
            return
        if self.process.poll() is None and interrupts.received() is None:
            try:
                self.conn.send(("quit",))
                self.process.wait(10)
            except (BrokenPipeError, ConnectionError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.conn.close()


def run_session(folder: Path, target: str, log: Path, time_it: bool, steps: int | None = None,
                timeout_s: float = SESSION_TIMEOUT_S, scratch: Path | None = None) -> dict[str, Any]:
    """``python -m exporter.generation.session`` for one generation target of ``folder`` in a child process (with
    the compiler's libstdc++ preloaded for a target whose artifacts need it: ``targets.toolchain``); its request
    and answer files go to ``scratch`` (default: the folder itself). The child's answer, or ``{"target", "error"}``
    when it ended without one."""
    preload = aoti_preload() if get_target(target).preload else None
    request = (scratch or folder) / f".session-{target}.json"
    answer = (scratch or folder) / f".session-{target}.result.json"
    request.write_text(json.dumps({"folder": str(folder), "target": target, "time": time_it, "steps": steps}))
    try:
        with open(log, "ab") as out, scratch_env(child_env(preload)) as env:
            process = forkserver.start("exporter.generation.session", [str(request), str(answer)], env,
                                       out.fileno(), (), CHILD_PYTHON)
            try:
                process.wait(timeout_s)
            finally:  # a timeout, or a signal to this process
                if process.poll() is None:
                    kill_child(process)
        if not answer.is_file():
            ended = _describe_exit(process.returncode)
            return {"target": target, "error": f"the session process {ended} without a result (see {log.name})"}
        return json.loads(answer.read_text(encoding="utf-8"))
    except subprocess.TimeoutExpired:
        return {"target": target, "error": f"the session did not finish in {timeout_s:.0f} s"}
    finally:
        request.unlink(missing_ok=True)
        answer.unlink(missing_ok=True)


__all__ = ["RunnerFailed", "LocalRunner", "RemoteRunner", "Spares", "failure_reason", "run_session",
           "DEFAULT_TIMEOUT_S"]
