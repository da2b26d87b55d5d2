"""``exporter verify --checkpoint``: the weights and program proofs asked again, from what an output folder holds.

A folder holds its artifacts, the stored inputs and the float64 reference outputs; the proofs also need the
checkpoint's own tensors, which a folder does not hold. Given the checkpoint, verify first checks it is the one
the folder was made from (each weight file's SHA-256 against ``manifest.json``'s ``checkpoint`` list), then asks
each artifact's proofs as convert and check asked them (``numerics/proofs.py``): its constants against the
checkpoint's tensors, its program (a ``.pt2``, the ``.pt2`` an AOTInductor package was compiled from, an ONNX
graph) in float64 against the stored float64 outputs. Nothing is localised here (``exporter validate --locate``
does that).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import describe
from ..modelio import by_name
from .program64 import ProgramProof, prove_twin
from .weights import WeightProof, prove_weights


@dataclass
class Asked:
    subject: str  # an artifact's name, or "folder"
    name: str  # weights | program | checkpoint
    passed: bool | None  # None: not asked (the message says why)
    message: str


def _checkpoint_problem(files: list[Path], manifest: dict[str, Any]) -> str | None:
    from ..outdir import sha256_file  # noqa: PLC0415

    recorded = {entry["path"]: entry["sha256"] for entry in manifest.get("checkpoint") or []}
    if not recorded:
        return "manifest.json records no checkpoint hashes to compare it with"
    for file in files:
        if file.name not in recorded:
            return f"{file.name} is not a file of the checkpoint the folder was made from"
        if sha256_file(file) != recorded[file.name]:
            return f"{file.name} differs from the checkpoint the folder was made from (SHA-256)"
    return None


def _asked(subject: str, name: str, proof: WeightProof | ProgramProof | str) -> Asked:
    if isinstance(proof, str):
        return Asked(subject, name, None, f"not asked: {proof}")
    return Asked(subject, name, proof.passed, proof.summary())


def reask(checkpoint: Path, out: Path, report: dict[str, Any], manifest: dict[str, Any], entries: list[dict],
          samples: list[list[torch.Tensor]], reference: list[list[torch.Tensor]],
          requantize: Callable[[torch.nn.Module, dict[str, Any]], Any], allow_pickle: bool = False) -> list[Asked]:
    """The proofs of each of ``entries`` (artifacts verify re-ran) asked again with ``checkpoint``'s tensors, against
    the folder's stored ``samples`` and float64 ``reference`` outputs. A quantized run's weights are compared with
    the checkpoint's after ``requantize(model, the recipe's [quantize] section)`` made its fp8 linears again."""
    from ..checkpoint import load_model  # noqa: PLC0415
    from ..modelio import import_spec_types  # noqa: PLC0415
    from ..targets.program_file import load_program, read_constants  # noqa: PLC0415
    from .proofs import AFTER_QUANTIZATION, QUANTIZED, checkpoint_tensors, onnx_program, onnx_weights  # noqa: PLC0415

    recipe = report.get("recipe") or {}
    if (recipe.get("model") or {}).get("factory"):
        return [Asked("folder", "checkpoint", None, "not asked: the model was built by a factory (code the folder "
                      "names is not run)")]
    try:
        loaded = load_model(checkpoint, None, False, bool((recipe.get("model") or {}).get("pipeline")))
    except Exception as exc:  # noqa: BLE001 - a checkpoint that does not load: the proofs are not asked
        return [Asked("folder", "checkpoint", False, f"{checkpoint} does not load ({describe(exc, 200)})")]
    problem = _checkpoint_problem([Path(f) for f in loaded.checkpoint.files], manifest)
    if problem:
        return [Asked("folder", "checkpoint", False, problem)]
    asked = [Asked("folder", "checkpoint", True, f"{checkpoint} is the checkpoint the folder was made from")]
    quantized = bool(report.get("quantization"))
    if quantized:  # the declared transform again, from the checkpoint's weights (the manifest holds the recipe)
        requantize(loaded.model, (manifest.get("recipe") or {}).get("quantize") or {})
    tensors = checkpoint_tensors(loaded.model)
    against = AFTER_QUANTIZATION if quantized else "the checkpoint's"
    inputs, outputs = tuple(report["inputs"]["names"]), tuple(report["outputs"])
    program_file = next((out / a["path"] for a in report["artifacts"] if a.get("target") == "exported_program"
                         and a.get("path") and a.get("status") == "ok"), None)
    for entry in entries:
        name, target, path = entry["name"], entry["target"], out / entry["path"]
        device = "cpu" if target == "onnx" else entry["device"]
        if target == "onnx":
            weights: WeightProof | str = onnx_weights(path, tensors, against)
            program: ProgramProof | str = QUANTIZED if quantized else onnx_program(path, tensors, samples, reference,
                                                                                  outputs, inputs)
        elif target in ("exported_program", "aoti"):
            source = path if target == "exported_program" else program_file
            if source is None:
                why = "the folder holds no .pt2 of the program the package was compiled from"
                asked += [Asked(name, "weights", None, f"not asked: {why}"),
                          Asked(name, "program", None, f"not asked: {why}")]
                continue
            load = (entry.get("info") or {}).get("load") or {}
            weights = prove_weights(read_constants(source), tensors, against=against) if not allow_pickle else \
                "its constants are pickled (loaded with --allow-artifact-pickle)"
            if quantized:
                asked += [_asked(name, "weights", weights), _asked(name, "program", QUANTIZED)]
                continue
            try:
                import_spec_types(tuple(load.get("imports") or ()))  # allow-listed ModelOutput modules only
                module_program = load_program(source, allow_pickle=allow_pickle)
                program = prove_twin(module_program, tensors, device, _caller(load, outputs), samples, reference,
                                     outputs)
            except Exception as exc:  # noqa: BLE001
                program = f"its program does not run in float64 ({describe(exc, 200)})"
        else:
            continue
        asked += [_asked(name, "weights", weights), _asked(name, "program", program)]
    return asked


def _caller(load: dict[str, Any], outputs: tuple[str, ...]):
    from ..modelio import named_call  # noqa: PLC0415

    if not load.get("named"):
        return lambda module, args: list(by_name(module)(*args))
    keywords = tuple(load["keywords"]) if load.get("keywords") else None
    return lambda module, args: named_call(module, keywords, tuple(load.get("outputs") or outputs),
                                           int(load.get("positional", 0)))(args)


__all__ = ["Asked", "reask"]
