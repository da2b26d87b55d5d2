"""The proofs ``exporter check`` asks of an artifact another tool made, beside its outputs' verdict (recorded by
``numerics/proofs.py`` under ``proofs`` in the report, one JUnit case each):

* **weights**: every constant it carries equals the checkpoint's tensor after the cast (``numerics/weights.py``);
* **program**: its program, run in float64 with the checkpoint's weights, computes what the model computes
  (a ``.pt2``: ``numerics/program64.py``; an ONNX graph: ``numerics/onnx64.py``; a compiled package has no program
  in it, and the report says so);
* **rounding**: the outputs' rule (``numerics/tolerance.py``), with its stated power: the smallest increase of the
  error over eager's it fails with 95% probability.

A weight that differs, or a program that computes another function, fails the artifact (numerics, exit 3) by name,
whatever its outputs showed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..errors import describe
from ..modelio import import_spec_types, named_call
from ..numerics.program64 import ProgramProof, prove_twin
from ..numerics.proofs import onnx_program
from ..numerics.weights import WeightProof, prove_weights
from ..targets.program_file import load_program
from ..targets.spec import RunnerSpec
from .artifacts import Artifact
from .constants import artifact_constants


def prove_artifact(artifact: Artifact, kept: list[Path], weights: dict[str, Any]) -> WeightProof | str:
    """The weights proof of one artifact (``numerics/weights.py``) from its copied files, or why it has none (its
    format keeps no readable constants, or they are pickled)."""
    if artifact.pickle:
        return "its constants are pickled (loaded with --allow-artifact-pickle): they are not read as data"
    try:
        constants, why = artifact_constants(artifact, kept)
    except Exception as exc:  # noqa: BLE001 - the proof is not run; the outputs are still judged
        return f"its constants could not be read ({describe(exc, 160)})"
    return prove_weights(constants, weights) if constants is not None else why


def prove_program(artifact: Artifact, path: Path, spec: RunnerSpec, tensors: dict[str, torch.Tensor],
                  samples: list[list[torch.Tensor]], reference: list[list[torch.Tensor]], names: tuple[str, ...],
                  original: Any, device: str, inputs: tuple[str, ...] = ()) -> ProgramProof | str:
    """The program proof of a ``.pt2`` artifact (its float64 twin against the float64 reference, and the first
    divergent module when it fails), or why it is not run."""
    if artifact.target not in ("exported_program", "onnx"):
        return "a compiled package's program is not in it (only its native code): no float64 twin"
    if artifact.past is not None:
        return "a decoder with past is judged step by step: no float64 twin of its steps"
    t0 = time.perf_counter()
    if artifact.target == "onnx":
        return onnx_program(path, tensors, samples, reference, names, inputs, original)
    keywords, positional = spec.option("keywords"), spec.option("positional", 0)
    try:
        import_spec_types(artifact.imports)  # allow-listed ModelOutput modules only
        program = load_program(path, allow_pickle=artifact.pickle)
    except Exception as exc:  # noqa: BLE001 - the twin explains; the outputs are still judged
        return f"its program could not be read ({describe(exc, 200)})"

    def call(module, args):
        return named_call(module, keywords, spec.option("outputs"), positional)(args)

    prefix = "model." if artifact.made_by == "exporter" else ""
    return prove_twin(program, tensors, device, call, samples, reference, names, original, prefix, keywords,
                      positional, t0)


__all__ = ["prove_artifact", "prove_program"]
