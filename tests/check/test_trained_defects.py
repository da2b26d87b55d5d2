"""The gate's power on a model whose weights mean something (the trained GPT-NeoX of exporter.testing.trained):
a user's bfloat16 program or float32 ONNX with a defect planted in layer 1 fails ``exporter check`` (exit 3),
named by the proof that sees it; so does exporter convert's own program when the defect enters while it traces;
the clean artifacts pass every proof."""

from __future__ import annotations

import json

import pytest
import torch

from exporter.testing.cli import run_cli
from exporter.testing.defects import EXPECT, export, export_onnx, planted_in_convert
from exporter.testing.trained import trained_lm


@pytest.fixture(scope="module")
def trained():
    return trained_lm()


def check(program, checkpoint, out) -> tuple[int, dict, str]:
    done = run_cli(["check", program, "--against", checkpoint, "--out", out, "--dim", "sequence=64"])
    entry = json.loads((out / "report.json").read_text())["artifacts"][0] if (out / "report.json").is_file() else {}
    return done.returncode, entry, done.stderr


def test_the_trained_model_learned_its_text(trained):
    summary = json.loads((trained / "training.json").read_text())
    assert summary["held_out_loss"] < 0.45 * summary["uniform_loss"]  # ~1.6 nats a byte against 5.5 for chance


def test_a_clean_bfloat16_program_passes_every_proof(trained, tmp_path):
    code, entry, stderr = check(export(trained, tmp_path / "clean.pt2", "clean", "cpu", torch.bfloat16), trained,
                                tmp_path / "clean")
    assert code == 0, stderr[-3000:]
    proofs = entry["proofs"]
    assert proofs["weights"]["passed"] and proofs["weights"]["changed"] == []
    assert proofs["program"]["passed"] and proofs["program"]["worst"] < 1e-12 and proofs["program"]["kept"] == []
    rounding = proofs["rounding"]
    assert rounding["passed"] and rounding["power"] == 0.95 and 1.0 < rounding["detects_ratio"] < 4.0
    assert f"{rounding['detects_increase_pct']:.0f}%" in rounding["summary"]


@pytest.mark.parametrize("defect, proof", [("scale", "program"), ("gelu-tanh", "program"),
                                           ("mask-shift", "program"), ("layernorm", "weights"),
                                           ("rope-base", "weights"), ("stale", "weights")])
def test_a_planted_defect_fails_named_by_its_proof(trained, tmp_path, defect, proof):
    code, entry, stderr = check(export(trained, tmp_path / f"{defect}.pt2", defect, "cpu", torch.bfloat16), trained,
                                tmp_path / defect)
    assert code == 3, stderr[-3000:]
    assert entry["proofs"][proof]["passed"] is False
    assert EXPECT[defect] in entry["error"], entry["error"]
    other = "weights" if proof == "program" else "program"
    assert entry["proofs"][other]["passed"] is True  # each proof asks its own half of the question


@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_a_users_onnx_gets_the_program_proof_and_a_defect_is_located_by_value(trained, tmp_path, dynamo):
    clean = export_onnx(trained, tmp_path / "clean.onnx", "clean", dynamo=dynamo)
    code, entry, stderr = check(clean, trained, tmp_path / "clean")
    assert code == 0, stderr[-3000:]
    program = entry["proofs"]["program"]
    assert program["passed"] and program["worst"] < 1e-7, program  # float32 literals: ~1e-8, not ~1e-15
    bad = export_onnx(trained, tmp_path / "gelu.onnx", "gelu-tanh", dynamo=dynamo)
    code, entry, stderr = check(bad, trained, tmp_path / "gelu")
    assert code == 3, stderr[-3000:]
    assert entry["proofs"]["program"]["passed"] is False and entry["proofs"]["weights"]["passed"] is True
    assert EXPECT["gelu-tanh"] in entry["proofs"]["program"]["module"], entry["proofs"]["program"]


def test_a_users_optimum_export_of_a_changed_folder_fails_by_the_weight_it_changed(trained, tmp_path):
    """A user's Optimum export (``optimum-cli export onnx``, in Optimum's own environment with transformers 4) of a
    copy of the folder with 0.5% noise on one Linear fails by the weights proof, named; the clean folder's export
    passes every proof: both transformers generations build the same model from the folder."""
    from exporter.testing.defects import planted_folder
    from exporter.testing.optimum_peer import export as optimum_export
    from exporter.testing.optimum_peer import optimum_cli

    cli, why = optimum_cli()
    if cli is None:
        pytest.skip(why)
    for defect, expected in (("clean", 0), ("noise", 3)):
        folder = planted_folder(trained, defect, tmp_path / f"{defect}-model")
        done = optimum_export(folder, tmp_path / f"{defect}-onnx", "text-generation")
        assert done.returncode == 0, done.stderr[-2000:]
        code, entry, stderr = check(tmp_path / f"{defect}-onnx", trained, tmp_path / defect)
        assert code == expected, stderr[-3000:]
        if defect == "clean":
            assert entry["proofs"]["weights"]["passed"] and entry["proofs"]["program"]["passed"], entry["proofs"]
        else:
            assert entry["proofs"]["weights"]["passed"] is False and EXPECT["noise"] in entry["error"], entry["error"]


def test_a_defect_entering_converts_export_fails_every_artifact_built_from_it(trained, tmp_path):
    """The defect is planted only while convert traces the model (the reference, eager and the rewritten model stay
    clean): the exported program, and the ONNX model made from it, fail the program proof, named."""
    import exporter

    with planted_in_convert(trained, "mask-shift"):
        result = exporter.convert(trained, "cpu-fp32", tmp_path / "run", dims=("sequence=64",),
                                  targets=("exported_program", "onnx"))
    assert result.exit_code == 3
    assert result.report["rewritten"]["status"] == "ok"
    for entry in result.report["artifacts"]:
        assert entry["status"] == "numerics_failed" and entry["proofs"]["program"]["passed"] is False, entry
        assert EXPECT["mask-shift"] in entry["error"], entry["error"]
        assert entry["proofs"]["weights"]["passed"] is True


def test_verify_with_the_checkpoint_asks_the_proofs_again_and_refuses_another_checkpoint(trained, tmp_path):
    import exporter

    result = exporter.convert(trained, "cpu-fp32", tmp_path / "run", dims=("sequence=64",),
                              targets=("exported_program", "onnx"))
    assert result.exit_code == 0, result.report["problems"]
    done = run_cli(["verify", tmp_path / "run", "--checkpoint", trained, "--json"])
    assert done.returncode == 0, done.stderr[-2000:]
    checks = {(c["subject"], c["check"]): c for c in json.loads(done.stdout)["checks"]}
    for name in ("exported_program", "onnx"):
        assert checks[(name, "weights")]["status"] == "passed", checks[(name, "weights")]
        assert checks[(name, "program")]["status"] == "passed", checks[(name, "program")]
    stale = run_cli(["verify", tmp_path / "run", "--checkpoint", trained / "earlier"])
    assert stale.returncode == 6
    assert "model.safetensors differs from the checkpoint the folder was made from" in stale.stderr


def test_the_training_script_learns(tmp_path):
    """What made the shipped model: a few steps of the same script already lower the loss."""
    from exporter.testing.trained import train

    summary = train(tmp_path / "lm", steps=40)
    assert summary["held_out_loss"] < summary["first_loss"] - 1.0
    assert (tmp_path / "lm" / "earlier" / "model.safetensors").is_file()
