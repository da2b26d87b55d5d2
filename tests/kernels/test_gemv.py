"""``exporter::gemv`` and the rewrite that puts it in the decode program of batch 1 (``generation.decode_gemv_kernel``).

Its speed is a GPU figure (docs/generation.md). Its arithmetic and the rewrite are pinned here on the CPU: the Triton
kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``) in a process of its own with Triton on its path
(scripts/test.sh installs Triton into ``.triton/``), against :func:`gemv.reference`, the same computation in float64.

- In float32 the kernel's error is float32's own, with every combination of what it folds in (the RMSNorm, the gated
  activation of a fused gate/up weight, the residual, a bias), at tiles that divide the row and tiles that do not.
- In bfloat16 it rounds where the unfused model rounds, no more: its error is that of the same
  steps computed by torch with the same roundings (here it is that, bit for bit). The interpreter rounds toward zero
  where the GPU rounds to nearest, so the emulation rounds toward zero too.
- The same bounds fail a kernel handed a norm weight 2% off, or no residual.
- Through real decoders' steps (transformers' Llama with grouped-query heads, an RMSNorm epsilon of 0.5 that a
  rewrite ignoring it would miss, and Qwen2 with biased q/k/v), :func:`decode_products.fuse` turns every product of
  the decode program of batch 1 into one node, the norms, activations and residual adds into it, and the rewritten
  program gives the program's own logits; GPT-2's transposed ``Conv1D`` products are left as they were.
- An fp8 weight-only weight (``float8_e4m3fn`` rows, a float32 scale each) is read by the same kernel with the same
  fusions: float32's own error, bf16's rounding and no more, and a kernel handed its scales one row off fails the
  same bounds. A Llama quantized to fp8 weight-only, whose decode program of batch 1 holds ``exporter::fp8_gemv``,
  folds into ``exporter::gemv`` nodes with the quantized step's own logits.
"""

from __future__ import annotations

import json

import pytest

from exporter.testing.interpreted import run_interpreted

KERNEL = r"""
import json, sys, torch
from exporter.kernels import gemv as G
assert G.AVAILABLE
torch.manual_seed(0)

def toward_zero(t):  # bfloat16, rounded toward zero (as the interpreter rounds), kept in float32
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32)

def emulate(x, w, norm, eps, glu, residual, bias, scales):  # the kernel's roundings in torch, sums in float32
    h = x.float().reshape(-1)
    if norm is not None:
        h = toward_zero(h * torch.rsqrt(h.square().mean() + eps))
        h = toward_zero(h * norm.float())
    y = w.float() @ h
    if scales is not None:
        y = y * scales
    if bias is not None:
        y = y + bias.float()
    if glu:
        gate, up = toward_zero(y).chunk(2)
        y = toward_zero(toward_zero(torch.nn.functional.silu(gate)) * up)
    y = toward_zero(y)
    if residual is not None:
        y = toward_zero(y + residual.float().reshape(-1))
    return y

rows = []
for n, k, dtype, norm, glu, residual, bias, tile, defect, *fp8 in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    weight = (torch.randn(2 * n if glu else n, k) / k ** 0.5).to(dtype)
    scales = None
    if fp8:  # weight-only fp8: one float32 scale a row, the weight in float8_e4m3fn
        scales = weight.float().abs().amax(1) / 448
        weight = (weight.float() / scales[:, None]).to(torch.float8_e4m3fn)
    given_scales = scales
    if defect == "scale":  # each row given another row's scale
        given_scales = scales.roll(1)
    x = (3 * torch.randn(1, 1, k)).to(dtype)
    nw = (1 + 0.2 * torch.randn(k)).to(dtype) if norm else None
    res = torch.randn(1, 1, n).to(dtype) if residual else None
    b = torch.randn(weight.shape[0]).to(dtype) if bias else None
    given_norm = nw * 1.02 if defect == "norm" else nw
    given_res = None if defect == "residual" else res
    if tile:
        out = torch.empty(n, dtype=dtype)
        G.launch(x.reshape(k), weight, out, given_norm, 1e-5, glu, None if given_res is None else given_res.reshape(n),
                 b, *tile, scales=given_scales)
    else:
        out = torch.ops.exporter.gemv(x, weight, given_norm, 1e-5, glu, given_res, b,
                                      None if given_scales is None else given_scales.reshape(-1, 1))
    ref = G.reference(x, weight, nw, 1e-5, glu, res, b, scales).reshape(-1)
    rel = lambda t: float((t.double().reshape(-1) - ref).norm() / ref.norm())
    rows.append({"case": [n, k, str(dtype), norm, glu, residual, bias, bool(fp8)], "kernel": rel(out),
                 "emulated": rel(emulate(x, weight, nw, 1e-5, glu, res, b, scales)), "shape": list(out.shape),
                 "tile": list(G.config(n, k, glu, fp8=bool(fp8)))})
print(json.dumps(rows))
"""

STEP = r"""
import json, sys, torch, transformers
from exporter.generation.cache import DecoderStep, probe_layout
from exporter.generation.programs import export_steps
from exporter.kernels.decode_products import fuse
from exporter.rewrite.graph_facts import count_graph_ops
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
kind, dtype = sys.argv[1], getattr(torch, sys.argv[2])
fp8 = kind.endswith("-fp8")
kind = kind.removesuffix("-fp8")
small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128)
if kind == "llama":  # an epsilon large enough that a rewrite reading another would miss
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rms_norm_eps=0.5, **small))
elif kind == "qwen2":  # q, k and v with biases: addmm
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small))
else:
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                                                 n_positions=128))
for p in model.parameters():
    p.data.normal_(0, 0.2)
model = model.eval().to(dtype)
if fp8:  # weight-only fp8 as h100-fp8 quantizes it; its products of one row run exporter::fp8_gemv
    from exporter.quantize import fp8_gemv as F
    from exporter.quantize.transform import quantize_model
    quantize_model(model, "fp8-weight-only", keep_originals=False)
    def eligible(x, qweight):  # as on CUDA: the interpreter runs the kernel on the CPU's tensors
        return F._ACTIVE and x.dtype in F.ACTIVATIONS and all(s == 1 for s in x.shape[:-1]) and \
            x.shape[-1] == qweight.shape[1]
    F.eligible = eligible
layout = probe_layout(model, True, "cpu")
if fp8:  # traced, the op only allocates its output: a GPU build's wrap_triton does not run the kernel on fake
    launch, F.launch = F.launch, lambda *args, **kwargs: None  # tensors, the interpreter's kernel would
programs = export_steps(DecoderStep(model, True), layout, 2, 4, 32, dtype, "cpu", fuse=True, one=True)
if fp8:
    F.launch = launch
program = programs.decode_one
kv = layout.allocate(1, 32, dtype, "cpu")
for t in kv:
    t.normal_()
padding = torch.ones(1, 32, dtype=torch.long)
padding[0, :2] = 0
args = (torch.tensor([[5]]), padding, torch.tensor([7]))
before = program.module()(*args, [t.clone() for t in kv])
fp8_nodes = lambda: sum("fp8_gemv" in str(node.target) for node in program.graph.nodes)
fp8_before = fp8_nodes()
done = fuse(program)
after = program.module()(*args, [t.clone() for t in kv])
model.double()
ref = DecoderStep(model, True)(*args, [t.double() for t in kv])
rel = lambda t: float((t.double() - ref).norm() / ref.norm())
print(json.dumps({"products": done.products, "fp8": done.fp8, "fp8_before": fp8_before, "fp8_after": fp8_nodes(),
                  "norms": done.norms, "activations": done.activations,
                  "residuals": done.residuals, "kept": len(done.kept), "ops": count_graph_ops(program.graph),
                  "fused": rel(after), "program": rel(before), "layers": layout.layers, "note": done.note()}))
"""


def test_the_kernel_matches_float64_with_all_it_folds_in_and_rounds_where_the_model_rounds():
    # n, k, dtype, norm, glu, residual, bias, tile (None: the op at config()), defect
    cases = [[48, 200, "float32", True, False, False, False, [4, 64, 2], None],   # the tile not dividing the row
             [50, 128, "float32", True, True, False, True, [4, 32, 2], None],     # gate/up with biases, rows left over
             [33, 300, "float32", False, False, True, False, [2, 128, 2], None],
             [64, 256, "float32", False, False, False, False, None, None],
             [96, 512, "bfloat16", True, False, False, False, None, None],        # q/k/v after the norm
             [128, 256, "bfloat16", True, True, False, False, None, None],        # gate/up, silu(gate) * up
             [64, 1024, "bfloat16", False, False, True, False, None, None],       # down, the residual added
             [80, 512, "bfloat16", False, False, True, True, [1, 512, 4], None]]
    rows = run_interpreted(KERNEL, json.dumps(cases))
    for row, case in zip(rows, cases):
        assert row["shape"] == ([case[0]] if case[7] else [1, 1, case[0]]), row
    for row in rows[:4]:
        assert row["kernel"] < 1e-5, row  # float32's own error
    for row in rows[4:]:
        assert row["emulated"] > 1e-4, row  # bfloat16's rounding, measured
        assert row["kernel"] <= 1.01 * row["emulated"], row  # the model's roundings, no more (here: bit for bit)


def test_the_bounds_fail_a_kernel_given_another_norm_weight_or_no_residual():
    cases = [[96, 512, "bfloat16", True, False, False, False, None, "norm"],
             [64, 1024, "bfloat16", False, False, True, False, None, "residual"],
             [48, 200, "float32", True, False, False, False, [4, 64, 2], "norm"]]
    for row in run_interpreted(KERNEL, json.dumps(cases)):
        assert row["kernel"] > 1e-2 and row["kernel"] > 1.2 * row["emulated"], row


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_rewrite_folds_every_product_of_a_decode_step_and_keeps_its_logits(kind):
    row = run_interpreted(STEP, kind, "float32")
    layers = row["layers"]
    assert row["products"] == 4 * layers + 1 and row["kept"] == 0, row  # q/k/v, o, gate/up, down a layer; the head
    assert row["norms"] == 2 * layers + 1 and row["activations"] == layers and row["residuals"] == 2 * layers, row
    assert row["ops"]["gemv"] == 4 * layers + 1 and row["ops"]["matmul"] == 0, row  # no product left beside them
    assert row["fused"] < 1e-5 and row["fused"] < 10 * row["program"] + 1e-6, row  # the step's own logits


def test_in_bfloat16_the_rewritten_step_stays_within_the_programs_own_rounding():
    row = run_interpreted(STEP, "llama", "bfloat16")
    assert row["products"] == 9 and row["program"] > 1e-3, row
    assert row["fused"] < 3 * row["program"], row  # the interpreter rounds toward zero: about twice the GPU's error


def test_gpt2s_transposed_products_are_left_as_they_were():
    row = run_interpreted(STEP, "gpt2", "float32")
    assert row["products"] == 1 and row["kept"] == 4 * row["layers"], row  # the head alone is a plain linear
    assert row["fused"] < 1e-5, row


def test_an_fp8_weight_is_scaled_row_by_row_with_everything_else_folded_in():
    # weight-only fp8: float8_e4m3fn rows, a float32 scale each, applied before the bias and rounded once
    cases = [[48, 200, "float32", True, False, False, True, [4, 64, 2], None, True],   # norm, bias, ragged row
             [50, 128, "float32", True, True, False, False, [2, 32, 2], None, True],   # gate/up: each half its scales
             [64, 256, "float32", False, False, True, False, None, None, True],
             [96, 512, "bfloat16", True, False, False, False, None, None, True],       # q/k/v after the norm
             [128, 256, "bfloat16", True, True, False, False, None, None, True],       # gate/up, silu(gate) * up
             [64, 1024, "bfloat16", False, False, True, False, None, None, True]]      # down, the residual added
    rows = run_interpreted(KERNEL, json.dumps(cases))
    for row in rows[:3]:
        assert row["kernel"] < 1e-5, row  # float32's own error: the scales are applied, and to the right rows
    for row in rows[3:]:
        assert row["emulated"] > 1e-4 and row["kernel"] <= 1.01 * row["emulated"], row
    for row in rows:
        block_n, block_k, warps = row["tile"]
        assert block_n >= 1 and block_k >= 16 and warps in (2, 4, 8), row  # fp8's own tile rule


def test_the_bound_fails_an_fp8_kernel_given_its_scales_one_row_off():
    cases = [[64, 256, "float32", False, False, False, False, None, "scale", True],
             [128, 256, "bfloat16", True, True, False, False, None, "scale", True]]
    for row in run_interpreted(KERNEL, json.dumps(cases)):
        assert row["kernel"] > 2e-3 and row["kernel"] > 1.2 * row["emulated"], row


def test_an_fp8_decode_step_folds_into_the_same_kernels():
    # transformers' Llama quantized to fp8 weight-only: its products of one row are exporter::fp8_gemv, and the
    # rewrite makes each, with its norm, activation or residual, one exporter::gemv reading the fp8 weight
    row = run_interpreted(STEP, "llama-fp8", "float32")
    layers = row["layers"]
    assert row["fp8_before"] == 4 * layers and row["fp8_after"] == 0, row  # q/k/v, o, gate/up, down in fp8
    assert row["products"] == 4 * layers + 1 and row["fp8"] == 4 * layers and row["kept"] == 0, row  # + the head
    assert row["norms"] == 2 * layers + 1 and row["activations"] == layers and row["residuals"] == 2 * layers, row
    assert row["fused"] < 1e-5 and row["fused"] < 10 * row["program"] + 1e-6, row  # the quantized step's logits
