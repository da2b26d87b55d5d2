"""The shape grid: every artifact with dynamic dims is checked at more than the one shape it was exported at.

For each dim the recipe declares dynamic (``min < max``) the grid holds its
minimum, its maximum and the awkward sizes of ``numerics.grid_sizes`` (1, 7,
129: not multiples of 8) that fall inside its range, each with the other dims
at their typical size; plus the typical point, every dim at its minimum and
every dim at its maximum. Each point is one generated sample with a recorded
seed, run through the float64 reference, the eager baseline and every
candidate, and judged by the same rule as the samples.

The float64 reference must stay affordable: a point may hold at most
``numerics.grid_budget`` times the input elements of the typical point. A point
over budget first shrinks the other dims to their minimum; if it is still over
budget it is skipped, and the report lists it with the reason.

Apart from running, each artifact's own signature is read: a dim the recipe
declared dynamic but the artifact holds fixed (an exporter that specialised it
in silence) or whose range is narrower than declared is flagged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch

from ..inputs import InputPlan, concrete_shape, generate_sample
from ..recipe import NumericsSection

GRID_SEED_OFFSET = 1000  # grid point i uses inputs.seed + 1000 + i, apart from the samples' seeds


@dataclass(frozen=True)
class GridPoint:
    name: str  # "sequence=129", "typical", "all min", "all max"
    role: str  # typical | min | max | awkward | all-min | all-max
    sizes: dict[str, int]
    seed: int
    elements: int  # input elements, summed over the inputs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GridPlan:
    points: list[GridPoint]
    skipped: list[dict[str, Any]] = field(default_factory=list)  # {name, sizes, elements, reason}
    budget: float = 8.0
    typical_elements: int = 0
    awkward: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        cost = sum(p.elements for p in self.points) / self.typical_elements if self.typical_elements else 0.0
        return {"points": [p.to_dict() for p in self.points], "skipped": list(self.skipped), "budget": self.budget,
                "awkward_sizes": list(self.awkward), "typical_elements": self.typical_elements,
                "cost_vs_typical": round(cost, 2)}


def elements(plan: InputPlan, sizes: dict[str, int]) -> int:
    return sum(math.prod(concrete_shape(spec, sizes)) for spec in plan.specs)


def plan_grid(plan: InputPlan, settings: NumericsSection, seed: int) -> GridPlan | None:
    """The grid points for ``plan``'s dynamic dims; None when the grid is off or no dim is dynamic."""
    axes = plan.dynamic_axes()
    used = {d.name for per_input in axes.values() for d in per_input.values()}
    dynamic = [d for d in plan.dims if d.dynamic and d.name in used]
    if not settings.grid or not dynamic:
        return None
    typical = {d.name: d.size for d in plan.dims}
    limit = settings.grid_budget * elements(plan, typical)
    grid = GridPlan([], budget=settings.grid_budget, typical_elements=elements(plan, typical),
                    awkward=tuple(settings.grid_sizes))
    seen: set[tuple[tuple[str, int], ...]] = set()

    def add(name: str, role: str, sizes: dict[str, int], shrink: list[str]) -> None:
        sizes = dict(sizes)
        for other in shrink:  # over budget: the other dims go to their minimum, one at a time
            if elements(plan, sizes) <= limit:
                break
            sizes[other] = next(d.min for d in dynamic if d.name == other)
        key = tuple(sorted(sizes.items()))
        if key in seen:
            return
        seen.add(key)
        count = elements(plan, sizes)
        if count > limit:
            grid.skipped.append({"name": name, "sizes": sizes, "elements": count,
                                 "reason": f"{count / grid.typical_elements:.0f}x the typical point's input elements, "
                                           f"over numerics.grid_budget = {settings.grid_budget:g}"})
            return
        grid.points.append(GridPoint(name, role, sizes, seed + GRID_SEED_OFFSET + len(grid.points), count))

    add("typical", "typical", typical, [])
    for dim in dynamic:
        others = [d.name for d in dynamic if d.name != dim.name]
        values = {dim.min: "min", dim.max: "max"}
        for size in settings.grid_sizes:
            if dim.min <= size <= dim.max and size not in values:
                values[size] = "awkward"
        for size in sorted(values):
            add(f"{dim.name}={size}", values[size], {**typical, dim.name: size}, others)
    add("all dims at min", "all-min", {**typical, **{d.name: d.min for d in dynamic}}, [])
    add("all dims at max", "all-max", {**typical, **{d.name: d.max for d in dynamic}}, [])
    return grid


def point_sample(plan: InputPlan, point: GridPoint) -> dict[str, torch.Tensor]:
    """The generated sample of one grid point (the same every time: its seed is recorded)."""
    return generate_sample(plan.specs, point.sizes, point.seed, plan.pad_token_id, plan.max_padding)


# --------------------------------------------------------------------------- artifact signatures


def _axes(plan: InputPlan):
    for name, per_input in plan.dynamic_axes().items():
        for axis, dim in per_input.items():
            yield name, axis, dim


def program_signature(program, plan: InputPlan) -> dict[str, Any]:
    """Which declared dynamic dims the exported program fixed or narrowed (read from its placeholders)."""
    user_inputs = list(program.graph_signature.user_inputs)
    nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    by_input = dict(zip(plan.names, user_inputs))
    specialised, narrowed = [], []
    for name, axis, dim in _axes(plan):
        node = nodes.get(by_input.get(name, ""))
        value = node.meta.get("val") if node is not None else None
        if value is None or axis >= value.dim():
            continue
        size = value.shape[axis]
        if isinstance(size, int):
            specialised.append({"input": name, "axis": axis, "dim": dim.name, "size": int(size)})
            continue
        bounds = program.range_constraints.get(size.node.expr)
        if bounds is None:
            continue
        lower = int(bounds.lower) if bounds.lower.is_finite else None
        upper = int(bounds.upper) if bounds.upper.is_finite else None
        # torch's symbolic shapes report a lower bound of 2 for any dynamic dim (sizes 0 and 1 are
        # specialised while tracing) although the program accepts 1; the grid's min point runs it to be sure
        if (lower is not None and lower > max(dim.min, 2)) or (upper is not None and upper < dim.max):
            narrowed.append({"input": name, "axis": axis, "dim": dim.name, "declared": [dim.min, dim.max],
                             "exported": [lower, upper]})
    return {"specialised": specialised, "narrowed": narrowed}


def onnx_signature(path: str | Path, plan: InputPlan) -> dict[str, Any]:
    """Which declared dynamic dims the ONNX graph inputs hold as fixed sizes (dim_value instead of dim_param)."""
    proto = onnx.load(str(path), load_external_data=False)
    inputs = {i.name: i for i in proto.graph.input}
    specialised = []
    for name, axis, dim in _axes(plan):
        entry = inputs.get(name)
        if entry is None:
            continue
        dims = entry.type.tensor_type.shape.dim
        if axis < len(dims) and dims[axis].HasField("dim_value"):
            specialised.append({"input": name, "axis": axis, "dim": dim.name, "size": int(dims[axis].dim_value)})
    return {"specialised": specialised, "narrowed": []}


def artifact_signature(result, plan: InputPlan, program, staging: Path) -> dict[str, Any]:
    """What an artifact's own signature says about the recipe's dynamic dims (empty when it has none to read)."""
    if result.target in ("exported_program", "aoti") and program is not None:
        source = ("exported program placeholders and range constraints" if result.target == "exported_program"
                  else "the exported program the package was compiled from")
        return {**program_signature(program, plan), "signature_source": source}
    if result.target == "onnx" and result.path is not None:
        return {**onnx_signature(staging / result.path, plan), "signature_source": "model.onnx graph inputs"}
    return {}


def describe_signature(signature: dict[str, Any]) -> list[str]:
    """One note per fixed or narrowed dim."""
    notes = [f"input {s['input']} axis {s['axis']}: the recipe declares dim {s['dim']} dynamic, the artifact fixed "
             f"it at {s['size']}" for s in signature.get("specialised", [])]
    notes += [f"input {s['input']} axis {s['axis']}: dim {s['dim']} declared {s['declared'][0]}..{s['declared'][1]}, "
              f"the artifact accepts only {s['exported'][0]}..{s['exported'][1]}"
              for s in signature.get("narrowed", [])]
    return notes


__all__ = ["GridPoint", "GridPlan", "plan_grid", "point_sample", "program_signature", "onnx_signature",
           "artifact_signature",
           "describe_signature", "elements"]
