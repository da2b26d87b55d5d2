"""JUnit XML for CI systems: one testsuite, one testcase per checked thing (``exporter verify --junit FILE``)."""

from __future__ import annotations

import os
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from .errors import OutputError
from .outdir import write_atomic


@dataclass
class Case:
    classname: str  # e.g. "exporter.verify.onnx"
    name: str  # e.g. "sha256"
    passed: bool | None  # None: skipped
    message: str = ""
    seconds: float = 0.0


def render(suite: str, cases: list[Case], seconds: float) -> str:
    failures = sum(1 for c in cases if c.passed is False)
    skipped = sum(1 for c in cases if c.passed is None)
    root = ET.Element("testsuites", name=suite, tests=str(len(cases)), failures=str(failures), errors="0",
                      skipped=str(skipped), time=f"{seconds:.3f}")
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)), failures=str(failures), errors="0",
                         skipped=str(skipped), time=f"{seconds:.3f}")
    for case in cases:
        element = ET.SubElement(node, "testcase", classname=case.classname, name=case.name, time=f"{case.seconds:.3f}")
        if case.passed is False:
            failure = ET.SubElement(element, "failure", message=case.message, type="failure")
            failure.text = case.message
        elif case.passed is None:
            ET.SubElement(element, "skipped", message=case.message)
        elif case.message:
            ET.SubElement(element, "system-out").text = case.message
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def write(path: str | Path, suite: str, cases: list[Case], seconds: float) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the folder of the JUnit file {path}: {exc.strerror}",
                          "pass a writable --junit path") from None
    write_atomic(path, render(suite, cases, seconds))


def check_writable(path: str | Path) -> None:
    """Fail before any work when the JUnit file cannot be written."""
    path = Path(path)
    folder = path.parent if str(path.parent) else Path(".")
    existing = next((p for p in [folder, *folder.parents] if p.exists()), None)
    if path.is_dir() or existing is None or not existing.is_dir():
        raise OutputError(f"cannot write the JUnit file {path}", "pass a file path in a writable folder to --junit")
    if not os.access(existing, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise OutputError(f"cannot write the JUnit file {path}: permission denied", "pass a writable --junit path")
    try:  # permissions do not tell everything (a read-only or virtual file system, as root): try a file there
        fd, probe = tempfile.mkstemp(prefix=".junit-probe.", suffix=".tmp", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputError(f"cannot write the JUnit file {path}: {exc.strerror or type(exc).__name__}",
                          "pass a writable --junit path") from None


__all__ = ["Case", "render", "write", "check_writable"]
