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

import ast
import json
import re
import zipfile
import zlib
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
    except (ValueError, UnicodeDecodeError, zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError):
        data = None
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict) or not all(isinstance(meta, dict) for meta in config.values()):
        raise UsageError(f"{archive.filename} is not a readable torch.export archive ({entry} is damaged)",
                         "pass the file torch.export.save wrote")
    return config


def pickled(path: str | Path) -> list[str]:
    """What in the ``.pt2`` at ``path`` only a pickle can load (empty: it reads as data); a UsageError where the
    archive cannot be read."""
    try:
        return _pickled(path)
    except UsageError:
        raise
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError, ValueError, KeyError, OSError,
            EOFError) as exc:
        raise UsageError(f"{Path(path).name} is not a readable torch.export archive ({type(exc).__name__})",
                         "pass the file torch.export.save wrote") from None


def _pickled(path: str | Path) -> list[str]:
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


def _tensors(archive: zipfile.ZipFile, layout: Layout, kind: str, as_saved: bool = True) -> dict[str, Any]:
    import torch  # noqa: PLC0415

    config = _config(archive, layout.entry(f"data/{kind}/{layout.name}_{kind}_config.json"))
    tensors: dict[str, Any] = {}
    shared: dict[str, Any] = {}  # one record read once: tensors that alias it stay aliased, as torch keeps them
    for fqn, meta in config.items():
        tensor_meta = meta["tensor_meta"]
        record = meta["path_name"]
        if record not in shared:
            base = dict(tensor_meta, sizes=[{"as_int": -1}], strides=[{"as_int": 1}], storage_offset={"as_int": 0})
            shared[record] = _flat(archive, layout.entry(f"data/{kind}/{record}"),
                                   base if as_saved else dict(base, device={"type": "cpu"}))
        flat = shared[record]
        sizes = [int(s["as_int"]) for s in tensor_meta["sizes"]]
        strides = [int(s["as_int"]) for s in tensor_meta["strides"]]
        offset = int(tensor_meta.get("storage_offset", {}).get("as_int", 0))
        if all(sizes) and offset + sum((s - 1) * st for s, st in zip(sizes, strides)) >= flat.numel():
            raise ValueError(f"{kind} {fqn}: its record {record} is smaller than the tensor")
        tensor = torch.as_strided(flat, sizes, strides, offset) if all(sizes) else \
            torch.zeros(sizes, dtype=flat.dtype, device=flat.device)
        if kind == "weights" and meta.get("is_param") and as_saved:
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


def _as_data(path: str | Path) -> zipfile.ZipFile:
    """The archive at ``path``, opened to be read as data: a :class:`PickleRefused` where it needs a pickle."""
    what = pickled(path)
    if what:
        raise PickleRefused(path, what)
    return zipfile.ZipFile(path)


def _layout(archive: zipfile.ZipFile, name: str) -> Layout | None:
    return next((lay for lay in _layouts(archive.namelist()) if lay.name == name), None)


def load_program(path: str | Path, allow_pickle: bool = False, name: str = "model"):
    """The ExportedProgram ``name`` in the ``.pt2`` at ``path``, read without unpickling anything; a
    :class:`PickleRefused` where the archive needs a pickle and ``allow_pickle`` is false."""
    import torch  # noqa: PLC0415

    if allow_pickle:
        return torch.export.load(str(path))
    from torch._export.serde import schema  # noqa: PLC0415
    from torch._export.serde.serialize import ExportedProgramDeserializer, _dict_to_dataclass  # noqa: PLC0415

    with _as_data(path) as archive:
        layout = _layout(archive, name)
        if layout is None:
            raise ValueError(f"{Path(path).name} holds no program named {name!r}")
        serialized = _dict_to_dataclass(schema.ExportedProgram,
                                        json.loads(archive.read(layout.entry(f"models/{name}.json"))))
        state_dict = _tensors(archive, layout, "weights")
        constants = _tensors(archive, layout, "constants")
    # example inputs None: the archive's sample inputs are a pickle; their structure is rebuilt below instead
    program = ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, None)
    _keep_guards(program, path)
    return program


# What a guard of a program may be made of (torch turns each into Python and runs it: ``_unlift``)
_GUARD_NODES = (ast.Expression, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Name,
                ast.Attribute, ast.Call, ast.Subscript, ast.Load, ast.Tuple, ast.And, ast.Or, ast.Not, ast.USub,
                ast.UAdd, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.Eq, ast.NotEq,
                ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Slice)
_GUARD_ATTRIBUTES = {"size", "stride", "storage_offset", "dim", "numel"}


def _guard_problem(text: str, names: set[str]) -> str | None:
    """Why ``text`` (a guard from the archive) is not a plain comparison of sizes and numbers (None: it is)."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return "not an expression"
    for node in ast.walk(tree):
        if not isinstance(node, _GUARD_NODES):
            return f"holds {type(node).__name__}"
        if isinstance(node, ast.Name) and node.id not in names:
            return f"names {node.id!r}"
        if isinstance(node, ast.Attribute) and (node.attr not in _GUARD_ATTRIBUTES and not (
                isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr.isalnum())):
            return f"reads .{node.attr}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not node.value.isidentifier():
            return f"holds the string {node.value!r}"
        if isinstance(node, ast.Constant) and not isinstance(node.value, (int, float, str, bool, type(None))):
            return f"holds a {type(node.value).__name__}"
    return None


def _keep_guards(program: Any, path: str | Path) -> None:
    """Give ``program`` back the input guards ``torch.export.load`` gives it (a program specialised at export is
    refused at the sizes it was not traced for, as its users will meet it), without running anything the file
    chose: torch builds the guards by turning the archive's guard strings and input names into Python, so each
    guard must be a plain comparison of sizes and numbers and each input name an identifier; a program whose
    guards are anything else is refused. The example inputs torch needs for this are only the inputs' structure:
    empty tensors in the call spec's tree."""
    import torch  # noqa: PLC0415
    import torch.utils._pytree as pytree  # noqa: PLC0415
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP  # noqa: PLC0415

    in_spec = program.call_spec.in_spec
    if in_spec is None:
        return
    args, kwargs = pytree.tree_unflatten([torch.empty(0) for _ in range(in_spec.num_leaves)], in_spec)
    for key_path, _ in pytree.tree_leaves_with_path((args, kwargs)):
        for key in key_path:
            name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", 0)))
            if not (isinstance(name, int) or (isinstance(name, str) and name.isidentifier())):
                raise UsageError(f"{Path(path).name} names an input {name!r}, which is not an identifier",
                                 "export the program with inputs named by identifiers")
    names = {"L", "math", "inf", "max", "min", "abs", "int", "float", "bool", "round", "len", *SYMPY_INTERP}
    for guard in getattr(program, "_guards_code", None) or []:
        problem = _guard_problem(str(guard), names)
        if problem is not None:
            raise UsageError(f"{Path(path).name} holds an input guard that is not a plain comparison of sizes "
                             f"({problem}): torch would run it as Python", "export the program again with torch.export")
    for spec in program.graph_signature.input_specs:
        value = getattr(spec.arg, "value", None)
        if isinstance(value, str) and not value.isidentifier():
            raise UsageError(f"{Path(path).name} takes a constant input {value!r} that torch would write into Python",
                             "export the program again with torch.export")
    program.example_inputs = (tuple(args), dict(kwargs))


def read_constants(path: str | Path, name: str = "model") -> dict[str, Any]:
    """Every weight and constant tensor of the program ``name``, by its qualified name, on the CPU, read as data
    (a :class:`PickleRefused` where the archive needs a pickle): what the weights proof compares."""
    with _as_data(path) as archive:
        layout = _layout(archive, name)
        if layout is None:
            return {}
        return {**_tensors(archive, layout, "weights", as_saved=False),
                **_tensors(archive, layout, "constants", as_saved=False)}


__all__ = ["PICKLE_FIX", "PickleRefused", "load_program", "pickled", "read_constants"]
