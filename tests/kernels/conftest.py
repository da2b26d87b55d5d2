"""The kernels' tests run their Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``), in a process
of their own with Triton on its path: scripts/test.sh installs Triton into ``.triton/``, apart from the suite's
environment, whose CPU torch has none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON = ROOT / ".triton"


@pytest.fixture
def interpreted() -> Callable[..., Any]:
    """``interpreted(script, *args)``: the script's last line of output, read as JSON."""
    if not (TRITON / "triton").is_dir():
        pytest.skip("Triton is not installed in .triton/ (scripts/test.sh installs it)")

    def run(script: str, *args: str) -> Any:
        env = {**os.environ, "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(TRITON), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run
