"""fp8 through the whole convert, on the CPU (PyTorch's CPU ``_scaled_mm`` performs the same fp8 roundings; its
speed says nothing about a GPU's): both questions of the gate, each failing on its own planted defect, the report
and manifest, the stored fp8 weights, and ``exporter verify`` asking both questions again."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import exporter
from exporter.published.verification import verify
from exporter.recipe import load_recipe

pytestmark = pytest.mark.slow

SETTINGS = ("quantize.scheme=fp8-rowwise", "runtime.dtype=bfloat16")
LINEARS = 14  # a tiny Llama: 2 layers x (q, k, v, o, gate, up, down); the head stays in bf16


def quick(targets=("exported_program", "aoti")):
    recipe = load_recipe("cpu-fp32")
    return dataclasses.replace(recipe, bench=dataclasses.replace(recipe.bench, warmup=1, rounds=1, iterations=2),
                               targets=dataclasses.replace(recipe.targets, build=tuple(targets)))


@pytest.fixture(scope="module")
def fp8_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "llama"
    return exporter.convert(tiny_models["llama"], quick(), out, settings=SETTINGS)


def test_both_questions_pass_and_are_reported_apart(fp8_run):
    report = fp8_run.report
    assert fp8_run.exit_code == 0, report["problems"]
    q = report["quantization"]
    assert q["passed"] and q["scheme"] == "fp8-rowwise" and q["weight_dtype"] == "float8_e4m3fn"
    assert q["counts"] == {"fp8": LINEARS, "excluded": 1, "fallback": 0} and q["excluded"] == ["lm_head"]
    layers = [layer for layer in q["layers"] if layer["status"] == "fp8"]
    assert len(layers) == LINEARS and all(layer["sqnr_db"] >= q["budget"]["layer_min_sqnr_db"] for layer in layers)
    for row in q["outputs"]:  # fp8 costs more than bf16 does, and the report says how much more
        assert row["sqnr_db"] < row["unquantized_sqnr_db"] and row["error_ratio"] > 1
        assert row["sqnr_db"] >= 20 or row["error_ratio"] <= 16
    assert {e["sample"] for e in q["logits"]} == {0, 1} and all(0 <= e["top1_agreement"] <= 1 for e in q["logits"])
    # question 1: each artifact judged against the quantized model's float64 arithmetic
    assert report["reference"]["model"].startswith("quantized")
    for variant in [report["rewritten"], *report["artifacts"]]:
        assert variant["status"] == "ok", (variant["name"], variant["error"])
        assert variant["numerics"]["passed"]
    for variant in report["artifacts"]:  # every constant equals the checkpoint's, quantized as declared
        weights = variant["proofs"]["weights"]
        assert weights["passed"] and not weights["changed"], weights
        assert weights["by_name"] >= 2 * LINEARS  # each fp8 linear's qweight and scales, traced by name
        assert variant["proofs"]["program"]["passed"] is None  # its twin would promote the fp8 roundings away
    text = (fp8_run.out / "report.md").read_text()
    assert "## Quantization" in text and "fp8 error = N × bfloat16" in text
    manifest = json.loads((fp8_run.out / "manifest.json").read_text())
    assert manifest["quantization"]["scheme"] == "fp8-rowwise"
    assert manifest["quantization"]["scales_dtype"] == "float32" and manifest["quantization"]["excluded"] == ["lm_head"]
    assert manifest["recipe"]["quantize"]["min_sqnr_db"] == 20.0
    assert any(f["path"] == "reference/original_outputs.safetensors" for f in manifest["files"])


def test_the_exported_program_stores_the_linears_in_fp8(fp8_run):
    entry = next(a for a in fp8_run.report["artifacts"] if a["name"] == "exported_program")
    program = torch.export.load(str(fp8_run.out / entry["path"]))
    fp8 = [v for v in program.state_dict.values() if v.dtype == torch.float8_e4m3fn]
    fp8 += [v for v in program.constants.values() if isinstance(v, torch.Tensor) and v.dtype == torch.float8_e4m3fn]
    assert len(fp8) == LINEARS
    scaled = [n for n in program.graph.nodes if n.op == "call_function" and "_scaled_mm" in str(n.target)]
    assert len(scaled) == LINEARS


def test_verify_asks_both_questions_again(fp8_run, tiny_models):
    """With the checkpoint, verify also quantizes its weights again as the recipe declared and proves every
    artifact's constants equal them."""
    result = verify(fp8_run.out, checkpoint=tiny_models["llama"])
    assert result.exit_code == 0, result.problems
    numerics = [c for c in result.checks if c.name == "numerics"]
    assert {c.subject for c in numerics} == {"exported_program", "aoti"} and all(c.passed for c in numerics)
    weights = [c for c in result.checks if c.name == "weights"]
    assert {c.subject for c in weights} == {"exported_program", "aoti"} and all(c.passed for c in weights), weights
    assert all(c.passed is None for c in result.checks if c.name == "program")


def test_verify_fails_an_artifact_the_original_reference_no_longer_supports(fp8_run, tmp_path):
    """The second question re-asked of the artifact itself: with a tighter stored budget the same artifact is
    over it (the folder is re-hashed so only the budget differs)."""
    import shutil

    from exporter.report.files import build_manifest
    out = tmp_path / "copy"
    shutil.copytree(fp8_run.out, out)
    report = json.loads((out / "report.json").read_text())
    report["quantization"]["budget"].update(min_sqnr_db=60.0, max_error_ratio=1.0)
    (out / "report.json").write_text(json.dumps(report))
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(build_manifest(out, report, [], manifest["recipe"])))
    result = verify(out)
    assert result.exit_code == 3
    problems = " ".join(result.problems)
    assert "against the original model SQNR" in problems and "(this artifact)" in problems


def test_a_wrong_scale_in_one_layer_fails_question_two_and_is_named(tiny_models, tmp_path, monkeypatch):
    """Question 2 fails and names the layer; question 1 passes: the artifacts compute the (wrongly) quantized
    model faithfully. The two questions stay apart."""
    from exporter.quantize import stage

    real = stage.quantize_model

    def planted(model, *args, **kwargs):
        audit = real(model, *args, **kwargs)
        model.get_submodule("model.layers.1.mlp.up_proj").scales.mul_(1.7)
        return audit

    monkeypatch.setattr(stage, "quantize_model", planted)
    result = exporter.convert(tiny_models["llama"], quick(("exported_program",)), tmp_path / "out", settings=SETTINGS)
    report = result.report
    assert result.exit_code == 3
    q = report["quantization"]
    assert not q["passed"] and q["worst_layers"][0]["name"] == "model.layers.1.mlp.up_proj"
    low = [layer["name"] for layer in q["layers"] if layer["sqnr_db"] is not None and layer["sqnr_db"] < 20]
    assert low == ["model.layers.1.mlp.up_proj"]
    assert any("quantization: numerics failed" in p and "model.layers.1.mlp.up_proj" in p for p in report["problems"])
    program = next(a for a in report["artifacts"] if a["name"] == "exported_program")
    assert program["status"] == "ok" and program["numerics"]["passed"]


def test_a_quantize_recipe_that_quantizes_nothing_is_refused(tmp_path):
    """A model none of whose linears fp8 can take (every size off the 16 alignment) is refused in one line, not
    published as "within the budget" with nothing quantized."""
    import transformers

    from exporter.errors import RecipeError

    config = transformers.GPT2Config(n_layer=1, n_embd=24, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0,
                                     eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(RecipeError, match="quantized none of the model's 5 linear layer"):
        exporter.convert(tmp_path / "gpt2", quick(("exported_program",)), tmp_path / "out", settings=SETTINGS)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_an_export_only_defect_fails_question_one(tiny_models, tmp_path, monkeypatch):
    """A defect only the exported graph carries (the weight scales of the MLP's gate and up products dropped, as
    a broken lowering would): the artifacts fail and are localised to the MLP; question 2, asked of the eager
    quantized model, passes."""
    from exporter.quantize import fp8

    real = fp8.rowwise_product

    def planted(x, qweight, scales):
        if torch.compiler.is_exporting() and qweight.shape[0] == 128:  # gate_proj and up_proj
            scales = torch.ones_like(scales)
        return real(x, qweight, scales)

    monkeypatch.setattr(fp8, "rowwise_product", planted)
    result = exporter.convert(tiny_models["llama"], quick(("exported_program",)), tmp_path / "out", settings=SETTINGS)
    report = result.report
    assert result.exit_code == 3
    assert report["quantization"]["passed"]
    assert report["rewritten"]["status"] == "ok"
    program = next(a for a in report["artifacts"] if a["name"] == "exported_program")
    assert program["status"] == "numerics_failed"
    located = program["numerics"]["locate"]["module"]
    assert located.startswith("model.layers.0.mlp"), located


def test_an_fp8_scale_entering_the_export_fails_the_weights_proof_by_name(tmp_path):
    """One fp8 linear's scales x1.05 in convert's trace of the trained model (its reference and eager model
    clean): the artifact's constants differ from the checkpoint's weights quantized as declared, and the weights
    proof fails it by the scales' name, whatever its outputs showed."""
    from exporter.testing.defects import EXPECT, planted_in_convert
    from exporter.testing.trained import trained_lm

    checkpoint = trained_lm()
    with planted_in_convert(checkpoint, "fp8-scale"):
        result = exporter.convert(checkpoint, quick(("exported_program",)), tmp_path / "out", settings=SETTINGS,
                                  dims=("sequence=64",))
    assert result.exit_code == 3
    assert result.report["quantization"]["passed"]  # question 2, asked of the eager quantized model
    entry = next(a for a in result.report["artifacts"] if a["name"] == "exported_program")
    assert entry["status"] == "numerics_failed"
    changed = entry["proofs"]["weights"]["changed"]
    assert [c["weight"] for c in changed] == [f"gpt_neox.{EXPECT['fp8-scale']}"], changed
    assert abs(changed[0]["rel_l2"] - 0.05) < 1e-3
    assert EXPECT["fp8-scale"] in entry["error"] and "quantized as the recipe declares" in entry["error"]


def test_the_absolute_budget_holds_on_a_real_checkpoint(minilm_path, tmp_path):
    """all-MiniLM-L6-v2 (real weights, not chaotic): every output within 20 dB of SQNR of the original float64
    reference on its own, without the relative allowance."""
    result = exporter.convert(minilm_path, quick(("exported_program",)), tmp_path / "out", settings=SETTINGS)
    assert result.exit_code == 0, result.report["problems"]
    q = result.report["quantization"]
    assert q["counts"]["fp8"] == 37 and q["passed"]
    assert all(row["sqnr_db"] >= q["budget"]["min_sqnr_db"] for row in q["outputs"]), q["outputs"]
    assert min(layer["sqnr_db"] for layer in q["layers"] if layer["sqnr_db"] is not None) > 25


def test_h100_fp8_is_a_builtin_recipe():
    recipe = load_recipe("h100-fp8")
    assert recipe.quantize.scheme == "fp8-rowwise" and recipe.runtime.dtype == "bfloat16"
    assert recipe.targets.build == ("exported_program", "aoti") and recipe.quantize.include_head is False


def test_fp8_generation_prefill_and_decode(tiny_models, tmp_path):
    """--task text-generation: the prefill and decode programs carry the fp8 linears (the AOTI weights file
    holds them once, in fp8), each step is judged against the quantized model's float64 generation, and the
    cost is judged on the steps teacher-forced on the original model's tokens."""
    from safetensors import safe_open

    result = exporter.convert(tiny_models["llama"], quick(), tmp_path / "out", settings=SETTINGS,
                              task="text-generation")
    report = result.report
    assert result.exit_code == 0, report["problems"]
    q = report["quantization"]
    assert q["passed"] and q["counts"]["fp8"] == LINEARS
    (logits,) = q["logits"]
    assert 0.5 <= logits["top1_agreement"] <= 1 and 0 <= logits["kl"] < 0.01
    assert report["reference"]["model"].startswith("quantized")
    for entry in report["artifacts"]:
        assert entry["status"] == "ok", (entry["name"], entry["error"])
    with safe_open(str(result.out / "generation.aoti.weights.safetensors"), "pt") as weights:
        dtypes = [weights.get_slice(name).get_dtype() for name in weights.keys()]
    assert dtypes.count("F8_E4M3") == LINEARS
    decode = torch.export.load(str(result.out / "decode.pt2"))
    assert sum(1 for n in decode.graph.nodes if "_scaled_mm" in str(n.target)) == LINEARS
    assert verify(result.out).exit_code == 0


def test_validate_rebuilds_the_quantized_model(fp8_run):
    """exporter validate re-judges the folder from the checkpoint: the model it rebuilds is quantized again, so the
    artifacts meet the quantized reference they were stored with."""
    from exporter.published.revalidate import validate_folder

    result = validate_folder(fp8_run.out, targets=("exported_program",))
    assert result["exit_code"] == 0, result["problems"]


def test_fp8_weight_only_generation_with_the_batch_1_program(tiny_models, tmp_path):
    """fp8 weight-only with the decode program of batch 1: the weight-only linears that read one input are fused in
    all three programs (the kernel of one row reads a group's concatenated fp8 weight on CUDA; on the CPU the
    unfused form runs), so the weights file holds each fp8 weight once; every program passes the gate and verify."""
    from safetensors import safe_open

    settings = ("quantize.scheme=fp8-weight-only", "runtime.dtype=bfloat16", "generation.decode_batch_1=true")
    result = exporter.convert(tiny_models["llama"], quick(("aoti",)), tmp_path / "out", settings=settings,
                              task="text-generation")
    report = result.report
    assert result.exit_code == 0, report["problems"]
    (entry,) = report["artifacts"]
    assert entry["status"] == "ok" and entry["numerics"]["batch_1"]["passed"]
    assert len(entry["fused_projections"]) == 4  # q/k/v and gate/up of each layer, in fp8
    with safe_open(str(result.out / "generation.aoti.weights.safetensors"), "pt") as weights:
        fp8_names = sorted(n for n in weights.keys() if weights.get_slice(n).get_dtype() == "F8_E4M3")
    # 2 layers x (q/k/v fused, o, gate/up fused, down), each stored once for the three programs
    assert len(fp8_names) == 8 and sum(".fused." in n for n in fp8_names) == 4, fp8_names
    assert verify(result.out).exit_code == 0


def test_a_generation_build_that_fails_publishes_no_half_built_program(tiny_models, tmp_path, monkeypatch):
    """A compile that fails after the prefill package was written: the target fails with the whole message in
    logs/aoti.build.log, no package of it is published (a package without its weights file would load and read
    unset memory), and exporter generate refuses the target."""
    from exporter.errors import UsageError
    from exporter.generation.generate import generate_tokens
    from exporter.targets import compile_apart, package_cache

    compiled = []

    def second_fails(job, device, backend, entry):
        if compiled:
            raise RuntimeError("C++ compile error: " + "x" * 600 + " the compiler's last line")
        compiled.append(job.path)
        job.path.write_bytes(b"the prefill package")  # written, as a compile writes it; nothing reads it before
        return None  # as compile_one returns with the package cache off

    monkeypatch.setenv(compile_apart.ENV, "1")  # one after the other, here (as a CPU build compiles by default)
    monkeypatch.delenv(package_cache.ENV, raising=False)  # compiled, not reused from an earlier test's build
    monkeypatch.setattr(compile_apart, "compile_one", second_fails)
    result = exporter.convert(tiny_models["llama"], quick(("aoti",)), tmp_path / "out", settings=SETTINGS,
                              task="text-generation")
    assert result.exit_code == 4
    (entry,) = result.report["artifacts"]
    assert entry["status"] == "failed" and "logs/aoti.build.log" in entry["error"]
    assert compiled and compiled[0].name == "prefill.aoti.pt2"
    assert "the compiler's last line" in (result.out / "logs" / "aoti.build.log").read_text()
    assert not list(result.out.glob("*.aoti.pt2"))
    with pytest.raises(UsageError, match="has no decode program"):
        generate_tokens(result.out, "aoti", [[1, 2, 3]])
