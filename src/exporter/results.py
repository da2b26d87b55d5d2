"""What one run found, variant by variant: the data the report is written from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .numerics.tolerance import CandidateNumerics

OK = "ok"
FAILED = "failed"
SKIPPED = "skipped"
NUMERICS_FAILED = "numerics_failed"


@dataclass
class VariantResult:
    """One candidate: the rewritten model or a target's artifact."""

    target: str  # registry name ("onnx", "compile"), or "rewritten"
    name: str  # report name ("onnx", "compile:max-autotune")
    status: str = OK
    error: str | None = None
    path: Path | None = None  # main file, relative to the output folder
    files: list[dict[str, Any]] = field(default_factory=list)  # {path, sha256, bytes}
    build_s: float | None = None
    load_s: float | None = None
    device: str | None = None
    dtype: str | None = None
    notes: list[str] = field(default_factory=list)
    graph: dict[str, Any] = field(default_factory=dict)
    numerics: CandidateNumerics | None = None
    bench: dict[str, Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    static_shapes: bool = False  # a benchmark variant (compile modes, a CUDA graph): judged at the samples only
    replays: str | None = None  # the variant whose artifact this one runs: it fails where that one fails

    def fail(self, status: str, error: str) -> None:
        self.status = status
        self.error = error

    @property
    def sha256(self) -> str | None:
        return self.files[0]["sha256"] if self.files else None

    @property
    def size_bytes(self) -> int | None:
        return sum(f["bytes"] for f in self.files) if self.files else None
