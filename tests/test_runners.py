"""Child-process runners: a crash while loading or running fails one variant, with the signal named."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from exporter.runners import RemoteRunner
from exporter.targets.spec import RunnerFailed, RunnerSpec

LOADERS = textwrap.dedent('''
    import ctypes, os, torch
    from exporter.targets.spec import Loaded

    def doubling(spec):
        return Loaded(lambda args: [a * 2 for a in args], "cpu", torch.float32, {"kind": "doubling"})

    def segfault_on_load(spec):
        ctypes.string_at(0)  # a real SIGSEGV, as a broken native library would cause

    def segfault_on_run(spec):
        def call(args):
            ctypes.string_at(0)
        return Loaded(call, "cpu", torch.float32)

    def raises_on_load(spec):
        raise RuntimeError("cannot open the artifact")

    def load(spec):
        return globals()[spec.target](spec)
''')

# The child process imports sitecustomize from its PYTHONPATH at start: it adds the test's targets to the
# target list there (the library has no plugin path; this is the one place a test reaches into it).
REGISTER = textwrap.dedent('''
    import exporter.targets as targets
    from exporter.targets.spec import Target

    targets.TARGETS = targets.TARGETS + tuple(
        Target(name, "crashing_loaders", "a test loader")
        for name in ("doubling", "segfault_on_load", "segfault_on_run", "raises_on_load"))
''')


@pytest.fixture
def loaders(tmp_path, monkeypatch):
    (tmp_path / "crashing_loaders.py").write_text(LOADERS)
    (tmp_path / "sitecustomize.py").write_text(REGISTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "crashing_loaders"


def spec(target: str) -> RunnerSpec:
    return RunnerSpec(name=target, target=target, device="cpu", dtype="float32")


def test_a_healthy_child_runs_and_times(loaders):
    runner = RemoteRunner(spec("doubling"))
    try:
        x = torch.arange(4.0)
        assert torch.equal(runner.run([[x]])[0][0], x * 2)
        runner.set_bench_input([x])
        times = runner.bench(5)
        assert len(times) == 5 and all(t > 0 for t in times)
        assert runner.info["kind"] == "doubling"
        assert runner.memory()["peak_memory_bytes"] > 0
    finally:
        runner.close()
    assert runner.process.poll() is not None


@pytest.mark.parametrize("loader, stage", [("segfault_on_load", "load"), ("raises_on_load", "load")])
def test_load_failures_become_reasons(loaders, loader, stage, tmp_path):
    log = tmp_path / "child.log"
    with pytest.raises(RunnerFailed) as info:
        RemoteRunner(spec(loader), log=log)
    reason = info.value.reason
    assert reason.startswith(stage)
    if "segfault" in loader:
        assert "SIGSEGV" in reason
    else:
        assert "cannot open the artifact" in reason


def test_segfault_while_running_is_caught(loaders):
    runner = RemoteRunner(spec("segfault_on_run"))
    with pytest.raises(RunnerFailed, match="crashed with SIGSEGV"):
        runner.run([[torch.zeros(2)]])
    runner.close()


def test_the_parent_survives(loaders):
    with pytest.raises(RunnerFailed):
        RemoteRunner(spec("segfault_on_load"))
    assert sys.modules["exporter.runners"] is not None  # still here, still running
