"""softmax_attention_graph: hand-written attention in user code becomes SDPA in every artifact, or is left alone
with the reason. The models are the user code of src/exporter/testing/attention_zoo.py."""

from __future__ import annotations

import pytest
import torch

from exporter.modelio import cast_in_place
from exporter.rewrite import REWRITTEN, SKIPPED, graph_rule, rewrite_attention, softmax_attention_graph
from exporter.rewrite.graph_capture import TracedModule
from exporter.rewrite.graph_facts import count_graph_ops
from exporter.testing import attention_zoo as zoo

HAND_WRITTEN = [c for c in zoo.CASES if c.family == zoo.HAND and c.expect == "rewritten"]
UNSAFE = [c for c in zoo.CASES if c.family == "unsafe" and c.expect == "skipped"]
_cache: dict[str, tuple] = {}


def rewritten(name: str):
    """(model, io, rewritten module, audit) of a zoo case, computed once per test session."""
    if name not in _cache:
        model = zoo.build(zoo.BY_NAME[name])
        io = zoo.io_module(model)
        module, audit = rewrite_attention(io, zoo.inputs())
        _cache[name] = (model, io, module, audit)
    return _cache[name]


def close(a, b, atol=1e-5) -> bool:
    return all(torch.allclose(x, y, atol=atol, rtol=1e-4) for x, y in zip(a, b))


@pytest.mark.parametrize("case", HAND_WRITTEN, ids=lambda c: c.name)
def test_spelling_is_rewritten_to_sdpa(case):
    model, io, module, audit = rewritten(case.name)
    assert audit.count(REWRITTEN) == case.sites and audit.count(SKIPPED) == 0, audit.to_dict()
    assert isinstance(module, TracedModule)
    sites = [s for s in audit.sites if s.status == REWRITTEN]
    assert all(s.rule == softmax_attention_graph.RULE and s.location.startswith("layers.") for s in sites)
    assert all(s.causal == case.causal for s in sites), [s.causal for s in sites]
    assert all(s.grouped_query == case.grouped_query for s in sites)
    assert all(s.masked for s in sites) if case.masked else not any(s.masked for s in sites)
    assert all(s.head_dim == zoo.HEAD_DIM for s in sites)
    assert audit.checks and audit.checks[-1]["ok"]
    # the exported program keeps one SDPA node per site and no softmax
    program = zoo.export_named(module, zoo.inputs())
    ops = count_graph_ops(program.graph)
    assert ops["sdpa"] == case.sites and ops["softmax"] == 0, ops
    # and computes what the original computes, at other sizes and other padding than the example's
    other = zoo.inputs(3, 17, seed=1)
    with torch.inference_mode():
        assert close(model(*other), program.module()(*other))
        assert close(model(*zoo.inputs(1, 5, seed=2)), module(*zoo.inputs(1, 5, seed=2)))


@pytest.mark.parametrize("case", UNSAFE, ids=lambda c: c.name)
def test_unsafe_attention_is_left_alone_with_the_reason(case):
    model, io, module, audit = rewritten(case.name)
    assert audit.count(REWRITTEN) == 0
    assert audit.count(SKIPPED) == case.sites, audit.to_dict()
    assert all(case.reason in s.reason for s in audit.sites if s.status == SKIPPED), [s.reason for s in audit.sites]
    assert module is io  # nothing changed


def test_softmax_that_is_not_attention_is_neither_reported_nor_traced(monkeypatch):
    def no_tracing(*args, **kwargs):
        raise AssertionError("traced a model with no attention")

    monkeypatch.setattr(graph_rule, "capture", no_tracing)
    io = zoo.io_module(zoo.build(zoo.BY_NAME["not_attention"]))
    module, audit = rewrite_attention(io, zoo.inputs())
    assert module is io and audit.found == 0


def _sdpa_calls(name):
    return [dict(n.kwargs) for n in zoo.sdpa_nodes(rewritten(name)[2].graph_module.graph)]


@pytest.mark.parametrize("name", ["causal_masked_fill", "causal_where", "causal_additive", "causal_arange"])
def test_a_causal_mask_becomes_is_causal(name):
    calls = _sdpa_calls(name)
    assert len(calls) == 2 and all(c["is_causal"] and c["attn_mask"] is None for c in calls)


@pytest.mark.parametrize("name", ["padding_square", "anti_causal", "sliding_window", "padding_boolean"])
def test_a_mask_that_is_not_causal_stays_a_mask(name):
    """A square padding mask, a triu buffer and a window that equals tril(ones) up to length 40 (beyond the
    example's 32): never is_causal."""
    calls = _sdpa_calls(name)
    assert len(calls) == 2 and all(not c["is_causal"] and c["attn_mask"] is not None for c in calls)
    assert not any(s.causal for s in rewritten(name)[3].sites)
    model, _, module, _ = rewritten(name)
    longer = zoo.inputs(2, 60, seed=3)  # past the window, where a causal mask would differ
    with torch.inference_mode():
        assert close(model(*longer), module(*longer))


def test_causal_and_padding_keeps_both_in_one_mask():
    calls = _sdpa_calls("causal_and_padding")
    assert all(not c["is_causal"] and c["attn_mask"] is not None for c in calls)
    model, _, module, _ = rewritten("causal_and_padding")
    other = zoo.inputs(3, 17, seed=4)
    with torch.inference_mode():
        assert close(model(*other), module(*other))


@pytest.mark.parametrize("name, native", [("gqa_expand", True), ("gqa_repeat_interleave", True), ("gqa_tiled", False),
                                          ("mqa_broadcast", True)])
def test_grouped_query_attention(name, native):
    """repeat_kv / repeat_interleave become enable_gqa on the un-repeated k, v; tiled heads (another head order)
    keep their repeated k, v."""
    graph = rewritten(name)[2].graph_module.graph
    for node in zoo.sdpa_nodes(graph):
        assert bool(node.kwargs.get("enable_gqa")) is native
        heads = node.args[1].meta["val"].shape[1] if "val" in node.args[1].meta else None
        if native and heads is not None:
            assert heads < zoo.HEADS
    assert all(s.kv_heads < s.heads for s in rewritten(name)[3].sites)


def test_rewritten_module_shares_the_weights_and_takes_any_size():
    model, io, module, _ = rewritten("causal_and_padding")
    assert list(module.state_dict()) == list(io.state_dict())
    for (name, a), b in zip(module.state_dict(keep_vars=True).items(), io.state_dict(keep_vars=True).values()):
        assert a is b, name
    for batch, seq in ((1, 2), (3, 17), (8, 63)):
        sample = zoo.inputs(batch, seq, seed=seq)
        with torch.inference_mode():
            assert close(model(*sample), module(*sample))


def test_dtype_change_traces_again_and_in_place_casts_are_followed():
    """softmax(s.float()).to(q.dtype) bakes the trace's dtype into the graph: .to(bfloat16) must trace again."""
    model = zoo.build(zoo.BY_NAME["softmax_float32"])
    io = zoo.io_module(model)
    module, audit = rewrite_attention(io, zoo.inputs())
    model.to(dtype=torch.bfloat16)
    module.to(dtype=torch.bfloat16)
    sample = [zoo.inputs()[0].bfloat16(), zoo.inputs()[1]]
    with torch.inference_mode():
        expected, got = model(*sample)[0], module(*sample)[0]
    assert got.dtype == torch.bfloat16
    assert torch.allclose(expected.float(), got.float(), atol=0.1)
    program = zoo.export_named(module, sample)
    assert count_graph_ops(program.graph)["sdpa"] == 2
    with cast_in_place(module, torch.float32, "cpu"), torch.inference_mode():
        assert module(*zoo.inputs())[0].dtype == torch.float32
    with torch.inference_mode():  # restored to bfloat16 in place, behind the module's back
        assert module(*sample)[0].dtype == torch.bfloat16


def test_rewrite_is_deterministic():
    """Child processes rewrite again and must get the same sites."""
    first = rewritten("gqa_expand")[3].to_dict()
    model = zoo.build(zoo.BY_NAME["gqa_expand"])
    _, again = rewrite_attention(zoo.io_module(model), zoo.inputs())
    assert again.to_dict()["sites"] == first["sites"]


def test_audit_lists_every_site_with_its_properties():
    audit = rewritten("gqa_expand")[3].to_dict()
    assert {"found", "rewritten", "already_sdpa", "skipped", "sites", "notes"} <= set(audit)
    site = audit["sites"][0]
    assert site["location"] == "layers.0.attn" and site["node"].startswith("softmax")
    assert site["kind"] == "softmax attention in GroupedQueryExpand"
    assert (site["heads"], site["kv_heads"], site["head_dim"], site["grouped_query"]) == (4, 2, 8, True)
    assert site["pattern"].startswith("matmul → kv heads ×2") and "softmax" in site["pattern"]


def test_transformers_eager_attention_through_the_graph_rule():
    """The graph rule alone (the fallback when the attention interface cannot be used) on Llama's eager attention:
    repeat_kv, additive causal+padding mask, softmax in float32."""
    transformers = pytest.importorskip("transformers")
    from exporter.modelio import Signature, make_io_module
    from exporter.rewrite.audit import AttentionAudit

    torch.manual_seed(0)
    model = transformers.LlamaModel(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=1000)).eval()
    io = make_io_module(model, Signature(("input_ids", "attention_mask"), ("last_hidden_state",)), "eager")
    ids = torch.randint(0, 1000, (2, 32))
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    audit = AttentionAudit()
    module = graph_rule.rewrite(io, [ids, mask], audit)
    assert audit.count(REWRITTEN) == 2
    assert [s.location for s in audit.sites] == ["layers.0.self_attn", "layers.1.self_attn"]
    assert all(s.grouped_query and s.kv_heads == 2 for s in audit.sites)
    program = zoo.export_named(module, [ids, mask], ("input_ids", "attention_mask"))
    assert count_graph_ops(program.graph)["softmax"] == 0
    ids, mask = torch.randint(0, 1000, (3, 17)), torch.ones(3, 17, dtype=torch.int64)
    mask[2, 9:] = 0
    with torch.inference_mode():
        assert close(io(ids, mask), program.module()(ids, mask))


@pytest.mark.parametrize("name", ["padding_boolean", "gqa_expand", "bmm_reshape", "einsum_sequence_major",
                                  "causal_masked_fill", "padding_both_sides"])
def test_onnx_model_uses_the_attention_op(name, tmp_path):
    import collections

    import numpy as np
    import onnx
    import onnxruntime as ort

    model, _, module, _ = rewritten(name)
    program = zoo.export_named(module, zoo.inputs())
    path = tmp_path / "model.onnx"
    torch.onnx.export(program, (), dynamo=True, opset_version=23, input_names=["x", "mask"], optimize=False,
                      verbose=False).save(str(path))
    ops = collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)
    assert ops["Attention"] == 2 and ops["Softmax"] == 0, ops
    other = zoo.inputs(3, 17, seed=1)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, {"x": other[0].numpy(), "mask": other[1].numpy()})[0]
    with torch.inference_mode():
        assert np.allclose(got, model(*other)[0].numpy(), atol=1e-5)


def test_inspect_lists_the_sites_of_a_custom_model(factory_checkpoint, write_recipe):
    """`exporter inspect` on the hand-written TinyEncoder (tests/conftest.py): one site, with what was matched."""
    from click.testing import CliRunner

    import exporter
    from conftest import FACTORY_RECIPE
    from exporter.cli import cli

    path, factory = factory_checkpoint
    recipe = write_recipe(FACTORY_RECIPE.format(targets='["exported_program"]'))
    attention = exporter.inspect(path, recipe, model=factory)["attention"]
    assert (attention["found"], attention["rewritten"], attention["skipped"]) == (1, 1, 0)
    site = attention["sites"][0]
    assert (site["location"], site["status"], site["heads"], site["head_dim"]) == ("TinyEncoder", REWRITTEN, 4, 8)
    assert site["pattern"] == "matmul → mul → softmax → matmul"
    result = CliRunner().invoke(cli, ["inspect", str(path), "--recipe", str(recipe), "--model", factory])
    assert result.exit_code == 0, result.output
    assert "TinyEncoder: softmax attention in TinyEncoder [rewritable]" in result.output  # inspect changes nothing


@pytest.mark.parametrize("name", ["causal_and_padding", "relative_bias"])
def test_exported_program_runs_on_any_sdpa_kernel(name):
    """SDPA kernels return different strides and a decomposed program bakes the traced ones into its views:
    the rewrite fixes the output layout, so the program also runs when another kernel is chosen at run time.
    A mask sliced from a parameter is copied, so it does not require grad and the flash kernel can take it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from exporter.measure import kernels

    model, _, module, _ = rewritten(name)
    program = zoo.export_named(module, zoo.inputs()).module()
    other = zoo.inputs(3, 17, seed=1)
    with torch.inference_mode():
        expected = model(*other)
        assert close(expected, program(*other))
        with sdpa_kernel([SDPBackend.MATH]):
            assert close(expected, program(*other))
        assert kernels.profile(lambda: program(*other))["backends"] == {"flash": 2}


class CountsCalls(zoo.MatmulDiv):
    """Hand-written attention in a module that mutates a buffer in forward."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def attend(self, q, k, v, mask):
        self.calls += 1
        return super().attend(q, k, v, mask)


def test_a_buffer_mutated_in_forward_is_still_mutated():
    torch.manual_seed(0)
    model = zoo.Stack(CountsCalls).eval()
    module, audit = rewrite_attention(zoo.io_module(model), zoo.inputs())
    assert audit.count(REWRITTEN) == 2
    before = int(model.layers[0].attn.calls)
    with torch.inference_mode():
        module(*zoo.inputs())
    assert int(model.layers[0].attn.calls) == before + 1


def test_failing_to_trace_again_falls_back_to_the_unrewritten_model(monkeypatch):
    model = zoo.build(zoo.BY_NAME["matmul_div"])
    module, audit = rewrite_attention(zoo.io_module(model), zoo.inputs())
    assert audit.count(REWRITTEN) == 2

    def broken(*args, **kwargs):
        raise RuntimeError("no trace at this dtype")

    monkeypatch.setattr(graph_rule, "capture", broken)
    model.double()
    module.double()
    assert audit.count(REWRITTEN) == 0 and all("tracing again at torch.float64" in s.reason for s in audit.sites)
    assert any("runs unrewritten" in n for n in audit.notes)
    sample = [zoo.inputs()[0].double(), zoo.inputs()[1]]
    with torch.inference_mode():
        assert torch.equal(model(*sample)[0], module(*sample)[0])


def test_a_mask_expanded_over_folded_heads_is_broadcast_not_copied():
    """baddbmm(mask.expand(b, h, 1, s).reshape(b·h, 1, s), q, kᵀ) on heads folded into the batch: SDPA runs on
    (batch, heads) with the mask as it was before the expansion, (batch, 1, q, k), broadcast over the heads; before,
    it ran on (1, batch·heads) with the mask built once per head, (1, batch·heads, q, k)."""
    _, _, module, audit = rewritten("baddbmm_mask")
    program = zoo.export_named(module, zoo.inputs(3, 17, seed=1))
    sdpa = [n for n in program.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert len(sdpa) == zoo.LAYERS
    for node in sdpa:
        q = node.args[0].meta["val"]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs["attn_mask"]
        assert tuple(q.shape)[:2] == (3, zoo.HEADS), q.shape
        assert tuple(mask.meta["val"].shape)[:2] == (3, 1), mask.meta["val"].shape
    assert all("heads unfolded (4): mask broadcast" in s.pattern for s in audit.sites), [s.pattern for s in audit.sites]
