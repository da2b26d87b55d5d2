"""Host memory: converting a >= 1 GB checkpoint keeps the convert process's peak RSS within
1.3 x the checkpoint + 768 MiB (the interpreter, torch and exporter themselves; see docs/errors.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

FIXED_OVERHEAD = 768 * 2**20
FACTOR = 1.3

FACTORY = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Deep(nn.Module):
        """16 blocks of a 4096x4096 linear layer: 1.07 GB of float32 weights."""

        def __init__(self, width=4096, depth=16):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width))
                                        for _ in range(depth))

        def forward(self, x):
            for block in self.blocks:
                x = x + torch.tanh(block(x))
            return x

    def build(config=None):
        return Deep()
''')

RECIPE = """schema_version = 1
[targets]
build = ["exported_program"]
[inputs]
samples = 1
[inputs.dims]
batch = 2
[[inputs.tensor]]
name = "x"
shape = ["batch", 4096]
[bench]
warmup = 0
rounds = 1
iterations = 2
"""


def test_convert_peak_rss_of_a_1gb_checkpoint(tmp_path, capsys):
    (tmp_path / "deep_factory.py").write_text(FACTORY)
    (tmp_path / "deep.toml").write_text(RECIPE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    subprocess.run([sys.executable, "-c", "import torch, deep_factory; from safetensors.torch import save_model; "
                    "torch.manual_seed(0); save_model(deep_factory.build(), 'deep.safetensors')"],
                   cwd=tmp_path, env=env, check=True)
    size = (tmp_path / "deep.safetensors").stat().st_size
    assert size >= 10**9
    result = subprocess.run([sys.executable, "-m", "exporter", "convert", "deep.safetensors", "--model",
                             "deep_factory:build", "--recipe", "deep.toml", "--out", "out", "--quiet"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    peak = report["memory"]["convert_peak_rss_bytes"]
    limit = FACTOR * size + FIXED_OVERHEAD
    with capsys.disabled():
        print(f"\ncheckpoint {size / 2**30:.2f} GiB; convert peak RSS {peak / 2**30:.2f} GiB "
              f"({peak / size:.2f}x); limit {limit / 2**30:.2f} GiB")
    assert peak <= limit
    assert report["reference"]["dtype"] == "float64" and report["passed"]
    assert report["run"]["command"] == ["exporter", "convert", "deep.safetensors", "--recipe", "deep.toml", "--out",
                                        "out", "--model", "deep_factory:build", "--quiet"]  # as it can be typed again
    tree = report["memory"]["tree"]  # the whole process tree, sampled: the convert process and its children
    assert tree["processes_seen"] >= 2 and tree["samples"] > 0
    assert tree["tree_peak_pss_bytes"] >= min(p["peak_pss_bytes"] for p in tree["largest_processes"])
    with capsys.disabled():
        print(f"process tree peak {tree['tree_peak_pss_bytes'] / 2**30:.2f} GiB PSS, "
              f"{tree['tree_peak_rss_bytes'] / 2**30:.2f} GiB RSS")


def test_each_memory_sample_counts_toward_the_stage_under_way():
    import time

    from exporter.measure.memory import TreeMemory
    from exporter.progress import Progress

    progress = Progress(enabled=False)
    with TreeMemory(interval_s=0.02, stage=lambda: progress.current) as tree:
        with progress.stage("small"):
            time.sleep(0.2)
        with progress.stage("big"):
            block = bytearray(300 * 2**20)
            for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
                block[i] = 1
            time.sleep(0.3)
        del block
    stages = {e["stage"]: e for e in tree.to_dict()["stages"]}
    assert list(stages)[:2] == ["small", "big"] or list(stages)[1:3] == ["small", "big"]  # in the order they came
    assert stages["big"]["root_peak_rss_bytes"] > stages["small"]["root_peak_rss_bytes"] + 250 * 2**20
    # every sample belongs to one stage (or to "between stages"): the tree's peak is one stage's peak
    assert max(e["tree_peak_pss_bytes"] for e in stages.values()) == tree.peak_pss
