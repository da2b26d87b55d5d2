"""exporter.measure.launches: the kernels a decode step launches, counted from the profiler's device activities,
and how the generation report carries and renders them."""

from __future__ import annotations

import jsonschema
import torch

from exporter.measure import launches
from exporter.report.generation import _launches, report_schema

# as the profiler names them for the Llama-3.2-1B shape's program of batch 1 on an H100
# (docs/runs/h100-decode-probe-gemv.md), two steps' worth
EVENTS = [("_gemv_kernel", 130, 1907.6), ("_slice_kernel", 32, 127.4), ("_merge_kernel", 32, 49.2),
          ("triton_poi_fused_index_put_permute_split_with_sizes_view_4", 32, 34.4),
          ("Memcpy DtoD (Device -> Device)", 2, 3.0), ("Memset (Device)", 4, 1.0)]


def test_kernels_are_counted_a_step_and_a_layer_with_copies_apart():
    counted = launches.launches(EVENTS, calls=2, layers=16)
    assert counted["per_step"] == (130 + 32 + 32 + 32) / 2
    assert counted["per_layer"] == counted["per_step"] / 16
    assert counted["copies"] == 3  # a copy and two fills a step, not kernels
    assert abs(counted["device_ms"] - (1907.6 + 127.4 + 49.2 + 34.4) / 2 / 1e3) < 1e-12
    assert [k["name"] for k in counted["top"]][:2] == ["_gemv_kernel", "_slice_kernel"]
    assert counted["top"][0]["per_step"] == 65 and len(counted["top"]) == 4
    assert launches.launches(EVENTS, calls=2)["per_layer"] is None  # no layer count where none is known


def test_the_count_is_taken_on_cuda_only():
    if not torch.cuda.is_available():
        assert launches.count(lambda: torch.ones(4) * 2) is None  # nothing is launched on the CPU
        return
    x = torch.ones(1024, device="cuda")
    counted = launches.count(lambda: torch.mul(x, 2).add_(1))
    assert counted is not None and counted["per_step"] == 2 and counted["copies"] == 0


def test_the_report_carries_and_renders_the_count():
    counted = launches.launches(EVENTS, calls=2, layers=16)
    timing = {"batch": 1, "prompt": 8, "tokens": 4, "prefill": {"median_ms": 1.0}, "decode": {"median_ms": 1.2},
              "decode_best_ms": 1.1, "tokens_per_s": 900.0, "kernels": counted}
    validator = jsonschema.Draft202012Validator({"$defs": report_schema()["$defs"], "$ref": "#/$defs/timing"})
    validator.validate(timing)
    broken = {**timing, "kernels": {k: v for k, v in counted.items() if k != "per_step"}}
    assert list(validator.iter_errors(broken))
    line = _launches({"batch_1": timing})
    assert line is not None and "113 kernels (7.06 a layer)" in line and "_gemv_kernel ×65" in line
    assert _launches({"batch_1": {**timing, "kernels": None}}) is None  # a CPU run says nothing
