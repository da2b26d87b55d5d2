"""Harmless payloads planted in artifacts, for the tests of what ``check``, ``verify`` and ``generate`` never run.

Each payload, if it ever runs, creates a marker file and does nothing else; a test plants one, runs the command
and asserts the marker never appears (docs/check.md, "Threat model"):

* :func:`pickle_program`: a ``.pt2`` whose sample inputs and one constant are pickles that create the marker when
  unpickled (``torch.export.load`` unpickles both: the sample inputs through its ``weights_only=False`` fallback);
* :func:`native_package`: an "AOTInductor package" whose shared library creates the marker from an ELF
  constructor, i.e. as soon as anything loads it (gcc builds it);
* :func:`spec_module_program`: a ``.pt2`` whose call spec names a module that creates the marker when imported,
  with that module written beside it (and into the working folder a test runs from).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import zipfile
from pathlib import Path


class Marker:
    """Unpickling this runs ``pathlib.Path(marker).touch()``: what an attacker's ``__reduce__`` would do, made
    harmless."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"import pathlib; pathlib.Path({self.marker!r}).touch()",))


def _pickle_bytes(marker: Path) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(Marker(marker), buffer)
    return buffer.getvalue()


def _rewrite(source: Path, target: Path, change) -> None:
    """Copy the zip archive ``source`` to ``target``, each entry's bytes passed through ``change(name, data)``."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(info.filename, change(info.filename, old.read(info.filename)))


def pickle_program(source: Path, target: Path, marker: Path, where: str = "sample_inputs") -> Path:
    """``source`` (a ``torch.export.save`` archive) with a pickle payload in its sample inputs (``where``
    "sample_inputs") or in place of its first constant or weight ("constant", "weight", saved with ``use_pickle``)."""
    payload = _pickle_bytes(marker)
    kind = {"constant": "constants", "weight": "weights"}.get(where)
    with zipfile.ZipFile(source) as archive:
        names = archive.namelist()
        config_name = next((n for n in names if kind and n.endswith(f"data/{kind}/model_{kind}_config.json")), None)
        config = json.loads(archive.read(config_name)) if config_name else None
    record = None
    if kind:
        if not config or not config["config"]:
            raise ValueError(f"{source} has no {where} to replace")
        fqn = next(iter(config["config"]))
        config["config"][fqn]["use_pickle"] = True
        record = config["config"][fqn]["path_name"]

    def change(name: str, data: bytes) -> bytes:
        if where == "sample_inputs" and name.endswith("data/sample_inputs/model.pt"):
            return payload
        if kind and name == config_name:
            return json.dumps(config).encode()
        if kind and name.endswith(f"data/{kind}/{record}"):
            return payload
        return data

    _rewrite(source, target, change)
    return target


CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def native_package(target: Path, marker: Path, wrapper_from: Path | None = None) -> Path:
    """An archive shaped like an AOTInductor package (``data/aotinductor/model/``) whose ``.so`` creates ``marker``
    from an ELF constructor when loaded; its wrapper source (the call spec) is ``wrapper_from``'s where given."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler to build the planted shared library")
    build = target.parent / f".{target.stem}-build"
    build.mkdir(parents=True, exist_ok=True)
    (build / "planted.c").write_text(CONSTRUCTOR % str(marker).replace('"', '\\"'))
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(build / "planted.so"), str(build / "planted.c")], check=True)
    leaf: dict[str, object] = {"type": None, "context": None, "children_spec": []}
    spec = [1, {"type": "builtins.tuple", "context": "null", "children_spec": [
        {"type": "builtins.tuple", "context": "null", "children_spec": []},
        {"type": "builtins.dict", "context": json.dumps(["input_ids", "attention_mask"]),
         "children_spec": [leaf, leaf]}]}]
    wrapper = f'// planted\nin_spec_ = R"({json.dumps(spec)})";\n'.encode()
    if wrapper_from is not None:
        with zipfile.ZipFile(wrapper_from) as archive:
            wrapper = next(archive.read(n) for n in archive.namelist() if n.endswith("wrapper.cpp"))
    with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("model/archive_format", "pt2")
        archive.writestr("model/data/aotinductor/model/model.wrapper.cpp", wrapper)
        archive.write(build / "planted.so", "model/data/aotinductor/model/model.so")
        archive.writestr("model/data/aotinductor/model/model_metadata.json", json.dumps({"AOTI_DEVICE_KEY": "cpu"}))
    shutil.rmtree(build, ignore_errors=True)
    return target


def spec_module_program(source: Path, target: Path, module: str, marker: Path, beside: list[Path]) -> Path:
    """``source`` (a ``torch.export.save`` archive whose output spec names a transformers ModelOutput) with that
    type renamed into ``module``, and ``module.py`` written into each folder of ``beside``: importing it creates
    ``marker`` (and registers nothing)."""
    for folder in beside:
        (folder / f"{module}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")

    def change(name: str, data: bytes) -> bytes:
        if name.endswith(".json") and "/models/" in f"/{name}":
            text = data.decode()
            return text.replace("transformers.modeling_outputs.", f"{module}.").encode()
        return data

    _rewrite(source, target, change)
    return target


def rehash(folder: Path) -> None:
    """Rewrite ``folder/manifest.json`` to match what the folder now holds: what anyone who can write the folder
    can do, so a manifest proves the files unchanged since it was written, not who wrote them."""
    from exporter.outdir import sha256_file

    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        path = folder / entry["path"]
        if path.is_file():
            entry["sha256"], entry["bytes"] = sha256_file(path), path.stat().st_size
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


__all__ = ["Marker", "native_package", "pickle_program", "rehash", "spec_module_program"]
