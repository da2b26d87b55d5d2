"""Several AOTInductor packages compiled at once, each program after the first in a process of its own.

A generation's programs (the prefill, the decode step and the decode program of batch 1) are compiled from one
model but independently of each other, and compiling one is mostly one thread: Inductor's lowering in Python, then
one ``g++`` of its wrapper. One after the other they were the largest stage of a generation convert on a GPU
machine (75-134 s of 200-340 s, its 16 cores mostly idle; ``docs/generation.md``). :func:`compile_all` compiles the
first program here and hands the others to children that run at the same time:

- each program a child compiles is saved with ``torch.export.save`` into a temporary folder, with the ranges of its
  shapes' symbols as this process holds them (:func:`shape_ranges`: a program with a dynamic dimension does not
  come back from a save and a load whole); the child (``python -m exporter.targets.compile_apart REQUEST``, forked
  warm where :mod:`exporter.forkserver` can) imports the modules that register exporter's Triton ops
  (:data:`OP_MODULES`), loads the program, puts the ranges back, and compiles it under the same options and
  contexts as here (:func:`build_context`), through the same package cache;
- a child ends with the process that started it (``PR_SET_PDEATHSIG``); a signal, a failure or a timeout here kills
  every child's process group, and the temporary folder goes with them;
- a child that fails to compile fails the build with its last lines; a program that cannot be saved, or that a
  child could not load (it reads the file as every ``.pt2`` is read, ``program_file.load_program``: nothing
  unpickled), is compiled here, as before.

What stays here, one after the other: a CPU build (``EXPORTER_BUILD_JOBS``: how many programs compile at once; by
default this machine's CPU count for a GPU build, 1 for a CPU build: :func:`jobs_at_once`), a single program, and
programs whose weights would not fit again in the free GPU or host memory (a child loads its own copy). Each
package is the same compile of the same program either way, and the gate judges it the same.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import forkserver, interrupts
from ..attention_backend import backend_context
from . import package_cache

ENV = "EXPORTER_BUILD_JOBS"
# the modules whose import registers an op a program can hold (``torch.library.triton_op``): a child imports
# them before it loads a program (tests/targets/test_compile_apart.py keeps this list whole)
OP_MODULES = ("exporter.kernels.gemv", "exporter.kernels.decode_attention", "exporter.kernels.decode_step_attention",
              "exporter.quantize.fp8_gemv")
CHILD_PYTHON = [sys.executable, "-P"]  # -P: the working folder is not put on the child's import path
HOST_PER_CHILD_BYTES = 3 * 2**30  # an interpreter with torch and Inductor, and Inductor's compile workers
TIMEOUT_S = 3600.0


@dataclass
class Job:
    """One package to compile: ``program`` into ``path`` with Inductor's ``configs``; ``batch_1``: the decode
    program of batch 1 (compiled with :func:`int_arrays_declared_where_used`)."""

    program: Any  # torch.export.ExportedProgram
    path: Path
    configs: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    batch_1: bool = False


def jobs_at_once(device: str) -> int:
    """How many programs compile at once: ``EXPORTER_BUILD_JOBS``, else this machine's CPU count for a GPU build and
    1 for a CPU build. On the 2-core CPU machine three programs at once took longer than one after the other (the
    tiny Llama's generation programs: 74 s against 53 s): run in turn, a program reuses the kernels the one before it
    compiled (Inductor's kernel caches), and at once each compiles its own."""
    named = os.environ.get(ENV, "").strip()
    if named.isdigit() and int(named) >= 1:
        return int(named)
    return 1 if device == "cpu" else max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def int_arrays_declared_where_used() -> Iterator[bool]:
    """Inductor's C++ wrapper (torch 2.11 to 2.13) caches the name of each size/stride array it declares by the
    ``id()`` of the buffer the declaration went to. A short-lived buffer's ``id`` taken again by a later one makes a
    later use find a name declared where it cannot see it, and the wrapper does not compile (``'int_array_93' was
    not declared in this scope``, seen building the decode program of batch 1 with ``exporter::gemv`` on an H100;
    pytorch/pytorch#193621). Inside, every use declares its own array (a longer wrapper, nothing else). Yields
    whether torch had the method to replace."""
    try:
        from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu  # noqa: PLC0415
    except ImportError:
        yield False
        return
    original = CppWrapperCpu.__dict__.get("codegen_int_array_var")
    declare = getattr(CppWrapperCpu, "_codegen_int_array_var_impl", None)
    if original is None or declare is None:
        yield False
        return

    def codegen_int_array_var(self, int_array, writeline, known_statically=False, graph=None):
        return declare(self, int_array, writeline, known_statically)

    setattr(CppWrapperCpu, "codegen_int_array_var", codegen_int_array_var)  # noqa: B010 - mypy: a method
    try:
        yield True
    finally:
        setattr(CppWrapperCpu, "codegen_int_array_var", original)  # noqa: B010


@contextlib.contextmanager
def build_context(device: str, backend: str, batch_1: bool) -> Iterator[None]:
    """The contexts a package is compiled in, here and in a child alike."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(backend_context(backend, device))
        if device != "cpu":
            # Inductor probes the CPU's vector instruction sets (a g++ compile and a Python process per set) for
            # the C++ it would write for CPU kernels; a CUDA graph has none worth vectorising
            import torch._inductor.config as inductor_config  # noqa: PLC0415

            stack.enter_context(inductor_config.patch({"cpp.vec_isa_ok": False}))
        if batch_1:
            stack.enter_context(int_arrays_declared_where_used())
        yield


def compile_one(job: Job, device: str, backend: str, entry: str | None) -> str | None:
    """``job`` compiled in this process, through the package cache (``entry``: its key, when the cache is on)."""
    with build_context(device, backend, job.batch_1):
        return package_cache.compile_keyed(job.program, job.path, job.configs, entry)


def _shape_env(program: Any) -> Any:
    for node in program.graph.nodes:
        value = node.meta.get("val")
        for size in getattr(value, "shape", ()):
            if isinstance(size, torch.SymInt):
                return size.node.shape_env
    return None


def shape_ranges(program: Any) -> dict[str, list[int | None]]:
    """The range of every symbol of ``program``'s shapes as the process that exported it holds them (``None``: no
    bound). A program does not come back from ``torch.export.save`` and ``load`` whole (torch 2.11 to 2.13):
    a batch dimension is traced as a symbol of at least 2 (``[2, 2]`` when traced at 2) and loaded as one of at
    least 1, and the package Inductor compiled from the loaded program read an embedding out of bounds at batch 1
    (tests/targets/test_compile_apart.py). The child puts these ranges back (:func:`restore_ranges`)."""
    env = _shape_env(program)
    if env is None:
        return {}
    import sympy  # noqa: PLC0415

    def bound(value: Any) -> int | None:
        return int(value) if isinstance(value, sympy.Integer) else None

    return {str(symbol): [bound(r.lower), bound(r.upper)] for symbol, r in env.var_to_range.items()}


def restore_ranges(program: Any, ranges: dict[str, list[int | None]]) -> None:
    """Give a loaded program's symbols the ranges they had where it was exported (:func:`shape_ranges`); a symbol
    without one raises ``ValueError`` (the program is compiled in its parent instead)."""
    from torch.utils._sympy.numbers import int_oo  # noqa: PLC0415
    from torch.utils._sympy.value_ranges import ValueRanges  # noqa: PLC0415

    env = _shape_env(program)
    if env is None:
        return
    for symbol in list(env.var_to_range):
        if str(symbol) not in ranges:
            raise ValueError(f"symbol {symbol} of the loaded program has no range from the exporting process")
        lower, upper = ranges[str(symbol)]
        env.var_to_range[symbol] = ValueRanges(-int_oo if lower is None else lower, int_oo if upper is None else upper)


def weight_bytes(program: Any) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in [*program.state_dict.values(), *program.constants.values()]:
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total


def _host_available() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def room_for(children: list[Job], device: str) -> bool:
    """Whether each child's own copy of its program's weights fits in the free memory (host, and GPU)."""
    needed = sum(weight_bytes(job.program) for job in children)
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if needed * 1.25 > free:
            return False
    return needed * 2 + HOST_PER_CHILD_BYTES * len(children) < _host_available()


@dataclass
class _Child:
    job: Job
    index: int
    request: Path
    answer: Path
    log: Path
    process: Any


def _start(job: Job, index: int, device: str, backend: str, entry: str | None, folder: Path) -> _Child | None:
    """``job`` saved and handed to a child; None where its program cannot be saved (it is compiled here)."""
    program_file = folder / f"program-{index}.pt2"
    try:
        ranges = shape_ranges(job.program)
        torch.export.save(job.program, str(program_file))
    except Exception:
        program_file.unlink(missing_ok=True)
        return None
    request, answer, log = (folder / f"{kind}-{index}.{ext}" for kind, ext in
                            (("request", "json"), ("answer", "json"), ("child", "log")))
    request.write_text(json.dumps({
        "program": str(program_file), "path": str(job.path), "configs": job.configs, "device": device,
        "backend": backend, "batch_1": job.batch_1, "entry": entry, "ranges": ranges, "answer": str(answer)}),
        encoding="utf-8")
    env = dict(os.environ)  # the package cache's folder (EXPORTER_PACKAGE_CACHE) among it
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    scratch = folder / f"tmp-{index}"
    scratch.mkdir()
    env["TMPDIR"] = str(scratch)
    with contextlib.suppress(Exception):  # Inductor's caches (kernels, its precompiled header) shared with this process
        from torch._inductor.runtime.cache_dir_utils import cache_dir  # noqa: PLC0415

        env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir())
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        process = forkserver.start("exporter.targets.compile_apart", [str(request)], env, fd, (), CHILD_PYTHON)
    except Exception:  # no process could be started: compiled here
        return None
    finally:
        os.close(fd)
    return _Child(job, index, request, answer, log, process)


def _kill(child: _Child) -> None:
    """The child and whatever it started (its own session), as ``runners.kill_child`` stops an artifact's child
    (``runners`` imports ``targets``: this module cannot import it back)."""
    if child.process.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if child.process.pid > 0:
                os.killpg(child.process.pid, signal.SIGKILL)
        child.process.kill()
        with contextlib.suppress(Exception):
            child.process.wait(5)


def _tail(path: Path, limit: int = 2000) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    lines = [line for line in text.splitlines() if line.strip() and "Warning" not in line]
    return "\n".join(lines)[-limit:]


def _finish(child: _Child, deadline: float) -> dict[str, Any]:
    """Wait for ``child`` (a signal here is raised at once); its answer."""
    while child.process.poll() is None:
        interrupts.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"compiling {child.job.path.name} in a process of its own took over {TIMEOUT_S:.0f} s")
        time.sleep(0.1)
    if child.answer.is_file():
        return json.loads(child.answer.read_text(encoding="utf-8"))
    code = child.process.returncode
    ended = f"was killed by signal {-code}" if code and code < 0 else f"ended with exit code {code}"
    return {"stage": "compile", "error": f"the process compiling {child.job.path.name} {ended} without an answer:\n"
                                         f"{_tail(child.log)}"}


def compile_all(jobs: list[Job], device: str, backend: str) -> list[dict[str, Any]]:
    """Compile every job (see the module's docstring): for each, ``{"cache": "reused" | "stored" | None,
    "apart": bool}`` (``apart``: compiled by a child). A failed compile raises ``RuntimeError`` with its output."""
    cache = package_cache.folder()
    outcomes: list[dict[str, Any]] = [{"cache": None, "apart": False} for _ in jobs]
    todo: list[tuple[int, Job, str | None]] = []
    for index, job in enumerate(jobs):
        entry = package_cache.key(job.program, job.configs, device, job.extra) if cache is not None else None
        if cache is not None and entry is not None and package_cache.fetch(cache, entry, job.path):
            outcomes[index]["cache"] = "reused"
        else:
            todo.append((index, job, entry))
    apart = todo[1:jobs_at_once(device)]
    if apart and not room_for([job for _, job, _ in apart], device):
        apart = []
    here = todo[:1] + todo[1 + len(apart):]
    with tempfile.TemporaryDirectory(prefix="exporter-compile-") if apart else contextlib.nullcontext("") as folder:
        children: list[_Child] = []
        try:
            for index, job, entry in apart:
                child = _start(job, index, device, backend, entry, Path(folder))
                if child is None:
                    here.append((index, job, entry))
                else:
                    children.append(child)
            for index, job, entry in here:
                outcomes[index]["cache"] = compile_one(job, device, backend, entry)
            deadline = time.monotonic() + TIMEOUT_S
            for child in children:
                answer = _finish(child, deadline)
                if answer.get("stage") == "load":  # the program did not travel: compiled here after all
                    entry = next(e for i, _, e in apart if i == child.index)
                    outcomes[child.index]["cache"] = compile_one(child.job, device, backend, entry)
                elif "error" in answer:
                    raise RuntimeError(answer["error"])
                else:
                    outcomes[child.index].update(cache=answer["cache"], apart=True)
        finally:
            for child in children:
                _kill(child)
    return outcomes


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    """The child: one request (see :func:`_start`), one answer file."""
    _die_with_parent()
    request = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    answer = Path(request["answer"])
    stage = "load"
    try:
        for module in OP_MODULES:
            importlib.import_module(module)
        from .program_file import load_program  # noqa: PLC0415 - the one reader of a .pt2 (nothing unpickled)

        program = load_program(request["program"])
        restore_ranges(program, request["ranges"])
        stage = "compile"
        job = Job(program, Path(request["path"]), request["configs"], batch_1=request["batch_1"])
        result: dict[str, Any] = {"cache": compile_one(job, request["device"], request["backend"], request["entry"])}
    except Exception as exc:
        result = {"stage": stage, "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"}
    tmp = answer.with_suffix(".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    os.replace(tmp, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


__all__ = ["ENV", "Job", "OP_MODULES", "compile_all", "compile_one", "jobs_at_once"]
