"""Build every target a recipe lists, in :data:`exporter.targets.TARGETS` order.

The program every program-based target shares is exported once, first; a target that fails to build
loses none of the others (a full disk stops the run: nothing else could be written either).
"""

from __future__ import annotations

import contextlib
import time
import traceback
from pathlib import Path
from typing import Callable

from ..errors import ExporterError, describe
from ..outdir import disk_full, file_entry, os_problem
from ..results import FAILED, SKIPPED, VariantResult
from . import TARGETS
from .context import BuildContext, build
from .exported_program import export_program
from .spec import BuildSettings, RunnerSpec, Target, TargetSkipped


def spare_children(settings: BuildSettings) -> int:
    """How many built targets will be loaded in a child that a spare can be: every available target the recipe
    builds (one per compile mode), but those whose child may need its own LD_PRELOAD (``preload``: AOTInductor)."""
    wanted = [t for t in TARGETS if t.name in settings.targets.build and not t.preload and t.unavailable() is None]
    if any(t.name == "onnx" for t in wanted):
        from .onnx import refused_here  # noqa: PLC0415 - onnxruntime only where ONNX is built
        if refused_here(settings):
            wanted = [t for t in wanted if t.name != "onnx"]
    return sum(len(settings.targets.compile_modes) if t.name == "compile" else 1 for t in wanted)


def stop_compile_workers() -> None:
    """Idle Inductor compile workers must not share the CPU with the benchmark."""
    try:
        from torch._inductor.async_compile import shutdown_compile_workers  # noqa: PLC0415 - a private API some torch versions lack
    except ImportError:
        return
    with contextlib.suppress(Exception):
        shutdown_compile_workers()


def build_targets(ctx: BuildContext, progress, log: Callable[[str, str], None],
                  on_built: Callable[[VariantResult, RunnerSpec | None], None] | None = None):
    """Build every target the recipe lists; one failing target loses none of the others.

    Targets that need no exported program (the compile variants, which build in their own process) come
    first, so their work overlaps the export; ``on_built`` hears of each variant as soon as it exists (to start
    loading it while the next one builds). Returns (VariantResult, RunnerSpec or None) pairs in
    :data:`TARGETS` order.
    """
    wanted = sorted((t for t in TARGETS if t.name in ctx.settings.targets.build), key=lambda t: t.needs_program)
    built: list[tuple[VariantResult, RunnerSpec | None]] = []

    def build_one(target: Target) -> None:
        for result, spec in _build_one(target, ctx, progress, log):
            built.append((result, spec))
            if on_built is not None:
                on_built(result, spec)

    for target in [t for t in wanted if not t.needs_program]:
        build_one(target)
    if any(t.needs_program and t.unavailable() is None for t in wanted):
        with progress.stage("torch.export"):
            t0 = time.perf_counter()
            try:
                ctx.program = export_program(ctx)
            except Exception as exc:
                if disk_full(exc) is not None:
                    raise
                ctx.program_error = describe(exc)
                log("torch.export", traceback.format_exc())
                progress.warn(f"torch.export failed: {ctx.program_error}")
            ctx.program_export_s = time.perf_counter() - t0
    for target in [t for t in wanted if t.needs_program]:
        build_one(target)
    stop_compile_workers()
    order = {t.name: i for i, t in enumerate(TARGETS)}
    return sorted(built, key=lambda pair: order[pair[0].target])


def _build_one(target: Target, ctx: BuildContext, progress,
               log: Callable[[str, str], None]) -> list[tuple[VariantResult, RunnerSpec | None]]:
    name = target.name
    reason = target.unavailable()
    if reason is not None:
        progress.info(f"{name}: skipped ({reason})")
        return [(VariantResult(name, name, status=SKIPPED, error=reason), None)]
    if target.needs_program and ctx.program is None:
        error = f"needs the exported program, which failed: {ctx.program_error}"
        return [(VariantResult(name, name, status=FAILED, error=error), None)]
    skipped: TargetSkipped | None = None
    try:
        with progress.stage(f"build {name}"):
            try:
                items = build(target, ctx)
            except TargetSkipped as exc:  # a decision, not a failure of the stage
                skipped = exc
    except ExporterError:
        raise
    except Exception as exc:
        full = disk_full(exc)
        if full is not None:  # no other target can be written either: stop the run
            raise os_problem(full, Path(full.filename or ctx.staging)) from None
        log(name, traceback.format_exc())
        return [(VariantResult(name, name, status=FAILED, error=f"build failed: {describe(exc)}"), None)]
    if skipped is not None:
        progress.warn(f"{name}: skipped ({skipped.reason})")
        return [(VariantResult(name, name, status=SKIPPED, error=skipped.reason), None)]
    pairs: list[tuple[VariantResult, RunnerSpec | None]] = []
    for item in items:
        spec = item.runner
        pairs.append((VariantResult(
            name, item.name, path=item.path.relative_to(ctx.staging) if item.path else None,
            files=[file_entry(p, ctx.staging) for p in item.files], build_s=item.build_s, notes=list(item.notes),
            graph=dict(item.graph), device=spec.device if spec else None, dtype=spec.dtype if spec else None,
            static_shapes=item.static_shapes, replays=item.replays),
            spec))
    return pairs


__all__ = ["build_targets", "stop_compile_workers"]
