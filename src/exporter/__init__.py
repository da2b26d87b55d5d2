"""exporter: a trained checkpoint in; validated, faster deployable artifacts and a report out.

Library use::

    import exporter
    result = exporter.convert("model.safetensors", recipe="cpu-fp32")
    result.passed, result.report["artifacts"]
"""

from __future__ import annotations

from .errors import ExporterError
from .measure.conditions import settle

settle()  # every variant timed alike: this process's OpenMP threads wait as its children's do

__all__ = ["convert", "inspect", "check_artifact", "run_batch", "verify", "validate_folder", "load_recipe",
           "ExporterError"]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str):  # keep `import exporter` light: torch loads on first use
    if name in ("convert", "inspect"):
        from . import api

        return getattr(api, name)
    if name == "check_artifact":  # exporter check (the name ``check`` is its package's)
        from .check import check

        return check
    if name == "run_batch":  # exporter batch (the name ``batch`` is its package's)
        from .batch import batch

        return batch
    if name == "verify":
        from .published.verification import verify

        return verify
    if name == "validate_folder":
        from .published.revalidate import validate_folder

        return validate_folder
    if name == "load_recipe":
        from .recipe import load_recipe

        return load_recipe
    raise AttributeError(name)
