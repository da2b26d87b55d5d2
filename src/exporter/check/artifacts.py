"""What ``exporter check`` is given: the artifacts in a file or folder, and what each one declares it takes.

An artifact is described from its own files, without running it and without loading its weights: an ONNX
model's graph inputs and outputs (names, element types, ``dim_value`` / ``dim_param``), a torch.export ``.pt2``'s
serialized program (``models/*.json``: the call spec's argument names, each placeholder's dtype and symbolic
sizes, the range constraints), an AOTInductor package's call spec (names only: a package does not declare
shapes or dtypes, so it is judged in the recipe's dtype). A folder is recognised by what it holds:

* an exporter output folder (``manifest.json`` and ``report.json``): every artifact its report lists;
* a transformers ``exporters`` folder (``model.pt2`` or ``model.onnx`` with its export manifest);
* a Hugging Face Optimum ONNX export: ``model.onnx`` (an encoder, a vision model, or a decoder with past inputs
  ``past_key_values.N.key``; other ``*.onnx`` beside it, quantized variants, are left out and noted), or
  ``decoder_model.onnx`` with ``decoder_with_past_model.onnx``, or ``decoder_model_merged.onnx``;
* otherwise every ``*.onnx`` and ``*.pt2`` in it.
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .untrusted import relative_name, spec_module_allowed

Axis = int | str | None  # a fixed size, a named dynamic dim, or unknown


@dataclass(frozen=True)
class Port:
    """One input or output as the artifact declares it."""

    name: str
    dtype: str | None  # a torch dtype name; None where the artifact does not say
    axes: tuple[Axis, ...] | None  # None where the artifact does not say
    bounds: tuple[tuple[int | None, int | None], ...] = ()  # per axis (min, max) of a dynamic one, where declared


@dataclass
class Past:
    """A decoder that takes and returns its key/value cache (Optimum's ``text-generation-with-past``)."""

    layers: int
    prefill: Path  # the file run for the prompt (past length 0 where it is the same file as ``decode``)
    decode: Path  # the file run for each next token, with the cache
    merged: bool = False  # decoder_model_merged.onnx: a ``use_cache_branch`` input picks the branch


@dataclass
class Artifact:
    name: str  # the candidate's name in the report
    target: str  # the target whose loader runs it: onnx, exported_program, aoti
    path: Path  # the file (the next-token step's file for a split decoder)
    made_by: str
    inputs: list[Port]
    outputs: list[Port]
    files: list[Path] = field(default_factory=list)  # every file it reads (external data included)
    call: str = "positional"  # how it takes its inputs: positional, or keyword (by name, after ``positional``)
    positional: int = 0  # with call "keyword": how many inputs come first, by position
    imports: tuple[str, ...] = ()  # modules whose pytree types its call spec names (ModelOutput classes)
    pickle: bool = False  # a .pt2 that needs unpickling, loaded because the user allowed it ([trust] artifact_pickle)
    past: Past | None = None
    notes: list[str] = field(default_factory=list)
    computes: str | None = None  # the dtype its weights are in, where it differs from its inputs' and outputs'

    @property
    def dtype(self) -> str | None:
        """The floating dtype it computes in, from what it declares (None: it does not say)."""
        if self.computes:
            return self.computes
        for ports in (self.outputs, self.inputs):
            for port in ports:
                if port.dtype in ("float32", "float16", "bfloat16", "float64"):
                    return port.dtype
        return None


# --------------------------------------------------------------------------- ONNX

ONNX_TYPES = {1: "float32", 2: "uint8", 3: "int8", 5: "int16", 6: "int32", 7: "int64", 9: "bool", 10: "float16",
              11: "float64", 16: "bfloat16"}


def _onnx_port(value: Any) -> Port:
    tensor = value.type.tensor_type
    axes: list[Axis] = []
    for dim in tensor.shape.dim:
        axes.append(int(dim.dim_value) if dim.HasField("dim_value") else (dim.dim_param or None))
    return Port(value.name, ONNX_TYPES.get(tensor.elem_type), tuple(axes))


def _initializers(graph: Any):
    """Every initializer of ``graph`` and of the subgraphs its nodes hold (If, Loop, Scan: a merged decoder)."""
    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _initializers(attribute.g)
            for sub in attribute.graphs:
                yield from _initializers(sub)


def onnx_files(path: Path, proto: Any) -> list[Path]:
    """The model file and the external data files it names (each a plain relative name: a UsageError otherwise)."""
    files = [path]
    for tensor in _initializers(proto.graph):
        for entry in tensor.external_data:
            if entry.key == "location":
                extra = path.parent / relative_name(entry.value, f"{path.name} (external data of {tensor.name})")
                if extra not in files:
                    files.append(extra)
    return files


def describe_onnx(path: Path, made_by: str = "ONNX", name: str = "onnx") -> Artifact:
    import onnx  # noqa: PLC0415

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise UsageError(f"{path} is not a readable ONNX model ({type(exc).__name__})",
                         "pass an .onnx file, a .pt2 file or a folder holding them") from None
    if not proto.graph.output:
        raise UsageError(f"{path} holds no ONNX graph (empty, or not an ONNX model)",
                         "pass the .onnx file the exporter wrote (and its .data files beside it)")
    initializers = {t.name for t in proto.graph.initializer}
    inputs = [_onnx_port(v) for v in proto.graph.input if v.name not in initializers]
    outputs = [_onnx_port(v) for v in proto.graph.output]
    missing = [f for f in onnx_files(path, proto) if not f.is_file()]
    if missing:
        raise UsageError(f"{path} keeps its weights in {missing[0].name}, which is not beside it",
                         "copy the whole export folder (the .onnx file and its .data files)")
    artifact = Artifact(name, "onnx", path, made_by, inputs, outputs, onnx_files(path, proto))
    weights: dict[str, int] = {}
    for tensor in proto.graph.initializer:  # the dtype it computes in: its weights' (float16 with float32 I/O)
        kind = ONNX_TYPES.get(tensor.data_type, "")
        if kind in ("float16", "bfloat16", "float32", "float64"):
            size = 1
            for d in tensor.dims:
                size *= int(d)
            weights[kind] = weights.get(kind, 0) + size
    computes = max(weights, key=lambda k: weights[k]) if weights else None
    if computes and computes != artifact.dtype and computes in ("float16", "bfloat16"):
        artifact.computes = computes
        artifact.notes.append(f"its weights are {computes} (inputs and outputs {artifact.dtype}): judged in {computes}")
    return artifact


# --------------------------------------------------------------------------- torch.export and AOTInductor

# torch/_export/serde/schema.py ScalarType
SERIALIZED_TYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float16", 7: "float32",
                    8: "float64", 12: "bool", 13: "bfloat16"}


def _spec_names(serialized: str) -> tuple[list[str], int]:
    """From a serialized call spec ``(args, kwargs)``: keyword names, and how many positional arguments."""
    _, tree = json.loads(serialized)
    args, kwargs = tree["children_spec"]
    names = json.loads(kwargs["context"]) if kwargs.get("context") not in (None, "null") else []
    return [str(n) for n in names], len(args["children_spec"])


def _out_count(serialized: str) -> int:
    """How many tensors a serialized output spec returns: a tensor is one, a tuple or list one per child."""
    _, tree = json.loads(serialized)
    children = tree.get("children_spec") or []
    return len(children) if tree.get("type") in ("builtins.tuple", "builtins.list") else max(1, len(children))


def _out_names(serialized: str) -> list[str] | None:
    """Output names from a serialized output spec: a dict's or a ModelOutput's keys (None: a tuple or a tensor)."""
    _, tree = json.loads(serialized)
    context = tree.get("context")
    if tree.get("type") in (None, "builtins.tuple", "builtins.list") or context in (None, "null"):
        return None
    keys = json.loads(context)
    return [str(k) for k in keys] if isinstance(keys, list) else None


def spec_modules(*serialized: str | None, path: Path | None = None) -> tuple[str, ...]:
    """The modules defining the types a serialized call spec names (transformers' ModelOutput classes register
    their pytree node when their module is imported; builtins and torch need nothing). A type from any other
    module is refused (a UsageError naming ``path``): importing it would run code the artifact chose."""
    found = []
    for text in serialized:
        for name in re.findall(r'"type": "([^"]+)"', text or ""):
            module = name.rpartition(".")[0]
            if not module or module.split(".")[0] in ("builtins", "collections", "torch") or module in found:
                continue
            if not spec_module_allowed(module):
                where = path.name if path is not None else "the program"
                raise UsageError(f"{where}'s call spec names the type {name}, which exporter does not import (only "
                                 "transformers' ModelOutput classes): importing it would run code the file chose",
                                 "export the program with tensors, tuples, dicts or transformers' ModelOutputs as its "
                                 "inputs and outputs")
            found.append(module)
    return tuple(found)


def _expr_symbol(size: dict[str, Any]) -> str | None:
    match = re.search(r"Symbol\('(\w+)'", size.get("as_expr", {}).get("expr_str", ""))
    return match.group(1) if match else None


def describe_program(path: Path, archive: zipfile.ZipFile, made_by: str, name: str) -> Artifact:
    model_json = next(n for n in archive.namelist() if re.search(r"(^|/)models/[^/]+\.json$", n))
    data = json.loads(archive.read(model_json))
    graph_module = data["graph_module"]
    graph, signature = graph_module["graph"], graph_module["signature"]
    values = graph["tensor_values"]
    ranges = data.get("range_constraints") or {}

    def port(name: str, tensor: str) -> Port:
        meta = values.get(tensor) or {}
        axes: list[Axis] = []
        bounds: list[tuple[int | None, int | None]] = []
        for size in meta.get("sizes", []):
            if "as_int" in size:
                axes.append(int(size["as_int"]))
                bounds.append((None, None))
            else:
                symbol = _expr_symbol(size)
                axes.append(symbol)
                limits = ranges.get(symbol or "", {})
                high = limits.get("max_val")
                bounds.append((limits.get("min_val"), None if high is None or high > 2**62 else int(high)))
        return Port(name, SERIALIZED_TYPES.get(meta.get("dtype", 0)), tuple(axes), tuple(bounds))

    user_inputs = [s["user_input"]["arg"]["as_tensor"]["name"] for s in signature["input_specs"]
                   if "user_input" in s and "as_tensor" in s["user_input"]["arg"]]
    user_outputs = [s["user_output"]["arg"]["as_tensor"]["name"] for s in signature["output_specs"]
                    if "user_output" in s and "as_tensor" in s["user_output"]["arg"]]
    call_graph = graph_module.get("module_call_graph") or []
    in_spec = (call_graph[0].get("signature") or {}).get("in_spec") if call_graph else None
    out_spec = (call_graph[0].get("signature") or {}).get("out_spec") if call_graph else None
    keywords, positional = _spec_names(in_spec) if in_spec else ([], len(user_inputs))
    # positional arguments come first (named as their placeholders), then the keyword ones
    names = user_inputs[:positional] + keywords
    inputs = [port(n, t) for n, t in zip(names, user_inputs)]
    out_names = (_out_names(out_spec) if out_spec else None) or [f"output_{i}" for i in range(len(user_outputs))]
    outputs = [port(n, t) for n, t in zip(out_names, user_outputs)]
    params = [values.get(s["parameter"]["arg"]["name"], {}).get("dtype") for s in signature["input_specs"]
              if "parameter" in s]
    artifact = Artifact(name, "exported_program", path, made_by, inputs, outputs, [path],
                        call="keyword" if keywords else "positional", positional=positional if keywords else 0,
                        imports=spec_modules(in_spec, out_spec, path=path))
    floats = [SERIALIZED_TYPES.get(d) for d in params if SERIALIZED_TYPES.get(d, "").startswith(("float", "bf"))]
    if floats and not any(p.dtype and p.dtype.startswith(("float", "bf")) for p in inputs):
        artifact.outputs = [Port(p.name, p.dtype or floats[0], p.axes, p.bounds) for p in outputs]
    return artifact


def describe_package(path: Path, archive: zipfile.ZipFile, made_by: str, name: str) -> Artifact:
    """An AOTInductor package: the call spec its generated wrapper source carries (names only)."""
    in_spec = out_spec = None
    for entry in archive.namelist():
        if entry.endswith("wrapper.cpp") and "/aotinductor/" in f"/{entry}":
            source = archive.read(entry).decode("utf-8", "replace")
            found_in = re.search(r'in_spec_ = R"\((.*?)\)";', source, re.S)
            found_out = re.search(r'out_spec_ = R"\((.*?)\)";', source, re.S)
            in_spec = found_in.group(1) if found_in else in_spec
            out_spec = found_out.group(1) if found_out else out_spec
    inputs: list[Port] = []
    outputs: list[Port] = []
    call = "positional"
    positional = 0
    if in_spec:
        try:
            keywords, positional = _spec_names(in_spec)
        except (ValueError, KeyError, TypeError, AttributeError):
            raise UsageError(f"{path} holds an AOTInductor package whose call spec is not readable",
                             "pass the package as torch._inductor.aoti_compile_and_package wrote it") from None
        inputs = [Port(f"arg{i}", None, None) for i in range(positional)] + [Port(n, None, None) for n in keywords]
        call = "keyword" if keywords else "positional"
    if out_spec:
        named = _out_names(out_spec)
        # a tensor or a tuple: unnamed outputs, compared with the model's in order (as a program's are)
        outputs = [Port(n, None, None) for n in (named or [f"output_{i}" for i in range(_out_count(out_spec))])]
    artifact = Artifact(name, "aoti", path, made_by, inputs, outputs, [path], call=call,
                        positional=positional if call == "keyword" else 0,
                        imports=spec_modules(in_spec, out_spec, path=path))
    artifact.notes.append("an AOTInductor package declares its argument names but not its shapes or dtype: it is "
                          "run at the recipe's shapes and judged in the recipe's dtype")
    return artifact


def describe_pt2(path: Path, made_by: str = "torch.export", name: str | None = None) -> Artifact:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise UsageError(f"{path} is not a .pt2 archive (not a zip file)",
                         "pass a file written by torch.export.save or an AOTInductor package") from None
    with archive:
        names = archive.namelist()
        try:
            if any("/data/aotinductor/" in n or n.startswith("data/aotinductor/") for n in names):
                return describe_package(path, archive, "AOTInductor" if made_by == "torch.export" else made_by,
                                        name or "aoti")
            if any(re.search(r"(^|/)models/[^/]+\.json$", n) for n in names):
                return describe_program(path, archive, made_by, name or "exported_program")
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, StopIteration, zipfile.BadZipFile,
                zlib.error, EOFError, NotImplementedError) as exc:  # JSON or UTF-8 errors are ValueErrors
            raise UsageError(f"{path.name} is not a readable torch.export archive (its program description is "
                             f"damaged: {type(exc).__name__})",
                             "pass the file torch.export.save or aoti_compile_and_package wrote") from None
    raise UsageError(f"{path} is a zip archive but neither a torch.export program nor an AOTInductor package",
                     "pass a file written by torch.export.save or torch._inductor.aoti_compile_and_package")


# --------------------------------------------------------------------------- folders

OPTIMUM_SPLIT = ("decoder_model.onnx", "decoder_with_past_model.onnx")
OPTIMUM_MERGED = "decoder_model_merged.onnx"
TRANSFORMERS_MANIFEST = "export.json"  # transformers.exporters.base.EXPORT_MANIFEST_FILE
PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def past_layers(artifact: Artifact) -> int:
    return len({int(m.group(1)) for p in artifact.inputs if (m := PAST.match(p.name))})


def _with_past(artifact: Artifact, prefill: Path | None = None, merged: bool = False) -> Artifact:
    layers = past_layers(artifact)
    if layers:
        artifact.past = Past(layers, prefill or artifact.path, artifact.path, merged)
        artifact.notes.append(f"a decoder with past ({layers} layers): judged step by step, the prompt (past length "
                              "0) and then one next token fed the cache the artifact returned")
    return artifact


def _exporter_folder(folder: Path) -> list[Artifact]:
    report = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    found: list[Artifact] = []
    for entry in report.get("artifacts", []):
        path = entry.get("path")
        if not path or entry.get("target") not in ("onnx", "exported_program", "aoti") or entry.get("replays"):
            continue
        file = folder / relative_name(path, f"{folder.name}/report.json")
        if not file.is_file() or any(a.path == file for a in found):
            continue
        made_by = "exporter"
        artifact = (describe_onnx(file, made_by, entry["name"]) if entry["target"] == "onnx"
                    else describe_pt2(file, made_by, entry["name"]))
        # every file the run recorded for it (an AOTInductor package's weights kept beside it, ONNX data)
        recorded = [folder / relative_name(f["path"], f"{folder.name}/report.json") for f in entry.get("files") or []]
        recorded = [f for f in recorded if f.is_file()]
        names = report.get("outputs") or []
        if names and len(artifact.outputs) == len(names):  # the run's own names for a tuple's outputs
            artifact.outputs = [Port(n, p.dtype, p.axes, p.bounds) for n, p in zip(names, artifact.outputs)]
        elif names and not artifact.outputs:
            artifact.outputs = [Port(n, None, None) for n in names]
        artifact.files = list(dict.fromkeys([*artifact.files, *recorded]))
        found.append(artifact)
    return found


def find_artifacts(path: Path) -> list[Artifact]:
    """Every artifact ``path`` holds (one for a file), described; a UsageError when it holds none."""
    if not path.exists():
        raise UsageError(f"artifact {path} does not exist", "check the path")
    if path.is_file():
        if path.suffix == ".onnx":
            return [_with_past(describe_onnx(path))]
        if path.suffix == ".pt2":
            return [describe_pt2(path)]
        raise UsageError(f"{path} is neither an .onnx nor a .pt2 file",
                         "pass an ONNX model, a torch.export program, an AOTInductor package or a folder of them")
    if (path / "manifest.json").is_file() and (path / "report.json").is_file():
        earlier = _exporter_folder(path)
        if earlier:
            return earlier
    if (path / TRANSFORMERS_MANIFEST).is_file():
        manifest = json.loads((path / TRANSFORMERS_MANIFEST).read_text(encoding="utf-8"))
        components: list[Artifact] = []
        for component, entry in (manifest.get("components") or {}).items():
            file = path / relative_name(entry["file"], f"{path.name}/{TRANSFORMERS_MANIFEST}")
            if file.suffix == ".onnx":
                components.append(_with_past(describe_onnx(file, "transformers.exporters", f"onnx:{component}")))
            elif file.suffix == ".pt2":
                components.append(describe_pt2(file, "transformers.exporters", f"exported_program:{component}"))
        if len(components) == 1:
            components[0].name = components[0].target
        if components:
            return components
    if (path / OPTIMUM_MERGED).is_file():
        merged = describe_onnx(path / OPTIMUM_MERGED, "Optimum", "onnx:decoder_model_merged")
        return [_with_past(merged, merged=True)]
    if all((path / f).is_file() for f in OPTIMUM_SPLIT):
        decode = describe_onnx(path / OPTIMUM_SPLIT[1], "Optimum", "onnx:decoder_with_past")
        prompt = describe_onnx(path / OPTIMUM_SPLIT[0], "Optimum", "onnx:decoder")
        decode.files = list(dict.fromkeys([*decode.files, *prompt.files]))
        return [_with_past(decode, prefill=path / OPTIMUM_SPLIT[0])]
    optimum = (path / "config.json").is_file()
    if optimum and (path / "model.onnx").is_file():
        main = _with_past(describe_onnx(path / "model.onnx", "Optimum", "onnx"))
        others = sorted(f.name for f in path.glob("*.onnx") if f.name != "model.onnx")
        if others:
            main.notes.append(f"left out: {', '.join(others)} (an Optimum folder's model is model.onnx; pass "
                              "another file to check it)")
        return [main]
    found = [_with_past(describe_onnx(f, "Optimum" if optimum else "ONNX", f"onnx:{f.stem}"))
             for f in sorted(path.glob("*.onnx"))]
    found += [describe_pt2(f, name=f"{f.stem}") for f in sorted(path.glob("*.pt2"))]
    if not found:
        raise UsageError(f"{path} holds no .onnx or .pt2 file", "pass the folder an exporter wrote, or one file in it")
    if len(found) == 1:
        found[0].name = found[0].target
    return found


__all__ = ["Artifact", "Past", "Port", "find_artifacts", "describe_onnx", "describe_pt2", "past_layers"]
