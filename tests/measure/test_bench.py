"""Timing you can trust: every variant's noise figure, and a speedup marked where the spread cannot support it."""

from __future__ import annotations

import random

from exporter.measure.bench import NOISY, Timing, speedup


def timing(median: float, spread: float, runs: int = 50, seed: int = 0, outliers: int = 0) -> dict:
    rng = random.Random(seed)
    times = [median * (1 + rng.uniform(-spread, spread)) for _ in range(runs)]
    times[:outliers] = [median * 73] * outliers
    return vars(Timing.of(times))


def test_noise_is_the_interquartile_range_over_the_median_and_ignores_rare_outliers():
    quiet = timing(10.0, 0.02, outliers=1)
    assert quiet["noise"] < NOISY and quiet["max_ms"] > 70 * quiet["median_ms"]
    noisy = timing(10.0, 0.6)
    assert noisy["noise"] > NOISY
    assert noisy["p25_ms"] < noisy["median_ms"] < noisy["p75_ms"]


def test_a_clear_speedup_is_supported_and_a_noisy_one_is_not():
    clear = speedup(timing(10.0, 0.02), timing(2.5, 0.02, seed=1))
    assert 3.8 < clear["speedup_vs_eager"] < 4.2 and clear["speedup_supported"]
    low, high = clear["speedup_range"]
    assert low < clear["speedup_vs_eager"] < high
    assert clear["speedup_precise"]
    # the baseline all over the place, yet slower in every pairing of the quartiles: which is faster is supported,
    # how much is not precise
    noisy = speedup(timing(10.0, 0.9), timing(2.5, 0.02, seed=1))
    assert noisy["speedup_vs_eager"] > 2 and noisy["speedup_range"][0] > 1
    assert noisy["speedup_supported"] and not noisy["speedup_precise"]
    tie = speedup(timing(10.0, 0.05), timing(9.8, 0.05, seed=1))  # which is faster cannot be told
    assert tie["speedup_range"][0] < 1.0 < tie["speedup_range"][1] and not tie["speedup_supported"]
    assert not tie["speedup_precise"]


def test_the_table_marks_an_unsupported_speedup():
    from exporter.report.markdown import _noise, _speedup

    bench = {**timing(9.8, 0.05), **speedup(timing(10.0, 0.05), timing(9.8, 0.05, seed=1))}  # a tie
    assert _speedup(bench).endswith("⚠") and _noise(bench).endswith("%")
    bench.update(speedup(timing(10.0, 0.02), timing(2.5, 0.02)))
    assert not _speedup(bench).endswith("⚠")
    bench.update(speedup(timing(10.0, 0.9), timing(2.5, 0.02)))  # faster in every pairing, by 2x to 6x: supported
    assert not _speedup(bench).endswith("⚠")


def test_an_artifact_slower_than_its_source_is_a_finding_with_the_ops_that_take_the_time():
    from exporter.measure.bench import slower_than_source
    from exporter.report.markdown import _slower_lines
    from exporter.results import VariantResult

    def variant(name, median, top):
        result = VariantResult(name if name == "rewritten" else "aoti", name, device="cuda", dtype="bfloat16")
        result.bench = timing(median, 0.02, seed=len(name))
        result.info["kernels"] = {"top": [{"name": n, "self_ms": 1.0, "share": s, "calls": 1} for n, s in top]}
        return result

    source = variant("rewritten", 11.6, [("cudnn_sdpa_fprop", 0.5), ("gemm", 0.4)])
    slow = variant("aoti", 13.7, [("triton_softmax", 0.45), ("gemm", 0.35)])
    fast = variant("exported_program", 9.0, [("gemm", 0.6)])
    elsewhere = variant("onnx", 30.0, [])
    elsewhere.device, elsewhere.dtype = "cpu", "float32"  # not comparable with the rewritten model
    lines = slower_than_source([source, slow, fast, elsewhere])
    (line,) = lines
    assert line.startswith("aoti is slower than the rewritten eager model it was built from (0.8")
    assert slow.bench["slower_than_rewritten"] and not fast.bench["slower_than_rewritten"]
    assert "speedup_vs_rewritten" not in elsewhere.bench and not elsewhere.notes
    (note,) = slow.notes
    assert "ms against 11." in note and "triton_softmax 45%" in note and "cudnn_sdpa_fprop 50%" in note
    report = {"artifacts": [{"name": v.name, "bench": v.bench} for v in (slow, fast)]}
    assert "aoti (0.8" in _slower_lines(report)[0]
    tie = variant("aoti", 11.7, [])
    assert slower_than_source([source, tie]) == [] and not tie.notes  # within the noise: no finding
