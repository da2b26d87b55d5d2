"""``python -P -m exporter.forkserver.server FD``: one interpreter that imports torch and the children's modules
once, then forks a child for each request that arrives on the socket ``FD`` (the client side, and why, is
:mod:`exporter.forkserver`).

A request is one datagram: JSON ``{"module", "args", "env", "cwd", "forks"}`` with the file descriptors it hands over
(the child's stdout and stderr, the pipe its statuses go to, then the descriptors ``args`` name as ``{0}``,
``{1}``...). The forked child starts its own session, takes its stdout and stderr, the environment and working
folder it was sent, and runs ``module`` as ``python -m module args`` would. The server writes the child's pid to
its status pipe at once, then its exit code (negative: the signal that ended it) once it has reaped it, and closes
the pipe. The server ends when the socket's other end closes (its parent has gone).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import tempfile
import traceback

# what the children import (onnxruntime is left out: importing it starts a thread of its own, and it costs little)
PRELOAD = ("torch", "torch._inductor", "torch._inductor.package", "transformers", "exporter.child",
           "exporter.generation.session", "exporter.cli")
MAX_FDS = 8


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def preload() -> str | None:
    """Import what every child would; why this interpreter must not fork (None: it may). torch's own import leaves
    threads that its fork handlers know of (a data loader's workers are forks of such a process); any thread the
    other imports start would be copied mid-use, so there must be none."""
    import torch  # noqa: PLC0415

    if torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None:
        return "a GPU build of torch: a process that may have started its driver must not fork"
    baseline = _threads()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # an optional library this machine lacks: its child imports (and reports) it alone
    if _threads() != baseline:
        return f"{_threads() - baseline} thread(s) started by the imports: a fork would copy them mid-use"
    gc.collect()
    gc.freeze()  # the imported objects' pages stay shared with every child (the collector never writes them)
    return None


def become_child(request: dict, fds: list[int], keep_closed: list[int]) -> None:
    """In the forked process: take the request's session, output, environment and folder, then run its module."""
    code = 1
    try:
        os.setsid()
        out, err, status, *passed = fds
        for fd in (status, *keep_closed):
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        if not request.get("forks", True):  # its own children start cold (no server of its own to import again)
            vars(importlib.import_module("exporter.forkserver"))["FORKS"] = False
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        if not sys.flags.safe_path and sys.path:  # `python -m` puts the folder it starts in first (-P: nothing)
            sys.path[0] = os.getcwd()
        tempfile.tempdir = None  # read TMPDIR again: each child has a temporary folder of its own
        sys.argv = [request["module"], *importlib.import_module("exporter.forkserver").fd_args(request["args"], passed)]
        code = 0
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what `python -m` would print before exiting with 1
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # what an interpreter's shutdown runs (os._exit skips it)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001, S110 - a closed stream has nothing left to say
                    pass
            os._exit(code)


def serve(control: socket.socket) -> None:
    statuses: dict[int, int] = {}  # pid -> the write end of its status pipe
    while True:
        readable, _, _ = select.select([control], [], [], 0.05)
        reap(statuses)
        if not readable:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(control, 65536, MAX_FDS)
        except OSError:
            return
        if not data:
            return  # the parent has gone: its children are its to stop (each reads its own socket's end)
        request = json.loads(data)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:
            become_child(request, fds, [control.fileno(), *statuses.values()])
        status = fds[2]
        try:
            os.write(status, f"{pid}\n".encode())
        except OSError:
            pass
        statuses[pid] = status
        for fd in fds:
            if fd != status:
                os.close(fd)


def reap(statuses: dict[int, int]) -> None:
    while statuses:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        status = statuses.pop(pid, None)
        if status is None:
            continue
        try:
            os.write(status, f"{os.waitstatus_to_exitcode(raw)}\n".encode())
        except OSError:
            pass
        os.close(status)


def main(fd: int) -> None:
    control = socket.socket(fileno=fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when its children stop
    refusal = preload()
    control.send(json.dumps({"ready": refusal is None, "why": refusal}).encode())
    if refusal is None:
        serve(control)


if __name__ == "__main__":
    main(int(sys.argv[1]))
