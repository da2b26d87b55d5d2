"""What lets a convert scale: the ONNX decision on a GPU recipe, the benchmark's time cap, the process-tree
memory sampler, the fast AOTInductor loader, and comparisons that stream (tests/numerics/test_compare.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from exporter.measure.bench import interleaved
from exporter.measure.memory import TreeMemory
from exporter.targets.onnx import CPU_FALLBACK_BYTES, placement
from exporter.targets.spec import TargetSkipped


def test_onnx_on_a_gpu_recipe_without_a_cuda_provider_is_skipped_unless_float32_is_asked_for():
    with pytest.raises(TargetSkipped, match="no CUDA execution provider.*onnxruntime-gpu.*onnx_dtype"):
        placement("cuda", "bfloat16", "CPUExecutionProvider", "auto", 10**6)
    small = placement("cuda", "bfloat16", "CPUExecutionProvider", "float32", 10**6)
    assert (small.device, small.dtype, small.in_float32) == ("cpu", "float32", True)
    with pytest.raises(TargetSkipped, match="float32 copies of"):
        placement("cuda", "bfloat16", "CPUExecutionProvider", "float32", CPU_FALLBACK_BYTES // 4)
    gpu = placement("cuda", "bfloat16", "CUDAExecutionProvider", "auto", 10**10)
    assert (gpu.device, gpu.dtype, gpu.in_float32, gpu.notes) == ("cuda", "bfloat16", False, [])
    cpu = placement("cpu", "float32", "CPUExecutionProvider", "auto", 10**10)
    assert (cpu.device, cpu.dtype, cpu.in_float32) == ("cpu", "float32", False)


class Sleeper:
    def __init__(self, name: str, seconds: float):
        self.name, self.seconds, self.calls = name, seconds, 0

    def bench(self, count: int) -> list[float]:
        out = []
        for _ in range(count + 1):  # one untimed call first, as time_calls does
            time.sleep(self.seconds)
            self.calls += 1
        return [self.seconds * 1000.0] * count if count else out


def test_a_slow_variant_is_timed_for_about_max_seconds_and_a_fast_one_in_full():
    slow, fast = Sleeper("slow", 0.05), Sleeper("fast", 0.0)
    times = interleaved([slow, fast], warmup=10, rounds=4, iterations=20, on_error=lambda v, e: None,
                        settle_s=0.0, max_seconds=0.4)
    assert len(times["fast"]) == 4 * 20
    assert 4 <= len(times["slow"]) <= 8  # at least one call per round; about 0.3 s of timed calls
    assert slow.calls < 25  # warm-up shrank too (10 asked)


def test_the_tree_sampler_sees_a_child_and_its_memory():
    code = "import time; block = bytearray(300 * 2**20); block[::4096] = b'x' * len(block[::4096]); time.sleep(2)"
    with TreeMemory(interval_s=0.1) as tree:
        subprocess.run([sys.executable, "-c", code], check=True)
    data = tree.to_dict()
    assert data["processes_seen"] >= 2 and data["samples"] >= 5
    child = max((p for p in data["largest_processes"] if p["pid"] != data["largest_processes"][0]["pid"]),
                key=lambda p: p["peak_rss_bytes"], default=None)
    assert tree.peak_pss >= 300 * 2**20
    assert child is None or child["peak_rss_bytes"] >= 250 * 2**20 or data["largest_processes"][0][
        "peak_rss_bytes"] >= 300 * 2**20


@pytest.mark.slow
def test_the_aoti_loader_needs_no_compiler_and_gives_the_same_outputs(tmp_path):
    """The package loads through torch's own package loader directly: no vector-ISA probe (g++ and a
    Python process per instruction set), the outputs of torch's public loader's model."""
    import torch

    class Small(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x))), x.sum(dim=1)

    torch.manual_seed(0)
    model = Small().eval()
    x = torch.randn(3, 16)
    program = torch.export.export(model, (x,), strict=False)
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "m.aoti.pt2"))
    torch.save({"x": x, "y": [t.detach() for t in model(x)]}, tmp_path / "io.pt")
    code = textwrap.dedent(f"""
        import json, sys, time, torch
        from exporter.targets.aoti_loader import load_package
        io = torch.load({str(tmp_path / 'io.pt')!r})
        t0 = time.perf_counter()
        model = load_package({package!r})
        load_s = time.perf_counter() - t0
        out = model(io["x"])
        err = max(float((a - b).abs().max()) for a, b in zip(out, io["y"]))
        print(json.dumps({{"err": err, "load_s": load_s, "probed": "torch._inductor.cpu_vec_isa" in sys.modules}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["err"] < 1e-5 and not result["probed"], result
