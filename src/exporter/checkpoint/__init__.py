"""The load stage: checkpoint files, architecture resolution, and weight assignment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from .architecture import Architecture, resolve_architecture
from .files import Checkpoint, open_checkpoint
from .loader import LoadReport, build_model, check_finite, load_weights
from .sentence_pipeline import PipelineInfo


@dataclass
class LoadedModel:
    model: nn.Module
    checkpoint: Checkpoint
    architecture: Architecture
    report: LoadReport
    pipeline: PipelineInfo | None = None  # a sentence-transformers folder: its modules, included or why not


def load_model(path: str | Path, factory: str | None = None, allow_pickle: bool = False,
               pipeline: bool = True) -> LoadedModel:
    """Open the checkpoint, build its architecture on the meta device and assign the weights; with
    ``pipeline``, a sentence-transformers folder's pooling (and dense, normalisation) modules go around the
    transformers model (:mod:`.sentence_pipeline`)."""
    checkpoint = open_checkpoint(path, allow_pickle=allow_pickle)
    arch = resolve_architecture(checkpoint.root, factory)
    if arch.is_transformers:
        from .hf_loader import load_transformers  # noqa: PLC0415 - transformers is optional

        model, report = load_transformers(arch, checkpoint)
        info = None
        if pipeline:
            from .sentence_pipeline import wrap  # noqa: PLC0415

            model, info = wrap(model, checkpoint.root)
        return LoadedModel(model, checkpoint, arch, report, info)
    model = build_model(arch)
    report = load_weights(model, checkpoint)
    return LoadedModel(model, checkpoint, arch, report)


__all__ = ["LoadedModel", "load_model", "open_checkpoint", "resolve_architecture", "check_finite",
           "Checkpoint", "Architecture", "LoadReport", "PipelineInfo"]
