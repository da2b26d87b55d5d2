"""``exporter batch``: many converts at once, checkpoints x recipes from one plan. :mod:`.plan` reads and checks
the plan, :mod:`.cell` runs one convert in a process of its own (and knows a cell an earlier run finished),
:mod:`.engines` runs the cells on this host's GPUs or a Dask cluster, :mod:`.summary` writes ``batch.json``,
``batch.md`` and JUnit. Nothing here imports torch: each cell's convert does."""

from .run import BatchResult, batch

__all__ = ["batch", "BatchResult"]
