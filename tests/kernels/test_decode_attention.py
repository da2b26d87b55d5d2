"""``exporter::decode_attention``, the attention of one decode step that the decode program of batch 1 runs on CUDA
with ``generation.decode_attention_kernel``.

Its speed is a GPU figure (docs/generation.md). Its arithmetic and its routing are pinned here on the CPU: the
Triton kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), in a process of their own with Triton on
their path (scripts/test.sh installs Triton into ``.triton/``, apart from the suite's environment, whose CPU torch
has none), against :func:`decode_attention.reference`, the same attention in float64. In float32 the kernels'
error is float32's own, at every slicing of the cache (one slice, several merged, slices the tile does not divide);
in bfloat16 it is the rounding of the softmax weights and of the output, no more than twice the output's own
rounding (Triton's interpreter rounds toward zero where the GPU rounds to nearest, which doubles both). The same
bounds fail a kernel handed a scale 10% off or no mask. Through a real decoder's step (transformers' Llama with
grouped-query heads, GPT-2 without), routed eagerly, every attention call runs the kernel and the logits are the
step's own. The step's mask built by ``exporter::step_mask`` is the step's own mask, bit for bit."""

from __future__ import annotations

import json

import pytest
import torch

from exporter.kernels import decode_attention as da
from exporter.testing.interpreted import run_interpreted

KERNEL = r"""
import json, math, sys, torch
from exporter.kernels import decode_attention as da
assert da.AVAILABLE and da.INTERPRETED
torch.manual_seed(0)
rows = []
for heads, kv_heads, per_head, slots, dim, dtype, masked, tile, defect in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    q = torch.randn(1, heads, per_head, dim, dtype=dtype)
    k, v = (torch.randn(1, kv_heads, slots, dim, dtype=dtype) for _ in range(2))
    mask = None
    if masked:  # a left-padded prompt's first slots and the slots after the step's position hidden
        mask = torch.zeros(1, 1, 1, slots, dtype=dtype)
        mask[..., :5] = mask[..., slots - 3:] = torch.finfo(dtype).min
    scale = 1 / math.sqrt(dim) * (1.1 if defect == "scale" else 1.0)
    given = None if defect == "no mask" else mask
    if tile:  # one launch at the given tile and number of slices
        out = torch.empty(1, heads, per_head, dim, dtype=dtype)
        da.launch(q, k, v, None if given is None else given.reshape(slots), out, scale, *tile)
    else:  # the registered op, at the tile config() chooses
        out = torch.ops.exporter.decode_attention(q, k, v, given, scale)
    ref = da.reference(q.double(), k.double(), v.double(), None if mask is None else mask.double())
    rel = lambda t: float((t.double() - ref).norm() / ref.norm())
    toward_zero = (ref.float().view(torch.int32) & -65536).view(torch.float32)  # bfloat16, rounded toward zero
    rows.append({"case": [heads, kv_heads, per_head, slots, dim], "kernel": rel(out), "dtype": str(out.dtype),
                 "toward_zero": rel(toward_zero)})
print(json.dumps(rows))
"""

STEP = r"""
import json, sys, torch, transformers
from exporter.generation.cache import DecoderStep, probe_layout
from exporter.kernels.decode_attention import routed
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
kind = sys.argv[1]
if kind == "llama":  # grouped-query heads: 4 query heads share each of 2 key/value heads
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM(config)
else:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
model.eval()
step = DecoderStep(model, True)
layout = probe_layout(model, True, "cpu")
slots = 40
kv = layout.allocate(1, slots, torch.float32, "cpu")
for tensor in kv:
    tensor.normal_()
padding = torch.ones(1, slots, dtype=torch.long)
padding[0, :3] = 0  # a left-padded prompt
rows = []
for position in (12, 25, 39):
    ids = torch.tensor([[position % 200 + 7]])
    where = torch.tensor([position])
    with torch.inference_mode():
        plain = step(ids, padding, where, [t.clone() for t in kv])
        with routed(devices=("cpu",)) as route:
            kernel = step(ids, padding, where, [t.clone() for t in kv])
        step.double()
        ref = step(ids, padding, where, [t.double() for t in kv])
        step.float()
    rel = lambda t: float((t.double() - ref).norm() / ref.norm())
    rows.append({"routed": route.routed, "kept": route.kept, "kernel": rel(kernel), "sdpa": rel(plain),
                 "layers": layout.layers})
print(json.dumps(rows))
"""


MASK = r"""
import json, torch
from exporter.generation.cache import step_mask
from exporter.kernels import decode_attention as da
torch.manual_seed(0)
rows = []
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    padding = (torch.rand(3, 1500) > 0.2).long()  # three rows, slots past one block of the kernel
    positions = torch.tensor([0, 700, 1499])
    built = torch.ops.exporter.step_mask(padding, positions, dtype)
    want = step_mask(padding, positions, dtype)
    with da.routed(devices=("cpu",)):
        routed = step_mask(padding, positions, dtype)  # what a step traced inside routed() builds
    rows.append({"dtype": str(dtype), "shape": list(built.shape), "equal": bool(torch.equal(built, want)),
                 "routed_equal": bool(torch.equal(routed, want)), "hidden": int((want != 0).sum())})
print(json.dumps(rows))
"""


def test_the_kernels_match_float64_at_every_slicing_and_round_once_in_bfloat16():
    cases = [[4, 2, 1, 40, 16, "float32", True, [16, 1, 4], None],      # one slice, the tile not dividing it
             [8, 2, 1, 130, 16, "float32", True, [16, 3, 4], None],     # three slices merged
             [4, 4, 1, 100, 32, "float32", False, [32, 2, 2], None],    # no mask, one query head per key head
             [8, 2, 2, 64, 16, "float32", True, [16, 2, 4], None],      # two query rows a head (8 rows a program)
             [14, 2, 1, 300, 64, "float32", True, None, None],          # Qwen2-0.5B's heads, the op's own tile
             [8, 2, 1, 512, 64, "bfloat16", True, None, None],
             [14, 2, 1, 300, 64, "bfloat16", True, None, None]]
    rows = run_interpreted(KERNEL, json.dumps(cases))
    for row in rows[:5]:
        assert row["dtype"] == "torch.float32" and row["kernel"] < 1e-5, row  # float32's own error
    for row in rows[5:]:
        assert row["dtype"] == "torch.bfloat16"
        assert row["kernel"] <= 2 * row["toward_zero"], row  # the weights' rounding and the output's, no more


def test_the_bounds_fail_a_kernel_given_a_wrong_scale_or_no_mask():
    cases = [[8, 2, 1, 64, 16, "float32", True, [16, 2, 4], "scale"],
             [8, 2, 1, 64, 16, "float32", True, [16, 2, 4], "no mask"],
             [8, 2, 1, 512, 64, "bfloat16", True, None, "scale"]]
    scale, no_mask, scale16 = run_interpreted(KERNEL, json.dumps(cases))
    assert scale["kernel"] > 1e-2 and no_mask["kernel"] > 1e-2, (scale, no_mask)
    assert scale16["kernel"] > 2 * scale16["toward_zero"], scale16


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_decoder_step_routed_runs_every_attention_in_the_kernel(kind):
    for row in run_interpreted(STEP, kind):
        assert row["routed"] == row["layers"] and row["kept"] == 0, row  # every layer's attention, none left on SDPA
        assert row["kernel"] < 1e-5 and row["kernel"] < 10 * row["sdpa"] + 1e-6, row  # the step's own logits


def test_the_step_mask_kernel_builds_the_steps_mask_bit_for_bit():
    for row in run_interpreted(MASK):
        assert row["shape"] == [3, 1, 3, 1500] and row["hidden"] > 0, row
        assert row["equal"] and row["routed_equal"], row  # 0 and the dtype's lowest value, where the step puts them


def test_only_one_row_over_the_whole_cache_is_taken():
    q, k, v = torch.zeros(1, 8, 1, 16), torch.zeros(1, 2, 40, 16), torch.zeros(1, 2, 40, 16)
    row = torch.zeros(1, 1, 1, 40)
    assert da.eligible(q, k, v, row, 0.0, False, True, ("cpu",))
    assert not da.eligible(q, k, v, row, 0.0, False, True)  # CUDA only unless told
    assert not da.eligible(q, k, v, row, 0.0, False, False, ("cpu",))  # grouped heads without enable_gqa
    assert not da.eligible(q, k, v, row, 0.0, True, True, ("cpu",))  # causal
    assert not da.eligible(q, k, v, row, 0.1, False, True, ("cpu",))  # dropout
    assert not da.eligible(q, k, v, torch.zeros(1, 1, 2, 40), 0.0, False, True, ("cpu",))  # a mask per query row
    assert not da.eligible(q, k, v, torch.zeros(1, 8, 1, 40), 0.0, False, True, ("cpu",))  # a mask per head
    assert not da.eligible(q, k, v, row.bool(), 0.0, False, True, ("cpu",))  # a boolean mask
    assert not da.eligible(torch.zeros(2, 8, 1, 16), torch.zeros(2, 2, 40, 16), torch.zeros(2, 2, 40, 16), row,
                           0.0, False, True, ("cpu",))  # two rows
    assert da.eligible(torch.zeros(1, 8, 4, 16), k, v, row, 0.0, False, True, ("cpu",))  # rows at one position
    assert not da.eligible(torch.zeros(1, 8, 5, 16), k, v, row, 0.0, False, True, ("cpu",))  # 20 rows a program
    assert not da.eligible(q.half(), k, v, row, 0.0, False, True, ("cpu",))  # dtypes that differ


def test_outside_its_context_nothing_is_routed():
    with da.routed(active=False) as route:
        assert route is None
    assert not any(isinstance(m, da._Route) for m in torch.overrides._get_current_function_mode_stack())
