"""An artifact's inputs and outputs mapped by name onto what the checkpoint's model takes and returns.

The model's own inputs (generated from its config as ``convert`` generates them, or declared in the recipe)
are kept where the artifact takes them, in the artifact's order; an input the artifact takes that the config
does not give (``token_type_ids``, ``position_ids``) is generated from the config too. A fixed size in the
artifact pins the recipe's dim to it (a static ONNX file is judged at its shapes, and the report says so); a
dynamic dim the artifact bounds (a ``.pt2``'s range constraints) narrows the recipe's to those bounds. A name
or a size the model does not have is a one-line error naming both sides: the artifact is of another model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.nn as nn

from ..errors import InputsError, UsageError
from ..inputs import infer_specs, within_positions
from ..modelio import forward_parameters
from ..recipe import Dim, Recipe, TensorSpec
from .artifacts import Artifact, Port


def _extra_spec(name: str, model: nn.Module, like: TensorSpec | None) -> TensorSpec | None:
    """A spec for an input the config's defaults do not generate but the artifact takes."""
    config: Any = getattr(model, "config", None)
    shape = like.shape if like is not None else ("batch", "sequence")
    if name == "token_type_ids":
        return TensorSpec(name, shape, "int64", 0, max(1, int(getattr(config, "type_vocab_size", 1) or 1)))
    if name == "position_ids":  # generated in range; their values are the model's own default positions below
        return TensorSpec(name, shape, "int64", 0, 1)
    return None


def _mismatch(what: str, artifact: Artifact, model: nn.Module) -> UsageError:
    return UsageError(f"{artifact.name} ({artifact.path.name}) does not fit {type(model).__name__}: {what}",
                      "check it against the checkpoint it was exported from (--against)")


def map_inputs(artifact: Artifact, model: nn.Module, recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe with the artifact's inputs declared (its order, its fixed sizes); and notes for the report."""
    params = [n for n in forward_parameters(model) if n not in ("self", "kwargs", "args")]
    try:
        defaults = {s.name: s for s in infer_specs(model, recipe.inputs)}
    except InputsError:
        defaults = {}
    notes: list[str] = []
    ports = list(artifact.inputs)
    if not ports or all(p.name.startswith("arg") and p.name[3:].isdigit() for p in ports):
        if not defaults:
            raise _mismatch("it does not name its inputs, and the model's cannot be generated", artifact, model)
        order = list(defaults)
        if ports and len(ports) < len(order) and set(order[len(ports):]) <= {"token_type_ids"}:
            order = order[:len(ports)]  # a BERT exported with its ids and mask only: the segments default to 0
        if ports and len(ports) != len(order):
            raise _mismatch(f"it takes {len(ports)} unnamed inputs, the model's generated inputs are "
                            f"{', '.join(order)}", artifact, model)
        ports = [Port(n, None, None) for n in order]
        notes.append(f"the artifact does not name its inputs: given {', '.join(order)} in that order")
    if artifact.positional:  # a package's leading positional arguments: the forward's first parameters
        ports = [Port(params[i], p.dtype, p.axes, p.bounds) if i < artifact.positional and i < len(params) else p
                 for i, p in enumerate(ports)]
    unknown = [p.name for p in ports if p.name not in params]
    if unknown:
        raise _mismatch(f"it takes {', '.join(unknown)}, which {type(model).__name__}.forward does not (it takes "
                        f"{', '.join(params[:8])})", artifact, model)
    dims = {d.name: d for d in recipe.inputs.dims}
    pinned: dict[str, tuple[int, str]] = {}
    bounded: dict[str, tuple[int | None, int | None]] = {}
    specs: list[TensorSpec] = []
    first = next(iter(defaults.values()), None)
    for port in ports:
        spec = defaults.get(port.name) or _extra_spec(port.name, model, first)
        if spec is None:
            raise _mismatch(f"it takes {port.name}, which cannot be generated from the model's config",
                            artifact, model)
        if port.axes is not None:
            if len(port.axes) != len(spec.shape):
                raise _mismatch(f"its input {port.name} has {len(port.axes)} axes, the model's has "
                                f"{len(spec.shape)} ({list(spec.shape)})", artifact, model)
            for axis, (mine, theirs) in enumerate(zip(spec.shape, port.axes)):
                if isinstance(theirs, int) and isinstance(mine, str):
                    seen = pinned.get(mine)
                    if seen is not None and seen[0] != theirs:
                        raise _mismatch(f"it fixes dim {mine} at {seen[0]} ({seen[1]}) and at {theirs} "
                                        f"({port.name})", artifact, model)
                    pinned[mine] = (theirs, port.name)
                elif isinstance(theirs, int) and isinstance(mine, int) and mine != theirs:
                    raise _mismatch(f"its input {port.name} axis {axis} is {theirs}, the model's is {mine} "
                                    f"(shape {list(spec.shape)})", artifact, model)
                elif isinstance(mine, str) and axis < len(port.bounds) and port.bounds[axis] != (None, None):
                    low, high = port.bounds[axis]
                    old = bounded.get(mine, (None, None))
                    bounded[mine] = (max(x for x in (low, old[0]) if x is not None) if low or old[0] else None,
                                     min(x for x in (high, old[1]) if x is not None) if high or old[1] else None)
        dtype = port.dtype if port.dtype and not spec.dtype.startswith(("float", "bf")) else spec.dtype
        specs.append(dataclasses.replace(spec, dtype=dtype))
    new_dims = []
    for dim in dims.values():
        if dim.name in pinned:
            size = pinned[dim.name][0]
            new_dims.append(Dim(dim.name, size, size, size))
            if dim.dynamic or dim.size != size:
                notes.append(f"dim {dim.name}: the artifact fixes it at {size} ({pinned[dim.name][1]}), so it is "
                             f"judged at that size only (the recipe declares {dim.min}..{dim.max})")
            continue
        low, high = bounded.get(dim.name, (None, None))
        new_min = max(dim.min, low) if low is not None else dim.min
        # torch.export reports a lower bound of 2 for a dim it traced at size >= 2; it still accepts 1
        new_min = dim.min if low == 2 and dim.min < 2 else new_min
        new_max = min(dim.max, high) if high is not None else dim.max
        if (new_min, new_max) != (dim.min, dim.max):
            notes.append(f"dim {dim.name}: the artifact accepts {low}..{high}; judged within "
                         f"{new_min}..{new_max} (the recipe declares {dim.min}..{dim.max})")
        new_dims.append(Dim(dim.name, min(max(dim.size, new_min), new_max), new_min, new_max))
    narrowed, position_notes = within_positions(model, tuple(specs), tuple(new_dims))
    for dim in narrowed:
        if dim.name in pinned and dim.size != pinned[dim.name][0]:  # the model cannot take the size it fixes
            size, port_name = pinned[dim.name]
            raise _mismatch(f"it fixes dim {dim.name} at {size} ({port_name}), past the model's {dim.max} positions",
                            artifact, model)
    _check_sample_size(artifact, model, specs, narrowed, pinned)
    notes += position_notes
    section = dataclasses.replace(recipe.inputs, tensors=tuple(specs), dims=narrowed)
    return dataclasses.replace(recipe, inputs=section), notes


def check_output_sizes(artifact: Artifact, names: tuple[str, ...], outputs: list[Any], model: nn.Module) -> None:
    """Each size an artifact's output fixes (a hidden width, a vocabulary) against the model's output on the same
    sample: another width is another model, refused in one line before anything is judged."""
    ports = {p.name: p for p in artifact.outputs}
    by_order = not set(ports) & set(names)
    for index, name in enumerate(names):
        port = artifact.outputs[index] if by_order and index < len(artifact.outputs) else ports.get(name)
        tensor = outputs[index] if index < len(outputs) else None
        if port is None or port.axes is None or tensor is None or not hasattr(tensor, "shape"):
            continue
        shape = tuple(tensor.shape)
        if len(port.axes) != len(shape):
            raise _mismatch(f"its output {name} has {len(port.axes)} axes, the model's has {len(shape)} "
                            f"({list(shape)})", artifact, model)
        for axis, (theirs, mine) in enumerate(zip(port.axes, shape)):
            if isinstance(theirs, int) and theirs != mine:
                raise _mismatch(f"its output {name} is {theirs} wide on axis {axis}, the model's is {mine} "
                                f"(shape {list(shape)})", artifact, model)


SAMPLE_SHARE = 16  # one sample's inputs may take at most this fraction of the available memory (activations: more)


def _check_sample_size(artifact: Artifact, model: nn.Module, specs: list[TensorSpec], dims: tuple[Dim, ...],
                       pinned: dict[str, tuple[int, str]]) -> None:
    """A size the artifact fixes must leave one sample within what this machine can hold: a batch fixed at 2^31
    would otherwise be allocated (hundreds of GiB) before anything is judged."""
    import math  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    from ..dtypes import torch_dtype  # noqa: PLC0415

    if not pinned:
        return
    sizes = {d.name: d.size for d in dims}
    total = sum(math.prod(sizes.get(e, 1) if isinstance(e, str) else int(e) for e in spec.shape) *
                torch_dtype(spec.dtype).itemsize for spec in specs)
    allowed = psutil.virtual_memory().available // SAMPLE_SHARE
    if total > allowed:
        fixed = ", ".join(f"{name} at {size} ({port})" for name, (size, port) in pinned.items())
        raise UsageError(f"{artifact.name} ({artifact.path.name}) fixes {fixed}: one sample's inputs would take "
                         f"{total / 2**30:.1f} GiB, over the {allowed / 2**30:.1f} GiB this machine can give a sample "
                         f"(1/{SAMPLE_SHARE} of its available memory)",
                         "check an artifact exported at sizes this machine can run, or one with dynamic dims")


def map_outputs(artifact: Artifact, model_outputs: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
    """The model's outputs the artifact returns, in the artifact's order (positional names mapped in order)."""
    names = [p.name for p in artifact.outputs]
    notes: list[str] = []
    if not names:
        return model_outputs, ["the artifact does not name its outputs: compared with the model's, in order"]
    if not set(names) & set(model_outputs):  # generated names (output_0, a graph value's number): by position
        if len(names) > len(model_outputs):
            raise UsageError(f"{artifact.name} returns {len(names)} outputs, the model {len(model_outputs)} "
                             f"({', '.join(model_outputs)})", "check it against the checkpoint it was exported from")
        notes.append("the artifact does not name its outputs: compared with the model's "
                     f"{', '.join(model_outputs[:len(names)])}, in order")
        return model_outputs[:len(names)], notes
    unknown = [n for n in names if n not in model_outputs]
    if unknown:
        raise UsageError(f"{artifact.name} ({artifact.path.name}) returns {', '.join(unknown)}, which the model does "
                         f"not (it returns {', '.join(model_outputs)})",
                         "check it against the checkpoint it was exported from (--against); a task head the "
                         "checkpoint lacks (e.g. exported with another --task) is another model")
    return tuple(names), notes


__all__ = ["map_inputs", "map_outputs"]
