"""Find and open checkpoint files: one safetensors file, a sharded set, or a folder.

Every safetensors header is checked here before the file is memory-mapped, so a
damaged file is reported as one line naming the file and the problem instead
of an exception from deep inside a reader. Tensors are then read lazily through
``safetensors.safe_open``, which maps the file: weights are not copied until
something casts or moves them.

Pickle checkpoints (``.bin``, ``.pt``, ``.pth``, ``.ckpt``) can run code when
unpickled; they are refused unless the caller opts in, and then loaded with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..dtypes import BY_CODE, from_safetensors
from ..errors import CheckpointError
from ..supervisor import report, snapshot

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit



@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: Path


@dataclass
class Checkpoint:
    """An opened checkpoint: where it is, what it holds, and lazy access to each tensor."""

    path: Path  # what the user named
    root: Path  # the folder searched for config.json
    files: list[Path]
    format: str  # "safetensors" or "pickle"
    entries: dict[str, TensorInfo]
    metadata: dict[str, str]
    _pickled: dict[str, torch.Tensor] | None = None
    seen: dict[str, tuple[int, int] | None] = field(default_factory=dict, repr=False)  # size, mtime when opened

    def __post_init__(self) -> None:
        for file in self.files:
            where = str(Path(file).resolve())
            seen = self.seen[where] = snapshot(Path(where))
            if seen is not None:
                report("checkpoint", where, *seen)  # the supervising parent checks them after a crash

    def changed(self) -> list[Path]:
        """The files that are no longer what was opened (rewritten, truncated or gone since)."""
        return [Path(p) for p, seen in self.seen.items() if snapshot(Path(p)) != seen]

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def tensors(self):
        """Yield (name, tensor) pairs, one file open at a time; tensors map the file."""
        if self._pickled is not None:
            yield from self._pickled.items()
            return
        by_file: dict[Path, list[str]] = {}
        for info in self.entries.values():
            by_file.setdefault(info.file, []).append(info.name)
        for file, names in by_file.items():
            try:
                with safe_open(str(file), framework="pt", device="cpu") as handle:
                    for name in names:
                        yield name, handle.get_tensor(name)
            except CheckpointError:
                raise
            except Exception as exc:  # safetensors raises its own error type from Rust
                raise CheckpointError(f"cannot read tensors from {file}: {exc}",
                                      "re-save the checkpoint with safetensors") from None


def open_checkpoint(path: str | Path, allow_pickle: bool = False) -> Checkpoint:
    """Resolve ``path`` (file, index or folder), check every header, and return a lazy Checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist", "check the path")
    if path.is_dir():
        return _open_folder(path, allow_pickle)
    name = path.name
    if name.endswith(".safetensors.index.json") or name.endswith(".index.json"):
        return _open_index(path)
    if path.suffix == ".safetensors":
        entries, metadata = read_header(path)
        return Checkpoint(path, path.parent, [path], "safetensors", entries, metadata)
    if path.suffix in PICKLE_SUFFIXES:
        return _open_pickle(path, allow_pickle)
    raise CheckpointError(f"checkpoint {path} is not a .safetensors file, a shard index or a folder",
                          "pass a .safetensors file, a *.safetensors.index.json or the folder holding them")


def _open_folder(folder: Path, allow_pickle: bool) -> Checkpoint:
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if len(indexes) == 1:
        return _open_index(indexes[0], user_path=folder)
    if len(indexes) > 1:
        raise CheckpointError(f"folder {folder} holds {len(indexes)} shard indexes "
                              f"({', '.join(p.name for p in indexes)})",
                              "pass the index file to use")
    files = sorted(folder.glob("*.safetensors"))
    if len(files) == 1:
        entries, metadata = read_header(files[0])
        return Checkpoint(folder, folder, files, "safetensors", entries, metadata)
    if len(files) > 1:
        raise CheckpointError(f"folder {folder} holds {len(files)} .safetensors files and no *.safetensors.index.json",
                              "pass the weights file to use, or add the shard index")
    pickles = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if len(pickles) == 1:
        return _open_pickle(pickles[0], allow_pickle, user_path=folder)
    raise CheckpointError(f"folder {folder} holds no weights (no .safetensors file or shard index)",
                          "pass the folder that holds model.safetensors, or the file itself")


def _open_index(index: Path, user_path: Path | None = None) -> Checkpoint:
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"shard index {index} is not valid JSON ({exc})", "regenerate the index file") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"shard index {index} has no 'weight_map' of tensor name to file name",
                              "regenerate the index file")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise CheckpointError(f"shard index {index.name} names missing shard(s): {', '.join(missing)}",
                              f"copy the missing shard(s) into {index.parent}")
    entries: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for shard in shards:
        shard_entries, shard_meta = read_header(index.parent / shard)
        metadata.update(shard_meta)
        for name, info in shard_entries.items():
            if name in entries:
                raise CheckpointError(f"tensor {name!r} is stored in two shards ({entries[name].file.name}, {shard})",
                                      "regenerate the sharded checkpoint")
            entries[name] = info
    for name, shard in weight_map.items():
        if name not in entries:
            raise CheckpointError(f"shard index {index.name} places {name!r} in {shard}, which does not hold it",
                                  "regenerate the index file")
        if entries[name].file.name != Path(shard).name:
            raise CheckpointError(f"shard index {index.name} places {name!r} in {shard}, but it is in "
                                  f"{entries[name].file.name}",
                                  "regenerate the index file")
    return Checkpoint(user_path or index, index.parent, [index.parent / s for s in shards], "safetensors",
                      entries, metadata)


def _open_pickle(path: Path, allow_pickle: bool, user_path: Path | None = None) -> Checkpoint:
    if not allow_pickle:
        raise CheckpointError(f"checkpoint {path} is a pickle file, which can run code when loaded",
                              "convert it to safetensors, or pass --allow-pickle to load it with "
                              "torch.load(weights_only=True)")
    try:
        loaded = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        try:
            loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception:
            raise CheckpointError(f"cannot load pickle checkpoint {path} with weights_only=True "
                                  f"({str(exc).splitlines()[0]})",
                                  "convert it to safetensors in a trusted environment") from None
    if isinstance(loaded, dict) and "state_dict" in loaded and isinstance(loaded["state_dict"], dict):
        loaded = loaded["state_dict"]
    tensors_by_name = isinstance(loaded, dict) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in loaded.items())
    if not tensors_by_name:
        raise CheckpointError(f"pickle checkpoint {path} is not a state dict of named tensors",
                              "save model.state_dict(), or convert it to safetensors")
    entries = {k: TensorInfo(k, tuple(v.shape), v.dtype, path) for k, v in loaded.items()}
    return Checkpoint(user_path or path, path.parent, [path], "pickle", entries, {}, _pickled=loaded)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header; raise CheckpointError naming the file and the problem."""
    def bad(problem: str, hint: str = "re-save or re-download the file; it is damaged or not safetensors"):
        return CheckpointError(f"{path} is not a valid safetensors file: {problem}", hint)

    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise bad(f"it is {size} bytes, too short to hold a header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise bad(f"header length {header_len} exceeds the format's limit of {MAX_HEADER_BYTES} bytes")
            if header_len > size - 8:
                raise bad(f"header length {header_len} is larger than the file ({size} bytes); the file is truncated")
            raw = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}", "check the file's permissions") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_size = size - 8 - header_len
    metadata = header.pop("__metadata__", {}) or {}
    strings = isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    if not strings:
        raise bad("__metadata__ must map strings to strings")
    entries: dict[str, TensorInfo] = {}
    spans = []
    for name, spec in header.items():
        if not isinstance(spec, dict) or set(spec) - {"dtype", "shape", "data_offsets"} or len(spec) != 3:
            raise bad(f"entry {name!r} must have exactly dtype, shape and data_offsets")
        dtype_code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(dtype_code, str) or dtype_code not in BY_CODE:
            raise bad(f"tensor {name!r} has unknown dtype {dtype_code!r}",
                      f"save it in one of {', '.join(BY_CODE)}")
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**53 for d in shape)):
            raise bad(f"tensor {name!r} has an invalid shape {str(shape)[:80]}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise bad(f"tensor {name!r} has invalid data_offsets {str(offsets)[:80]}")
        begin, end = offsets
        dtype, itemsize = from_safetensors(dtype_code), BY_CODE[dtype_code].itemsize
        if not 0 <= begin <= end <= data_size:
            raise bad(f"tensor {name!r} has data_offsets [{begin}, {end}] outside the {data_size}-byte data section")
        expected = math.prod(shape) * itemsize
        if end - begin != expected:
            raise bad(f"tensor {name!r} spans {end - begin} bytes but shape {shape} of {dtype_code} needs {expected}")
        spans.append((begin, end, name))
        entries[name] = TensorInfo(name, tuple(shape), dtype, path)
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if begin < position:
            raise bad(f"tensor {name!r} overlaps the tensor stored before it")
        if begin > position:
            raise bad(f"there is a gap of {begin - position} bytes before tensor {name!r}")
        position = end
    if position != data_size:
        raise bad(f"{data_size - position} bytes after the last tensor are not covered by the header")
    return entries, metadata


def folder_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


__all__ = ["Checkpoint", "TensorInfo", "open_checkpoint", "read_header", "folder_size",
           "PICKLE_SUFFIXES"]
