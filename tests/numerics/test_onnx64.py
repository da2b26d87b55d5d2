"""The ONNX twin's limits: integer indices computed through a logarithm of float32 literals (T5's and MPNet's
relative-position buckets) get no program proof, and say why, instead of a false failure."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from exporter.numerics.onnx64 import NotTwinned, indices_through_log, run_onnx_twin


def bucket_graph(through_log: bool) -> onnx.ModelProto:
    """``index = int64(log(distance / 8) / 2.7725887 * 8)`` (T5's bucket, its constants float32 literals), then an
    embedding lookup; without ``through_log`` the index is ``int64(distance / 8 * 8)``."""
    nodes = [helper.make_node("Cast", ["distance"], ["d"], to=TensorProto.FLOAT),
             helper.make_node("Constant", [], ["exact"], value_float=8.0),
             helper.make_node("Div", ["d", "exact"], ["ratio"])]
    if through_log:
        nodes += [helper.make_node("Log", ["ratio"], ["logged"]),
                  helper.make_node("Constant", [], ["span"], value_float=float(np.float32(np.log(16.0)))),
                  helper.make_node("Div", ["logged", "span"], ["scaled"])]
    else:
        nodes += [helper.make_node("Identity", ["ratio"], ["scaled"])]
    nodes += [helper.make_node("Mul", ["scaled", "exact"], ["bucket"]),
              helper.make_node("Cast", ["bucket"], ["index"], to=TensorProto.INT64),
              helper.make_node("Gather", ["table", "index"], ["bias"])]
    table = helper.make_tensor("table", TensorProto.FLOAT, [32], np.linspace(0, 1, 32).astype(np.float32))
    graph = helper.make_graph(nodes, "bucket", [helper.make_tensor_value_info("distance", TensorProto.INT64, [4])],
                              [helper.make_tensor_value_info("bias", TensorProto.FLOAT, [4])], [table])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_index_through_a_logarithm_is_found_and_an_arithmetic_one_is_not():
    assert indices_through_log(bucket_graph(True)) != []
    assert indices_through_log(bucket_graph(False)) == []


def test_the_twin_is_not_run_on_such_a_graph_and_says_why(tmp_path):
    path = tmp_path / "bucket.onnx"
    onnx.save(bucket_graph(True), str(path))
    sample = [torch.tensor([9, 17, 40, 100])]
    with pytest.raises(NotTwinned, match="integer indices through a logarithm of float32 literals"):
        run_onnx_twin(path, {"table": torch.linspace(0, 1, 32)}, [sample], [[torch.zeros(4)]], ("distance",),
                      ("bias",))
