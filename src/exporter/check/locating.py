"""The first divergent module of an artifact another tool made, from the values the artifact itself exposes.

* **ONNX.** An exporter that traces modules names each node by its module scope (``/encoder/layer.0/attention/
  self/value/MatMul``: torch.onnx's TorchScript exporter, which Optimum uses). The last node of a scope in
  topological order gives that module's output; a copy of the model lists those values as extra graph outputs
  and runs once on the failing sample. Each is compared with the same module's float64 output, against the
  eager model's own error there (:func:`exporter.numerics.locate_program.first_divergent`). A graph whose node
  names carry no scopes cannot be localised this way, and the report says so.
* **torch.export ``.pt2``.** Its submodules, unflattened (``torch.export.unflatten``), run end to end.
* **AOTInductor package.** Monolithic: no intermediate values to read; the report says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..dtypes import torch_dtype
from ..errors import describe
from ..modelio import IOModule, import_spec_types
from ..numerics.locate import record_reference, summary
from ..numerics.locate_program import baseline_store, first_divergent, in_program
from ..numerics.module_checks import ModuleFloor
from ..numerics.tolerance import relative_floor
from ..recipe import Recipe
from ..results import VariantResult
from ..targets.program_file import load_program
from .artifacts import Artifact


def scope_values(proto: Any) -> dict[str, str]:
    """Module path -> the value its scope's last node (in topological order) produces."""
    last: dict[str, str] = {}
    for node in proto.graph.node:
        if not node.name.startswith("/") or not node.output:
            continue
        parts = node.name.strip("/").split("/")[:-1]  # the last part is the op's own name
        for end in range(1, len(parts) + 1):
            last[".".join(parts[:end])] = node.output[0]
    return last


def in_onnx(path: Path, calls, original: IOModule, sample: list[torch.Tensor], names: tuple[str, ...],
            device: str, dtype: torch.dtype, k: float, atol) -> dict[str, Any]:
    import onnx  # noqa: PLC0415
    import onnxruntime as ort  # noqa: PLC0415

    proto = onnx.load(str(path), load_external_data=False)
    values = scope_values(proto)
    wanted = {c.path: values[c.path] for c in calls if c.path in values}
    if not wanted:
        return {"modules_recorded": len(calls), "modules_checked": 0, "first_divergent": None,
                "note": "the ONNX graph's node names carry no module scopes: no intermediate value maps to a module"}
    present = {o.name for o in proto.graph.output}
    for value in dict.fromkeys(wanted.values()):
        if value not in present:
            proto.graph.output.append(onnx.ValueInfoProto(name=value))
    copy = path.with_name(f".{path.stem}.locate.onnx")  # beside it: its external data paths stay valid
    try:
        onnx.save(proto, str(copy))
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(copy), sess_options=options, providers=["CPUExecutionProvider"])
        args = [(t.to(dtype) if t.is_floating_point() else t) for t in sample]
        by_name = dict(zip(names, args))
        feeds = {i.name: np.ascontiguousarray((by_name[i.name] if i.name in by_name else a).cpu().numpy())
                 for i, a in zip(session.get_inputs(), args)}
        fetched = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    finally:
        copy.unlink(missing_ok=True)
    graph: dict[tuple[str, int], tuple[list, list]] = {
        (c.path, 0): ([], [torch.from_numpy(np.asarray(fetched[wanted[c.path]]))])
        for c in calls if c.index == 0 and c.path in wanted and wanted[c.path] in fetched}
    baseline = baseline_store(original, calls, [t.to(device) for t in args], device, dtype)
    return first_divergent(calls, graph, baseline, k, atol)


def locate_artifact(result: VariantResult, artifact: Artifact, path: Path, original: IOModule,
                    sample: list[torch.Tensor], recipe: Recipe, names: tuple[str, ...] = (), index: int = 0) -> None:
    """Fill ``result.numerics.locate`` (and add its summary to the failure) for a failing foreign artifact, on
    sample ``index``; ``names``: the inputs by name (the outputs' order, for a decoder with past)."""
    if result.numerics is None:
        return
    dtype_name = result.dtype or recipe.runtime.dtype
    device = result.device or recipe.runtime.device
    dtype = torch_dtype(dtype_name)
    k = recipe.numerics.multiplier(dtype_name)
    outputs: list[torch.Tensor] = []
    calls, note = ([], "") if artifact.past is not None else record_reference(original, sample, None, outputs)
    floor = ModuleFloor(recipe.numerics.atol, outputs, relative_floor(recipe.numerics.floor, dtype_name))
    found: dict[str, Any] = {"device": device, "dtype": dtype_name, "module": None, "found_by": None,
                             "replay": None, "graph": None, "notes": [note] if note else []}
    try:
        if artifact.past is not None:
            order = {name: i for i, name in enumerate(names)}
            failing = sorted({c.output for c in result.numerics.checks if not c.passed}, key=lambda n: order.get(n, 0))
            found["notes"].append(f"a decoder with past, judged on two steps: the first output that fails, in the "
                                  f"order the steps make them, is {failing[0] if failing else 'none'} "
                                  f"({len(failing)} failing: {', '.join(failing[:6])})")
            entry = None
        elif artifact.target == "onnx":
            entry = in_onnx(path, calls, original, sample, names or tuple(p.name for p in artifact.inputs),
                            device, dtype, k, floor)
            found["graph"] = {"replayed": "the ONNX graph's own values at each module scope's last node", **entry}
        elif artifact.target == "exported_program":
            import_spec_types(artifact.imports)  # allow-listed ModelOutput modules only
            program = load_program(path, allow_pickle=artifact.pickle)  # as data, as its runner loaded it
            prefix = "model." if artifact.made_by == "exporter" else ""
            keywords = names[artifact.positional:] if artifact.call == "keyword" else None
            entry = in_program(program, calls, original, sample, device, dtype, k, floor,
                               recipe.runtime.attention_backend, prefix=prefix, keywords=keywords,
                               positional=artifact.positional)
            found["graph"] = {"replayed": "the program's submodules (torch.export.unflatten), run end to end",
                              **entry}
        else:
            found["notes"].append("an AOTInductor package is monolithic: it exposes no intermediate values")
            entry = None
        if entry and entry.get("note"):
            found["notes"].append(entry["note"])
        if entry and entry["first_divergent"]:
            found["module"], found["found_by"] = entry["first_divergent"]["module"], "graph"
    except Exception as exc:  # localisation explains a failure; it never hides one
        found["notes"].append(f"localisation failed: {describe(exc, 300)}")
    found["summary"] = summary(found, True) if (found["graph"] or found["module"]) else \
        "; ".join(found["notes"]) or "no localisation"
    result.numerics.locate = {"sample": index, **found}
    if result.error:
        result.error = f"{result.error}; {found['summary']}"


__all__ = ["locate_artifact", "scope_values", "in_onnx"]
