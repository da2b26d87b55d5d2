"""Child-process runners: a crash while loading or running fails one variant, with the signal named; children
started ahead of need (spares) are taken in turn, replaced while more are expected, and stopped at the end."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from exporter.errors import RunnerFailed
from exporter.runners import RemoteRunner, Spares
from exporter.targets.spec import RunnerSpec

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
# target list there (the library has no plugin path; this is the one place a test reaches into it). The test's
# own process is left as it is: only the children's environment names the folder.
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
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
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


def test_two_variants_of_one_artifact_share_one_process(loaders):
    """aoti:cuda-graph is loaded into aoti's process: one process per artifact kind. Each is spoken to on its
    own, in any order, and the process ends with its host."""
    first = RemoteRunner(spec("doubling"), wait=False)
    second = RemoteRunner(RunnerSpec("graphed", "doubling", "cpu", "float32"), host=first, wait=False)
    try:
        assert second.process is first.process
        second.ready()  # the host's answer comes first on the line: it is read and kept for the host
        first.ready()
        x = torch.arange(3.0)
        for runner in (first, second, first):
            assert torch.equal(runner.run([[x]])[0][0], x * 2)
        events = list(second.begin_stream([x]))
        assert events[0][0] == "outputs" and torch.equal(events[1][2], x * 2)
        second.set_bench_input([x])
        assert len(second.bench(3)) == 3
        second.close()
        assert first.process.poll() is None  # the hosted variant leaves the process to its host
    finally:
        first.close()
    assert first.process.poll() is not None


def test_a_variant_whose_host_cannot_load_fails_with_the_hosts_reason(loaders):
    first = RemoteRunner(spec("raises_on_load"), wait=False)
    second = RemoteRunner(RunnerSpec("graphed", "doubling", "cpu", "float32"), host=first, wait=False)
    with pytest.raises(RunnerFailed, match="could not load raises_on_load.*cannot open the artifact"):
        second.ready()
    with pytest.raises(RunnerFailed, match="cannot open the artifact"):
        first.ready()
    first.close()


def test_the_host_is_used_before_its_guest_has_been_waited_for(loaders):
    """The guest's load was asked for before the host's first request: its answer comes first on the line and
    is read (and kept for the guest) before the request's."""
    first = RemoteRunner(spec("doubling"), wait=False)
    second = RemoteRunner(RunnerSpec("graphed", "doubling", "cpu", "float32"), host=first, wait=False)
    try:
        first.ready()
        x = torch.ones(2)
        assert torch.equal(first.run([[x]])[0][0], x * 2)
        assert second.load_s is not None  # read on the way
        assert torch.equal(second.ready().run([[x]])[0][0], x * 2)
    finally:
        second.close()
        first.close()


def test_spares_wait_ahead_are_taken_and_replaced_while_more_are_expected(loaders, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    spares = Spares(expected=2, log_path=lambda name: logs / f"{name}.log", keep=1)
    runners = []
    try:
        assert len(spares.waiting) == 1
        first = spares.waiting[0][0]
        runners.append(RemoteRunner(spec("doubling"), log=logs / "first.log", spares=spares))
        assert runners[0].process is first
        # the spare's output file became the variant's: the open file followed the rename
        assert runners[0].log == logs / "first.log" and (logs / "first.log").exists()
        assert not (logs / "spare-1.log").exists()
        assert torch.equal(runners[0].run([[torch.ones(3)]])[0][0], torch.full((3,), 2.0))
        assert len(spares.waiting) == 1  # one more is expected: a new spare waits
        second = spares.waiting[0][0]
        runners.append(RemoteRunner(spec("doubling"), log=logs / "second.log", spares=spares))
        assert runners[1].process is second and spares.waiting == []  # none expected after it
        third = RemoteRunner(spec("doubling"), spares=spares)  # none waits: a child of its own
        runners.append(third)
        assert third.process not in (first, second)
        assert torch.equal(third.run([[torch.ones(1)]])[0][0], torch.full((1,), 2.0))
    finally:
        for runner in runners:
            runner.close()
        spares.close()
    assert all(r.process.poll() is not None for r in runners)


def test_a_child_with_its_own_environment_or_a_dead_spare_is_not_taken(loaders, tmp_path):
    spares = Spares(expected=3, log_path=lambda name: tmp_path / f"{name}.log", keep=1)
    waiting = spares.waiting[0][0]
    preloaded = RemoteRunner(RunnerSpec("doubling", "doubling", "cpu", "float32",
                                        options=(("ld_preload", "libm.so.6"),)), spares=spares)
    try:
        assert preloaded.process is not waiting and spares.waiting[0][0] is waiting  # LD_PRELOAD: a fresh child
        waiting.kill()
        waiting.wait(5)
        runner = RemoteRunner(spec("doubling"), spares=spares)  # the dead spare is passed over
        assert runner.process is not waiting
        assert torch.equal(runner.run([[torch.ones(2)]])[0][0], torch.full((2,), 2.0))
        runner.close()
    finally:
        preloaded.close()
        left = [p for p, _, _ in spares.waiting]
        spares.close()
    assert all(p.poll() is not None for p in left) and spares.waiting == []
    assert not list(tmp_path.glob("spare-*.log"))  # a stopped spare's empty output file is not left behind


def test_a_run_expects_one_spare_per_target_a_spare_can_serve(tmp_path):
    import onnxruntime

    from exporter.recipe import load_recipe
    from exporter.targets.build import spare_children

    def expected(name: str) -> int:
        return spare_children(load_recipe(name).build_settings())

    assert expected("cpu-fp32") == 2  # exported program and ONNX; AOTInductor's child may need its own LD_PRELOAD
    cuda_onnx = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    # h100-bf16: exported program and one compile mode, plus ONNX only where onnxruntime can run it on the GPU
    assert expected("h100-bf16") == 2 + cuda_onnx
