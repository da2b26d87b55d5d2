"""Facts about the machine and the software, for the manifest, and checks that fail before any work.

Disk space and the temporary folder are checked here too, before anything large is written. A convert writes
each artifact into the output folder, and into the temporary folder it writes what the compilers make
(Inductor's cache: an AOTInductor build holds a copy of the weights there) and what every AOTInductor load
extracts (another copy while it is loaded). A disk that fills halfway through a build can end the process inside
a native library with no error of ours at all (torch's zip writer aborts), so the space the weights say the
artifacts will take is checked first, on each disk that will hold it (:func:`check_space`), and a ``TMPDIR``
that cannot be written is refused before any work (:func:`check_temp_folder`).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .dtypes import BY_NAME
from .errors import EnvironmentProblem, OutputError
from .recipe import Recipe
from .targets import TARGETS
from .targets import get as get_target


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {
        "exporter": package_version("exporter"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": package_version("onnx"),
        "onnxscript": package_version("onnxscript"),
        "onnxruntime": package_version("onnxruntime"),
        "transformers": package_version("transformers"),
        "safetensors": package_version("safetensors"),
        "torch_tensorrt": package_version("torch-tensorrt") or package_version("torch_tensorrt"),
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info(device: str, host: bool = False) -> dict[str, object]:
    """The machine a run used; its host name only when asked (``[report] host = true``): reports get published."""
    info: dict[str, object] = {"type": device, "kernel": platform.release(), "platform": sys.platform,
                               "cpu": cpu_name()}
    if host:
        info["host"] = platform.node()
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update({"name": props.name, "capability": f"{props.major}.{props.minor}",
                     "multiprocessors": props.multi_processor_count, "memory_bytes": props.total_memory,
                     "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()})
    else:
        info["name"] = cpu_name()
    return info


def check_compiler(recipe: Recipe) -> None:
    """The C++ compiler Inductor builds with (``CXX``, else ``g++``), where a target needs one: an AOTInductor
    package, and ``torch.compile`` on the CPU. Without it the build would fail deep inside Inductor."""
    needs = [t for t in recipe.targets.build if recipe.runtime.device in get_target(t).compiler_on]
    if not needs:
        return
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler  # noqa: PLC0415 - private; some torch versions lack it
    except ImportError:
        return
    try:
        get_cpp_compiler()
    except Exception:  # noqa: BLE001 - torch's InvalidCxxCompiler, or whatever its search raises
        wanted = os.environ.get("CXX") or "g++"
        others = [t for t in recipe.targets.build if t not in needs]
        raise EnvironmentProblem(f"target {' and '.join(needs)} compiles C++ with Inductor, but the C++ compiler "
                                 f"{wanted!r} does not run on this machine",
                                 "install one (e.g. apt install g++) or set CXX to a C++ compiler; or build without "
                                 + ("it: " + " ".join(f"-t {t}" for t in others) if others else
                                    "it (-t exported_program -t onnx)")) from None


def check_machine(recipe: Recipe) -> None:
    """Fail before loading anything when the recipe asks for what this machine lacks (a GPU, bfloat16, a usable
    temporary folder)."""
    check_temp_folder()
    if recipe.runtime.device == "cuda" and not torch.cuda.is_available():
        raise EnvironmentProblem(f"recipe {recipe.name} runs on CUDA, but this machine has no usable GPU "
                                 f"(torch {torch.__version__}, cuda {torch.version.cuda})",
                                 "run it on a GPU machine, or choose a CPU recipe such as cpu-fp32")
    if recipe.runtime.device == "cuda" and recipe.runtime.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise EnvironmentProblem(f"recipe {recipe.name} uses bfloat16, which this GPU does not support",
                                 "choose a float16 or float32 recipe")


MARGIN = 1.1  # the estimate, plus a tenth (graphs, references, logs)
SLACK_BYTES = 256 * 2**20


def check_temp_folder() -> Path:
    """The temporary folder the compilers and loaders write to; refused when ``TMPDIR`` names one that cannot be
    used (torch's C++ loaders then fail with "Error generating temporary directory", and Python quietly falls
    back to another folder)."""
    named = os.environ.get("TMPDIR")
    if named:
        folder = Path(named)
        if not folder.is_dir():
            raise EnvironmentProblem(f"TMPDIR={named} does not exist: the compilers and AOTInductor write their "
                                     "temporary files there", "create that folder, or unset TMPDIR")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise EnvironmentProblem(f"TMPDIR={named} is not writable: the compilers and AOTInductor write their "
                                     "temporary files there", "make it writable, or point TMPDIR at a folder you "
                                     "can write")
        return folder
    return Path(tempfile.gettempdir())


@dataclass(frozen=True)
class Need:
    where: Path  # a folder on the disk that must hold it
    bytes: int
    what: str  # what it is, for the error: "the artifacts", "compiler and AOTInductor temporary files"
    fix: str


def check_space(needs: list[Need]) -> None:
    """Refuse (exit 5) when a disk has less free space than what will be written on it (needs on one disk add
    up), naming the folder, the estimate and what is free."""
    by_disk: dict[int, list[Need]] = {}
    for need in needs:
        if need.bytes > 0:
            by_disk.setdefault(_device(need.where), []).append(need)
    for group in by_disk.values():
        total = int(sum(n.bytes for n in group) * MARGIN) + SLACK_BYTES
        free = shutil.disk_usage(_existing(group[0].where)).free
        if free < total:
            parts = "; ".join(f"{n.what} in {n.where} about {_gib(n.bytes)}" for n in group)
            raise OutputError(f"not enough free disk space: {parts}, {_gib(total)} with a margin, and that disk has "
                              f"{_gib(free)} free", " or ".join(dict.fromkeys(n.fix for n in group)))


def space_needs(recipe: Recipe, model: Any, staging: Path, decoder: bool = False) -> list[Need]:
    """What the recipe's targets will write, from the weights' size (each target's row says how many copies)."""
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    itemsize = BY_NAME[recipe.runtime.dtype].itemsize
    wanted = [t for t in TARGETS if t.name in recipe.targets.build and t.unavailable() is None]
    graph = recipe.targets.aoti_cuda_graph and recipe.runtime.device != "cpu"
    spaces = [t.space(weights, itemsize, decoder, graph) for t in wanted]
    out, temp = sum(s[0] for s in spaces), sum(s[1] for s in spaces)
    return [Need(staging.parent, out, "the artifacts", "free disk space there, or choose another --out"),
            Need(Path(tempfile.gettempdir()), temp, "compiler and AOTInductor temporary files",
                 "free disk space there, or point TMPDIR at a larger disk")]


def folder_of(failed: OSError, out: Path) -> Path:
    """The folder a disk-full error happened in: the temporary folder when the failing file is under it,
    else ``out``."""
    name = failed.filename if isinstance(failed.filename, str) else None
    temp = Path(tempfile.gettempdir()).resolve()
    if name and Path(name).resolve().is_relative_to(temp) and not out.resolve().is_relative_to(temp):
        return temp
    return out


def _existing(path: Path) -> Path:
    path = Path(path).resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _device(path: Path) -> int:
    return os.stat(_existing(path)).st_dev


def _gib(count: float) -> str:
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 / 10 else f"{count / 2**20:.0f} MiB"
