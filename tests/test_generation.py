"""--task text-generation: prefill and decode programs over a static KV cache, judged step by step, generating,
verified; a planted defect in a cache update fails the gate; left padding never turns into NaN."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import exporter
from exporter.generation.cache import DecoderStep, probe_layout
from exporter.generation.driver import Prompt, Steps, generate
from exporter.generation.reference import reference_generation
from exporter.modelio import attention_implementation
from exporter.revalidate import validate_folder
from exporter.verify import verify


def generate_cli(*args):
    return subprocess.run([sys.executable, "-m", "exporter", "generate", *args], capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def llama_generation(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("generation") / "llama"
    result = exporter.convert(tiny_models["llama"], "cpu-fp32", out, task="text-generation",
                              targets=("exported_program", "aoti", "onnx"))
    return result


def test_llama_prefill_and_decode_match_the_float64_reference(llama_generation):
    report = llama_generation.report
    assert llama_generation.exit_code == 0 and report["passed"], report["problems"]
    assert report["task"] == "text-generation"
    gen = report["generation"]
    assert gen["padded_rows"] == [1] and gen["eager"]["tokens_identical"]  # eager float32 picks the same tokens
    built = {a["name"]: a for a in report["artifacts"]}
    for name in ("exported_program", "aoti", "onnx"):
        entry = built[name]
        numerics = entry["numerics"]
        assert entry["status"] == "ok" and numerics["passed"]
        assert len(numerics["steps"]) == gen["new_tokens"] and all(s["passed"] for s in numerics["steps"])
        assert numerics["tokens_identical"] and numerics["free_running"]["identical"]
        assert numerics["nonfinite_logits"] == 0  # the left-padded row stays finite (onnxruntime's too)
        assert entry["programs"]["prefill"] == {"sdpa": 2, "softmax": 0}
        assert entry["programs"]["decode"] == {"sdpa": 2, "softmax": 0}
        assert len(entry["fused_projections"]) == 4  # q/k/v and gate/up of both layers (the default)
        for label in ("batch_1", "batch"):
            timing = entry["bench"][label]
            assert timing["decode"]["median_ms"] > 0 and timing["prefill"]["median_ms"] > 0
    assert len(report["attention"]["sites"]) == 2
    files = {f["path"] for a in report["artifacts"] for f in a["files"]}
    assert {"prefill.pt2", "decode.pt2", "prefill.aoti.pt2", "decode.aoti.pt2", "aoti_loader.py",
            "generation.aoti.weights.safetensors", "prefill.onnx", "decode.onnx", "generation.onnx.data"} <= files
    decode = torch.export.load(str(llama_generation.out / "decode.pt2"))  # one weight per fused group, no other
    weights = [s.target for s in decode.graph_signature.input_specs if s.kind.name == "PARAMETER"]
    assert not any(name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")) for name in weights)
    assert sum(name.endswith("fused.weight") for name in weights) == 4
    assert "Numerics" in (llama_generation.out / "report.md").read_text()


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
        located[name] = {(t.name, tuple((e.key, e.value) for e in t.external_data))
                         for t in proto.graph.initializer if t.external_data}
        assert {dict(e)["location"] for _, e in located[name]} == {"generation.onnx.data"}
    assert located["prefill.onnx"] == located["decode.onnx"]  # the same bytes of the one file
    assert not (out / "prefill.onnx.data").exists() and not (out / "decode.onnx.data").exists()


def test_onnx_generation_programs_are_refused_where_onnxruntime_cannot_check_them():
    from exporter.generation.onnx_programs import refusal

    assert refusal("cpu", "float32") is None
    assert "no CUDA execution provider" in refusal("cuda", "bfloat16")
    assert "no bfloat16 kernels" in refusal("cpu", "bfloat16")


def test_a_constant_that_differs_between_the_programs_stays_in_its_own_model(tmp_path):
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from exporter.generation.onnx_programs import share_weights

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


def test_the_aoti_programs_share_one_copy_of_the_weights(llama_generation):
    from pathlib import Path

    from exporter.generation.cache import CacheLayout
    from exporter.generation.programs import FILES, WEIGHTS, load_steps
    from exporter.targets.aoti_loader import weights_beside

    out = llama_generation.out
    packages = [out / name for name in FILES["aoti"]]
    assert not any(Path(weights_beside(str(p))).exists() for p in packages)  # no weights file per program
    with open(out / WEIGHTS, "rb") as handle:  # the shared file holds every weight of the model once
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    params = {k for k in header if k != "__metadata__"}
    assert any(name.endswith("embed_tokens.weight") for name in params)
    setup = json.loads((out / "generation.json").read_text())
    steps = load_steps("aoti", out, CacheLayout.from_dict(setup["layout"]), setup["cache_length"], torch.float32,
                       "cpu")
    prefill, decode, fresh = steps.prefill.constants, steps.decode.constants, steps.fresh_decode().constants
    shared = set(prefill) & set(decode)
    assert shared and set(prefill) | set(decode) <= params
    assert sum(n.endswith("fused.weight") for n in shared) == 4  # the fused weights are shared too
    # the decode programs use the prefill's tensors themselves: one copy of the weights in memory
    assert all(decode[n].data_ptr() == prefill[n].data_ptr() == fresh[n].data_ptr() for n in shared)


def test_generate_prints_the_reference_tokens(llama_generation):
    report = llama_generation.report
    ids = json.loads((llama_generation.out / "generation.json").read_text())
    from safetensors.torch import load_file

    stored = load_file(llama_generation.out / "reference" / "generation.safetensors")
    rows = [stored["prompt_ids"][r][stored["prompt_mask"][r].bool()].tolist() for r in range(2)]
    expected = report["generation"]["reference_tokens"]
    for target in ("aoti", "exported_program", "onnx"):
        done = generate_cli(str(llama_generation.out), "--target", target, "--json",
                            *[f"--input-ids={','.join(map(str, row))}" for row in rows])
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"generated": expected}
    short = generate_cli(str(llama_generation.out), "-t", "aoti", "--input-ids", ",".join(map(str, rows[0])),
                         "--max-new-tokens", "3", "--json")
    assert json.loads(short.stdout)["generated"] == [expected[0][:3]]
    assert ids["new_tokens"] == len(expected[0])


def test_generate_refuses_what_it_cannot_run(llama_generation, tmp_path):
    out = str(llama_generation.out)
    cases = [(["-t", "compile", "--input-ids", "1,2"], "has no decode program"),
             (["-t", "exported_program", "--input-ids", "1,99999"], "outside the vocabulary"),
             (["-t", "exported_program", "--input-ids", "1,x"], "comma-separated")]
    for args, expected in cases:
        done = generate_cli(out, *args)
        assert done.returncode == 2 and expected in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    forward = generate_cli(str(tmp_path), "-t", "exported_program", "--input-ids", "1")
    assert forward.returncode == 2 and "--task text-generation" in forward.stderr


def test_verify_re_runs_a_short_generation(llama_generation):
    result = verify(llama_generation.out)
    assert result.passed, result.problems
    numerics = [c for c in result.checks if c.name == "numerics"]
    assert {c.subject for c in numerics} == {"exported_program", "aoti", "onnx"}
    assert all(c.passed and "steps within their stored bars" in c.message for c in numerics)


def test_validate_points_a_generation_folder_to_verify(llama_generation):
    with pytest.raises(exporter.errors.UsageError, match="exporter verify"):
        validate_folder(llama_generation.out)


def test_verify_fails_a_changed_reference(llama_generation, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(llama_generation.out, copy)
    setup = json.loads((copy / "generation.json").read_text())
    setup["numerics"]["bars"][0]["allowed_rmse"] = 1e-12
    (copy / "generation.json").write_text(json.dumps(setup))
    result = verify(copy)
    assert not result.passed and result.exit_code == 6


def test_gpt2_generation_passes_and_generates(tiny_models, tmp_path):
    result = exporter.convert(tiny_models["gpt2"], "cpu-fp32", tmp_path / "gpt2", task="text-generation",
                              targets=("exported_program", "onnx"))
    assert result.exit_code == 0, result.problems
    for entry in result.report["artifacts"]:  # GPT-2: tied lm_head, learned positions, Conv1D projections
        assert entry["numerics"]["free_running"]["identical"] and entry["programs"]["decode"]["sdpa"] == 2
        done = generate_cli(str(result.out), "-t", entry["name"], "--input-ids", "5,6,7,8", "--max-new-tokens", "4")
        assert done.returncode == 0 and len(done.stdout.strip().split(",")) == 4, done.stderr


FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 2}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"num_key_value_heads": 2}),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
}


def save_family(name: str, folder, **overrides):
    transformers = pytest.importorskip("transformers")
    model_cls, config_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                               intermediate_size=128, vocab_size=1000, **extra, **overrides)
    getattr(transformers, model_cls)(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoder_families_generate_the_reference_tokens(family, tmp_path):
    path = save_family(family, tmp_path / family)
    result = exporter.convert(path, "cpu-fp32", tmp_path / "out", task="text-generation",
                              targets=("exported_program", "onnx"))
    assert result.exit_code == 0, result.problems
    for entry in result.report["artifacts"]:
        numerics = entry["numerics"]
        assert numerics["passed"] and numerics["free_running"]["identical"], entry["name"]


def test_sliding_window_narrower_than_the_cache_is_refused(tmp_path):
    path = save_family("mistral", tmp_path / "mistral", sliding_window=8)
    with pytest.raises(exporter.errors.ArchitectureError, match="sliding_window"):
        exporter.convert(path, "cpu-fp32", tmp_path / "out", task="text-generation", targets=("exported_program",))
    assert not (tmp_path / "out").exists()


@pytest.fixture
def factory_decoder(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    from safetensors.torch import save_model

    import generation_models

    def make(cache_bug: bool):
        folder = tmp_path / ("buggy" if cache_bug else "clean")
        folder.mkdir()
        torch.manual_seed(3)
        save_model(generation_models.build(), str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"cache_bug": cache_bug}))
        return folder

    return make


def test_factory_decoder_follows_the_contract(factory_decoder, tmp_path):
    result = exporter.convert(factory_decoder(False), "cpu-fp32", tmp_path / "out", task="text-generation",
                              model="generation_models:build", targets=("exported_program", "onnx"))
    assert result.exit_code == 0, result.problems
    for entry in result.report["artifacts"]:
        assert entry["numerics"]["tokens_identical"] and entry["programs"]["decode"] == {"sdpa": 2, "softmax": 0}


def test_planted_cache_update_defect_fails_the_gate(factory_decoder, tmp_path):
    """The decode step writes keys where the values belong: prefill is right, every decode step is wrong."""
    result = exporter.convert(factory_decoder(True), "cpu-fp32", tmp_path / "out", task="text-generation",
                              model="generation_models:build", targets=("exported_program", "onnx"))
    assert result.exit_code == 3 and not result.report["passed"]
    for variant in (result.report["rewritten"], *result.report["artifacts"]):
        steps = variant["numerics"]["steps"]
        assert steps[0]["passed"]  # the prefill's logits: the cache was written right
        assert not any(s["passed"] for s in steps[1:])  # every decode step reads the corrupted values
        assert variant["status"] == "numerics_failed"


def test_left_padding_gives_the_unpadded_rows_logits(tiny_models):
    """A left-padded row (its padded queries see nothing) generates what its unpadded prompt does, finite."""
    loaded = exporter.checkpoint.load_model(tiny_models["llama"])
    model = loaded.model.eval()
    with attention_implementation(model, "sdpa"):
        step = DecoderStep(model, True)
        layout = probe_layout(model, True, "cpu")
        steps = Steps(step, step, layout, 32, torch.float32, "cpu")
        ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :7] = 0  # seven pad tokens: five real ones
        ids[1, :7] = 0
        padded, logits = generate(steps, Prompt(ids, mask), 4)
        alone, alone_logits = generate(steps, Prompt(ids[1:, 7:], mask[1:, 7:]), 4)
    assert all(torch.isfinite(x).all() for x in logits)
    assert torch.equal(padded[1:], alone)
    for mine, theirs in zip(logits, alone_logits):
        torch.testing.assert_close(mine[1:], theirs, rtol=1e-4, atol=1e-4)
    with attention_implementation(model, "eager"):
        ref_tokens, _ = reference_generation(model, Prompt(ids, mask), 4, "cpu", True)
    assert torch.equal(ref_tokens, padded)


def test_recipe_refuses_a_cache_too_small():
    with pytest.raises(exporter.errors.RecipeError, match="max_cache_len"):
        exporter.api.resolve_recipe("cpu-fp32", settings=("generation.max_cache_len=10",))
