"""The contract between a target and the processes that build and run it.

``Target`` declares an artifact kind once: its name, where its ``build`` (in the convert process, into the
staging folder) and ``load`` (in the process that runs it) live, and what it needs. ``BuildContext`` is what
``build`` gets; ``Built`` what it returns, with a ``RunnerSpec``: the plain, picklable description from which
another process loads the variant (``load`` returns ``Loaded``). ``ModelSource`` says how a process rebuilds
the model itself from the checkpoint (the compile variants).

Nothing here imports torch at module level, so the target list can be read by the command line's help.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..errors import describe

if TYPE_CHECKING:
    import torch

    from ..inputs import InputPlan
    from ..modelio import IOModule
    from ..recipe import Recipe


class RunnerFailed(Exception):
    """A variant could not be loaded or run; ``reason`` is one line for the report, ``detail`` for its log."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class TargetSkipped(Exception):
    """A target that cannot be built here, for a reason the report gives (not a failure of the run)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def failure_reason(exc: BaseException) -> str:
    """One line for the report: a runner's own reason, else the exception described."""
    return exc.reason if isinstance(exc, RunnerFailed) else describe(exc)


@dataclass(frozen=True)
class ModelSource:
    """How a child process rebuilds the model from the checkpoint."""

    checkpoint: str
    factory: str | None
    allow_pickle: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    example_file: str  # safetensors of the reference inputs; sample 0 drives the rewrite's audit run
    rewrite: bool = True  # the recipe's runtime.rewrite_attention


@dataclass(frozen=True)
class RunnerSpec:
    name: str  # the variant's name in the report
    target: str  # the target that knows how to load it
    device: str
    dtype: str
    path: str | None = None
    source: ModelSource | None = None
    options: tuple[tuple[str, Any], ...] = ()
    attention_backend: str = "auto"

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)

    def file(self) -> str:
        """The artifact's file, for a target whose variants have one."""
        if self.path is None:
            raise RunnerFailed(f"{self.name} has no artifact file to load")
        return self.path

    def model_source(self) -> ModelSource:
        """How to rebuild the model, for a variant built in its own process."""
        if self.source is None:
            raise RunnerFailed(f"{self.name} needs the checkpoint to rebuild the model, and its spec names none")
        return self.source


@dataclass
class Loaded:
    """What a target's loader returns: a callable over device tensors, and facts for the report."""

    call: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    device: str
    input_dtype: torch.dtype
    info: dict[str, Any] = field(default_factory=dict)  # plain data, sent back to the parent
    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)  # extra commands, e.g. a profiler


@dataclass
class BuildContext:
    io: IOModule  # the rewritten model, on the recipe's device and dtype
    plan: InputPlan
    recipe: Recipe
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
        return self.recipe.runtime.device

    @property
    def dtype(self) -> str:
        return self.recipe.runtime.dtype


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


@dataclass(frozen=True)
class Target:
    """One artifact kind. ``module`` defines ``build(BuildContext) -> list[Built]`` and, for a target whose
    artifacts can be run, ``load(RunnerSpec) -> Loaded``; it is imported only when the target is used."""

    name: str
    module: str
    describe: str
    requires: tuple[str, ...] = ()  # importable modules it needs
    needs_program: bool = False  # built from the torch.export program
    loadable: bool = True

    def build(self, ctx: BuildContext) -> list[Built]:
        return importlib.import_module(self.module).build(ctx)

    def load(self, spec: RunnerSpec) -> Loaded:
        if not self.loadable:
            raise RuntimeError(f"target {self.name} cannot be loaded")
        return importlib.import_module(self.module).load(spec)

    def unavailable(self) -> str | None:
        """Why the target cannot run here, or None."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not importable (install it to build this target)"
        return None
