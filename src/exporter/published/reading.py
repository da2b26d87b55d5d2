"""A finished output folder, read without trusting it: its JSON, the stored reference, how each recorded artifact
is loaded, and why one must not be (``verify`` and ``validate`` both read a folder this way)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors.torch import load_file

from ..check.untrusted import NATIVE_FIX, relative_name, spec_module_allowed
from ..errors import EXIT_ENVIRONMENT, EXIT_INTEGRITY, EXIT_NUMERICS, EXIT_OK, EXIT_TARGET, EXIT_USAGE, UsageError
from ..numerics.compare import InFile, Source, safetensors_index
from ..targets.program_file import PICKLE_FIX, pickled
from ..targets.spec import RunnerSpec
from ..targets.toolchain import aoti_preload


@dataclass
class Check:
    subject: str  # "folder" or an artifact's name
    name: str  # manifest | files | recorded verdict | sha256 | loads | numerics
    passed: bool | None  # None: not run (the reason is the message)
    message: str = ""
    code: int = EXIT_OK  # the exit code a failure maps to
    seconds: float = 0.0
    fix: str = ""  # where the exit code's own fix does not say it

    def line(self) -> str:
        """One line: what is wrong, and (for a failure) how to fix it."""
        text = f"{self.subject}: {self.message}" if self.subject != "folder" else self.message
        fix = (self.fix or FIXES.get(self.code)) if self.passed is False else None
        return f"{text.rstrip('.')}. Fix: {fix}." if fix else text


FIXES = {
    EXIT_INTEGRITY: "publish only the folder exactly as exporter convert wrote it, or run exporter convert again",
    EXIT_NUMERICS: "do not publish it; run exporter validate OUT_DIR --locate to find where it diverges",
    EXIT_TARGET: "check the runtime versions against manifest.json's versions, or run exporter convert again",
    EXIT_ENVIRONMENT: "verify on a machine like the one that built it",
}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def out_folder(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if not out.exists():
        raise UsageError(f"output folder {out} does not exist", "pass the folder exporter convert wrote (--out)")
    if not out.is_dir():
        raise UsageError(f"{out} is not a folder", "pass the folder exporter convert wrote (--out)")
    return out


LOAD_OPTIONS = ("named", "keywords", "positional", "outputs", "imports", "past", "provider")  # read from report.json


def artifact_spec(entry: dict[str, Any], out: Path, report: dict[str, Any], allow_pickle: bool = False):
    """The RunnerSpec that loads a recorded artifact as convert loaded it (rebuilt from report.json). What may run
    is never read from the folder: a program is unpickled only where this verify allows it (``allow_pickle``)."""
    options: tuple = ()
    if entry["target"] == "onnx":
        options = (("provider", (entry.get("graph") or {}).get("provider") or "CPUExecutionProvider"),)
    elif entry["target"] == "aoti":
        options = (("ld_preload", aoti_preload()),)  # this machine's compiler libstdc++, as convert does
    load = (entry.get("info") or {}).get("load") or {}  # an artifact exporter check judged: loaded by name
    options += tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in load.items() if k in LOAD_OPTIONS)
    if allow_pickle:
        options += (("pickle", True),)
    return RunnerSpec(entry["name"], entry["target"], entry["device"], entry["dtype"], path=str(out / entry["path"]),
                      options=options, attention_backend=(report.get("recipe") or {}).get("attention_backend", "auto"))


def load_reference(out: Path, report: dict[str, Any]):
    """(samples, fp64 reference outputs): each a list per sample, in the report's input/output order."""
    names, outputs = report["inputs"]["names"], report["outputs"]
    count = report["inputs"]["samples"]
    stored_in = load_file(str(out / "reference" / "inputs.safetensors"))
    stored_out = load_file(str(out / "reference" / "outputs.safetensors"))
    samples = [[stored_in[f"{i}.{n}"] for n in names] for i in range(count)]
    reference = [[stored_out[f"{i}.{o}"] for o in outputs] for i in range(count)]
    return samples, reference


def reference_sources(out: Path, report: dict[str, Any], file: str = "outputs.safetensors"
                      ) -> tuple[list[list[torch.Tensor]], list[list[Source]]]:
    """(samples, the stored float64 outputs as slices read on demand): verify never loads the outputs whole.
    ``file``: ``original_outputs.safetensors`` for a quantized run's original model."""
    names, outputs = report["inputs"]["names"], report["outputs"]
    count = report["inputs"]["samples"]
    stored_in = load_file(str(out / "reference" / "inputs.safetensors"))
    path = out / "reference" / file
    index = safetensors_index(path)
    samples = [[stored_in[f"{i}.{n}"] for n in names] for i in range(count)]
    reference: list[list[Source]] = [[InFile(path, *index[f"{i}.{o}"]) for o in outputs] for i in range(count)]
    return samples, reference


def device_problem(device: str) -> str | None:
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            return "runs on cuda; this machine has no usable GPU"
    return None



def untrusted_entry(out: Path, report: dict[str, Any], entry: dict[str, Any], listed: set[str],
                    allow: dict[str, bool]) -> Check | None:
    """Why the artifact must not be loaded, before anything of it runs (None: it may be): a path that leaves the
    folder or that the manifest does not hash (an ONNX model's external data included), a program that needs a
    pickle, a package another tool compiled (a check folder's) without the user's opt-in."""
    name = entry["name"]
    files = [str(f.get("path", "")) for f in entry.get("files") or []]
    try:
        path = relative_name(str(entry["path"]), "report.json")
        for file in files:
            relative_name(file, "report.json")
        if str(path) not in files or not set(files) <= listed:
            raise UsageError(f"{path} is not among the files manifest.json hashes for it", "")
        past = ((entry.get("info") or {}).get("load") or {}).get("past")
        if past:  # a decoder's prompt file, named beside the artifact
            prefill = str(path.parent / relative_name(str(past[1]), "report.json"))
            if prefill.removeprefix("./") not in files:
                raise UsageError(f"{prefill} is not among the files manifest.json hashes for it", "")
        stray = [f for f in _onnx_files(out, path) if f not in files] if entry["target"] == "onnx" else []
        if stray:
            raise UsageError(f"{path} reads {stray[0]}, which manifest.json does not hash for it", "")
    except UsageError as exc:
        return Check(name, "files", False, f"not loaded: {exc.message}", EXIT_INTEGRITY)
    imports = [str(m) for m in ((entry.get("info") or {}).get("load") or {}).get("imports") or []]
    stray_imports = [m for m in imports if not spec_module_allowed(m)]
    if stray_imports:
        return Check(name, "loads", False, f"not loaded: report.json asks to import {stray_imports[0]!r} before "
                     "loading it; exporter imports only transformers' ModelOutput modules", EXIT_USAGE,
                     fix="check the artifact again with exporter check, which reads its call spec itself")
    if entry["target"] == "aoti" and report.get("task") == "check" and not allow["native_code"]:
        return Check(name, "loads", False, "not loaded: an AOTInductor package another tool compiled; loading it "
                     "runs its native code", EXIT_USAGE, fix=NATIVE_FIX.replace(" (recipe: [trust] native_code = true)",
                                                                           ""))
    if entry["target"] == "exported_program" and not allow["artifact_pickle"]:
        try:
            what = [w for f in files if f.endswith(".pt2") for w in pickled(out / f)]
        except UsageError:
            what = []  # not a readable archive: its loader says so ("no longer loads", as for any broken file)
        if what:
            return Check(name, "loads", False, f"not loaded: it holds pickled data ({', '.join(what[:3])}), and "
                         "loading it would run code from the file", EXIT_USAGE,
                         fix=PICKLE_FIX.replace(" (recipe: [trust] artifact_pickle = true)", ""))
    return None


def _onnx_files(out: Path, path: PurePosixPath) -> list[str]:
    """The files the ONNX model at ``out/path`` reads (itself and its external data), relative to ``out``; none
    where it is not a readable model (its loader says so: "no longer loads", as for any broken file)."""
    import onnx  # noqa: PLC0415

    from ..check.artifacts import onnx_files  # noqa: PLC0415

    try:
        proto = onnx.load(str(out / path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not an ONNX model: nothing is read from it here
        return []
    return [str(f.relative_to(out)) for f in onnx_files(out / path, proto)]
