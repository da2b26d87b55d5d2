"""SIGINT and SIGTERM during export or compile: a prompt stop, the signal's exit code, nothing that looks done."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from exporter import api, forkserver, interrupts
from exporter.errors import Interrupted
from exporter.outdir import OutputFolder
from exporter.progress import Progress

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


def start(args, cwd):
    return subprocess.Popen([sys.executable, "-m", "exporter", *args], cwd=cwd, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)


def wait_for(process, fragment: str, timeout: float = 300) -> list[str]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        seen.append(line)
        if fragment in line:
            return seen
    raise AssertionError(f"never saw {fragment!r}; stderr: {''.join(seen)[-2000:]}")


@pytest.mark.parametrize("signum, code, stage", [(signal.SIGTERM, 143, "build aoti"),
                                                 (signal.SIGINT, 130, "torch.export"),
                                                 (signal.SIGTERM, 143, "validate numerics"),
                                                 (signal.SIGTERM, 143, "shape grid")])
def test_stop_promptly_and_leave_no_manifest(tiny_models, tmp_path, signum, code, stage):
    out = tmp_path / "out"
    # past the build stages the AOTInductor package (a long CPU compile) is left out: it is not what is tested
    targets = [] if stage in ("build aoti", "torch.export") else ["-t", "exported_program", "-t", "onnx"]
    process = start(["convert", str(tiny_models["gpt2"]), "--out", str(out), *targets], cwd=tmp_path)
    wait_for(process, stage)
    time.sleep(0.5)
    children = psutil.Process(process.pid).children(recursive=True)
    sent = time.monotonic()
    process.send_signal(signum)
    rest = process.stderr.read()
    process.wait(timeout=60)
    elapsed = time.monotonic() - sent
    assert process.returncode == code, rest[-2000:]
    assert elapsed < 10, f"took {elapsed:.1f} s to stop"
    assert f"interrupted by {signal.Signals(signum).name}" in rest
    assert "Traceback" not in rest
    assert not out.exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    assert not list(tmp_path.rglob("manifest.json"))
    time.sleep(1)
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(c.cmdline()[:4]) for c in alive]


def test_sigterm_is_not_swallowed_by_a_broad_except():
    """Stages catch ``Exception`` to fail one target or one grid point; SIGTERM must pass through them all
    (it once landed in the shape grid, was recorded as a failing grid point, and the run finished)."""
    with pytest.raises(Interrupted) as caught:
        with interrupts.watch():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
            except Exception:  # what a stage's failure handling does
                pass
            raise AssertionError("the run went on after SIGTERM")
    assert caught.value.exit_code == 143


class _RaisesInFinalizer:
    """Python discards an exception raised in ``__del__`` ("Exception ignored in ..."): where a signal
    that lands there goes."""

    def __init__(self, signum: int):
        self.signum = signum

    def __del__(self):
        os.kill(os.getpid(), self.signum)
        time.sleep(0.2)


def test_a_discarded_signal_still_stops_the_block():
    with pytest.raises(Interrupted) as caught:
        with interrupts.watch():
            _RaisesInFinalizer(signal.SIGINT)
            assert interrupts.received() == signal.SIGINT
    assert caught.value.exit_code == 130
    assert interrupts.received() == signal.SIGINT  # until the next run starts watching


class SignalAt(Progress):
    """Delivers ``signum`` to this process as the stage ``at`` begins; ``discarded``: inside a ``__del__``."""

    def __init__(self, at: str, signum: int, discarded: bool):
        super().__init__(enabled=False)
        self.at, self.signum, self.discarded = at, signum, discarded
        self.delivered = False

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = ""):
        with super().stage(name, detail):
            if name == self.at:
                self.delivered = True
                if self.discarded:
                    _RaisesInFinalizer(self.signum)
                else:
                    os.kill(os.getpid(), self.signum)
                    time.sleep(5)
            yield


MOMENTS = ["load", "inputs", "reference", "rewrite attention", "torch.export", "build exported_program",
           "build onnx", "validate numerics", "shape grid", "benchmark", "attention kernels"]


def _assert_nothing_left(tmp_path, out):
    assert not out.exists()
    assert not list(tmp_path.glob(".out.partial-*"))
    assert not list(tmp_path.rglob("manifest.json"))
    time.sleep(0.5)
    alive = [c for c in psutil.Process().children(recursive=True)
             if c.status() != psutil.STATUS_ZOMBIE and c.pid not in forkserver.server_pids()]  # the idle server stays
    assert not alive, [" ".join(c.cmdline()[:4]) for c in alive]


@pytest.mark.parametrize("at", MOMENTS)
@pytest.mark.parametrize("signum, discarded", [(signal.SIGTERM, False), (signal.SIGINT, True)],
                         ids=["SIGTERM", "SIGINT-discarded"])
def test_every_stage_stops_on_a_signal(tiny_models, tmp_path, at, signum, discarded):
    """At every stage, raised or discarded where it landed, a signal ends the run with 128+signum and
    nothing published."""
    out = tmp_path / "out"
    progress = SignalAt(at, signum, discarded)
    with pytest.raises(Interrupted) as caught:
        api.convert(tiny_models["gpt2"], "cpu-fp32", out, progress=progress, targets=("exported_program", "onnx"))
    assert progress.delivered, f"the run never reached {at!r}"
    assert caught.value.exit_code == 128 + signum
    _assert_nothing_left(tmp_path, out)


def test_a_signal_during_publish_publishes_nothing(tiny_models, tmp_path, monkeypatch):
    out = tmp_path / "out"
    publish = OutputFolder.publish

    def signalled_publish(self):
        _RaisesInFinalizer(signal.SIGTERM)
        return publish(self)

    monkeypatch.setattr(OutputFolder, "publish", signalled_publish)
    with pytest.raises(Interrupted) as caught:
        api.convert(tiny_models["gpt2"], "cpu-fp32", out, targets=("exported_program",))
    assert caught.value.exit_code == 143
    _assert_nothing_left(tmp_path, out)


def test_a_signal_discarded_in_a_finalizer_prints_no_traceback(capsys):
    import sys

    hook = sys.unraisablehook
    with pytest.raises(Interrupted):
        with interrupts.watch():
            _RaisesInFinalizer(signal.SIGTERM)
    assert "Traceback" not in capsys.readouterr().err
    assert sys.unraisablehook is hook  # restored


def test_a_library_logging_the_stop_prints_nothing_until_the_block_ends(capsys):
    """torch's fake tensors log the exception a stop raised inside a meta kernel, with its traceback (seen once in
    the torch.export stage): from the signal to the end of the watched block no log record is printed; after it,
    logging works again."""
    import logging

    log = logging.getLogger("tests.library")
    log.addHandler(handler := logging.StreamHandler())
    try:
        with pytest.raises(Interrupted):
            with interrupts.watch():
                log.error("before the stop")
                try:
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(5)
                except BaseException:
                    log.exception("failed while attempting to run meta for aten.mm")  # what the library does
                    raise
        err = capsys.readouterr().err
        assert "before the stop" in err and "failed while attempting" not in err and "Traceback" not in err
        log.error("after the block")
        assert "after the block" in capsys.readouterr().err
    finally:
        log.removeHandler(handler)
