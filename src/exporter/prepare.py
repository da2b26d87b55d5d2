"""Build the original and the rewritten model from a checkpoint: shared by convert and the child runners."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from .checkpoint import LoadedModel, load_model
from .dtypes import torch_dtype
from .modelio import IOModule, Signature, make_io_module
from .rewrite import AttentionAudit, rewrite_attention


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
    pipeline: bool = True  # the recipe's model.pipeline (a sentence-transformers folder's modules)


@dataclass
class Prepared:
    loaded: LoadedModel
    original: IOModule  # eager attention, as the checkpoint's author wrote it
    rewritten: IOModule  # attention routed through SDPA; shares the original's weights
    audit: AttentionAudit
    example: list[torch.Tensor]  # the stored sample 0, on the CPU


def original_module(loaded: LoadedModel, signature: Signature) -> IOModule:
    return make_io_module(loaded.model, signature, "eager" if loaded.architecture.is_transformers else None)


def from_source(source: ModelSource) -> Prepared:
    """Rebuild what convert built, in another process: load, wrap, rewrite (audited on the stored sample 0)."""
    loaded = load_model(source.checkpoint, source.factory, source.allow_pickle, source.pipeline)
    signature = Signature(source.inputs, source.outputs)
    original = original_module(loaded, signature)
    stored = load_file(source.example_file)
    example = [stored[f"0.{name}"] for name in source.inputs]
    rewritten, audit = rewrite_attention(original, example, apply=source.rewrite)
    return Prepared(loaded, original, rewritten, audit, example)


def place(module: torch.nn.Module, device: str, dtype: str) -> torch.nn.Module:
    return module.to(device=device, dtype=torch_dtype(dtype))
