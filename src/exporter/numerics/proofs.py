"""Recording the proofs an artifact gets beside its outputs' verdict (``VariantResult.proofs``, one JUnit case each),
for convert and check alike:

* **weights** (``numerics/weights.py``): every constant equals the checkpoint's tensor after the cast;
* **program** (``numerics/program64.py``): the program, in float64 with the checkpoint's weights, computes what the
  model computes;
* **rounding** (``numerics/tolerance.py``): the outputs' rule, with its stated power.

A weight that differs or a program that computes another function fails the artifact (numerics, exit 3) by name,
whatever its outputs showed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..errors import describe
from ..modelio import by_name
from ..results import FAILED, NUMERICS_FAILED, OK, VariantResult
from .program64 import ProgramProof, detached, holding, prove_twin
from .tolerance import POWER, detectable_ratio
from .weights import WeightProof, prove_weights

FROM_PROGRAM = ("exported_program", "aoti")  # convert's targets built from its one exported program


def _fail(result: VariantResult, why: str) -> None:
    if result.status != FAILED:
        earlier = f"; {result.error}" if result.status == NUMERICS_FAILED and result.error else ""
        result.fail(NUMERICS_FAILED, f"{why}{earlier}")


QUANTIZED = "fp8 weights and scaled matrix products: judged against the quantized model's float64 arithmetic"
# a quantized run's weights proof compares with the checkpoint's tensors after the declared quantization
AFTER_QUANTIZATION = "the checkpoint's, quantized as the recipe declares"


def record(result: VariantResult, name: str, proof: WeightProof | ProgramProof | str) -> None:
    """Record the ``name`` proof (weights | program) on ``result``; one that failed fails the artifact (numerics,
    exit 3) by name, before whatever its outputs showed. A string says why the proof was not run."""
    if isinstance(proof, str):
        result.proofs[name] = {"passed": None, "summary": f"not run: {proof}"}
        result.notes.append(f"{name} proof not run: {proof}")
        return
    result.proofs[name] = proof.to_dict()
    result.notes.append(f"{name} proof: {'passed' if proof.passed else 'failed'}: {proof.summary()}")
    if not proof.passed:
        _fail(result, proof.summary())


def rounding_proof(result: VariantResult, sizes: dict[str, int], samples: int) -> None:
    """The outputs' rule with its stated power (``proofs.rounding``): per output, the smallest error, as a multiple
    of eager's, that one check fails with 95% probability; the artifact's power is its most sensitive output's."""
    numerics = result.numerics
    if numerics is None:
        result.proofs["rounding"] = {"passed": None, "summary": "not run: the artifact did not run"}
        return
    k = numerics.k
    per_output = {name: detectable_ratio(k, n) for name, n in sizes.items() if n > 0}
    if not per_output:
        return
    best = min(per_output, key=per_output.__getitem__)
    ratio = per_output[best]
    summary = (f"an error {ratio:.3g}x eager's (an increase of {100 * (ratio - 1):.0f}%) on {best} fails with "
               f"{POWER:.0%} probability (k={k:g}, {sizes[best]} values a sample, {samples} samples); "
               f"{'within' if numerics.passed else 'over'} the bar")
    result.proofs["rounding"] = {"passed": numerics.passed, "k": k, "power": POWER, "output": best,
                                 "values": sizes[best], "samples": samples, "detects_ratio": ratio,
                                 "detects_increase_pct": 100 * (ratio - 1),
                                 "per_output": {n: round(r, 4) for n, r in per_output.items()}, "summary": summary}


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as loaded (and the buffers it computes, such as RoPE's frequencies), by name: taken
    before the model is cast to the recipe's dtype, they are what the proofs compare with (the cast makes new
    tensors; these keep the checkpoint's values)."""
    return {**{n: b.detach() for n, b in model.named_buffers()}, **model.state_dict()}


def prove_built(results: list[VariantResult], program: Any, tensors: dict[str, torch.Tensor], device: str,
                samples: list[list[torch.Tensor]], reference: list[list[torch.Tensor]], names: tuple[str, ...],
                original: Any, quantized: bool, staging: Path | None = None, inputs: tuple[str, ...] = ()) -> None:
    """convert's own artifacts: the weights and program proofs of the exported program every ``FROM_PROGRAM``
    target was built from (asked once, recorded on each) and those of its ONNX model (``numerics/onnx64.py``).

    Neither reads the artifacts' outputs: convert asks them while the artifacts load in their children, before
    the outputs are judged; the rounding proof, which reads the outputs' verdict, comes after
    (:func:`rounding_proofs`)."""
    built = [r for r in results if r.target in FROM_PROGRAM and r.status in (OK, NUMERICS_FAILED)]
    if built and program is not None:
        constants = {k: v for k, v in {**program.state_dict, **program.constants}.items()
                     if isinstance(v, torch.Tensor)}
        # quantized: ``tensors`` are the model's after quantization (each fp8 linear's qweight and scales made from
        # the checkpoint's weight), and the program's float64 twin would promote the fp8 roundings away
        weights: WeightProof | str = prove_weights({k: v.detach().cpu() for k, v in constants.items()}, tensors,
                                                   against=AFTER_QUANTIZATION if quantized else "the checkpoint's")
        proof: ProgramProof | str = QUANTIZED if quantized else prove_twin(
            detached(program), tensors, device, lambda module, args: list(by_name(module)(*args)), samples, reference,
            names, original, prefix="model.")
        for result in built:
            record(result, "weights", weights)
            record(result, "program", proof)
            if result.target != "exported_program" and isinstance(proof, ProgramProof):
                result.proofs["program"]["of"] = "the exported program it was compiled from"
    for result in results:
        if result.target == "onnx" and result.status in (OK, NUMERICS_FAILED) and staging is not None and result.path:
            prove_onnx_built(result, staging / str(result.path), tensors, samples, reference, names, inputs, original,
                             quantized)


def rounding_proofs(results: list[VariantResult], reference: list[torch.Tensor], names: tuple[str, ...],
                    samples: int) -> None:
    """The rounding proof of every candidate whose outputs were judged (``reference``: one sample's outputs)."""
    sizes = {name: int(t.numel()) for name, t in zip(names, reference) if t.is_floating_point()}
    for result in results:
        rounding_proof(result, sizes, samples)


def prove_onnx_built(result: VariantResult, path: Path, tensors: dict[str, torch.Tensor], samples, reference,
                     names: tuple[str, ...], inputs: tuple[str, ...], original: Any, quantized: bool) -> None:
    """The weights and program proofs of convert's ONNX model, from its file."""
    record(result, "weights", onnx_weights(path, tensors, AFTER_QUANTIZATION if quantized else "the checkpoint's"))
    record(result, "program", QUANTIZED if quantized else onnx_program(path, tensors, samples, reference, names,
                                                                        inputs, original))


def onnx_weights(path: Path, tensors: dict[str, torch.Tensor], against: str = "the checkpoint's") -> WeightProof | str:
    """The weights proof of an ONNX model: its initializers (external data included) against the checkpoint's
    tensors, or why it is not run."""
    from .onnx64 import onnx_constants  # noqa: PLC0415

    try:
        return prove_weights(onnx_constants(path), tensors, against=against)
    except Exception as exc:  # noqa: BLE001 - the proof is not run; the outputs are still judged
        return f"its initializers could not be read ({describe(exc, 160)})"


def onnx_program(path: Path, tensors: dict[str, torch.Tensor], samples, reference, names: tuple[str, ...],
                 inputs: tuple[str, ...], original: Any = None) -> ProgramProof | str:
    """The program proof of an ONNX model (``numerics/onnx64.py``): its float64 twin against the float64
    ``reference``, localised by value against ``original`` run with the checkpoint's own tensors when it fails
    (no ``original``: not localised), or why it is not run."""
    from .locate import record_reference  # noqa: PLC0415
    from .onnx64 import NotTwinned, run_onnx_twin  # noqa: PLC0415

    def locate_with(sample):
        with holding(original.model, tensors):  # the checkpoint's own tensors, not the recipe's cast of them
            return record_reference(original, sample, None, [])[0]

    t0 = time.perf_counter()
    try:
        proof = run_onnx_twin(path, tensors, samples, reference, inputs, names,
                              locate_with if original is not None else None)
    except NotTwinned as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - the twin explains; the outputs are still judged
        return f"its graph does not run in float64 ({describe(exc, 200)})"
    proof.seconds = time.perf_counter() - t0
    return proof


__all__ = ["AFTER_QUANTIZATION", "QUANTIZED", "checkpoint_tensors", "onnx_program", "onnx_weights", "prove_built",
           "record", "rounding_proof", "rounding_proofs"]
