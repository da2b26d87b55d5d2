"""A torch.export ``.pt2`` read as data: its JSON and its raw tensor records, nothing unpickled.

``torch.export.load`` unpickles: the archive's sample inputs (``torch.load``, falling back to
``weights_only=False`` when the restricted loader refuses them), every weight or constant saved with
``use_pickle``, custom and opaque objects, and the weights of the legacy format. A ``.pt2`` handed to
``exporter check``, ``verify`` or ``generate`` is someone's file, and a pickle in it is their code. So a program is
read here from what the format keeps as data: ``models/<name>.json`` (the serialized program),
``data/weights|constants/<name>_*_config.json`` (each tensor's dtype, sizes, strides, offset and record) and the
raw records themselves; the sample inputs are never read (the program runs on the inputs exporter gives it).

An archive that needs a pickle to load (:func:`pickled` says what) is refused with :class:`PickleRefused`, unless
the caller passes ``allow_pickle`` (the user's ``--allow-artifact-pickle``), in which case torch's own loader
reads it, pickles and all.
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import UsageError

PICKLE_FIX = ("re-export it with torch.export.save from plain tensors, or pass --allow-artifact-pickle (recipe: "
              "[trust] artifact_pickle = true) if you trust whoever made it: loading it runs the pickle's code")


class PickleRefused(UsageError):
    """A ``.pt2`` that cannot be loaded without unpickling, and no opt-in to do so."""

    def __init__(self, path: str | Path, what: list[str]):
        listed = ", ".join(what[:3]) + (f" and {len(what) - 3} more" if len(what) > 3 else "")
        super().__init__(f"{Path(path).name} holds pickled data ({listed}): loading it would run code from the file",
                         PICKLE_FIX)
        self.what = what


@dataclass(frozen=True)
class Layout:
    """Where one program's parts lie in the archive (names as ``zipfile`` gives them)."""

    root: str  # the archive's top folder with its slash ("model/"), or ""
    name: str  # the program's name ("model")

    def entry(self, relative: str) -> str:
        return f"{self.root}{relative}"


def _layouts(names: list[str]) -> list[Layout]:
    found = []
    for entry in names:
        match = re.fullmatch(r"(.*?)models/([^/]+)\.json", entry)
        if match and (match.group(1) == "" or match.group(1).count("/") == 1):
            found.append(Layout(match.group(1), match.group(2)))
    return found


def _config(archive: zipfile.ZipFile, entry: str) -> dict[str, Any]:
    try:
        data = json.loads(archive.read(entry))
    except KeyError:
        return {}
    except (ValueError, UnicodeDecodeError, zipfile.BadZipFile):
        data = None
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict) or not all(isinstance(meta, dict) for meta in config.values()):
        raise UsageError(f"{archive.filename} is not a readable torch.export archive ({entry} is damaged)",
                         "pass the file torch.export.save wrote")
    return config


def pickled(path: str | Path) -> list[str]:
    """What in the ``.pt2`` at ``path`` only a pickle can load (empty: it reads as data). A file that is not such
    an archive is the loader's to report."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        layouts = _layouts(names)
        found: list[str] = []
        if not layouts:
            return ["no models/*.json (an older or unknown archive format, which torch reads by unpickling)"]
        for layout in layouts:
            for kind in ("weights", "constants"):
                if layout.entry(f"data/{kind}/{layout.name}.pt") in names:
                    found.append(f"{kind} in the legacy pickled format")
                for fqn, meta in _config(archive, layout.entry(f"data/{kind}/{layout.name}_{kind}_config.json")
                                         ).items():
                    record = str(meta.get("path_name", ""))
                    if meta.get("use_pickle") or not record.startswith(("weight_", "tensor_")):
                        found.append(f"{kind[:-1]} {fqn}")
    return found


def _tensors(archive: zipfile.ZipFile, layout: Layout, kind: str) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    config = _config(archive, layout.entry(f"data/{kind}/{layout.name}_{kind}_config.json"))
    tensors: dict[str, Any] = {}
    shared: dict[str, Any] = {}  # one record read once: tensors that alias it stay aliased, as torch keeps them
    for fqn, meta in config.items():
        tensor_meta = meta["tensor_meta"]
        record = meta["path_name"]
        if record not in shared:
            base = dict(tensor_meta, sizes=[{"as_int": -1}], strides=[{"as_int": 1}], storage_offset={"as_int": 0})
            shared[record] = _flat(archive, layout.entry(f"data/{kind}/{record}"), base)
        flat = shared[record]
        sizes = [int(s["as_int"]) for s in tensor_meta["sizes"]]
        strides = [int(s["as_int"]) for s in tensor_meta["strides"]]
        offset = int(tensor_meta.get("storage_offset", {}).get("as_int", 0))
        if all(sizes) and offset + sum((s - 1) * st for s, st in zip(sizes, strides)) >= flat.numel():
            raise ValueError(f"{kind} {fqn}: its record {record} is smaller than the tensor")
        tensor = torch.as_strided(flat, sizes, strides, offset) if all(sizes) else \
            torch.zeros(sizes, dtype=flat.dtype, device=flat.device)
        if kind == "weights" and meta.get("is_param"):
            tensor = torch.nn.Parameter(tensor, requires_grad=bool(tensor_meta.get("requires_grad")))
        tensors[fqn] = tensor
    return tensors


def _flat(archive: zipfile.ZipFile, entry: str, meta: dict[str, Any]):
    """A record's bytes as a flat tensor of the dtype ``meta`` names, on its device."""
    import torch  # noqa: PLC0415
    from torch._export.serde import schema  # noqa: PLC0415
    from torch._export.serde.serialize import deserialize_scalar_type  # noqa: PLC0415

    dtype = deserialize_scalar_type(schema.ScalarType(int(meta["dtype"])))
    data = archive.read(entry)
    element = torch.empty((), dtype=dtype).element_size()
    if len(data) % element:
        raise ValueError(f"record {entry} holds {len(data)} bytes, not a whole number of {dtype} values")
    flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
    device = meta.get("device") or {}
    if device.get("type", "cpu") != "cpu":
        index = device.get("index")
        flat = flat.to(torch.device(device["type"], index) if index is not None else device["type"])
    return flat


def load_program(path: str | Path, allow_pickle: bool = False, name: str = "model"):
    """The ExportedProgram ``name`` in the ``.pt2`` at ``path``, read without unpickling anything; a
    :class:`PickleRefused` where the archive needs a pickle and ``allow_pickle`` is false."""
    import torch  # noqa: PLC0415

    if allow_pickle:
        return torch.export.load(str(path))
    what = pickled(path)
    if what:
        raise PickleRefused(path, what)
    from torch._export.serde import schema  # noqa: PLC0415
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass  # noqa: PLC0415

    with zipfile.ZipFile(path) as archive:
        layout = next((lay for lay in _layouts(archive.namelist()) if lay.name == name), None)
        if layout is None:
            raise ValueError(f"{Path(path).name} holds no program named {name!r}")
        serialized = _dict_to_dataclass(schema.ExportedProgram,
                                        json.loads(archive.read(layout.entry(f"models/{name}.json"))))
        state_dict = _tensors(archive, layout, "weights")
        constants = _tensors(archive, layout, "constants")
    # example inputs None: the archive's sample inputs are a pickle, and nothing here needs them
    return ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)


__all__ = ["PICKLE_FIX", "PickleRefused", "load_program", "pickled"]
