"""The constants an artifact carries, read from its files without running it: what the weights proof
(``numerics/weights.py``) traces to the checkpoint.

* a ``.pt2`` program: its state dict and constants, by qualified name (``targets/program_file.py``: as data);
* an ONNX model: its initializers, by name, external data included (every file of a split decoder);
* an AOTInductor package: its constants are compiled into its shared library or a blob only its loader reads, so
  a package someone else compiled gets no weights proof (the report says so).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..numerics.onnx64 import onnx_constants
from ..targets.program_file import read_constants
from .artifacts import Artifact

AOTI_NOTE = ("an AOTInductor package's constants live in its compiled library, which only its loader (native code) "
             "reads: no weights proof")


def artifact_constants(artifact: Artifact, files: list[Path]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """(the constants by name, a note) of ``artifact`` from its copied ``files``; None where it has no readable
    constants (an AOTInductor package)."""
    if artifact.target == "exported_program":
        return read_constants(next(f for f in files if f.name == artifact.path.name)), ""
    if artifact.target == "onnx":
        found: dict[str, torch.Tensor] = {}
        for file in files:
            if file.suffix == ".onnx":
                found.update(onnx_constants(file))
        return found, ""
    return None, AOTI_NOTE


__all__ = ["AOTI_NOTE", "artifact_constants", "onnx_constants"]
