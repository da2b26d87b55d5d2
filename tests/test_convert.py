"""The whole pipeline on tiny transformers models, a real checkpoint and a custom factory (CPU, cpu-fp32).

Each conversion builds the exported program, the AOTInductor package and the ONNX model, loads each back
in a child process, validates it against the float64 reference and times it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import exporter
from exporter.recipe import load_recipe
from exporter.targets.aoti_loader import load_package

pytestmark = pytest.mark.slow


def quick(name="cpu-fp32"):
    recipe = load_recipe(name)
    return dataclasses.replace(recipe, bench=dataclasses.replace(recipe.bench, warmup=1, rounds=2, iterations=3))


@pytest.fixture
def converted(converted_tiny):
    """Each model converted once for the whole run (``converted_tiny`` in conftest.py), with every target."""
    return converted_tiny


def strings(value):
    """Every string inside a JSON value, keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def test_a_published_run_names_no_folder_of_this_machine(converted):
    """Every string of report.json, manifest.json and recipe.json, and report.md, of a run that built every
    target (AOTInductor's notes and the process tree's commands included): no absolute path anywhere."""
    out = converted("minilm").out
    records = [json.loads((out / name).read_text()) for name in ("report.json", "manifest.json", "recipe.json")]
    texts = [(out / "report.md").read_text(), *strings(records)]
    absolute = sorted({word for text in texts for word in text.replace("=", " ").replace("(", " ").split()
                       if word.startswith("/") and len(word) > 1})
    assert absolute == [], absolute
    assert records[0]["memory"]["tree"]["largest_processes"]  # the field the scan must cover is there


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("name, outputs, causal, gqa, masked",
                         [("gpt2", ["logits"], True, False, True),
                          ("llama", ["logits"], True, True, True),
                          ("vit", ["last_hidden_state", "pooler_output"], False, False, False),
                          ("minilm", ["token_embeddings", "sentence_embedding"], False, False, True)])
def test_every_target_builds_and_passes(converted, name, outputs, causal, gqa, masked):
    result = converted(name)
    report = result.report
    assert result.exit_code == 0, report["problems"]
    assert report["passed"] is True
    assert report["outputs"] == outputs
    by_target = {a["target"]: a for a in report["artifacts"]}
    assert set(by_target) == {"exported_program", "aoti", "onnx"}
    for artifact in report["artifacts"]:
        assert artifact["status"] == "ok", artifact["error"]
        assert artifact["numerics"]["passed"] is True
        bench = artifact["bench"]
        assert bench["median_ms"] > 0 and bench["speedup_vs_eager"] > 0 and bench["noise"] >= 0
        low, high = bench["speedup_range"]
        assert low <= bench["speedup_vs_eager"] <= high and isinstance(bench["speedup_supported"], bool)
        if not bench["speedup_supported"]:  # marked in the table, explained in the notes
            assert f"{bench['speedup_vs_eager']:.2f}× ⚠" in (result.out / "report.md").read_text()
            assert any("not supported by the timings" in n for n in artifact["notes"])
        assert (result.out / artifact["path"]).is_file()
        assert artifact["sha256"] == sha256(result.out / artifact["path"])
        # every artifact's weights and program proven (the ONNX twin too, its pooling's GatherElements included)
        assert artifact["proofs"]["weights"]["passed"] is True, artifact["proofs"]["weights"]
        assert artifact["proofs"]["program"]["passed"] is True, artifact["proofs"]["program"]
    assert report["rewritten"]["numerics"]["passed"] is True
    attention = report["attention"]
    layers = 6 if name == "minilm" else 2
    assert attention["found"] == attention["rewritten"] == layers
    for site in attention["sites"]:
        assert (site["causal"], site["grouped_query"], site["masked"]) == (causal, gqa, masked), site
    assert report["reference"]["dtype"] == "float64" and report["reference"]["flops"] > 0


def test_a_sentence_transformers_folder_is_exported_with_its_pipeline_and_loads_as_a_model_folder(converted,
                                                                                                   minilm_path):
    """MiniLM's ONNX model and exported program give SentenceTransformer.encode's embeddings (float64, cosine
    >= 0.99999) from token ids of the tokenizer read back from the output folder."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoConfig, AutoTokenizer

    result = converted("minilm")
    pipeline = result.report["model"]["pipeline"]
    assert pipeline["included"] and pipeline["modules"][1:] == ["1 Pooling (mean)", "2 Normalize"]
    assert {"config.json", "tokenizer.json", "vocab.txt"} <= set(result.report["model"]["folder_files"])
    assert "- Pipeline: sentence-transformers 0 Transformer" in (result.out / "report.md").read_text()
    listed = {f["path"] for f in json.loads((result.out / "manifest.json").read_text())["files"]}
    assert {"config.json", "tokenizer.json"} <= listed
    assert AutoConfig.from_pretrained(result.out).model_type == "bert"
    texts = ["A cat sits on the mat.", "Release engineers want proof before they ship a model.", "x"]
    tokens = AutoTokenizer.from_pretrained(result.out)(texts, padding=True, return_tensors="pt")
    expected = SentenceTransformer(str(minilm_path), device="cpu").to(torch.float64).encode(texts,
                                                                                          convert_to_tensor=True)
    assert set(tokens) == {"input_ids", "token_type_ids", "attention_mask"}
    assert result.report["inputs"]["names"] == ["input_ids", "attention_mask", "token_type_ids"]
    session = ort.InferenceSession(str(result.out / "model.onnx"))  # fed the tokenizer's output as it comes
    onnx_out = dict(zip([o.name for o in session.get_outputs()],
                        session.run(None, {k: v.numpy() for k, v in tokens.items()})))
    program = torch.export.load(str(result.out / "model.pt2")).module()
    ep_out = program(**tokens)[1]  # by keyword, in the tokenizer's order
    package = load_package(result.out / "model.aoti.pt2")
    by_position = package(tokens["input_ids"], tokens["attention_mask"], tokens["token_type_ids"])[1]
    assert torch.equal(package(**tokens)[1], by_position)
    for got in (torch.from_numpy(onnx_out["sentence_embedding"]), ep_out, by_position):
        cosine = torch.nn.functional.cosine_similarity(got.to(torch.float64), expected, dim=-1)
        assert cosine.min().item() >= 0.99999, cosine


@pytest.mark.parametrize("name", ["gpt2", "llama", "vit"])
def test_sdpa_survives_into_the_artifacts(converted, name):
    result = converted(name)
    by_target = {a["target"]: a for a in result.report["artifacts"]}
    graph = by_target["exported_program"]["graph"]
    assert graph["sdpa"] == 2 and graph["softmax"] == 0
    program = torch.export.load(str(result.out / by_target["exported_program"]["path"]))
    masks = [len(n.args) > 3 or n.kwargs.get("attn_mask") is not None for n in program.graph.nodes
             if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
    # the decoders take a padding mask; ViT has none, and no all-true mask is built for it under export
    assert masks == [name != "vit"] * 2
    model = onnx.load(str(result.out / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Attention") == 2 and "Softmax" not in ops
    assert [i.name for i in model.graph.input] == result.report["inputs"]["names"]
    assert [o.name for o in model.graph.output] == result.report["outputs"]


def test_every_variant_is_timed_under_eager_s_process_conditions(converted, tiny_models, tmp_path):
    """Eager and rewritten are timed in the convert process, each artifact in a child: the OpenMP wait policy,
    threads and usable CPUs must be the same for all (a child's passive threads against a parent's spinning ones
    made eager 3-7x slower on a busy CPU). In process (torch loaded first) and through the command line (exporter
    sets the policy before torch loads)."""
    report = converted("gpt2").report
    eager = report["baseline"]["bench"]["process"]
    timed = [report["rewritten"]] + [a for a in report["artifacts"] if a.get("bench")]
    assert len(timed) >= 3 and all(v["bench"]["process"] == eager for v in timed), (eager, timed)
    assert not any("other process conditions" in w for w in report["warnings"])
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run([sys.executable, "-m", "exporter", "convert", str(tiny_models["gpt2"]), "-t",
                           "exported_program", "-t", "onnx", "--out", str(tmp_path / "out"), "-q", "--set",
                           "bench.warmup=1", "--set", "bench.rounds=1", "--set", "bench.iterations=2"],
                          capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    cli = json.loads((tmp_path / "out" / "report.json").read_text())
    processes = [cli["baseline"]["bench"]["process"], cli["rewritten"]["bench"]["process"]] + [
        a["bench"]["process"] for a in cli["artifacts"] if a.get("bench")]
    assert len(processes) == 4 and all(p == processes[0] for p in processes), processes
    assert processes[0]["omp_wait_policy"] == "PASSIVE"


def test_the_python_api_prints_no_profiler_lines(tiny_models, tmp_path):
    """The kernel audit runs torch.profiler, whose Kineto backend prints start/stop lines to stderr unless told
    otherwise: quiet from the Python API too (torch imported first, as a user's script does)."""
    script = ("import torch, exporter, sys\n"
              f"r = exporter.convert({str(tiny_models['gpt2'])!r}, 'cpu-fp32', {str(tmp_path / 'out')!r}, "
              "targets=('exported_program',), settings=('bench.rounds=1', 'bench.iterations=2', 'bench.warmup=1'))\n"
              "sys.exit(r.exit_code)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "EXPORTER_DEBUG")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "profiler_st" not in done.stderr, done.stderr[-2000:]


def test_manifest_hashes_every_file_and_is_last(converted):
    result = converted("gpt2")
    manifest = json.loads((result.out / "manifest.json").read_text())
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    on_disk = {str(p.relative_to(result.out)) for p in result.out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(listed) == on_disk
    assert not [p for p in on_disk if "spare" in p]  # children started ahead of need leave no file of their own
    for path, digest in listed.items():
        assert sha256(result.out / path) == digest
    checkpoint = (result.out / result.report["model"]["checkpoint"]).resolve()  # relative to the output folder
    entry = manifest["checkpoint"][0]
    assert entry["sha256"] == sha256(checkpoint / entry["path"])
    assert manifest["versions"]["torch"] == torch.__version__
    assert manifest["recipe"]["name"] == "cpu-fp32"
    mtimes = {p.name: p.stat().st_mtime_ns for p in result.out.iterdir() if p.is_file()}
    assert mtimes["manifest.json"] == max(mtimes.values())


def test_report_markdown_has_one_row_per_target(converted):
    text = (converted("llama").out / "report.md").read_text()
    for row in ("| eager (baseline) |", "| rewritten | ✅ ok", "| exported_program | ✅ ok", "| aoti | ✅ ok",
                "| onnx | ✅ ok"):
        assert row in text
    assert "numerics: passed · speed: " in text.splitlines()[0]


def test_dynamic_dims_work_in_the_artifacts(converted, tiny_models):
    """Artifacts exported at batch 2 x seq 32 run at batch 3 x seq 17 and agree with eager."""
    result = converted("llama")
    from exporter.checkpoint import load_model

    model = load_model(tiny_models["llama"]).model
    ids = torch.randint(0, 1000, (3, 17))
    mask = torch.ones_like(ids)
    mask[2, 11:] = 0
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    program = torch.export.load(str(result.out / "model.pt2")).module()
    assert torch.allclose(program(attention_mask=mask, input_ids=ids)[0], expected, atol=1e-4)
    session = ort.InferenceSession(str(result.out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0]
    assert np.allclose(got, expected.numpy(), atol=1e-4)
    shapes = {i.name: i.shape for i in session.get_inputs() + session.get_outputs()}  # what an ORT user sees
    assert shapes == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                      "logits": ["batch", "sequence", 1000]}
    dims = result.report["inputs"]["dynamic"]
    assert dims["input_ids"]["0"]["dim"] == "batch" and dims["input_ids"]["1"]["dim"] == "sequence"


def test_custom_factory_with_declared_inputs(factory_checkpoint, write_recipe, tmp_path):
    from conftest import FACTORY_RECIPE

    path, factory = factory_checkpoint
    recipe = write_recipe(FACTORY_RECIPE.format(targets='["exported_program", "aoti", "onnx"]'))
    result = exporter.convert(path, recipe, tmp_path / "out", model=factory)
    report = result.report
    assert result.exit_code == 0, report["problems"]
    assert report["model"]["architecture_source"] == "factory"
    assert report["inputs"]["names"] == ["tokens", "features"]
    assert report["outputs"] == ["logits", "hidden"]
    assert report["inputs"]["seed"] == 3
    assert {a["target"]: a["status"] for a in report["artifacts"]} == {
        "exported_program": "ok", "aoti": "ok", "onnx": "ok"}
    program = torch.export.load(str(result.out / "model.pt2")).module()
    tokens = torch.randint(0, 100, (5, 20))
    features = torch.randn(5, 20, 32)
    logits, hidden = program(**dict(zip(report["inputs"]["names"], (tokens, features))))
    assert logits.shape == (5, 20, 100)


ONNX_BREAKER = '''
import torch
import torch.nn as nn


class RunningMax(nn.Module):
    """torch.cummax has no ONNX translation: the onnx target must fail while the others are built."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cummax(self.proj(x), dim=-1).values


def build(config=None):
    return RunningMax()
'''


def test_one_failing_target_loses_none_of_the_others(tmp_path, user_module):
    from safetensors.torch import save_model

    onnx_breaker = user_module("onnx_breaker", ONNX_BREAKER)

    save_model(onnx_breaker.build(), str(tmp_path / "model.safetensors"))
    recipe = dataclasses.replace(quick(), inputs=dataclasses.replace(quick().inputs, tensors=()))
    recipe = recipe.with_inputs(("batch=2:1:8",), ("x:float32:batch,8",))
    result = exporter.convert(tmp_path / "model.safetensors", recipe, tmp_path / "out", model="onnx_breaker:build")
    status = {a["target"]: a["status"] for a in result.report["artifacts"]}
    assert status == {"exported_program": "ok", "aoti": "ok", "onnx": "failed"}
    onnx_entry = next(a for a in result.report["artifacts"] if a["target"] == "onnx")
    assert onnx_entry["error"].startswith("build failed")
    assert result.exit_code == 4 and not result.report["passed"]
    assert any(p.startswith("onnx:") for p in result.report["problems"])
    assert (result.out / "manifest.json").is_file() and (result.out / "model.aoti.pt2").is_file()
    assert (result.out / "logs" / "onnx.log").is_file()  # the traceback, for whoever debugs it


def test_compile_variant_of_a_graph_rewritten_model(factory_checkpoint, write_recipe, tmp_path):
    """torch.compile runs in its own process, rebuilt from the checkpoint with the same rewrite."""
    from conftest import FACTORY_RECIPE

    path, factory = factory_checkpoint
    text = FACTORY_RECIPE.format(targets='["compile"]').replace("[bench]", "[numerics]\ngrid = false\n\n[bench]")
    recipe = write_recipe(text.replace('build = ["compile"]', 'build = ["compile"]\ncompile_modes = ["default"]'))
    result = exporter.convert(path, recipe, tmp_path / "out", model=factory)
    assert result.exit_code == 0, result.report["problems"]
    assert result.report["attention"]["rewritten"] == 1  # the factory's hand-written attention
    (variant,) = result.report["artifacts"]
    assert variant["name"] == "compile:default" and variant["status"] == "ok"
    assert variant["numerics"]["passed"] and variant["path"] is None
    assert variant["build_s"] > 0 and variant["info"]["mode"] == "default"
    assert variant["bench"]["median_ms"] > 0
    assert variant["info"]["kernels"]["softmax_kernels"] == 0  # no unfused softmax survived the rewrite


def test_no_rewrite_leaves_attention_as_written(tmp_path, monkeypatch):
    """--no-rewrite --target exported_program on a model with hand-written attention: the sites are audited,
    none rewritten, the artifact runs explicit softmax; the same run with the rewrite runs the SDPA kernel."""
    import subprocess

    from exporter.rewrite import OFF

    subprocess.run([sys.executable, "-m", "exporter.testing.handwritten_gpt", str(tmp_path / "gpt"), "--size", "tiny"],
                   check=True, capture_output=True)
    declared = dict(dims=("batch=2:1:4", "sequence=32:2:128"),
                    tensors=("input_ids:int64:batch,sequence:0:256", "attention_mask:int64:batch,sequence"))
    runs = {}
    for rewrite in (True, False):
        runs[rewrite] = exporter.convert(tmp_path / "gpt", "cpu-fp32", tmp_path / f"out-{rewrite}",
                                         model="exporter.testing.handwritten_gpt:build", rewrite=rewrite,
                                         targets=("exported_program",), **declared)
        assert runs[rewrite].exit_code == 0, runs[rewrite].report["problems"]
    on, off = runs[True].report, runs[False].report
    assert [a["name"] for a in off["artifacts"]] == ["exported_program"]
    assert off["recipe"]["rewrite_attention"] is False and on["recipe"]["rewrite_attention"] is True
    assert (on["attention"]["found"], on["attention"]["rewritten"]) == (2, 2)
    assert (off["attention"]["found"], off["attention"]["rewritten"]) == (2, 0)
    assert all(s["status"] == "skipped" and s["reason"] == OFF for s in off["attention"]["sites"])
    kernels_on, kernels_off = (r["artifacts"][0]["info"]["kernels"] for r in (on, off))
    assert kernels_on["backends"] == {"flash": 2} and kernels_on["softmax_kernels"] == 0
    assert kernels_off["backends"] == {} and kernels_off["softmax_kernels"] == 2
    assert "rewrite off" in (runs[False].out / "report.md").read_text()


def test_attention_behind_views_is_rewritten_end_to_end(tmp_path, monkeypatch):
    """The hand-written GPT with its heads folded into the batch (bmm, views around the softmax, causal and
    padding masks in 4-D): every site rewritten, the program runs the fused kernel and no softmax, ONNX holds
    the Attention op, and every artifact passes the gate over the shape grid."""
    import subprocess

    subprocess.run([sys.executable, "-m", "exporter.testing.handwritten_gpt", str(tmp_path / "gpt"), "--size", "tiny",
                    "--layout", "flattened"], check=True, capture_output=True)
    result = exporter.convert(tmp_path / "gpt", "cpu-fp32", tmp_path / "out",
                              model="exporter.testing.handwritten_gpt:build",
                              targets=("exported_program", "onnx"), dims=("batch=2:1:4", "sequence=32:2:128"),
                              tensors=("input_ids:int64:batch,sequence:0:256", "attention_mask:int64:batch,sequence"))
    report = result.report
    assert result.exit_code == 0, report["problems"]
    assert (report["attention"]["found"], report["attention"]["rewritten"]) == (2, 2)
    assert all("view" in s["pattern"] and s["causal"] and s["masked"] for s in report["attention"]["sites"])
    program, onnx_artifact = report["artifacts"]
    assert program["info"]["kernels"]["backends"] == {"flash": 2} and program["info"]["kernels"]["softmax_kernels"] == 0
    assert onnx_artifact["graph"]["attention"] == 2 and onnx_artifact["graph"]["softmax"] == 0
    assert all(a["numerics"]["grid"]["passed"] for a in report["artifacts"])


def test_four_spellings_of_attention_in_one_model_are_all_rewritten(tmp_path):
    """The hand-written GPT with --layout mixed: its four blocks write attention four ways (matmul on heads, bmm
    behind views, baddbmm with a mask expanded over the heads and folded with them, einsum with an arange causal
    mask). Every site is rewritten, the program runs no softmax, and it passes the gate over the shape grid."""
    from safetensors.torch import save_model

    from exporter.testing import handwritten_gpt

    config = {**handwritten_gpt.SIZES["tiny"], "layers": 4, "layout": "mixed"}
    (tmp_path / "gpt").mkdir()
    save_model(handwritten_gpt.build(config).eval(), str(tmp_path / "gpt" / "model.safetensors"))
    (tmp_path / "gpt" / "config.json").write_text(json.dumps(config), encoding="utf-8")
    result = exporter.convert(tmp_path / "gpt", "cpu-fp32", tmp_path / "out",
                              model="exporter.testing.handwritten_gpt:build", targets=("exported_program",),
                              dims=("batch=2:1:4", "sequence=32:2:128"),
                              tensors=("input_ids:int64:batch,sequence:0:256", "attention_mask:int64:batch,sequence"))
    report = result.report
    assert result.exit_code == 0, report["problems"]
    assert (report["attention"]["found"], report["attention"]["rewritten"]) == (4, 4)
    sites = report["attention"]["sites"]
    assert all(s["masked"] for s in sites) and [s["causal"] for s in sites] == [True, True, False, True]
    # the baddbmm block sums causal and padding into one mask (data, so not causal), expanded over the heads:
    # SDPA takes it at its broadcast shape, not one copy per head
    assert sites[2]["pattern"].startswith("baddbmm") and "mask broadcast" in sites[2]["pattern"]
    kernels = report["artifacts"][0]["info"]["kernels"]
    assert kernels["softmax_kernels"] == 0 and sum(kernels["backends"].values()) == 4
    assert report["artifacts"][0]["numerics"]["grid"]["passed"]


def test_target_option_checks_names():
    from exporter.api import resolve_recipe
    from exporter.errors import RecipeError

    assert resolve_recipe("h100-bf16", targets=("onnx", "aoti")).targets.build == ("aoti", "onnx")
    with pytest.raises(RecipeError, match="'trt' is not one of"):
        resolve_recipe("cpu-fp32", targets=("trt",))
    assert resolve_recipe("cpu-fp32", rewrite=False).runtime.rewrite_attention is False


def test_a_decoder_declared_without_a_padding_mask_ships_the_causal_kernel(tiny_models, tmp_path):
    """A convert whose inputs leave out attention_mask: every artifact runs SDPA with is_causal=True (ONNX's
    Attention with is_causal=1) and no mask tensor, and passes the gate over the shape grid."""
    result = exporter.convert(tiny_models["llama"], quick(), tmp_path / "out", targets=("exported_program", "onnx"),
                              tensors=("input_ids:int64:batch,sequence:0:1000",))
    report = result.report
    assert result.exit_code == 0, report["problems"]
    assert report["inputs"]["names"] == ["input_ids"]
    assert all(a["status"] == "ok" and a["numerics"]["passed"] for a in report["artifacts"])
    for artifact in report["artifacts"]:  # sequence 1 included: the grid covers the declared range's ends
        grid = artifact["numerics"]["grid"]
        assert grid["checked"] and grid["passed"] and grid["points"] and not grid["specialised"]
    program = torch.export.load(str(result.out / "model.pt2"))
    calls = [n for n in program.graph.nodes
             if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target)]
    assert len(calls) == 2
    assert all(c.args[3] is None and c.args[5] is True and c.kwargs.get("enable_gqa") for c in calls)
    attention = [n for n in onnx.load(str(result.out / "model.onnx")).graph.node if n.op_type == "Attention"]
    assert len(attention) == 2
    assert all(any(a.name == "is_causal" and a.i == 1 for a in n.attribute) for n in attention)
    assert all(len(n.input) < 4 or not n.input[3] for n in attention)  # no attn_mask input
