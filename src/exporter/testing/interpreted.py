"""A script run under Triton's interpreter (``TRITON_INTERPRET=1``) in a process of its own: how the tests judge the
Triton kernels on a machine without a GPU. Triton comes with PyTorch's CUDA builds only; ``scripts/test.sh``
installs it into the repository's ``.triton/``, apart from the suite's environment, and the script's process finds
it there first on its path. Without it the test is skipped, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
TRITON = ROOT / ".triton"


def run_interpreted(script: str, *args: str) -> Any:
    """The JSON on the last line ``script`` prints, run with ``args`` under Triton's interpreter."""
    import pytest  # noqa: PLC0415 - a test helper: pytest is there when it runs

    if not (TRITON / "triton").is_dir():
        pytest.skip("Triton is not installed in .triton/ (scripts/test.sh installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(TRITON), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
