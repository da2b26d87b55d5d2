"""The fp8 weight transform on its own: the stored weight and scales, the module's arithmetic in the model's dtype and
in float64, which linears are chosen, and that casting the model never touches the fp8 weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from exporter.modelio import cast_in_place
from exporter.numerics.reference import upcast_while_running
from exporter.quantize.cost import layer_sqnr, sqnr_db, top1_and_kl
from exporter.quantize.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_weight, rowwise_product
from exporter.quantize.transform import quantize_model


def test_weight_rows_scaled_to_the_fp8_range_and_rounded_once():
    torch.manual_seed(0)
    weight = torch.randn(64, 48) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different magnitudes
    qweight, scales = quantize_weight(weight)
    assert qweight.dtype == FP8 and scales.dtype == torch.float32 and scales.shape == (64, 1)
    # every row's largest value lands on 448, the top of e4m3's range
    assert torch.equal(qweight.float().abs().amax(dim=1), torch.full((64,), FP8_MAX))
    restored = qweight.double() * scales.double()
    # one rounding to e4m3 (3 mantissa bits): a relative error of at most 2^-4 on normal values, per row
    relative = ((restored - weight.double()).abs() / weight.double().abs().amax(dim=1, keepdim=True)).max()
    assert 0 < relative <= 2 ** -4


def test_zero_rows_stay_zero():
    product = rowwise_product(torch.zeros(3, 32, dtype=torch.bfloat16), *quantize_weight(torch.randn(16, 32)))
    assert torch.equal(product, torch.zeros(3, 16, dtype=torch.bfloat16))


def test_the_float64_path_is_the_same_arithmetic():
    """In float64 the module rounds activations and weights to fp8 as the bf16 path does, then multiplies exactly:
    the bf16 result differs from it by bf16's own roundings only (the activation scales, the accumulation, the
    output), far less than the quantization itself costs."""
    torch.manual_seed(1)
    linear = nn.Linear(256, 128)
    x = torch.randn(32, 256).bfloat16()  # bf16 values: both paths see the same input
    fp8 = Fp8Linear.from_linear(linear, "fp8-rowwise")
    fast, exact = fp8(x), fp8.double()(x.double())
    original = linear.double()(x.double())
    cost = sqnr_db(exact, original)
    assert 20 < cost < 35  # what fp8 costs: about 28 dB for Gaussian rows
    assert sqnr_db(fast, exact) > cost + 8  # bf16's roundings: about 39 dB


def test_casting_the_model_keeps_fp8_weights_and_float32_scales():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16))
    quantize_model(model, "fp8-rowwise")
    model.to(torch.bfloat16)
    layer = model[0]
    assert isinstance(layer, Fp8Linear) and layer.qweight.dtype == FP8 and layer.scales.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16
    with cast_in_place(model, torch.float16):
        assert layer.qweight.dtype == FP8 and layer.scales.dtype == torch.float32
    with upcast_while_running(model, torch.float64):
        out = model(torch.randn(2, 32, dtype=torch.float64))
    assert out.dtype == torch.float64 and layer.qweight.dtype == FP8


def test_the_head_tied_weights_exclusions_and_odd_sizes_stay_unquantized():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=40, vocab_size=128)
    model = transformers.LlamaForCausalLM(config)
    audit = quantize_model(model, "fp8-rowwise", exclude=("*.layers.1.*",))
    by_name = {layer.name: layer for layer in audit.layers}
    assert by_name["lm_head"].status == "excluded" and "head" in by_name["lm_head"].reason
    assert by_name["model.layers.1.self_attn.q_proj"].status == "excluded"
    assert "*.layers.1.*" in by_name["model.layers.1.self_attn.q_proj"].reason
    # intermediate size 40 is not a multiple of 16: gate, up and down stay in the model's dtype, each saying why
    down = by_name["model.layers.0.mlp.down_proj"]
    assert down.status == "fallback" and "multiple of 16" in down.reason
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert audit.count("fp8") == 4  # q, k, v, o of layer 0
    assert isinstance(model.lm_head, nn.Linear) and type(model.lm_head) is nn.Linear


def test_gpt2s_conv1d_linears_are_quantized_with_their_weight_transposed():
    """transformers' Conv1D (GPT-2's c_attn, c_proj, c_fc) stores its weight [in, out]: taken, quantized as the
    [out, in] linear it is, each layer's output within fp8's rounding of its float64 product (a weight quantized
    untransposed would be far off: c_attn is 64 x 192, the projections 64 x 64)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                                                 n_positions=64)).eval()
    audit = quantize_model(model, "fp8-rowwise")
    by_name = {layer.name: layer for layer in audit.layers}
    attn = by_name["transformer.h.0.attn.c_attn"]
    assert attn.status == "fp8" and (attn.in_features, attn.out_features) == (64, 192)
    assert audit.count("fp8") == 8 and by_name["lm_head"].status == "excluded"  # 2 x (c_attn, c_proj, c_fc, c_proj)
    assert isinstance(model.transformer.h[1].mlp.c_fc, Fp8Linear)
    ids = torch.randint(0, 128, (2, 16))
    layer_sqnr(model, audit, lambda: model(input_ids=ids))
    assert all(layer.sqnr_db is not None and layer.sqnr_db > 25 for layer in audit.layers if layer.status == "fp8"), \
        audit.judged()


def test_per_layer_sqnr_names_a_layer_with_a_wrong_scale():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32))
    audit = quantize_model(model, "fp8-rowwise")
    model[2].scales.mul_(1.5)  # a wrong scale in one layer
    model.to(torch.bfloat16)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    layer_sqnr(model, audit, lambda: model(x))
    values = {layer.name: layer.sqnr_db for layer in audit.layers}
    assert values["2"] < 10 and values["0"] > 25 and values["4"] > 25, values


def test_top1_and_kl_count_only_the_positions_the_mask_keeps():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 2.0], [5.0, 0.0]]])
    other = torch.tensor([[[2.0, 0.0], [2.0, 0.0], [0.0, 5.0]]])
    top1, kl = top1_and_kl(other, logits, torch.tensor([[1, 1, 0]]))
    assert top1 == 0.5 and kl > 0
    assert top1_and_kl(logits, logits, None) == (1.0, 0.0)


def test_weight_only_rounds_the_weight_alone():
    """fp8-weight-only: the product is the model's own (bf16) over the dequantized fp8 weight; the activations are
    not rounded to fp8, so it costs less than rowwise, and its program holds no fp8 product."""
    torch.manual_seed(3)
    linear = nn.Linear(128, 64)
    x = torch.randn(16, 128, dtype=torch.float64)
    rowwise, weight_only = (Fp8Linear.from_linear(linear, s) for s in ("fp8-rowwise", "fp8-weight-only"))
    exact = linear.double()(x)
    expected = x @ weight_only.dequantized_weight(torch.float64).t() + linear.bias.double()
    assert torch.allclose(weight_only.double()(x), expected)
    assert sqnr_db(weight_only.double()(x), exact) > sqnr_db(rowwise.double()(x), exact) + 2
    program = torch.export.export(weight_only.to(torch.bfloat16), (x[:2].bfloat16(),))
    assert not any("_scaled_mm" in str(n.target) for n in program.graph.nodes)
    assert weight_only.qweight.dtype == FP8


def test_weight_only_casts_the_weight_and_scales_after_the_product():
    """The form Inductor fuses whole: the fp8 weight cast to bf16 (exact) feeds the product, the scales multiply
    its output; no dequantized weight (a weight-sized tensor times the scales) is formed. In bf16 the output is
    rounded twice (the product, then the scaled value) where the dequantized form rounds the weight and the
    output once each: within 3 dB of it, far above the 20 dB a layer is held to."""
    torch.manual_seed(4)
    layer = Fp8Linear.from_linear(nn.Linear(256, 64, bias=False), "fp8-weight-only").to(torch.bfloat16)
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    program = torch.export.export(layer, (x,))
    muls = [n for n in program.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    assert muls and all(tuple(n.meta["val"].shape) == (64, 64) for n in muls)
    exact = x.double() @ layer.dequantized_weight(torch.float64).t()
    dequantized_first = x @ layer.dequantized_weight(torch.bfloat16).t()
    assert sqnr_db(layer(x).double(), exact) >= sqnr_db(dequantized_first.double(), exact) - 3


def test_the_kl_allowance_is_the_error_allowance_squared():
    """Where the unquantized model is itself off float64, KL passes within max_error_ratio squared times its own
    KL (KL is second order in the logit error): an error 10x bf16's passes (KL about 100x), 20x fails (400x)."""
    from exporter.quantize.cost import Budget, Cost, judge_outputs

    generator = torch.Generator().manual_seed(0)
    ref = 2 * torch.randn(1, 64, 50, generator=generator, dtype=torch.float64)

    def noisy(scale: float) -> torch.Tensor:
        return ref + scale * torch.randn(ref.shape, generator=generator, dtype=torch.float64)

    budget = Budget(min_sqnr_db=99.0, max_error_ratio=16.0, layer_min_sqnr_db=20.0, min_top1=0.0, max_kl=1e-9)
    unquantized = noisy(0.01)
    figures = {}
    for factor in (10, 20):
        cost = Cost(scheme="fp8-rowwise", budget=budget, dtype="bfloat16")
        judge_outputs(cost, ("logits",), [{}], [[noisy(0.01 * factor)]], [[unquantized]], [[ref]])
        figures[factor] = (cost.logits[0]["kl"] / cost.logits[0]["unquantized_kl_vs_float64"], cost.problems)
    ratio10, problems10 = figures[10]
    ratio20, problems20 = figures[20]
    assert 50 < ratio10 < 256 and not problems10, figures  # the old rule (KL <= bf16's own) failed this one
    assert ratio20 > 256 and any("mean KL" in p for p in problems20), figures


def test_the_recipe_names_exactly_the_scheme_rows():
    """``quantize.scheme`` is checked by the recipe parser (without torch) against its own list: that list and the
    scheme table must name the same schemes, so a new row is also a scheme a recipe can give."""
    from exporter.quantize.schemes import SCHEMES, scheme
    from exporter.recipe import QUANTIZE_SCHEMES

    assert set(QUANTIZE_SCHEMES) == {"none", *SCHEMES}
    assert {name: (row.label, row.per_token, row.one_row_kernel) for name, row in SCHEMES.items()} == {
        "fp8-rowwise": ("fp8", True, False), "fp8-weight-only": ("fp8", False, True)}
    with pytest.raises(KeyError, match="schemes are fp8-rowwise, fp8-weight-only"):
        scheme("int4")
