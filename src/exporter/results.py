"""What one run found, variant by variant: the data the report is written from.

``VariantResult`` is one candidate (the rewritten model or a target's artifact) with its status; its numerics
are a ``CandidateNumerics`` of ``OutputCheck`` records (the verdicts :mod:`exporter.numerics.tolerance` makes).
:func:`exit_code` is the one rule that turns the candidates' statuses into the run's exit code, for convert,
generation and validate alike. Plain data: no torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .errors import EXIT_NUMERICS, EXIT_OK, EXIT_TARGET


@dataclass
class RunResult:
    """What ``convert`` and ``check`` return: the published folder, its report, the exit code and its lines."""

    out: Path
    report: dict[str, Any]
    exit_code: int
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.report.get("passed"))

OK = "ok"
FAILED = "failed"
SKIPPED = "skipped"
NUMERICS_FAILED = "numerics_failed"


@dataclass
class OutputCheck:
    output: str
    sample: int
    max_abs: float
    max_rel: float
    rel_l2: float
    cosine: float
    rmse: float
    baseline_rmse: float
    allowed_rmse: float
    passed: bool
    reason: str = ""


@dataclass
class CandidateNumerics:
    candidate: str
    passed: bool
    k: float
    atol: float
    baseline: str  # which eager run set the bar, e.g. "eager (cuda, bfloat16)"
    worst: list[OutputCheck] = field(default_factory=list)  # worst sample for each output
    failures: list[OutputCheck] = field(default_factory=list)
    checks: list[OutputCheck] = field(default_factory=list)  # every (sample, output), for verify's bars
    grid: dict | None = None  # the shape grid (exporter.grid), when checked
    locate: dict | None = None  # divergence localisation (exporter.locate), when run

    def samples(self) -> list[dict]:
        """Per sample: passed, and its worst output as a ratio of the allowed RMSE."""
        by_sample: dict[int, dict] = {}
        for check in self.checks:
            entry = by_sample.setdefault(check.sample, {"sample": check.sample, "passed": True,
                                                        "worst_output": None, "ratio": 0.0})
            entry["passed"] = entry["passed"] and check.passed
            r = ratio(check)
            if entry["worst_output"] is None or r > entry["ratio"]:
                entry["worst_output"], entry["ratio"] = check.output, r
        return [by_sample[i] for i in sorted(by_sample)]

    def to_dict(self) -> dict:
        return {"candidate": self.candidate, "passed": self.passed, "k": self.k, "atol": self.atol,
                "baseline": self.baseline, "outputs": [asdict(c) for c in self.worst],
                "failures": [asdict(c) for c in self.failures],
                "samples": self.samples(),
                "checks": [{"sample": c.sample, "output": c.output, "rmse": c.rmse, "baseline_rmse": c.baseline_rmse,
                            "allowed_rmse": c.allowed_rmse, "passed": c.passed} for c in self.checks],
                "grid": self.grid, "locate": self.locate}


def ratio(check: OutputCheck) -> float:
    """How much of its allowance a check used (> 1 fails); inf for NaN/Inf or a shape mismatch."""
    if not check.passed and check.reason and "rmse" not in check.reason:
        return math.inf
    return check.rmse / check.allowed_rmse if check.allowed_rmse > 0 else (0.0 if check.rmse == 0 else math.inf)


def exit_code(statuses: Iterable[str], allow_drift: bool = False) -> int:
    """The run's exit code from its candidates' statuses: 3 if numerics failed (0 with ``allow_drift``, unless a
    target failed too), else 4 if a target failed, else 0."""
    seen = set(statuses)
    if NUMERICS_FAILED in seen and not allow_drift:
        return EXIT_NUMERICS
    if FAILED in seen:
        return EXIT_TARGET
    return EXIT_OK


def passed(statuses: Iterable[str]) -> bool:
    """A run passes when every candidate is ok or was skipped (a skipped target does not fail a run)."""
    return all(status in (OK, SKIPPED) for status in statuses)


def problem_lines(rows: Iterable[tuple[str, str, str | None]]) -> list[str]:
    """One line per failed candidate, ``(name, status, error)`` rows: numerics failures first, then the rest."""
    rows = list(rows)
    return ([f"{name}: numerics failed: {error}" for name, status, error in rows if status == NUMERICS_FAILED]
            + [f"{name}: {error}" for name, status, error in rows if status == FAILED])


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
    proofs: dict[str, Any] = field(default_factory=dict)  # proofs beyond the outputs' (weights: numerics/weights.py)

    def fail(self, status: str, error: str) -> None:
        self.status = status
        self.error = error

    @property
    def sha256(self) -> str | None:
        return self.files[0]["sha256"] if self.files else None

    @property
    def size_bytes(self) -> int | None:
        return sum(f["bytes"] for f in self.files) if self.files else None
