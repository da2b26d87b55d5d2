"""``exporter convert`` under its supervising parent: a convert that dies outright (SIGBUS from a checkpoint
truncated under it, SIGKILL from the out-of-memory killer) is told in one line with a documented exit code, and
leaves no staging folder; one that ends normally passes its output and exit code through."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from exporter.supervisor import Heard, explain

pytestmark = pytest.mark.slow

QUICK = 'schema_version = 1\n[targets]\nbuild = ["exported_program"]\n[bench]\nwarmup = 0\nrounds = 1\niterations = 1\n'


def start(checkpoint, out, cwd):
    recipe = cwd / "quick.toml"
    recipe.write_text(QUICK)
    return subprocess.Popen([sys.executable, "-m", "exporter", "convert", str(checkpoint), "--recipe", str(recipe),
                             "--out", str(out)], cwd=cwd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def wait_for(process, fragment: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        if fragment in line:
            return
    raise AssertionError(f"never saw {fragment!r}")


def the_convert(parent: subprocess.Popen) -> psutil.Process:
    """The supervised convert: the parent's child running ``-m exporter convert``."""
    for child in psutil.Process(parent.pid).children():
        if "convert" in child.cmdline():
            return child
    raise AssertionError("no supervised convert process")


def leftovers(out):
    return [p.name for p in out.parent.glob(f".{out.name}.partial-*")]


def test_a_convert_killed_by_the_oom_killer_is_told_and_leaves_nothing(tiny_models, tmp_path):
    out = tmp_path / "out"
    process = start(tiny_models["gpt2"], out, tmp_path)
    wait_for(process, "validate numerics")
    the_convert(process).send_signal(signal.SIGKILL)
    rest = process.stderr.read()
    process.wait(timeout=60)
    assert process.returncode == 5, rest[-2000:]
    errors = [ln for ln in rest.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "killed (SIGKILL)" in errors[0] and "out-of-memory" in errors[0], rest[-2000:]
    assert "during validate numerics" in errors[0] and "Fix:" in errors[0]
    assert not out.exists() and leftovers(out) == []


def test_a_checkpoint_truncated_under_the_convert_is_told(tiny_models, tmp_path):
    """A sync writing over the memory-mapped weights: the convert dies with SIGBUS; the parent says why."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_models["gpt2"], checkpoint)
    out = tmp_path / "out"
    process = start(checkpoint, out, tmp_path)
    wait_for(process, "build exported_program")
    (checkpoint / "model.safetensors").write_bytes(b"")  # truncated in place
    rest = process.stderr.read()
    process.wait(timeout=120)
    errors = [ln for ln in rest.splitlines() if ln.startswith("error:")]
    assert process.returncode == 2, rest[-2000:]
    assert len(errors) == 1 and "the checkpoint changed while it was being read" in errors[0], rest[-2000:]
    assert not out.exists() and leftovers(out) == []


def test_a_checkpoint_overwritten_in_place_is_refused_before_publishing(tiny_models, tmp_path):
    """Bytes rewritten without a size change (no SIGBUS): the reference and the artifacts may come from different
    weights, so nothing is published."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_models["gpt2"], checkpoint)
    out = tmp_path / "out"
    process = start(checkpoint, out, tmp_path)
    wait_for(process, "validate numerics")
    weights = checkpoint / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.seek(weights.stat().st_size - 64)
        handle.write(b"\0" * 64)
    rest = process.stderr.read()
    process.wait(timeout=300)
    errors = [ln for ln in rest.splitlines() if ln.startswith("error:")]
    assert process.returncode == 2 and len(errors) == 1, rest[-2000:]
    assert "the checkpoint changed while it was being read" in errors[0] and "nothing was published" in errors[0]
    assert not out.exists() and leftovers(out) == []


def test_the_next_run_removes_what_a_dead_run_left(tiny_models, tmp_path):
    """A staging folder of a run killed before anyone could clean (the parent killed too) is removed by the next
    run into that folder, under its lock."""
    out = tmp_path / "out"
    stale = tmp_path / ".out.partial-deadbeef"
    stale.mkdir()
    (stale / "model.pt2").write_bytes(b"half")
    process = start(tiny_models["gpt2"], out, tmp_path)
    process.communicate(timeout=600)
    assert process.returncode == 0
    assert not stale.exists() and (out / "manifest.json").is_file()


def test_explain_names_what_happened(tmp_path):
    changed = tmp_path / "model.safetensors"
    changed.write_bytes(b"12345678")
    heard = Heard(stage="reference", checkpoint={str(changed): (1, 1)})
    message, code = explain(-signal.SIGBUS, heard)
    assert code == 2 and "the checkpoint changed while it was being read" in message and "during reference" in message
    message, code = explain(-signal.SIGSEGV, Heard(stage="build aoti"))
    assert code == 1 and "crashed with SIGSEGV during build aoti" in message


def test_the_parent_hears_a_stage_before_its_line_shows(monkeypatch):
    """Whoever acts on a stage's line (a kill at 'validate numerics') finds the parent already told: the stage is
    written to the pipe before the line is printed, and the enclosing stage is told again when an inner one ends."""
    import os

    from exporter import interrupts
    from exporter.progress import Progress
    from exporter.supervisor import ENV

    monkeypatch.setattr(interrupts, "_received", None)  # a signal an earlier test sent stays recorded until a watch
    read_fd, write_fd = os.pipe()
    monkeypatch.setenv(ENV, str(write_fd))
    heard_at_print: list[str] = []

    class Console:
        is_terminal = False

        def print(self, text):
            os.set_blocking(read_fd, False)
            try:
                chunk = os.read(read_fd, 65536).decode()
            except BlockingIOError:
                chunk = ""
            for line in chunk.splitlines():
                heard.hear(line)
            heard_at_print.append(f"{text} | {heard.stage}")

    heard = Heard()
    progress = Progress(console=Console())
    with progress.stage("validate numerics"):
        with progress.stage("shape grid"):
            pass
        progress.info("after the grid")
    os.close(write_fd)
    os.close(read_fd)
    assert heard_at_print[0] == "validate numerics ... | validate numerics"
    assert heard_at_print[1] == "shape grid ... | shape grid"
    assert heard_at_print[3] == "  after the grid | validate numerics", heard_at_print
