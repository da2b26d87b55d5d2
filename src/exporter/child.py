"""``python -m exporter.child FD``: the process that loads and runs one variant (the parent side is
:class:`exporter.runners.RemoteRunner`).

It receives ``sys.path`` and a :class:`~exporter.targets.spec.RunnerSpec` over a socket, loads the variant
with its target's ``load`` and answers run, bench, memory, info and hook requests until told to quit.
:class:`Session` (a loaded variant plus the tensors it is timed on) is shared with the parent's
in-process runner.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch

from .dtypes import name_of
from .errors import describe
from .measure.bench import time_calls
from .measure.conditions import conditions
from .measure.memory import peak_memory
from .quiet import quiet_libraries
from .targets import load_runner
from .targets.spec import Loaded, RunnerSpec


class Session:
    """A loaded variant plus the tensors it is timed on; shared by the local and remote runners."""

    def __init__(self, loaded: Loaded):
        self.loaded = loaded
        self.bench_args: list[torch.Tensor] | None = None

    def prepare(self, sample: list[torch.Tensor]) -> list[torch.Tensor]:
        dtype = self.loaded.input_dtype
        return [(t.to(dtype) if t.is_floating_point() else t).to(self.loaded.device) for t in sample]

    def run(self, samples: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Every sample's outputs, on the CPU (small models and tests; comparisons stream, see ``outputs``)."""
        return [[t.detach().to("cpu") for t in self.outputs(sample)] for sample in samples]

    def outputs(self, sample: list[torch.Tensor]) -> list[torch.Tensor]:
        """One sample's outputs where the variant made them (its device)."""
        with torch.inference_mode():
            return [t.detach() for t in self.loaded.call(self.prepare(sample))]

    def set_bench_input(self, sample: list[torch.Tensor]) -> None:
        self.bench_args = self.prepare(sample)
        if self.loaded.device.startswith("cuda"):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def bench(self, count: int) -> list[float]:
        args = self.bench_args
        if args is None:
            raise RuntimeError("bench: set the benchmark input first")
        call = self.loaded.call
        with torch.inference_mode():
            return time_calls(lambda: call(args), count, self.loaded.device)


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

    def send_tensor(self, tensor: torch.Tensor) -> None:
        """A CPU tensor's raw bytes, without pickling (its shape and dtype travel in the message before it)."""
        data = tensor.detach().contiguous().reshape(-1)
        self._conn.send_bytes(data.view(torch.uint8).numpy().data if data.numel() else b"")

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = math.prod(shape)
        buffer = torch.empty(count * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8)
        if count:
            self._conn.recv_bytes_into(buffer.numpy())
        else:
            self._conn.recv_bytes()
        return buffer.view(dtype).reshape(shape)

    def close(self) -> None:
        self._conn.close()


def stream_outputs(conn: Channel, session: Session, sample: list[torch.Tensor], chunk: int) -> None:
    """Run ``sample``; send its outputs' shapes and dtypes, then each output in flat chunks of ``chunk`` values,
    copied to the CPU one chunk at a time; then ``end``."""
    outputs = session.outputs(sample)
    conn.send(("outputs", [(tuple(t.shape), name_of(t.dtype)) for t in outputs]))
    for index, tensor in enumerate(outputs):
        flat = tensor.reshape(-1)
        for start in range(0, flat.numel(), chunk):
            piece = flat[start:start + chunk]
            piece = piece.to("cpu") if piece.device.type != "cpu" else piece
            conn.send(("chunk", index, piece.numel()))
            conn.send_tensor(piece)
    conn.send(("end", None))


WARM_ENV = "EXPORTER_CHILD_WARM"  # set on a spare child (runners.Spares): the device to start before waiting


def child_main(fd: int) -> None:
    """Entry point of ``python -m exporter.child FD``: receive sys.path and the spec, then serve.

    A spare child (``EXPORTER_CHILD_WARM=cuda...``) starts CUDA while it waits for its spec."""
    conn = Channel(fd)
    warm = os.environ.pop(WARM_ENV, "")
    if warm.startswith("cuda") and torch.cuda.is_available():
        with contextlib.suppress(Exception):  # a failure to start CUDA is the loader's to report
            torch.cuda.init()
    try:
        path, spec = conn.recv()
    except EOFError:  # the parent went away before it needed this child
        return
    sys.path[:] = path + [p for p in sys.path if p not in path]  # the parent's first, then this child's own
    serve(conn, spec)


def serve(conn: Channel, spec: RunnerSpec) -> None:
    """Load the variant, then answer run/bench/memory requests until the parent says quit.

    ``("add", spec)`` loads another variant of the same artifact into this process (``aoti:cuda-graph`` beside
    ``aoti``: one process per artifact kind, so one CUDA context and one interpreter fewer); a request for it
    comes as ``("as", name, command, ...)``. The first variant's requests come as they are."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet = quiet_libraries()
    quiet.__enter__()  # for the child's whole life
    sessions: dict[str, Session] = {}
    if not _load(conn, spec, sessions):
        return
    first = sessions[spec.name]
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        command, *args = message
        if command == "add":
            _load(conn, args[0], sessions)
            continue
        try:
            session = first
            if command == "as":  # a request for another variant this process loaded
                name, command, *args = args
                session = sessions[name]
            if command == "stream":  # one sample, its outputs sent in chunks: nothing large is pickled
                stream_outputs(conn, session, args[0], args[1])
                continue
            if command == "quit":  # end at once: tearing down torch's interpreter state takes seconds
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
                conn.send(("ok", None))
                os._exit(0)
            conn.send(("ok", answer(session, command, args)))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", describe(exc), traceback.format_exc()))


def _load(conn: Channel, spec: RunnerSpec, sessions: dict[str, Session]) -> bool:
    """Load ``spec`` into ``sessions``; tell the parent ``ready`` (with the load time and facts) or why not."""
    try:
        t0 = time.perf_counter()
        loaded = load_runner(spec)
        sessions[spec.name] = Session(loaded)
        conn.send(("ready", time.perf_counter() - t0, dict(loaded.info)))
        return True
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as a reason
        conn.send(("error", describe(exc), traceback.format_exc()))
        return False


def answer(session: Session, command: str, args: list[Any]) -> Any:
    """One request of a loaded variant's session (every command but stream and quit)."""
    loaded = session.loaded
    if command == "run":
        return session.run(args[0])
    if command == "set_bench_input":
        session.set_bench_input(args[0])
        return None
    if command == "bench":
        return session.bench(args[0])
    if command == "memory":
        return {**peak_memory(loaded.device), "process": conditions()}
    if command == "info":
        return dict(loaded.info)
    if command == "call":  # a named hook of the loaded variant (e.g. a profiler)
        return loaded.hooks[args[0]](session, *args[1:])
    raise ValueError(f"unknown command {command!r}")



CHUNK_ELEMENTS = 1 << 24  # 16 M values: 128 MiB in float64


def chunks(tensor: torch.Tensor, size: int = CHUNK_ELEMENTS):
    """Flat, ordered chunks of ``tensor`` (views where it is contiguous)."""
    flat = tensor.detach().reshape(-1)
    for start in range(0, flat.numel(), size):
        yield flat[start:start + size]


if __name__ == "__main__":
    child_main(int(sys.argv[1]))
