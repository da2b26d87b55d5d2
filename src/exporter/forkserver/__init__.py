"""Children forked from one warm interpreter instead of started cold.

Every artifact runs in a process of its own (``exporter.runners``), and a fresh interpreter spends about two
seconds of CPU importing torch (and more for Inductor, onnxruntime and transformers) before it can load anything.
A run that judges four targets paid that four times, and a test suite hundreds of times. Instead, the first child a
process needs starts a server (``python -m exporter.forkserver.server``: :mod:`.server`) that imports all of that
once; every later child is a ``fork`` of it, ready at once, its pages shared with the server until written.

A forked child is what a started one would be: its own session (a kill reaches whatever it starts), its output
file, the environment and working folder the caller gives it, ``python -m module`` semantics, and an exit code
that names the signal that ended it. :func:`start` returns a :class:`Forked`, which answers what
``subprocess.Popen`` does (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``).

When a child cannot be forked it is started as before, by the ``fallback`` the caller passes:

- ``EXPORTER_FORK=0`` in the environment;
- a GPU build of torch (a process must not fork once a GPU driver may have started in it, and the server cannot
  prove it has not), or an interpreter with threads after its imports;
- a server that failed to start or has ended.

The server lasts as long as the process that started it (it ends when that process's end of its socket closes),
and one is kept per environment: a child whose environment differs from the running server's, beyond its own
temporary folder, gets a new server. :func:`server_pids` names the running one (tests that look for leftover
processes must not count it).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from typing import Any

ENV = "EXPORTER_FORK"
# what a library may read as it is imported (the server's imports are the children's): a child whose values of
# these differ from every running server's gets a server of its own. Everything else in its environment (a test's
# name, a cache folder) is the child's own, set after the fork, like those of PER_CHILD.
IMPORT_TIME = ("LD_", "PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "TORCH", "PYTORCH", "CUDA", "NVIDIA",
               "ORT_", "TRANSFORMERS", "HF_", "TOKENIZERS", "TRITON", "XDG_", "HOME")
# set for one child alone: its temporary folder (runners.with_scratch), the device a spare warms up (child.WARM_ENV)
PER_CHILD = ("TMPDIR", "TORCHINDUCTOR_CACHE_DIR", "EXPORTER_CHILD_WARM")
MAX_SERVERS = 2  # a server holds torch's imports, some hundreds of MB: at most this many at a time


class _Server:
    def __init__(self, env: dict[str, str], python: list[str]):
        self.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [*python, "-m", "exporter.forkserver.server", str(theirs.fileno())], pass_fds=(theirs.fileno(),),
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            theirs.close()
        self.ready: bool | None = None  # None: still importing
        self.children: weakref.WeakSet[Forked] = weakref.WeakSet()

    def check(self, wait: float | None = 0) -> bool | None:
        """True once it can fork, False if it cannot (or has ended), None while it is still importing (after
        waiting up to ``wait`` seconds for its answer; None: until it answers)."""
        if self.control.fileno() < 0:
            self.ready = False
        if self.ready is None:
            if select.select([self.control], [], [], wait)[0]:
                try:
                    answer = json.loads(self.control.recv(4096) or b'{"ready": false}')
                except (OSError, ValueError):
                    answer = {"ready": False}
                self.ready = bool(answer.get("ready"))
            elif self.process.poll() is not None:
                self.ready = False
        if self.ready and self.process.poll() is not None:
            self.ready = False
        return self.ready

    def idle(self) -> bool:
        """No child of it still runs (closing it now would lose no child's exit code)."""
        return all(child.poll() is not None for child in list(self.children))

    def send(self, request: dict[str, Any], fds: list[int]) -> bool:
        try:
            socket.send_fds(self.control, [json.dumps(request).encode()], fds)
            return True
        except OSError:
            self.ready = False
            return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


_servers: dict[tuple, _Server] = {}  # by the environment's import-time values, the most recently used last


def _key(env: dict[str, str], python: list[str]) -> tuple:
    """What a server's children inherit from its start: the interpreter's command line and the import-time part of
    the environment."""
    return (*python, *sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in PER_CHILD))


FORKS = True  # False in a child forked with ``forks=False`` (:func:`start`)


def enabled() -> bool:
    """Whether children may be forked here: on Linux, with a CPU build of torch, unless ``EXPORTER_FORK=0``."""
    if not FORKS or os.environ.get(ENV, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    torch = sys.modules.get("torch")
    version = getattr(torch, "version", None)
    return version is not None and getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None


def _server_for(env: dict[str, str], python: list[str]) -> _Server | None:
    """The running server for ``env``, a new one, or None (children start cold)."""
    if not enabled():
        return None
    key = _key(env, python)
    server = _servers.pop(key, None)
    if server is not None and server.check() is False and server.idle():
        server.close()
        server = None
    if server is None:
        while len(_servers) >= MAX_SERVERS:
            idle = next((k for k, s in _servers.items() if s.idle()), None)
            if idle is None:
                return None
            _servers.pop(idle).close()
        server = _Server(env, python)
    _servers[key] = server
    return server


def server_pids() -> set[int]:
    """The pids of the running servers."""
    return {s.process.pid for s in _servers.values() if s.process.poll() is None}


def stop() -> None:
    """End every server (their children go on: each is stopped by whoever started it)."""
    while _servers:
        _servers.popitem()[1].close()


atexit.register(stop)


class Forked:
    """A child asked of the server, with ``subprocess.Popen``'s surface. Until the server is ready the request
    waits here (the caller goes on); a server that cannot fork after all starts it cold (:func:`_cold`)."""

    def __init__(self, server: _Server, request: dict[str, Any], fds: list[int], python: list[str]):
        self.args = [request["module"], *request["args"]]
        self.returncode: int | None = None
        self._server, self._request, self._fds, self._python = server, request, fds, python
        self._popen: subprocess.Popen | None = None
        self._status: int | None = None  # the read end of the status pipe, once the request is sent
        self._buffer = b""
        self._pid: int | None = None
        self._orphan = False  # the server ended before the child did: only its liveness can be read
        self._advance()

    # ---------------------------------------------------------------- the request's way to a running child
    def _advance(self, wait: float | None = 0) -> None:
        if self._fds == [] or self.returncode is not None:
            return  # sent, started cold, or never to run
        ready = self._server.check(wait)
        if ready is None:
            return
        if ready:
            read, write = os.pipe()
            out, err, *passed = self._fds
            if self._server.send(self._request, [out, err, write, *passed]):
                os.close(write)
                self._status = read
                self._release()
                return
            os.close(read)
            os.close(write)
        request = self._request  # the server cannot fork: the child starts cold, with the same files
        self._popen = _cold(request["module"], request["args"], request["env"], request["cwd"], self._fds[0],
                            self._fds[1], tuple(self._fds[2:]), self._python)
        self._release()

    def _release(self) -> None:
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds = []

    def _read(self, timeout: float | None) -> None:
        """Read the status pipe (its pid, then its exit code), waiting up to ``timeout`` for news."""
        if self._status is None or not select.select([self._status], [], [], timeout)[0]:
            return
        chunk = os.read(self._status, 256)
        if chunk:
            self._buffer += chunk
            lines = self._buffer.split(b"\n")[:-1]
            if lines and self._pid is None:
                self._pid = int(lines[0])
            if len(lines) > 1:
                self.returncode = int(lines[1])
                self._close_status()
            return
        self._close_status()  # closed without an exit code: the server ended first
        if self._pid is None or not _alive(self._pid):
            self.returncode = -signal.SIGKILL
        else:
            self._orphan = True

    def _close_status(self) -> None:
        if self._status is not None:
            os.close(self._status)
            self._status = None

    def _settled(self, timeout: float | None) -> None:
        if self._popen is not None:
            self.returncode = self._popen.poll() if timeout == 0 else self._popen.wait(timeout)
        elif self._orphan:
            if not _alive(int(self._pid or -1)):
                self.returncode = -signal.SIGKILL  # its code went with the server
            elif timeout:
                time.sleep(min(timeout, 0.1))
        elif self._status is None:
            self._advance(timeout)
        else:
            self._read(timeout)

    # ---------------------------------------------------------------- Popen's surface
    @property
    def pid(self) -> int:
        while self._pid is None and self._popen is None and self.returncode is None:
            self._settled(None)
        return self._popen.pid if self._popen is not None else (self._pid or -1)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._settled(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            try:
                self._settled(1.0 if left is None else min(left, 1.0))
            except subprocess.TimeoutExpired:
                continue
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is not None:
            return
        if self._popen is not None:
            self._popen.send_signal(signum)
        elif self._status is None and not self._orphan:  # still waiting for the server: it never ran
            self._release()
            self.returncode = -signum
        elif self.pid > 0 and self.returncode is None:  # sent: its pid is on its way, if not read yet
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._release()
            self._close_status()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def fd_args(args: list[str], fds: tuple[int, ...] | list[int]) -> list[str]:
    """``args`` with each ``{N}`` replaced by the number of the N-th descriptor handed over, as the child has it."""
    return [str(fds[int(a[1:-1])]) if a.startswith("{") and a.endswith("}") and a[1:-1].isdigit() else a
            for a in args]


def _cold(module: str, args: list[str], env: dict[str, str], cwd: str, out: int, err: int,
          pass_fds: tuple[int, ...], python: list[str]) -> subprocess.Popen:
    return subprocess.Popen([*python, "-m", module, *fd_args(args, pass_fds)], pass_fds=pass_fds, env=env, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)


def start(module: str, args: list[str], env: dict[str, str], out: int, pass_fds: tuple[int, ...] = (),
          python: list[str] | None = None, err: int | None = None, cwd: str | None = None, forks: bool = True
          ) -> subprocess.Popen | Forked:
    """``python -m module args`` in its own session and folder ``cwd`` (default: this process's), its stdout to the
    file descriptor ``out``, its stderr to ``err`` (default: ``out``), and ``pass_fds`` handed to it (an argument
    ``{0}``, ``{1}``... is that descriptor's number in the child): forked from the server where it can be, else
    started cold. The caller keeps its own descriptors and closes them as before. ``forks=False``: a forked child
    starts its own children cold (a short-lived command would spend more importing a server of its own than its
    children save)."""
    python = python or [sys.executable]
    cwd = cwd or os.getcwd()
    err = out if err is None else err
    server = _server_for(env, python)
    if server is None:
        return _cold(module, args, env, cwd, out, err, pass_fds, python)
    request = {"module": module, "args": args, "env": env, "cwd": cwd, "forks": forks}
    child = Forked(server, request, [os.dup(fd) for fd in (out, err, *pass_fds)], python)
    server.children.add(child)
    return child


__all__ = ["ENV", "Forked", "enabled", "server_pids", "start", "stop"]
