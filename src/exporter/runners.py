"""Runners: one loaded variant (eager model or artifact) that runs samples and timed bursts.

Compiled artifacts are loaded and run in a child process (``RemoteRunner``): a
segfault while loading an AOTInductor package, or any other crash, becomes a
failed target with its signal named in the report, and the rest of the run goes
on. The parent talks to each child over a pipe, so the benchmark can still
interleave all variants. The eager models run in the parent (``LocalRunner``).
"""

from __future__ import annotations

import os
import pickle
import resource
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch

from .bench import time_calls
from .errors import ExporterError

DEFAULT_TIMEOUT_S = 3600.0


class RunnerFailed(Exception):
    """The variant could not be loaded or run; ``reason`` is one line for the report."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class ModelSource:
    """How a child process rebuilds the model from the checkpoint."""

    checkpoint: str
    factory: str | None
    allow_pickle: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    example_file: str  # safetensors of the reference inputs; sample 0 drives the rewrite's audit run
    rewrite: bool = True  # the recipe's runtime.rewrite_attention


@dataclass(frozen=True)
class RunnerSpec:
    name: str  # the variant's name in the report
    target: str  # registered target that knows how to load it
    device: str
    dtype: str
    path: str | None = None
    source: ModelSource | None = None
    options: tuple[tuple[str, Any], ...] = ()
    attention_backend: str = "auto"

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


@dataclass
class Loaded:
    """What a target's loader returns: a callable over device tensors, and facts for the report."""

    call: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    device: str
    input_dtype: torch.dtype
    info: dict[str, Any] = field(default_factory=dict)  # plain data, sent back to the parent
    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)  # extra commands, e.g. a profiler


def peak_rss_bytes() -> int:
    """This process's own peak resident memory.

    Linux's VmHWM belongs to the process's address space and starts afresh at exec; ``ru_maxrss`` would
    also count the parent's memory at the time it forked this process.
    """
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _peak_memory(device: str) -> dict[str, Any]:
    if device.startswith("cuda") and torch.cuda.is_available():
        return {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()), "memory_kind": "cuda allocator peak"}
    return {"peak_memory_bytes": peak_rss_bytes(), "memory_kind": "process peak RSS"}


class Session:
    """A loaded variant plus the tensors it is timed on; shared by the local and remote runners."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.bench_args: list[torch.Tensor] | None = None

    def prepare(self, sample: list[torch.Tensor]) -> list[torch.Tensor]:
        dtype = self.loaded.input_dtype
        return [(t.to(dtype) if t.is_floating_point() else t).to(self.loaded.device) for t in sample]

    def run(self, samples: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        results = []
        with torch.inference_mode():
            for sample in samples:
                out = self.loaded.call(self.prepare(sample))
                results.append([t.detach().to("cpu") for t in out])
        return results

    def set_bench_input(self, sample: list[torch.Tensor]) -> None:
        self.bench_args = self.prepare(sample)
        if self.loaded.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def bench(self, count: int) -> list[float]:
        args = self.bench_args
        call = self.loaded.call
        with torch.inference_mode():
            return time_calls(lambda: call(args), count, self.loaded.device)


class LocalRunner:
    def __init__(self, name: str, loaded: Loaded, load_s: float = 0.0):
        self.name = name
        self.session = Session(loaded)
        self.load_s = load_s
        self.info = dict(loaded.info)

    def run(self, samples):
        return self.session.run(samples)

    def set_bench_input(self, sample):
        self.session.set_bench_input(sample)

    def bench(self, count: int) -> list[float]:
        return self.session.bench(count)

    def memory(self) -> dict[str, Any]:
        return _peak_memory(self.session.loaded.device)

    def refresh_info(self) -> dict[str, Any]:
        self.info.update(self.session.loaded.info)
        return self.info

    def call(self, hook: str, *args):
        return self.session.loaded.hooks[hook](self.session, *args)

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- child side


class Channel:
    """Messages over a socket, pickled by value (torch's multiprocessing pickler would share memory
    through a resource sharer that only works between multiprocessing's own processes)."""

    def __init__(self, fd: int):
        self._conn = Connection(fd)

    def send(self, obj: Any) -> None:
        self._conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def recv(self) -> Any:
        return pickle.loads(self._conn.recv_bytes())

    def poll(self, timeout: float) -> bool:
        return self._conn.poll(timeout)

    def close(self) -> None:
        self._conn.close()


def child_main(fd: int) -> None:
    """Entry point of ``python -m exporter.child FD``: receive sys.path and the spec, then serve."""
    conn = Channel(fd)
    path, spec = conn.recv()
    sys.path[:] = path
    _serve(conn, spec)


def _serve(conn, spec: RunnerSpec) -> None:
    """Child process main loop: load the variant, then answer run/bench/memory requests."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .quiet import quiet_libraries

    quiet = quiet_libraries()
    quiet.__enter__()  # for the child's whole life
    try:
        from .targets import load_runner

        t0 = time.perf_counter()
        loaded = load_runner(spec)
        session = Session(loaded)
        conn.send(("ready", time.perf_counter() - t0, dict(loaded.info)))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as a reason
        reason = exc.one_line() if isinstance(exc, ExporterError) else f"{type(exc).__name__}: {exc}"
        conn.send(("error", reason, traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        command, *args = message
        try:
            if command == "run":
                reply = session.run(args[0])
            elif command == "set_bench_input":
                session.set_bench_input(args[0])
                reply = None
            elif command == "bench":
                reply = session.bench(args[0])
            elif command == "memory":
                reply = _peak_memory(loaded.device)
            elif command == "info":
                reply = dict(loaded.info)
            elif command == "call":  # a named hook of the loaded variant (e.g. a profiler)
                reply = loaded.hooks[args[0]](session, *args[1:])
            elif command == "quit":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
            conn.send(("ok", reply))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                       traceback.format_exc()))


# --------------------------------------------------------------------------- parent side


def _log_tail(log: Path | None, limit: int = 300) -> str:
    """The last meaningful line the child wrote, for the one-line reason."""
    if not log or not Path(log).is_file():
        return ""
    lines = [ln.strip() for ln in Path(log).read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    return lines[-1][:limit] if lines else ""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"crashed with {name}"
    return f"exited with code {code}"


class RemoteRunner:
    """A variant loaded in its own process (``python -m exporter.child``), spoken to over a socket pair.

    A fresh interpreter rather than multiprocessing's spawn: the caller's main
    script is not re-imported in the child, so library users need no
    ``if __name__ == "__main__"`` guard. The child's output goes to ``log``.
    """

    def __init__(self, spec: RunnerSpec, log: Path | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.name = spec.name
        self.spec = spec
        self.timeout_s = timeout_s
        self.info: dict[str, Any] = {}
        self.log = log
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        # Idle OpenMP threads in a child must not spin while another variant is being timed.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        preload = spec.option("ld_preload")
        if preload:
            env["LD_PRELOAD"] = os.pathsep.join(p for p in (preload, env.get("LD_PRELOAD")) if p)
        out = open(log, "ab") if log else subprocess.DEVNULL
        t0 = time.perf_counter()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "exporter.child", str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                start_new_session=True)
        finally:
            child_sock.close()
            if log:
                out.close()
        self.conn = Channel(parent_sock.detach())
        self.conn.send((list(sys.path), spec))
        kind, *rest = self._receive("load")
        self.load_s = rest[0] if kind == "ready" else time.perf_counter() - t0
        self.info = dict(rest[1]) if kind == "ready" else {}

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
            self.conn.send(message)
        except (BrokenPipeError, ConnectionError, OSError):
            raise RunnerFailed(f"{what}: the child process {self._exit()}") from None
        return self._receive(what)[1]

    def run(self, samples):
        return self._ask("run", "run", samples)

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
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.conn.send(("quit",))
                self.process.wait(10)
            except (BrokenPipeError, ConnectionError, OSError, subprocess.TimeoutExpired):
                pass
        self.kill()
        self.conn.close()
