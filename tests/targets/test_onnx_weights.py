"""onnx.pack_weights: a model saved with its weights apart becomes one self-contained model.onnx, written one
tensor at a time (the convert's peak memory no longer holds the weights twice over to serialise them)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from exporter.targets.onnx import pack_weights


def _model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    weights = {"w1": rng.standard_normal((64, 256)).astype(np.float32),
               "b1": rng.standard_normal(256).astype(np.float32),
               "w2": rng.standard_normal((256, 8)).astype(np.float32),
               "scale": np.array([0.5], dtype=np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]), helper.make_node("MatMul", ["r", "w2"], ["y0"]),
             helper.make_node("Mul", ["y0", "scale"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), weights


def test_weights_saved_apart_are_packed_into_one_file_that_runs(tmp_path):
    model, weights = _model()
    path = tmp_path / "model.onnx"
    copy = onnx.ModelProto.FromString(model.SerializeToString())  # saving apart rewrites the message it is given
    onnx.save_model(copy, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)  # the small "scale" stays inline
    proto = onnx.load(str(path), load_external_data=False)
    assert any(t.data_location == TensorProto.EXTERNAL for t in proto.graph.initializer)
    pack_weights(proto, path)
    (tmp_path / "model.onnx.data").unlink()  # the packed file must not need it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]
    packed = onnx.load(str(path))
    onnx.checker.check_model(packed, full_check=True)
    assert [n.op_type for n in packed.graph.node] == [n.op_type for n in model.graph.node]
    stored = {t.name: numpy_helper.to_array(t) for t in packed.graph.initializer}
    assert stored.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(stored[name], value)
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)
