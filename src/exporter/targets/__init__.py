"""Stage 4, export: one module per artifact kind, registered by name.

Each target declares what it needs (``requires``: importable modules;
``needs_program``: the torch.export program) and provides ``build`` (in the
parent, into the staging folder) and ``load`` (in the process that runs it).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..inputs import InputPlan
from ..modelio import IOModule
from ..recipe import Recipe
from ..runners import Loaded, ModelSource, RunnerSpec

ORDER = ("exported_program", "aoti", "onnx", "compile", "tensorrt")


@dataclass
class BuildContext:
    io: IOModule  # the rewritten model, on the recipe's device and dtype
    plan: InputPlan
    recipe: Recipe
    staging: Path
    source: ModelSource
    example: list[torch.Tensor]  # sample 0 on the recipe's device and dtype
    program: Any = None  # torch.export.ExportedProgram, set once exported
    program_error: str | None = None
    program_export_s: float = 0.0
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


@dataclass(frozen=True)
class Target:
    name: str
    build: Callable[[BuildContext], list[Built]]
    module: str  # the target's module, which defines ``load``
    requires: tuple[str, ...] = ()
    needs_program: bool = False
    describe: str = ""

    @property
    def load(self) -> Callable[[RunnerSpec], Loaded] | None:
        return getattr(importlib.import_module(self.module), "load", None)

    def unavailable(self) -> str | None:
        """Why the target cannot run here, or None."""
        missing = [m for m in self.requires if importlib.util.find_spec(m) is None]
        if missing:
            return f"{', '.join(missing)} not importable (install it to build this target)"
        return None


REGISTRY: dict[str, Target] = {}


def register(name: str, *, requires: tuple[str, ...] = (), needs_program: bool = False, describe: str = ""):
    """Decorator for a target module's build function; the module's ``load`` is found by name."""
    def wrap(build):
        REGISTRY[name] = Target(name, build, build.__module__, requires, needs_program, describe)
        return build
    return wrap


def _import_all() -> None:
    from . import aoti, compile, exported_program, onnx, tensorrt  # noqa: F401


def get(name: str) -> Target:
    _import_all()
    return REGISTRY[name]


def load_runner(spec: RunnerSpec) -> Loaded:
    """Load a variant in this process (called in the runner's child process).

    ``spec.target`` names a registered target, or ``package.module:function`` for a
    loader defined outside exporter (a plugin), which gets the spec and returns Loaded.
    """
    _import_all()
    if spec.target not in REGISTRY and ":" in spec.target:
        module, _, function = spec.target.partition(":")
        return getattr(importlib.import_module(module), function)(spec)
    target = get(spec.target)
    if target.load is None:
        raise RuntimeError(f"target {spec.target} cannot be loaded")
    return target.load(spec)


def count_graph_ops(graph) -> dict[str, int]:
    """SDPA, softmax and matmul nodes of an FX graph (the proof that attention survived as SDPA)."""
    counts = {"sdpa": 0, "softmax": 0, "matmul": 0}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        text = str(node.target)
        if "scaled_dot_product" in text:
            counts["sdpa"] += 1
        elif "softmax" in text:
            counts["softmax"] += 1
        elif any(op in text for op in ("aten.bmm", "aten.matmul", "aten.mm.", "aten.baddbmm")):
            counts["matmul"] += 1
    return counts


def build_targets(ctx: BuildContext, progress, log: Callable[[str, str], None]):
    """Build every target the recipe lists, in ORDER; one failing target loses none of the others.

    Returns (VariantResult, RunnerSpec or None) pairs; the program all program-based targets share is
    exported once, first.
    """
    import time
    import traceback

    from ..errors import ExporterError
    from ..outdir import disk_full, os_problem
    from ..report import file_entry
    from ..results import FAILED, SKIPPED, VariantResult
    from .exported_program import export_program, first_line

    wanted = [t for t in ORDER if t in ctx.recipe.targets.build]
    built: list[tuple[VariantResult, RunnerSpec | None]] = []
    if any((get(t).needs_program or t == "exported_program") and get(t).unavailable() is None for t in wanted):
        with progress.stage("torch.export"):
            t0 = time.perf_counter()
            try:
                ctx.program = export_program(ctx)
            except Exception as exc:
                if disk_full(exc) is not None:
                    raise
                ctx.program_error = first_line(exc)
                log("torch.export", traceback.format_exc())
                progress.warn(f"torch.export failed: {ctx.program_error}")
            ctx.program_export_s = time.perf_counter() - t0
    for name in wanted:
        target = get(name)
        reason = target.unavailable()
        if reason is not None:
            built.append((VariantResult(name, name, status=SKIPPED, error=reason), None))
            progress.info(f"{name}: skipped ({reason})")
            continue
        if (target.needs_program or name == "exported_program") and ctx.program is None:
            error = f"needs the exported program, which failed: {ctx.program_error}"
            built.append((VariantResult(name, name, status=FAILED, error=error), None))
            continue
        try:
            with progress.stage(f"build {name}"):
                items = target.build(ctx)
        except ExporterError:
            raise
        except Exception as exc:
            full = disk_full(exc)
            if full is not None:  # no other target can be written either: stop the run
                raise os_problem(full, Path(full.filename or ctx.staging)) from None
            log(name, traceback.format_exc())
            built.append((VariantResult(name, name, status=FAILED, error=f"build failed: {first_line(exc)}"), None))
            continue
        for item in items:
            spec = item.runner
            built.append((VariantResult(
                name, item.name, path=item.path.relative_to(ctx.staging) if item.path else None,
                files=[file_entry(p, ctx.staging) for p in item.files], build_s=item.build_s, notes=list(item.notes),
                graph=dict(item.graph), device=spec.device if spec else None, dtype=spec.dtype if spec else None),
                spec))
    return built


__all__ = ["BuildContext", "Built", "Target", "REGISTRY", "register", "get", "load_runner", "ORDER",
           "count_graph_ops", "build_targets"]
