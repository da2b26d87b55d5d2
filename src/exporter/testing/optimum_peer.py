"""Hugging Face Optimum as a test peer, in a virtual environment of its own.

``optimum-onnx`` pins ``transformers < 4.58`` and exporter runs on transformers 5, so Optimum never enters the
project's environment: :func:`optimum_cli` creates ``EXPORTER_OPTIMUM_VENV`` (default
``~/.cache/exporter/optimum-venv``) once, with the CPU build of torch first (so no CUDA build is pulled), then
``optimum-onnx`` and ``onnxruntime``, and returns its ``optimum-cli`` by path. Where it cannot be installed the
reason is returned instead, for a test to skip with.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TORCH = os.environ.get("EXPORTER_OPTIMUM_TORCH", "torch==2.13.0")
PACKAGES = ("optimum-onnx==0.1.0", "onnxruntime")


def venv_path() -> Path:
    return Path(os.environ.get("EXPORTER_OPTIMUM_VENV", Path.home() / ".cache" / "exporter" / "optimum-venv"))


def optimum_cli() -> tuple[Path | None, str]:
    """(the ``optimum-cli`` of Optimum's own environment, "") or (None, why it cannot be had)."""
    venv = venv_path()
    cli, python = venv / "bin" / "optimum-cli", venv / "bin" / "python"
    if cli.is_file() and (venv / ".complete").is_file():
        return cli, ""
    steps = [[sys.executable, "-m", "venv", "--clear", str(venv)],
             [str(python), "-m", "pip", "install", "-q", TORCH],
             [str(python), "-m", "pip", "install", "-q", *PACKAGES]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"Optimum's environment could not be made ({' '.join(step[-2:])}): {tail[0][:200]}"
    (venv / ".complete").write_text("ok\n")
    return cli, ""


def export(model: Path, out: Path, task: str) -> subprocess.CompletedProcess:
    """``optimum-cli export onnx --model MODEL --task TASK OUT``, in Optimum's own environment."""
    cli, why = optimum_cli()
    if cli is None:
        raise RuntimeError(why)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(cli), "export", "onnx", "--model", str(model), "--task", task, str(out)],
                          capture_output=True, text=True, check=False, env=env)


__all__ = ["optimum_cli", "export", "venv_path"]
