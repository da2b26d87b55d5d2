"""Target ``tensorrt``: Torch-TensorRT. Only the slot exists: the target is reported as skipped, with the
reason, when torch_tensorrt cannot be imported (TensorRT's runtime is not installable on every machine)."""

from __future__ import annotations

from .context import BuildContext, Built


def build(ctx: BuildContext) -> list[Built]:
    raise NotImplementedError("building Torch-TensorRT engines is not implemented yet")
