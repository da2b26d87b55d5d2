"""Nothing left in the temporary folder: every AOTInductor load extracts its package there, and only the
loader's destructor removes it, which a child ending with os._exit (or killed) never runs; each child's own
temporary folder is removed once it has ended."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import exporter

pytestmark = pytest.mark.slow


def leftovers() -> set[str]:
    temp = Path(tempfile.gettempdir())
    return {p.name for pattern in ("aotinductor_*", "exporter-child-*") for p in temp.glob(pattern)}


def test_a_convert_and_a_verify_leave_no_temporary_folder(tiny_models, tmp_path, monkeypatch):
    # a temporary folder of this test's own: other tests running beside it (pytest -n) use the shared one
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    before = leftovers()
    result = exporter.convert(tiny_models["gpt2"], "cpu-fp32", tmp_path / "out", targets=("exported_program", "aoti"))
    assert result.exit_code == 0, result.problems
    assert leftovers() - before == set()
    verified = subprocess.run([sys.executable, "-m", "exporter", "verify", str(result.out)], capture_output=True,
                              text=True, timeout=600)
    assert verified.returncode == 0, verified.stderr
    assert leftovers() - before == set()


def test_a_dead_parents_child_folders_are_swept(tmp_path):
    """A child folder whose parent process is gone (killed before it could remove it) goes with the next run."""
    from exporter import runners

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Path(tempfile.gettempdir()) / f"{runners.SCRATCH_PREFIX}{dead.pid}-leftover"
    stale.mkdir()
    (stale / "aotinductor_x").mkdir()
    runners._swept = False
    runners.sweep_scratch()
    assert not stale.exists()
