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
    noisy = speedup(timing(10.0, 0.9), timing(2.5, 0.02, seed=1))  # the baseline all over the place
    assert noisy["speedup_vs_eager"] > 2 and not noisy["speedup_supported"]
    tie = speedup(timing(10.0, 0.05), timing(9.8, 0.05, seed=1))  # which is faster cannot be told
    assert tie["speedup_range"][0] < 1.0 < tie["speedup_range"][1] and not tie["speedup_supported"]


def test_the_table_marks_an_unsupported_speedup():
    from exporter.report.markdown import _noise, _speedup

    bench = {**timing(2.5, 0.02), **speedup(timing(10.0, 0.9), timing(2.5, 0.02))}
    assert _speedup(bench).endswith("⚠") and _noise(bench).endswith("%")
    bench.update(speedup(timing(10.0, 0.02), timing(2.5, 0.02)))
    assert not _speedup(bench).endswith("⚠")
