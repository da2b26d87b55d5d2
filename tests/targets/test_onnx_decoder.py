"""The ONNX target's decoder programs: Optimum's cache-in, cache-out layout, one weights file for both, refused
where onnxruntime cannot check them; and what a fully masked attention row gives in every kernel."""

from __future__ import annotations

import json

import torch


def test_the_onnx_programs_take_the_cache_in_and_out_and_share_one_weights_file(llama_generation):
    import onnx

    out = llama_generation.out
    layers = len(json.loads((out / "generation.json").read_text())["layout"]["heads"])
    located: dict[str, set] = {}
    for name in ("prefill.onnx", "decode.onnx"):
        proto = onnx.load(str(out / name), load_external_data=False)
        assert [i.name for i in proto.graph.input][:4] == ["input_ids", "padding_mask", "cache_position",
                                                          "past_key_values.0.key"]
        assert [o.name for o in proto.graph.output] == ["logits"] + [
            f"present.{n}.{part}" for n in range(layers) for part in ("key", "value")]
        # each weight by where its bytes lie: the exporter's constant folding names a weight it transposed after
        # the node that made it (``val_39``), differently in each program, and share_weights matches by content
        located[name] = {(tuple(t.dims), tuple(sorted((e.key, e.value) for e in t.external_data)))
                         for t in proto.graph.initializer if t.external_data}
        assert {dict(e)["location"] for _, e in located[name]} == {"generation.onnx.data"}
    assert located["prefill.onnx"] == located["decode.onnx"]  # the same bytes of the one file
    weights = (out / "generation.onnx.data").stat().st_size  # every byte of it read by both programs, none twice
    assert sum(int(dict(e)["length"]) for _, e in located["prefill.onnx"]) == weights
    assert not (out / "prefill.onnx.data").exists() and not (out / "decode.onnx.data").exists()


def test_onnx_generation_programs_are_refused_where_onnxruntime_cannot_check_them():
    from exporter import targets

    onnx = targets.get("onnx")
    assert onnx.decoder_refusal("cpu", "float32") is None
    assert "no CUDA execution provider" in onnx.decoder_refusal("cuda", "bfloat16")
    assert "no bfloat16 kernels" in onnx.decoder_refusal("cpu", "bfloat16")
    assert "not built for text-generation" in targets.get("compile").decoder_refusal("cpu", "float32")


def test_a_constant_that_differs_between_the_programs_stays_in_its_own_model(tmp_path):
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from exporter.targets.onnx import share_weights

    def save(name, c):
        weight = numpy_helper.from_array(np.arange(256, dtype=np.float32).reshape(16, 16), "w")
        const = numpy_helper.from_array(np.full((16, 16), c, dtype=np.float32), "c")
        nodes = [helper.make_node("MatMul", ["x", "w"], ["y0"]), helper.make_node("Add", ["y0", "c"], ["y"])]
        square = [16, 16]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, square)],
                                  [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, square)], [weight, const])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, str(tmp_path / name), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=name + ".data", size_threshold=0)

    save("prefill.onnx", 1.0)
    save("decode.onnx", 2.0)
    share_weights(tmp_path / "prefill.onnx", tmp_path / "decode.onnx", tmp_path / "shared.data")
    decode = onnx.load(str(tmp_path / "decode.onnx"), load_external_data=False)
    where = {t.name: bool(t.external_data) for t in decode.graph.initializer}
    assert where == {"w": True, "c": False}  # the shared weight points into shared.data; the other is inside
    x = np.eye(16, dtype=np.float32)
    for name, c in (("prefill.onnx", 1.0), ("decode.onnx", 2.0)):
        y = ort.InferenceSession(str(tmp_path / name), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        np.testing.assert_array_equal(y, np.arange(256, dtype=np.float32).reshape(16, 16) + c)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.onnx", "prefill.onnx", "shared.data"]


def test_attention_kernels_on_a_fully_masked_row(tmp_path):
    """What docs/generation.md says about a query row that sees no key: with the step's finite mask every kernel
    gives a finite row; with ``-inf`` a plain softmax gives NaN, SDPA's CPU kernel and onnxruntime's
    ``Attention`` (opset 23) a finite row."""
    import numpy as np
    import onnxruntime as ort

    class Attend(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = (torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.zeros(1, 1, 3, 3)
    torch.onnx.export(Attend().eval(), (q, k, v, mask), dynamo=True, opset_version=23, optimize=False).save(
        str(tmp_path / "attend.onnx"))
    session = ort.InferenceSession(str(tmp_path / "attend.onnx"), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    for fill in (torch.finfo(torch.float32).min, float("-inf")):
        mask[..., 0, :] = fill  # query 0 sees no key
        onnx_out = session.run(None, dict(zip(names, (t.numpy() for t in (q, k, v, mask)))))[0]
        assert np.isfinite(onnx_out).all() and torch.isfinite(Attend()(q, k, v, mask)).all()
        plain = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5 + mask, dim=-1)
        assert torch.isfinite(plain).all() == (fill != float("-inf"))
