"""Disk space and the temporary folder, checked before anything large is written.

A convert writes each artifact into the output folder, and into the temporary folder it writes what the
compilers make (Inductor's cache: an AOTInductor build holds a copy of the weights there) and what every
AOTInductor load extracts (another copy while it is loaded). A disk that fills halfway through a build can end
the process inside a native library with no error of ours at all (torch's zip writer aborts), so the space the
weights say the artifacts will take is checked first, on each disk that will hold it (:func:`check_space`), and
a ``TMPDIR`` that cannot be written is refused before any work (:func:`check_temp_folder`). Nothing here
imports torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .dtypes import BY_NAME
from .errors import EnvironmentProblem, OutputError
from .targets import TARGETS

if TYPE_CHECKING:
    from .recipe import Recipe

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
    out = sum(t.space(weights, itemsize, decoder)[0] for t in wanted)
    temp = sum(t.space(weights, itemsize, decoder)[1] for t in wanted)
    if recipe.targets.aoti_cuda_graph and recipe.runtime.device != "cpu" and not decoder and \
            any(t.name == "aoti" for t in wanted):
        temp += weights  # the CUDA-graph variant loads (extracts) the package once more
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


__all__ = ["Need", "check_space", "check_temp_folder", "folder_of", "space_needs"]
