"""``exporter check --junit``: one JUnit case per artifact and check (loads, numerics, shape grid, and each proof:
weights), from the report, so a CI system shows which artifact failed which check."""

from __future__ import annotations

from typing import Any

from ..junit import Case
from ..results import FAILED, NUMERICS_FAILED, OK


def junit_cases(report: dict[str, Any]) -> list[Case]:
    cases = []
    for entry in report["artifacts"]:
        classname = f"exporter.check.{entry['name']}"
        numerics = entry.get("numerics") or {}
        loaded = not (entry["status"] == FAILED and numerics.get("passed") is None)
        cases.append(Case(classname, "loads", loaded, "" if loaded else entry.get("error") or "",
                          entry.get("load_s") or 0.0))
        if not loaded:
            cases.append(Case(classname, "numerics", None, "not run: the artifact did not load"))
            continue
        failures = numerics.get("failures") or []
        samples_passed = not failures
        message = entry.get("error") or "" if not samples_passed else \
            f"{len(numerics.get('checks') or [])} output checks within their bars"
        cases.append(Case(classname, "numerics", samples_passed, message))
        grid = numerics.get("grid") or {}
        if grid.get("checked"):
            failed = [p for p in grid.get("points", []) if p.get("passed") is False]
            cases.append(Case(classname, "shape grid", not failed,
                              f"{len(failed)} of {len(grid['points'])} points failed" if failed
                              else f"{len(grid['points'])} points passed"))
        else:
            cases.append(Case(classname, "shape grid", None, grid.get("reason") or "not checked"))
        for proof, found in (entry.get("proofs") or {}).items():
            cases.append(Case(classname, proof, found.get("passed"), found.get("summary") or ""))
        if entry["status"] not in (OK, NUMERICS_FAILED, FAILED):
            cases.append(Case(classname, "status", None, entry["status"]))
    return cases


__all__ = ["junit_cases"]
