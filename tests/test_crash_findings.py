"""A crash is a finding: a target whose process is killed at any stage fails that target alone, with the
signal named, and the run still judges, times and reports every other target (exit 4, report published)."""

from __future__ import annotations

import contextlib
import os
import signal

import psutil
import pytest

import exporter
from exporter.progress import Progress

pytestmark = pytest.mark.slow


def kill_the_child_of(variant: str) -> int:
    """SIGKILL the child process that runs ``variant`` (its output goes to logs/<variant>.log); its pid."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if any(f.path.endswith(f"/logs/{variant}.log") for f in child.open_files()):
                os.kill(child.pid, signal.SIGKILL)
                return child.pid
    raise AssertionError(f"no child process runs {variant}")


class KillAt(Progress):
    """Kills ``variant``'s child as stage ``at`` begins (the kernel's OOM killer picking it, say)."""

    def __init__(self, at: str, variant: str):
        super().__init__(enabled=False)
        self.at, self.variant, self.killed = at, variant, None

    @contextlib.contextmanager
    def stage(self, name: str, detail: str = ""):
        if name == self.at and self.killed is None:
            self.killed = kill_the_child_of(self.variant)
        with super().stage(name, detail):
            yield


@pytest.mark.parametrize("stage", ["build onnx", "validate numerics", "shape grid", "benchmark",
                                   "attention kernels"])
def test_a_child_killed_at_any_stage_fails_its_own_target_only(tiny_models, tmp_path, stage):
    progress = KillAt(stage, "exported_program")
    # the AOTInductor package (minutes of compile on this CPU) is one of the survivors at one stage only
    others = ("aoti", "onnx") if stage == "benchmark" else ("onnx",)
    result = exporter.convert(tiny_models["llama"], "cpu-fp32", tmp_path / "out", progress=progress,
                              targets=("exported_program", *others))
    assert progress.killed is not None
    report = result.report
    status = {a["name"]: a for a in report["artifacts"]}
    assert status["exported_program"]["status"] == "failed", status["exported_program"]
    assert "SIGKILL" in status["exported_program"]["error"]
    for name in others:  # the others are judged and timed as if nothing happened
        assert status[name]["status"] == "ok", status[name]["error"]
        assert status[name]["numerics"]["passed"] and status[name]["bench"]["median_ms"] > 0
    assert report["rewritten"]["status"] == "ok"
    assert result.exit_code == 4 and not report["passed"]
    assert any(p.startswith("exported_program:") for p in report["problems"])
    assert (result.out / "manifest.json").is_file()


def test_a_generation_session_killed_fails_its_target_only(tiny_models, tmp_path):
    """The ONNX programs' session process is killed while judged and timed: that target fails, the others pass."""

    class KillSession(Progress):
        def __init__(self):
            super().__init__(enabled=False)
            self.killed = None

        @contextlib.contextmanager
        def stage(self, name: str, detail: str = ""):
            with super().stage(name, detail):
                if name == "validate and time onnx":
                    import threading
                    import time

                    def later():
                        for _ in range(600):
                            try:
                                self.killed = kill_the_child_of("onnx")
                                return
                            except AssertionError:
                                time.sleep(0.05)

                    threading.Thread(target=later, daemon=True).start()
                yield

    progress = KillSession()
    result = exporter.convert(tiny_models["llama"], "cpu-fp32", tmp_path / "out", task="text-generation",
                              targets=("exported_program", "onnx"), progress=progress)
    assert progress.killed is not None
    status = {a["name"]: a for a in result.report["artifacts"]}
    assert status["onnx"]["status"] == "failed" and "SIGKILL" in status["onnx"]["error"]
    assert status["exported_program"]["status"] == "ok"
    assert result.exit_code == 4 and (result.out / "manifest.json").is_file()


@pytest.fixture(scope="module")
def roberta(tmp_path_factory):
    """RoBERTa's positions start after its padding index: 258 position embeddings take 256 tokens."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=258)
    folder = tmp_path_factory.mktemp("roberta") / "roberta"
    transformers.RobertaModel(config).save_pretrained(folder)
    return folder


def test_the_grid_stays_inside_the_positions_a_model_takes(roberta, tmp_path):
    result = exporter.convert(roberta, "cpu-fp32", tmp_path / "out", targets=("exported_program", "aoti"))
    assert result.exit_code == 0, result.problems
    notes = result.report["inputs"]["notes"]
    assert any("narrowed to 256" in n and "padding index" in n for n in notes), notes


def test_an_artifact_that_crashes_at_a_grid_point_fails_with_the_reason(roberta, tmp_path):
    """Declared past the positions by hand: the AOTI package aborts at that point (its process is gone), which
    fails that target with the native error's own words; the exported program only raises there, and goes on."""
    result = exporter.convert(roberta, "cpu-fp32", tmp_path / "out", targets=("exported_program", "aoti"),
                              dims=("batch=2:1:4", "sequence=32:2:300"),
                              tensors=("input_ids:int64:batch,sequence:0:512",))
    aoti = next(a for a in result.report["artifacts"] if a["name"] == "aoti")
    assert aoti["status"] == "failed" and "SIGABRT" in aoti["error"] and "index out of bounds" in aoti["error"]
    assert "sequence=300" in aoti["error"]
    assert result.exit_code == 4 and (result.out / "manifest.json").is_file()
    assert any("original model fails" in w for w in result.report["warnings"])
