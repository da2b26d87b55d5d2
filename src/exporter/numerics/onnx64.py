"""The program proof of an ONNX model: its graph run in float64, with the checkpoint's weights.

The twin of an ONNX graph (``numerics/program64.py`` has the same for an exported program):

* every float32, float16 or bfloat16 the graph names becomes float64: its inputs', outputs' and values' types, the
  target of each ``Cast``, the tensors of ``Constant`` and ``ConstantOfShape``, in every subgraph;
* every floating initializer is the checkpoint's tensor in float64, found as a program's constant is
  (:class:`~exporter.numerics.program64.Sources`: by name, by exact content, transposed included, since
  TorchScript's export stores ``W^T`` as ``onnx::MatMul_123``, else the nearest of its shape); one traced to
  nothing keeps its own value, upcast, and is named.

Float32 literals (a ``1/sqrt(2)`` the exporter wrote as a float32 ``Constant``) stay float32-rounded: the twin of an
ONNX graph sits ~1e-8 from the reference instead of ~1e-15, a hundred times under the bar. Float16 and bfloat16
literals would not (``1/sqrt(2)`` is 1e-4 off in float16): such a graph gets no program proof, and the report says
why.

onnxruntime runs it on the CPU where it has a float64 kernel for every operator; it has none for ``Erf`` (exact
GELU) or a fused ``com.microsoft`` kernel, and such a graph is run by onnx's reference evaluator instead (numpy,
float64 throughout; its ``Erf`` rounds to float32, so it is given a float64 one) up to :data:`EVALUATOR_LIMIT`
weights, else the proof says why it was not run.

When the twin fails, the first divergent module is found **by value**, which needs no node names (a dynamo export
names its nodes ``node_MatMul_12``): every intermediate value of the twin is fetched on the failing sample, and the
reference's modules are walked in the order they finish; the first whose float64 output equals no twin value of
its shape (within the bar), while its inputs do, is named.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .program64 import ProgramProof, Sources, _compare


class NotTwinned(Exception):
    """The graph cannot be judged by its float64 twin (the message says why)."""


EVALUATOR_LIMIT = 200_000_000  # floating initializer values: above this the reference evaluator is too slow to use


def initializer_tensor(initializer: Any) -> torch.Tensor | None:
    """An ONNX initializer as a CPU tensor (bfloat16 kept bfloat16), or None for a non-numeric one; its external
    data must have been loaded."""
    from onnx import TensorProto, numpy_helper  # noqa: PLC0415

    array = numpy_helper.to_array(initializer)
    if initializer.data_type == TensorProto.BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16).copy()).view(torch.bfloat16)
    if array.dtype.kind in "fiub":
        return torch.from_numpy(np.ascontiguousarray(array).copy())
    return None


def onnx_constants(path: Path) -> dict[str, torch.Tensor]:
    """The initializers of the ONNX model at ``path`` (external data beside it), as CPU tensors by name: what the
    weights proof traces."""
    import onnx  # noqa: PLC0415

    proto = onnx.load(str(path), load_external_data=True)
    found = {}
    for initializer in proto.graph.initializer:
        tensor = initializer_tensor(initializer)
        if tensor is not None:
            found[initializer.name] = tensor
    return found


def _graphs(graph: Any):
    """``graph`` and every subgraph of its nodes (If, Loop, Scan), depth first."""
    from onnx import AttributeProto  # noqa: PLC0415

    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == AttributeProto.GRAPH:
                yield from _graphs(attribute.g)
            elif attribute.type == AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    yield from _graphs(sub)


def half_literals(proto: Any) -> list[str]:
    """The float16 or bfloat16 literals of ``proto`` (``Constant``/``ConstantOfShape`` tensors, scalar
    initializers): values the model wrote in float64 (a ``1/sqrt(2)``, a scale) rounded to half precision, which
    the twin cannot undo and would judge as the program's own (``1/sqrt(2)`` in float16 is 1e-4 off)."""
    from onnx import AttributeProto, TensorProto  # noqa: PLC0415

    half = {TensorProto.FLOAT16, TensorProto.BFLOAT16}
    found = []
    for graph in _graphs(proto.graph):
        found += [i.name for i in graph.initializer if i.data_type in half and math.prod(i.dims) <= 1]
        found += [node.name or node.op_type for node in graph.node for a in node.attribute
                  if a.type == AttributeProto.TENSOR and a.t.data_type in half]
    return found


def promote_onnx(proto: Any, tensors: dict[str, torch.Tensor], proof: ProgramProof) -> None:
    """Make ``proto`` (external data loaded) its own float64 twin, in place (see the module's docstring)."""
    from onnx import AttributeProto, TensorProto, numpy_helper  # noqa: PLC0415

    low = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
    double = TensorProto.DOUBLE
    sources = Sources(tensors, proof)

    def twin(name: str, value: torch.Tensor) -> np.ndarray:
        return sources.float64(name, value).contiguous().numpy()

    def retype(values) -> None:
        for value in values:
            if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type in low:
                value.type.tensor_type.elem_type = double

    def tensor64(tensor: Any) -> Any:
        if tensor.data_type not in low:
            return tensor
        array = initializer_tensor(tensor)
        assert array is not None
        return numpy_helper.from_array(array.to(torch.float64).numpy(), tensor.name)

    for graph in _graphs(proto.graph):
        retype(graph.input)
        retype(graph.output)
        del graph.value_info[:]
        for index, initializer in enumerate(graph.initializer):
            if initializer.data_type in low:
                value = initializer_tensor(initializer)
                assert value is not None
                graph.initializer[index].CopyFrom(numpy_helper.from_array(twin(initializer.name, value),
                                                                          initializer.name))
        for node in graph.node:
            for attribute in node.attribute:
                if node.op_type in ("Cast", "EyeLike", "RandomNormal", "RandomUniform", "RandomNormalLike",
                                    "RandomUniformLike", "Multinomial") and attribute.name in ("to", "dtype") \
                        and attribute.i in low:
                    attribute.i = double
                elif attribute.type == AttributeProto.TENSOR:
                    attribute.t.CopyFrom(tensor64(attribute.t))
                elif node.op_type == "Constant" and attribute.name in ("value_float", "value_floats"):
                    data = [attribute.f] if attribute.name == "value_float" else list(attribute.floats)
                    array = np.asarray(data[0] if attribute.name == "value_float" else data, dtype=np.float64)
                    attribute.CopyFrom(_tensor_attribute("value", numpy_helper.from_array(array)))


def _tensor_attribute(name: str, tensor: Any) -> Any:
    from onnx import helper  # noqa: PLC0415

    return helper.make_attribute(name, tensor)


class _Session:
    """The twin, saved with its weights apart (a float64 graph may pass protobuf's 2 GB), run by onnxruntime or,
    where onnxruntime has no float64 kernel for an operator, by onnx's reference evaluator."""

    def __init__(self, proto: Any, folder: Path, floating_values: int):
        import onnx  # noqa: PLC0415

        self.path = folder / "twin.onnx"
        onnx.save(proto, str(self.path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location="twin.onnx.data", size_threshold=1024)
        self.evaluator = None
        self.session = None
        try:
            import onnxruntime as ort  # noqa: PLC0415

            options = ort.SessionOptions()
            options.log_severity_level = 3
            self.session = ort.InferenceSession(str(self.path), sess_options=options,
                                                providers=["CPUExecutionProvider"])
            self.inputs = [i.name for i in self.session.get_inputs()]
            self.outputs = [o.name for o in self.session.get_outputs()]
        except Exception as exc:
            if floating_values > EVALUATOR_LIMIT:
                raise RuntimeError(f"onnxruntime cannot run it in float64 ({str(exc).splitlines()[0][:160]})") \
                    from None
            from onnx.reference import ReferenceEvaluator  # noqa: PLC0415

            self.evaluator = ReferenceEvaluator(onnx.load(str(self.path)), new_ops=[_erf64(), _gather_elements()])
            self.inputs = list(self.evaluator.input_names)
            self.outputs = list(self.evaluator.output_names)

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.session is not None:
            return [np.asarray(o) for o in self.session.run(None, feed)]
        return [np.asarray(o) for o in self.evaluator.run(None, feed)]  # type: ignore[union-attr]

    def every_value(self, feed: dict[str, np.ndarray], folder: Path) -> list[np.ndarray]:
        """Every value the graph computes on ``feed`` (its outputs and intermediates)."""
        if self.evaluator is not None:
            values = self.evaluator.run(None, feed, intermediate=True)
            assert isinstance(values, dict)
            return [np.asarray(v) for v in values.values() if isinstance(v, np.ndarray)]
        import onnx  # noqa: PLC0415
        import onnxruntime as ort  # noqa: PLC0415

        proto = onnx.load(str(self.path), load_external_data=False)
        present = {o.name for o in proto.graph.output}
        for node in proto.graph.node:
            for value in node.output:
                if value and value not in present:
                    proto.graph.output.append(onnx.ValueInfoProto(name=value))
                    present.add(value)
        onnx.save(proto, str(folder / "wide.onnx"))  # beside twin.onnx: its weights stay in twin.onnx.data
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(str(folder / "wide.onnx"), sess_options=options,
                                       providers=["CPUExecutionProvider"])
        return [np.asarray(v) for v in session.run(None, feed)]


def _erf64():
    """The reference evaluator's ``Erf`` in float64 (its own rounds to float32)."""
    from math import erf  # noqa: PLC0415

    from onnx.reference.ops.op_erf import Erf  # noqa: PLC0415

    class Erf64(Erf):
        op_domain = ""

        def _run(self, x):
            return (np.vectorize(erf, otypes=[np.float64])(x).astype(x.dtype),)

    Erf64.__name__ = "Erf"
    return Erf64


def _gather_elements():
    """The reference evaluator's ``GatherElements`` as ``np.take_along_axis`` (its own falls back, past 32 values
    along the axis, to a path that fails on e.g. a ``[1, 512]`` position table gathered at ``[1, 32]``)."""
    from onnx.reference.ops.op_gather_elements import GatherElements  # noqa: PLC0415

    class GatherElementsAlongAxis(GatherElements):
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = int(axis or 0)
            indices = np.asarray(indices).astype(np.int64)
            indices = np.where(indices < 0, indices + data.shape[axis], indices)  # ONNX allows negative indices
            return (np.take_along_axis(data, indices, axis=axis),)

    GatherElementsAlongAxis.__name__ = "GatherElements"
    return GatherElementsAlongAxis


def _feed(session: _Session, sample: list[torch.Tensor], inputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    by_name = dict(zip(inputs, sample))
    ordered = [by_name[n] if n in by_name else t for n, t in zip(session.inputs, sample)]
    return {name: np.ascontiguousarray((t.to(torch.float64) if t.is_floating_point() else t).cpu().numpy())
            for name, t in zip(session.inputs, ordered)}


def indices_through_log(proto: Any) -> list[str]:
    """The casts to an integer type whose input is computed through a ``Log`` (a relative-position bucket, as T5
    and MPNet compute it: ``log(distance / exact) / log(max / exact)``, truncated to an index). The exporter writes
    that expression's Python-float constants as float32 literals; their rounding can move an index across an
    integer, which a float64 twin cannot undo (T5's twin picked other buckets: 0.8% of the output's RMS)."""
    from onnx import TensorProto  # noqa: PLC0415

    integers = {TensorProto.INT64, TensorProto.INT32, TensorProto.INT16, TensorProto.INT8, TensorProto.UINT8}
    found = []
    for graph in _graphs(proto.graph):
        producer = {out: node for node in graph.node for out in node.output}
        for node in graph.node:
            if node.op_type != "Cast" or not any(a.name == "to" and a.i in integers for a in node.attribute):
                continue
            seen: set[str] = set()
            stack = list(node.input)
            while stack and len(seen) < 64:  # a bucket's expression is a handful of nodes above its cast
                value = stack.pop()
                source = producer.get(value)
                if source is None or value in seen:
                    continue
                seen.add(value)
                if source.op_type == "Log":
                    found.append(node.name or node.output[0])
                    break
                stack.extend(source.input)
    return found


def run_onnx_twin(path: Path, tensors: dict[str, torch.Tensor], samples: list[list[torch.Tensor]],
                  reference: list[list[torch.Tensor]], inputs: tuple[str, ...], names: tuple[str, ...],
                  locate_with: Any = None) -> ProgramProof:
    """The program proof of the ONNX model at ``path`` (its external data beside it): the twin run on every sample
    against ``reference``; ``locate_with(sample) -> calls`` gives the reference's module calls on a sample (for
    the by-value localisation of a failing twin)."""
    import onnx  # noqa: PLC0415

    proof = ProgramProof(True)
    proto = onnx.load(str(path), load_external_data=True)
    half = half_literals(proto)
    if half:
        raise NotTwinned(f"its literals are float16/bfloat16 ({', '.join(half[:3])}): their rounding cannot be told "
                         "from the program's own in float64")
    through_log = indices_through_log(proto)
    if through_log:
        raise NotTwinned(f"it computes integer indices through a logarithm of float32 literals ({through_log[0]}: a "
                         "relative-position bucket): a literal's rounding can move an index, which float64 cannot "
                         "undo")
    floating = sum(math.prod(i.dims) for i in proto.graph.initializer)
    promote_onnx(proto, tensors, proof)
    with tempfile.TemporaryDirectory(prefix="exporter-onnx64-") as folder:
        session = _Session(proto, Path(folder), floating)
        del proto
        for index, (sample, expected) in enumerate(zip(samples, reference)):
            got = [torch.from_numpy(o) for o in session.run(_feed(session, sample, inputs))]
            if all(n in session.outputs for n in names):
                got = [got[session.outputs.index(n)] for n in names]
            _compare(proof, index, names, expected, got, "cpu")
        proof.judge()
        if not proof.passed and locate_with is not None:
            proof.locate_note = _by_value(session, Path(folder), samples[proof.worst_sample], inputs, locate_with,
                                          proof)
    return proof


def _by_value(session: _Session, folder: Path, sample: list[torch.Tensor], inputs: tuple[str, ...], locate_with,
              proof: ProgramProof) -> str:
    """Name the first divergent module by value (see the module's docstring); a note where none is found."""
    from .module_checks import floats  # noqa: PLC0415

    try:
        calls = locate_with(sample)
        fetched = session.every_value(_feed(session, sample, inputs), folder)
    except Exception as exc:  # noqa: BLE001 - localisation explains a failure; it never hides one
        return f"localisation by value failed: {str(exc).splitlines()[0][:200]}"
    by_shape: dict[tuple[int, ...], list[np.ndarray]] = {}
    for array in fetched:
        array = np.asarray(array)
        if array.dtype == np.float64:
            by_shape.setdefault(tuple(array.shape), []).append(array.reshape(-1))

    def found(tensor: torch.Tensor) -> bool | None:
        """Some twin value of this shape equals it within the bar (None: no value of its shape to compare)."""
        candidates = by_shape.get(tuple(tensor.shape))
        if not candidates:
            return None
        ref = tensor.detach().to(torch.float64).reshape(-1).numpy()
        rms = float(np.sqrt(np.mean(ref * ref))) if ref.size else 0.0
        return any(float(np.sqrt(np.mean((c - ref) ** 2))) <= proof.bar * rms for c in candidates)

    def clean(tensors: list[torch.Tensor]) -> bool:
        return all(found(t) is not False for t in tensors)

    checked = 0
    for position, call in enumerate(calls):
        outputs = floats(call.output)
        verdicts = [found(t) for t in outputs]
        if not outputs or all(v is None for v in verdicts):
            continue
        checked += 1
        if all(v is not False for v in verdicts):
            continue
        culprit = call
        while not clean(floats((culprit.args, culprit.kwargs))):
            parent = next((c for c in calls[position + 1:] if culprit.path.startswith(c.path + ".")), None)
            if parent is None:
                break
            culprit = parent
            position = calls.index(parent)
        proof.module = culprit.path
        return ""
    return f"no module's float64 output was missing from the twin's values ({checked} modules compared by value)"


__all__ = ["EVALUATOR_LIMIT", "NotTwinned", "half_literals", "indices_through_log", "initializer_tensor",
           "onnx_constants", "promote_onnx", "run_onnx_twin"]
