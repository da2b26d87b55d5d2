"""``exporter::decode_step_attention``: a decode step's rotary embedding, cache write and attention in one kernel,
and the rewrite that puts it in the decode program of batch 1 (``generation.decode_step_kernel``).

Its speed is a GPU figure (docs/generation.md). Its arithmetic and the rewrite are pinned here on the CPU, the
kernel under Triton's interpreter in a process of its own (as ``test_decode_attention``): against
:func:`decode_step_attention.reference` (float64, nothing rounded) in float32, and in bfloat16 against the same
step with the rotated q and key rounded once to bfloat16 (what the unfused program computes; toward zero, as Triton's
interpreter rounds), within twice the output's own rounding and no further from it than ``exporter::decode_attention``
is. The key and value land in the cache at the step's position and nowhere else, and the stale
slot there is never read. The same bounds fail a kernel handed the wrong position or a rotation turned the other
way. Through real decoders' steps (Llama with grouped-query heads, Qwen2 with q/k/v biases, GPT-2 without a
rotary embedding), exported and rewritten, every attention takes its cache write (and its rotation where there is
one), and the logits and caches are the program's own."""

from __future__ import annotations

import json

from exporter.testing.interpreted import run_interpreted

KERNEL = r"""
import json, math, sys, torch
from exporter.kernels import decode_attention as da
from exporter.kernels import decode_step_attention as dsa
assert da.AVAILABLE and da.INTERPRETED
torch.manual_seed(0)
rows = []
for heads, kv_heads, dim, slots, pos, dtype, rope, masked, in_kernel, defect in json.loads(sys.argv[1]):
    dtype = getattr(torch, dtype)
    q = torch.randn(1, heads, 1, dim).to(dtype)
    k_new, v_new = torch.randn(1, kv_heads, 1, dim).to(dtype), torch.randn(1, kv_heads, 1, dim).to(dtype)
    angles = (torch.rand(dim // 2) * 6).repeat(2)
    cos, sin = (angles.cos().to(dtype).reshape(1, 1, 1, dim), angles.sin().to(dtype).reshape(1, 1, 1, dim))
    if not rope:
        cos = sin = None
    k_cache, v_cache = torch.randn(1, kv_heads, slots, dim).to(dtype), torch.randn(1, kv_heads, slots, dim).to(dtype)
    k_cache[:, :, pos] = v_cache[:, :, pos] = 1e4  # a stale slot: read, it would swamp the output
    mask = None
    if masked:  # a left-padded prompt's first slots and the slots after the step's position hidden
        mask = torch.zeros(1, 1, 1, slots, dtype=dtype)
        mask[..., :2] = mask[..., pos + 1:] = torch.finfo(dtype).min
    position = torch.tensor([pos])
    given = torch.tensor([(pos + 1) % slots]) if defect == "position" else position
    turned = None if sin is None else (-sin if defect == "rotation" else sin)
    keys, values = k_cache.clone(), v_cache.clone()
    count = torch.full((kv_heads + 3,), 7, dtype=torch.int32)  # this call's counts from offset 3, zeroed
    count[3:] = 0
    out = torch.ops.exporter.decode_step_attention(q, k_new, v_new, cos, turned, given, keys, values, mask,
                                                   1 / math.sqrt(dim), count if in_kernel else count[:0], 3)
    slices = da.config(slots, dim)[1]
    ref, ref_keys, ref_values = dsa.reference(q, k_new, v_new, cos, sin, position, k_cache, v_cache, mask)
    def rounded(t):  # rotated in float32 and rounded once; Triton's interpreter rounds toward zero (the GPU, and
        turned = dsa.rotate(t.float(), None if cos is None else cos.float(), None if sin is None else sin.float())
        if dtype == torch.bfloat16:  # Inductor's unfused program, round to nearest)
            turned = (turned.view(torch.int32) & -65536).view(torch.float32)
        return turned.to(dtype)
    program, written_keys, written_values = dsa.reference(rounded(q), rounded(k_new), v_new, None, None, position,
                                                          k_cache, v_cache, mask)
    # the unfused form: the rotations rounded, the cache written, then exporter::decode_attention
    unfused = torch.ops.exporter.decode_attention(rounded(q), written_keys.to(dtype), written_values.to(dtype), mask,
                                                  1 / math.sqrt(dim))
    rel = lambda t, r: float((t.double() - r).norm() / r.norm())
    toward_zero = (program.float().view(torch.int32) & -65536).view(torch.float32)  # bfloat16 rounded toward 0
    others = [i for i in range(slots) if i != pos]
    counted = count[3:].tolist() == ([slices] * kv_heads if in_kernel and slices > 1 else [0] * kv_heads)
    rows.append({"case": [heads, kv_heads, dim, slots, pos, str(dtype), rope, in_kernel, slices],
                 "counted": counted and count[:3].tolist() == [7, 7, 7], "kernel": rel(out, ref),
                 "vs_program": rel(out, program), "toward_zero": rel(toward_zero, program),
                 "unfused": rel(unfused, program),
                 "key": rel(keys[:, :, pos], ref_keys[:, :, pos]),
                 "value": rel(values[:, :, pos], ref_values[:, :, pos]),
                 "rest_untouched": bool(torch.equal(keys[:, :, others], k_cache[:, :, others]) and
                                        torch.equal(values[:, :, others], v_cache[:, :, others]))})
print(json.dumps(rows))
"""

STEP = r"""
import json, sys, torch, transformers
from exporter.generation.cache import DecoderStep, probe_layout
from exporter.kernels import decode_attention as da
from exporter.kernels.decode_step_attention import fold
from exporter.rewrite.graph_facts import count_graph_ops
transformers.logging.set_verbosity_error()
rows = []
small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=128)
for kind in ("llama", "qwen2", "gpt2"):
    torch.manual_seed(0)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    elif kind == "qwen2":  # q, k and v with biases
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**small))
    else:  # learned positions: no rotary embedding
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                                                     n_positions=128))
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.config._attn_implementation = "sdpa"
    model = model.eval()
    layout = probe_layout(model, True, "cpu")
    step = DecoderStep(model, True)
    kv = layout.allocate(1, 32, torch.float32, "cpu")
    for t in kv:
        t.normal_()
    padding = torch.ones(1, 32, dtype=torch.long)
    padding[0, :2] = 0
    args = (torch.tensor([[5]]), padding, torch.tensor([7]))
    with da._gqa_unrepeated(da._Route(("cpu",))):  # grouped heads unrepeated, as routed() traces the program
        program = torch.export.export(step, (*args, [t.clone() for t in kv]), strict=False)
    program_kv = [t.clone() for t in kv]
    with torch.no_grad():
        before = program.module()(*args, program_kv)
    done = fold(program, sdpa=True)
    folded_kv = [t.clone() for t in kv]
    with torch.no_grad():
        after = program.module()(*args, folded_kv)
        model.double()
        ref_kv = [t.double() for t in kv]
        ref = step(*args, ref_kv)
    rel = lambda t, r: float((t.double() - r).norm() / r.norm())
    rows.append({"kind": kind, "layers": layout.layers, "attentions": done.attentions, "rotations": done.rotations,
                 "kept": done.kept, "ops": count_graph_ops(program.graph), "folded": rel(after, ref),
                 "program": rel(before, ref), "cache": max(rel(a, b) for a, b in zip(folded_kv, program_kv)),
                 "cache_vs_float64": max(rel(a, r) for a, r in zip(folded_kv, ref_kv))})
print(json.dumps(rows))
"""


def test_the_kernel_rotates_writes_and_attends_as_float64_does():
    # heads, kv heads, head dim, slots, position, dtype, rotary, mask, slices merged by the last, defect
    cases = [[8, 2, 16, 40, 7, "float32", True, True, True, None],          # one slice, grouped heads
             [8, 2, 16, 300, 200, "float32", True, True, True, None],       # three slices, the position in the second
             [8, 2, 16, 300, 200, "float32", True, True, False, None],      # the same merged by a kernel of its own
             [4, 4, 8, 20, 0, "float32", False, False, True, None],         # no rotation, no mask, the first slot
             [14, 2, 64, 300, 299, "float32", True, True, True, None],      # Qwen2-0.5B's heads, the last slot
             [8, 2, 64, 512, 300, "bfloat16", True, True, True, None],
             [14, 2, 64, 300, 130, "bfloat16", True, True, True, None]]
    rows = run_interpreted(KERNEL, json.dumps(cases))
    for row in rows:
        assert row["counted"], row  # each head's slices counted in its own counts, where the last merges them
        assert row["rest_untouched"], row  # the key and value written at the position, nothing else
        assert row["value"] == 0.0, row  # the value as given
    for row in rows[:5]:
        assert row["kernel"] < 1e-5 and row["key"] < 1e-6, row  # float32's own error; the stale slot never read
    for row in rows[5:]:
        assert row["vs_program"] <= 2 * row["toward_zero"], row  # the unfused program's rounding, no more
        assert row["vs_program"] <= 1.1 * row["unfused"], row  # and no more than exporter::decode_attention's
        assert row["key"] < 2 ** -8, row  # the rotated key rounded once to bfloat16


def test_the_bounds_fail_a_kernel_given_another_position_or_the_rotation_turned_back():
    cases = [[8, 2, 16, 40, 7, "float32", True, True, True, "position"],
             [8, 2, 16, 40, 7, "float32", True, True, True, "rotation"],
             [8, 2, 64, 512, 300, "bfloat16", True, True, True, "rotation"]]
    position, rotation, rotation16 = run_interpreted(KERNEL, json.dumps(cases))
    assert position["kernel"] > 1e-2 and not position["rest_untouched"], position
    assert rotation["kernel"] > 1e-2 and rotation["key"] > 1e-2, rotation
    assert rotation16["vs_program"] > 2 * rotation16["toward_zero"], rotation16


def test_the_rewrite_folds_every_layers_cache_write_and_rotation_and_keeps_the_step():
    for row in run_interpreted(STEP):
        layers = row["layers"]
        assert row["attentions"] == layers and not row["kept"], row  # every layer's attention took its cache write
        assert row["rotations"] == (0 if row["kind"] == "gpt2" else layers), row  # and its rotation, where it has one
        assert row["ops"].get("decode_step_attention") == layers and row["ops"]["sdpa"] == 0, row
        assert row["folded"] < 1e-5 and row["folded"] < 10 * row["program"] + 1e-6, row  # the step's own logits
        assert row["cache"] < 1e-6 and row["cache_vs_float64"] < 1e-5, row  # and its caches
