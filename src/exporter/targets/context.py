"""What a target is built from, in the convert process, and what building it returns.

``BuildContext`` carries the rewritten model, the input plan, what the recipe asks of the build (``BuildSettings``),
the staging folder and the torch.export
program every program-based target shares; ``Built`` is one variant a target's ``build`` made (with the
``RunnerSpec`` another process loads it from). ``DecoderPrograms`` is the same for ``--task text-generation``: a
decoder's prefill and decode programs, which each target with ``decoder`` files writes with ``build_decoder``.
:func:`build` and :func:`build_decoder` call a target's module (the contract is :mod:`exporter.targets.spec`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .spec import BuildSettings, RunnerSpec, Target

if TYPE_CHECKING:
    import torch

    from ..modelio import IOModule
    from ..prepare import ModelSource


class Inputs(Protocol):
    """What a target reads of the input plan (``inputs.InputPlan``): the inputs' names and their dynamic axes."""

    @property
    def names(self) -> tuple[str, ...]: ...

    def dynamic_axes(self) -> dict[str, dict[int, Any]]: ...

    def export_dynamic_shapes(self, hints: bool = False) -> dict[str, dict[int, Any] | None] | None: ...


@dataclass
class BuildContext:
    io: IOModule  # the rewritten model, on the recipe's device and dtype
    plan: Inputs
    settings: BuildSettings
    staging: Path
    source: ModelSource
    example: list[torch.Tensor]  # sample 0 on the recipe's device and dtype
    program: Any = None  # torch.export.ExportedProgram (training IR), set once exported
    program_error: str | None = None
    program_export_s: float = 0.0
    decomposed: Any = None  # the program in core ATen with SDPA kept, made on first need (exported_program.core_aten)
    decompose_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # about the exported program, for every target built from it

    @property
    def device(self) -> str:
        return self.settings.device

    @property
    def dtype(self) -> str:
        return self.settings.dtype


@dataclass
class Built:
    target: str
    name: str  # the variant's name in the report
    runner: RunnerSpec | None
    path: Path | None = None
    files: list[Path] = field(default_factory=list)
    build_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    graph: dict[str, Any] = field(default_factory=dict)
    static_shapes: bool = False  # a benchmark variant that runs the shapes it was captured at: not on the grid
    replays: str | None = None  # the variant whose artifact this one runs (its verdict over the grid holds here)


@dataclass
class DecoderPrograms:
    """A decoder's prefill and decode programs (core ATen, SDPA kept), as ``generation.programs`` exported them."""

    prefill: Any  # torch.export.ExportedProgram
    decode: Any
    export_s: float
    notes: list[str] = field(default_factory=list)
    fused: list[dict[str, Any]] = field(default_factory=list)  # projections computed as one product (groups)
    layers: int = 0
    past: tuple[Any, Any] | None = None  # the same two programs with the cache in and out (for ONNX)
    past_error: str | None = None  # why those could not be exported
    # the ONNX programs' input and output names (prefill in, out, decode in, out); None: a decoder's
    # (``targets.onnx.input_names``/``output_names``)
    past_names: tuple[list[str], list[str], list[str], list[str]] | None = None
    # the decode program again with the batch fixed at 1 (generation.decode_batch_1), for the targets that compile
    # it apart (``Target.decoder_one``)
    decode_one: Any = None
    # what a target's build says of how it built these programs (by target name; the report's notes)
    build_notes: dict[str, list[str]] = field(default_factory=dict)


def build(target: Target, ctx: BuildContext) -> list[Built]:
    """The variants ``target`` builds into ``ctx.staging``."""
    return target.implementation().build(ctx)


def build_decoder(target: Target, programs: DecoderPrograms, settings: BuildSettings, staging: Path) -> list[Path]:
    """Write ``target``'s prefill and decode programs into ``staging``; the files written."""
    if not target.decoder:
        raise ValueError(f"target {target.name} builds no generation programs: {target.decoder_note}")
    return target.implementation().build_decoder(programs, settings, _files(target, programs, staging))


def decoder_attention(target: Target, programs: DecoderPrograms, staging: Path) -> dict[str, dict[str, int]]:
    """What each of the built programs runs its attention as: ``{"prefill": {"sdpa": n, "softmax": m}, ...}``."""
    return target.implementation().decoder_attention(programs, _files(target, programs, staging))


def _files(target: Target, programs: DecoderPrograms, staging: Path) -> tuple[Path, ...]:
    """``target``'s decoder files in ``staging``, its decode program of batch 1 too where both it and ``programs``
    have one."""
    return target.decoder_files(staging, one=programs.decode_one is not None and bool(target.decoder_one))


__all__ = ["BuildContext", "Built", "DecoderPrograms", "build", "build_decoder", "decoder_attention"]
