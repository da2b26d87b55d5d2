"""``exporter check``: artifacts other tools made, judged against their checkpoint with convert's gate.

Real producers throughout: Optimum's ``optimum-cli export onnx`` (in its own virtual environment: it pins
transformers < 4.58), ``torch.export`` and transformers' own ``exporters``, AOTInductor; real onnxruntime and real
compiled packages load the results back. Planted defects must fail with exit 3 and name the output and the first
divergent module; an artifact of another model is refused in one line (exit 2).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
import torch

from exporter.check.artifacts import describe_pt2, find_artifacts, spec_modules
from exporter.check.locating import scope_values
from exporter.testing.cli import run_cli

pytestmark = pytest.mark.slow

QUICK = ["--set", "bench.warmup=0", "--set", "bench.rounds=1", "--set", "bench.iterations=2"]


def run_check(*args, cwd=None) -> subprocess.CompletedProcess:
    return run_cli(["check", *args, "-q", *QUICK], cwd)


def errors(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def optimum(tiny_models, tmp_path_factory):
    """Optimum's exports of the tiny BERT (an encoder), ViT (vision) and GPT-2 (a decoder with past)."""
    from exporter.testing.optimum_peer import export, optimum_cli

    cli, why = optimum_cli()
    if cli is None:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("optimum")
    made = {}
    for name, task in (("bert", "feature-extraction"), ("vit", "feature-extraction"),
                       ("gpt2", "text-generation-with-past")):
        done = export(tiny_models[name], root / name, task)
        assert done.returncode == 0, done.stderr[-2000:]
        made[name] = root / name
    return made


def test_optimum_encoder_and_vision_exports_pass_and_verify_later(optimum, tiny_models, tmp_path):
    for name in ("bert", "vit"):
        out = tmp_path / name
        done = run_check(optimum[name], "--against", tiny_models[name], "--out", out, "--junit", tmp_path / "j.xml")
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((out / "report.json").read_text())
        (entry,) = report["artifacts"]
        assert report["task"] == "check" and entry["status"] == "ok" and entry["info"]["made_by"] == "Optimum"
        assert entry["numerics"]["grid"]["checked"] and all(p["passed"] for p in entry["numerics"]["grid"]["points"])
        assert (out / entry["path"]).is_file()  # the judged file is in the folder, hashed by the manifest
        manifest = json.loads((out / "manifest.json").read_text())
        assert entry["path"] in {f["path"] for f in manifest["files"]}
        cases = ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
        assert {c.get("name") for c in cases} == {"loads", "numerics", "shape grid", "weights", "program", "rounding"}
        verified = run_cli(["verify", out])
        assert verified.returncode == 0, verified.stderr[-2000:]


def scale_initializer(folder: Path, node_prefix: str, factor: float) -> str:
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(folder / "model.onnx"))
    initializers = {t.name: t for t in proto.graph.initializer}
    node = next(n for n in proto.graph.node if n.name.startswith(node_prefix))
    name = next(i for i in node.input if i in initializers)
    scaled = numpy_helper.to_array(initializers[name]) * np.float32(factor)
    initializers[name].CopyFrom(numpy_helper.from_array(scaled, name))
    onnx.save(proto, str(folder / "model.onnx"))
    return name


def test_an_onnx_initializer_off_by_one_part_in_a_thousand_fails_naming_its_weight(optimum, tiny_models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(optimum["bert"], bad)
    scale_initializer(bad, "/encoder/layer.1/intermediate/dense/MatMul", 1 + 1e-3)
    done = run_check(bad, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 3, done.stderr[-3000:]
    (line,) = [e for e in errors(done) if "numerics failed" in e]
    # the weights proof traces the transposed initializer to its checkpoint tensor and names it
    assert "weight encoder.layer.1.intermediate.dense.weight (as onnx::" in line and "traced by transposed" in line
    assert "output last_hidden_state" in line


def shift_cache_update(folder: Path, layer: int) -> None:
    """Plant a cache written one position off: ``present.{layer}.key`` comes out rolled by one position (the step's
    own attention still reads the right keys; only the cache handed to the next step is wrong)."""
    import onnx
    from onnx import TensorProto, helper

    proto = onnx.load(str(folder / "model.onnx"))
    name, written = f"present.{layer}.key", f"present.{layer}.key.written"
    for node in proto.graph.node:
        node.output[:] = [written if o == name else o for o in node.output]
        node.input[:] = [written if i == name else i for i in node.input]

    def const(value_name: str, value: int):
        return helper.make_node("Constant", [], [value_name],
                                value=helper.make_tensor(value_name, TensorProto.INT64, [1], [value]))

    proto.graph.node.extend([
        const("one", 1), const("zero", 0), const("end", 2**62), const("axis", -2),
        helper.make_node("Slice", [written, "one", "end", "axis"], ["tail"]),
        helper.make_node("Slice", [written, "zero", "one", "axis"], ["head"]),
        helper.make_node("Concat", ["tail", "head"], [name], axis=-2)])
    onnx.save(proto, str(folder / "model.onnx"))


def test_a_decoder_with_past_passes_step_by_step_and_a_cache_one_position_off_fails(optimum, tiny_models, tmp_path):
    (artifact,) = find_artifacts(optimum["gpt2"])
    assert artifact.past is not None and artifact.past.layers == 2
    done = run_check(optimum["gpt2"], "--against", tiny_models["gpt2"], "--out", tmp_path / "good")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "good" / "report.json").read_text())
    assert report["inputs"]["names"] == ["input_ids", "attention_mask", "next_ids"]
    assert report["outputs"][0] == "prefill.logits" and "decode.present.1.value" in report["outputs"]
    verified = run_cli(["verify", tmp_path / "good"])
    assert verified.returncode == 0, verified.stderr[-2000:]
    bad = tmp_path / "bad"
    shutil.copytree(optimum["gpt2"], bad)
    shift_cache_update(bad, 1)
    done = run_check(bad, "--against", tiny_models["gpt2"], "--out", tmp_path / "out")
    assert done.returncode == 3, done.stderr[-3000:]
    (line,) = [e for e in errors(done) if "numerics failed" in e]
    assert "the first output that fails, in the order the steps make them, is prefill.present.1.key" in line, line
    entry = json.loads((tmp_path / "out" / "report.json").read_text())["artifacts"][0]
    passed = {c["output"] for c in entry["numerics"]["checks"] if c["passed"]}
    assert {"prefill.logits", "prefill.present.0.key", "prefill.present.1.value"} <= passed  # the rest is sound


def test_an_artifact_of_another_model_is_refused_in_one_line(optimum, tiny_models, tmp_path):
    done = run_check(optimum["bert"], "--against", tiny_models["vit"], "--out", tmp_path / "out")
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = errors(done)
    assert "input_ids" in line and "ViTModel" in line and "Fix:" in line
    assert not (tmp_path / "out").exists()


def export_bert_onnx(model, path: Path) -> Path:
    """A BERT exported by the dynamo ONNX exporter by keyword, batch and sequence dynamic, outputs named."""
    ids = torch.randint(0, 1000, (2, 16))
    torch.onnx.export(model, (), str(path), kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state", "pooler_output"],
                      dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
                      dynamo=True)
    return path


def test_an_artifact_of_another_width_is_refused_naming_both_widths(tiny_models, tmp_path):
    """Same inputs, same output names, another hidden width (a MiniLM ONNX checked against another BERT): refused
    in one line naming both widths, not judged as a numerics failure blamed on the runtime."""
    from transformers import BertConfig, BertModel

    other = BertModel(BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=1000)).eval()
    path = export_bert_onnx(other, tmp_path / "other.onnx")
    done = run_check(path, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 2, done.stderr[-2000:]
    (line,) = errors(done)
    assert "is 32 wide on axis 2, the model's is 64" in line and "BertModel" in line, line
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- torch.export and AOTInductor


def export_bert(checkpoint: Path, path: Path, scale: float | None = None, nudge: float | None = None) -> Path:
    """torch.export of the checkpoint's BertModel (SDPA attention) by keyword, as a user script would; with
    ``scale`` the attention of layer 1 uses a wrong softmax scale, with ``nudge`` one value of layer 1's
    intermediate weight is off by that relative amount (planted defects)."""
    from transformers import BertModel

    model = BertModel.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    if scale is not None:
        model.encoder.layer[1].attention.self.scaling *= scale
    if nudge is not None:
        with torch.no_grad():
            model.encoder.layer[1].intermediate.dense.weight[0, 0] *= 1 + nudge
    ids = torch.randint(0, 1000, (2, 16))
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)
    program = torch.export.export(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                  dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                  "attention_mask": {0: batch, 1: seq}})
    torch.export.save(program, str(path))
    return path


def test_a_torch_export_program_is_described_without_loading_it(tiny_models, tmp_path):
    artifact = describe_pt2(export_bert(tiny_models["bert"], tmp_path / "bert.pt2"))
    assert artifact.target == "exported_program" and artifact.call == "keyword"
    assert [p.name for p in artifact.inputs] == ["input_ids", "attention_mask"]
    assert [p.name for p in artifact.outputs] == ["last_hidden_state", "pooler_output"]
    assert artifact.inputs[0].dtype == "int64" and artifact.inputs[0].bounds[1] == (2, 128)
    assert artifact.imports == ("transformers.modeling_outputs",)


def test_a_torch_export_program_passes_and_a_wrong_attention_scale_fails_located(tiny_models, tmp_path):
    good = export_bert(tiny_models["bert"], tmp_path / "good.pt2")
    done = run_check(good, "--against", tiny_models["bert"], "--out", tmp_path / "good")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "good" / "report.json").read_text())
    assert report["outputs"] == ["last_hidden_state", "pooler_output"]
    weights = report["artifacts"][0]["proofs"]["weights"]  # a wrong scale is no weight: the proof passes
    assert weights["passed"] and weights["by_name"] == weights["constants"] - weights["untraced_small"] > 30
    assert weights["untraced"] == [] and weights["not_found"] == []
    bad = export_bert(tiny_models["bert"], tmp_path / "bad.pt2", scale=1.1)
    done = run_check(bad, "--against", tiny_models["bert"], "--out", tmp_path / "bad")
    assert done.returncode == 3, done.stderr[-3000:]
    (line,) = [e for e in errors(done) if "numerics failed" in e]
    assert "output last_hidden_state" in line or "output pooler_output" in line
    assert "first divergent module encoder.layer.1.attention" in line, line


def test_one_weight_off_by_one_part_in_a_million_fails_by_name(tiny_models, tmp_path):
    """Far below what the outputs' bar can see: the weights proof compares the program's weights with the
    checkpoint's bit for bit, names the weight and fails the artifact (exit 3, a failed JUnit case)."""
    bad = export_bert(tiny_models["bert"], tmp_path / "bad.pt2", nudge=1e-6)
    done = run_check(bad, "--against", tiny_models["bert"], "--out", tmp_path / "bad", "--junit", tmp_path / "j.xml")
    assert done.returncode == 3, done.stderr[-3000:]
    (line,) = [e for e in errors(done) if "numerics failed" in e]
    assert "weight encoder.layer.1.intermediate.dense.weight differs from the checkpoint's" in line, line
    entry = json.loads((tmp_path / "bad" / "report.json").read_text())["artifacts"][0]
    assert entry["numerics"]["passed"] and not entry["proofs"]["weights"]["passed"]  # the outputs could not tell
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")}
    assert cases["weights"].find("failure") is not None and cases["numerics"].find("failure") is None


def test_an_aoti_package_made_elsewhere_passes(tiny_models, tmp_path):
    program = torch.export.load(str(export_bert(tiny_models["bert"], tmp_path / "bert.pt2")))
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "bert.aoti.pt2"))
    (artifact,) = find_artifacts(Path(package))
    assert artifact.target == "aoti" and [p.name for p in artifact.inputs] == ["input_ids", "attention_mask"]
    refused = run_check(package, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert refused.returncode == 2 and "--allow-native-code" in refused.stderr, refused.stderr[-3000:]
    done = run_check(package, "--against", tiny_models["bert"], "--out", tmp_path / "out", "--allow-native-code")
    assert done.returncode == 0, done.stderr[-3000:]
    verify = ["verify", str(tmp_path / "out")]
    verified = run_cli([*verify, "--allow-native-code"])
    assert verified.returncode == 0, verified.stderr[-2000:]
    # verify runs another tool's package only with the same opt-in; a package swapped in never runs without it
    unasked = run_cli(verify)
    assert unasked.returncode == 2 and "another tool compiled" in unasked.stderr, unasked.stderr[-2000:]
    from exporter.testing.payloads import native_package, rehash

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    marker = tmp_path / "ran"
    native_package(tmp_path / "out" / report["artifacts"][0]["path"], marker, wrapper_from=Path(package))
    rehash(tmp_path / "out")
    swapped = run_cli(verify)
    assert swapped.returncode == 2 and not marker.exists(), swapped.stderr[-2000:]


def test_a_transformers_exporters_folder_passes(tiny_models, tmp_path):
    exporters = pytest.importorskip("transformers.exporters")
    from transformers import BertModel

    model = BertModel.from_pretrained(tiny_models["bert"], attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (2, 16))
    exported = exporters.DynamoExporter().export(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                                 config=exporters.DynamoConfig(dynamic=True))
    exported.save_pretrained(tmp_path / "exported")
    (artifact,) = find_artifacts(tmp_path / "exported")
    assert artifact.made_by == "transformers.exporters"
    done = run_check(tmp_path / "exported", "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_float16_onnx_is_judged_in_its_own_dtype(tiny_models, tmp_path):
    from transformers import BertModel

    model = BertModel.from_pretrained(tiny_models["bert"], attn_implementation="sdpa").eval().half()
    ids = torch.randint(0, 1000, (2, 16))
    path = tmp_path / "fp16" / "model.onnx"
    path.parent.mkdir()
    torch.onnx.export(model, (), str(path), kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state", "pooler_output"],
                      dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
                      dynamo=True)
    done = run_check(path, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    (entry,) = report["artifacts"]
    assert entry["dtype"] == "float16" and report["recipe"]["dtype"] == "float32"
    assert entry["numerics"]["baseline"].endswith("float16)")
    assert any("computes in float16" in n for n in entry["notes"])
    assert done.returncode == 0, done.stderr[-3000:]


# --------------------------------------------------------------------------- pieces


def test_module_scopes_map_onnx_values_to_module_paths():
    import onnx
    from onnx import helper

    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="/encoder/layer.0/attention/self/query/MatMul"),
             helper.make_node("Add", ["a", "b"], ["c"], name="/encoder/layer.0/attention/self/query/Add"),
             helper.make_node("Relu", ["c"], ["d"], name="/encoder/layer.0/output/Relu")]
    graph = helper.make_graph(nodes, "g", [], [])
    values = scope_values(onnx.ModelProto(graph=graph))
    assert values["encoder.layer.0.attention.self.query"] == "c"
    assert values["encoder.layer.0"] == "d" and values["encoder"] == "d"


def test_spec_types_name_the_modules_to_import():
    spec = '[1, {"type": "transformers.modeling_outputs.BaseModelOutput", "context": "[]", "children_spec": []}]'
    assert spec_modules(spec, '[1, {"type": "builtins.tuple"}]') == ("transformers.modeling_outputs",)


def test_an_earlier_exporter_folder_is_judged_again_artifact_by_artifact(tiny_models, tmp_path):
    recipe = tmp_path / "quick.toml"
    recipe.write_text('schema_version = 1\n[targets]\nbuild = ["exported_program", "onnx"]\n'
                      '[bench]\nwarmup = 0\nrounds = 1\niterations = 1\n')
    converted = run_cli(["convert", tiny_models["bert"], "--recipe", recipe, "--out", tmp_path / "run", "-q"])
    assert converted.returncode == 0, converted.stderr[-2000:]
    artifacts = find_artifacts(tmp_path / "run")
    assert {(a.name, a.made_by) for a in artifacts} == {("exported_program", "exporter"), ("onnx", "exporter")}
    done = run_check(tmp_path / "run", "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert sorted(a["name"] for a in report["artifacts"]) == ["exported_program", "onnx"]
    assert all(a["status"] == "ok" for a in report["artifacts"])


def test_a_static_artifact_pins_the_dims_and_says_so(tiny_models):
    """A static ONNX file is judged at its own shapes: the recipe's dims are pinned to them, with a note."""
    from exporter.check.artifacts import Artifact, Port
    from exporter.check.mapping import map_inputs
    from exporter.checkpoint import load_model
    from exporter.recipe import load_recipe

    model = load_model(tiny_models["bert"], None, False).model
    static = Artifact("onnx", "onnx", tiny_models["bert"] / "model.onnx", "ONNX",
                      [Port("input_ids", "int64", (3, 24)), Port("attention_mask", "int64", (3, 24))],
                      [Port("last_hidden_state", "float32", (3, 24, 64))])
    recipe, notes = map_inputs(static, model, load_recipe("cpu-fp32"))
    dims = {d.name: d for d in recipe.inputs.dims}
    assert (dims["batch"].size, dims["batch"].dynamic) == (3, False)
    assert (dims["sequence"].size, dims["sequence"].dynamic) == (24, False)
    assert any("fixes it at 24" in n and "judged at that size only" in n for n in notes), notes
    wrong = Artifact("onnx", "onnx", static.path, "ONNX", [Port("input_ids", "int64", (3, 24, 1))], [])
    with pytest.raises(Exception, match="has 3 axes, the model's has 2"):
        map_inputs(wrong, model, load_recipe("cpu-fp32"))


@pytest.mark.parametrize("shape, message", [
    ((2, 1000), "fixes dim sequence at 1000 (attention_mask), past the model's 512 positions"),
    ((2**31, 24), "one sample's inputs would take")])
def test_a_size_the_artifact_fixes_that_the_model_or_machine_cannot_take_is_refused(shape, message, tiny_models):
    """Refused before any work, in one line: a sequence past the model's positions (it would publish a failed
    folder) and a batch of 2^31 (it would allocate 512 GiB of inputs and die)."""
    from exporter.check.artifacts import Artifact, Port
    from exporter.check.mapping import map_inputs
    from exporter.checkpoint import load_model
    from exporter.errors import UsageError
    from exporter.recipe import load_recipe

    model = load_model(tiny_models["bert"], None, False).model
    static = Artifact("onnx", "onnx", tiny_models["bert"] / "model.onnx", "ONNX",
                      [Port("input_ids", "int64", shape), Port("attention_mask", "int64", shape)], [])
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        map_inputs(static, model, load_recipe("cpu-fp32"))


def test_a_symlinked_optimum_folder_judges_its_model_onnx_only(optimum, tiny_models, tmp_path):
    """A hub cache's snapshot is a folder of symlinks into the repository's blobs/; a quantized variant beside
    model.onnx is left out, noted."""
    repo = tmp_path / "models--org--bert"
    (repo / "blobs").mkdir(parents=True)
    linked = repo / "snapshots" / "rev"
    linked.mkdir(parents=True)
    for index, file in enumerate(optimum["bert"].iterdir()):
        shutil.copy(file, repo / "blobs" / f"blob{index}")
        (linked / file.name).symlink_to(Path("../../blobs") / f"blob{index}")
    shutil.copy(optimum["bert"] / "model.onnx", repo / "blobs" / "quantized")
    (linked / "model_quantized.onnx").symlink_to(Path("../../blobs/quantized"))
    (artifact,) = find_artifacts(linked)
    assert artifact.path.name == "model.onnx" and any("left out: model_quantized.onnx" in n for n in artifact.notes)
    done = run_check(linked, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "artifact" / "model.onnx").is_file()
    assert not (tmp_path / "out" / "artifact" / "model_quantized.onnx").exists()


def test_a_program_taking_positional_and_keyword_inputs_is_called_as_it_was_exported(tiny_models, tmp_path):
    from transformers import BertModel

    model = BertModel.from_pretrained(tiny_models["bert"], attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (2, 16))
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)
    program = torch.export.export(model, (ids,), {"attention_mask": torch.ones_like(ids)},
                                  dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                  "attention_mask": {0: batch, 1: seq}})
    torch.export.save(program, str(tmp_path / "mixed.pt2"))
    artifact = describe_pt2(tmp_path / "mixed.pt2")
    assert (artifact.call, artifact.positional) == ("keyword", 1)
    assert [p.name for p in artifact.inputs] == ["input_ids", "attention_mask"]
    done = run_check(tmp_path / "mixed.pt2", "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]


def test_outputs_without_the_models_names_are_compared_in_order(tiny_models, tmp_path):
    from transformers import BertModel

    model = BertModel.from_pretrained(tiny_models["bert"], attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (2, 16))
    path = tmp_path / "unnamed.onnx"
    torch.onnx.export(model, (), str(path), kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
                      dynamo=True)
    (artifact,) = find_artifacts(path)
    assert not {p.name for p in artifact.outputs} & {"last_hidden_state", "pooler_output"}
    done = run_check(path, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["outputs"] == ["last_hidden_state", "pooler_output"]
    assert any("compared with the model's" in n for n in report["inputs"]["notes"])


def test_a_package_returning_one_tensor_is_judged_as_its_program_is(tiny_models, tmp_path):
    """A program returning only ``last_hidden_state`` (a bare tensor) and the package compiled from it: both are
    compared with the model's first output, in order."""
    from transformers import BertModel

    class FirstOutput(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    model = BertModel.from_pretrained(tiny_models["bert"], attn_implementation="sdpa").eval()
    ids = torch.randint(0, 1000, (2, 16))
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)
    program = torch.export.export(FirstOutput(model), (ids, torch.ones_like(ids)),
                                  dynamic_shapes=({0: batch, 1: seq}, {0: batch, 1: seq}))
    torch.export.save(program, str(tmp_path / "one.pt2"))
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "one.aoti.pt2"))
    (artifact,) = find_artifacts(Path(package))
    assert [p.name for p in artifact.outputs] == ["output_0"]
    for path, opt_in in ((tmp_path / "one.pt2", ()), (Path(package), ("--allow-native-code",))):
        done = run_check(path, "--against", tiny_models["bert"], "--out", tmp_path / path.stem, *opt_in)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads((tmp_path / path.stem / "report.json").read_text())
        assert report["outputs"] == ["last_hidden_state"], report["outputs"]


def sentence_transformers_folder(bert: Path, folder: Path) -> Path:
    """The tiny BERT as a sentence-transformers folder: mean pooling, then normalisation."""
    shutil.copytree(bert, folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                   "pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return folder


def test_a_bare_transformer_export_of_a_sentence_transformers_folder_is_judged_against_the_transformer(
        tiny_models, tmp_path):
    """An ONNX model of the transformer alone (last_hidden_state, pooler_output), checked against the
    sentence-transformers folder it came from, is compared with the transformer, not with the pipeline's
    token_embeddings and sentence_embedding, and the report says so."""
    from transformers import BertModel

    folder = sentence_transformers_folder(tiny_models["bert"], tmp_path / "st")
    model = BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    path = export_bert_onnx(model, tmp_path / "bare.onnx")
    done = run_check(path, "--against", folder, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["outputs"] == ["last_hidden_state", "pooler_output"]
    assert any("judged against the transformer alone" in n for n in report["inputs"]["notes"])
