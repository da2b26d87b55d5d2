"""``exporter verify``: the release gate catches a tampered, incomplete, re-signed or broken output folder."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import exporter
from exporter.errors import UsageError
from exporter.published.verification import EXIT_INTEGRITY, verify
from exporter.recipe import load_recipe
from exporter.testing.cli import run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory) -> Path:
    recipe = load_recipe("cpu-fp32")
    recipe = dataclasses.replace(recipe, bench=dataclasses.replace(recipe.bench, warmup=1, rounds=1, iterations=2),
                                 targets=dataclasses.replace(recipe.targets, build=("exported_program", "onnx")))
    result = exporter.convert(tiny_models["bert"], recipe, tmp_path_factory.mktemp("verify") / "bert")
    assert result.exit_code == 0, result.report["problems"]
    return result.out


@pytest.fixture
def folder(converted, tmp_path) -> Path:
    """A private copy of the converted folder, to damage."""
    copy = tmp_path / "release"
    shutil.copytree(converted, copy)
    return copy


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def resign(folder: Path, rel: str) -> None:
    """Update every record of ``rel``'s hash, as someone re-exporting and re-hashing by hand would."""
    path = folder / rel
    sha, size = digest(path), path.stat().st_size
    report = json.loads((folder / "report.json").read_text())
    for artifact in report["artifacts"]:
        for entry in artifact["files"]:
            if entry["path"] == rel:
                entry.update(sha256=sha, bytes=size)
                artifact["sha256"] = artifact["files"][0]["sha256"]
    (folder / "report.json").write_text(json.dumps(report, indent=2))
    manifest = json.loads((folder / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["path"] in (rel, "report.json"):
            target = folder / entry["path"]
            entry.update(sha256=digest(target), bytes=target.stat().st_size)
    for entry in manifest["artifacts"]:
        if entry["path"] == rel:
            entry["sha256"] = sha
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def cases(junit: Path) -> dict[tuple[str, str], str]:
    """(classname, name) -> "passed" | "failed" | "skipped"."""
    root = ET.parse(junit).getroot()
    out = {}
    for case in root.iter("testcase"):
        state = "failed" if case.find("failure") is not None else "skipped" if case.find("skipped") is not None \
            else "passed"
        out[(case.get("classname"), case.get("name"))] = state
    return out


def test_an_intact_folder_verifies(folder, tmp_path):
    junit = tmp_path / "ci" / "verify.xml"
    result = verify(folder, junit=junit)
    assert result.exit_code == 0, result.problems
    checks = {(c.subject, c.name): c.passed for c in result.checks}
    for artifact in ("exported_program", "onnx"):
        assert checks[(artifact, "sha256")] and checks[(artifact, "loads")] and checks[(artifact, "numerics")]
    states = cases(junit)
    assert states[("exporter.verify.onnx", "numerics")] == "passed"
    assert set(states.values()) == {"passed"}
    assert ET.parse(junit).getroot().get("failures") == "0"


def test_flipped_bytes_in_the_onnx_model_fail_the_gate(folder, tmp_path):
    path = folder / "model.onnx"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    junit = tmp_path / "verify.xml"
    run = run_cli(["verify", folder, "--junit", junit])
    assert run.returncode == EXIT_INTEGRITY, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model.onnx" in errors[0] and "SHA-256" in errors[0] and "Fix:" in errors[0]
    states = cases(junit)
    assert states[("exporter.verify.onnx", "sha256")] == "failed"
    assert states[("exporter.verify.onnx", "loads")] == "skipped"  # a changed file is never run
    assert states[("exporter.verify.exported_program", "numerics")] == "passed"
    # the folder's own case speaks for the files beside the artifacts only (the changed model.onnx is onnx's)
    folder_case = ET.parse(junit).getroot().find(".//testcase[@classname='exporter.verify.folder'][@name='files']")
    assert "besides the artifacts' match" in (folder_case.findtext("system-out") or "")


def test_verify_json_is_versioned_and_matches_its_schema(folder):
    jsonschema = pytest.importorskip("jsonschema")
    from exporter.report import command_schema

    run = run_cli(["verify", folder, "--json"])
    assert run.returncode == 0, run.stderr
    data = json.loads(run.stdout)
    jsonschema.validate(data, command_schema("verify"))
    assert data["schema_version"] == 1 and data["command"] == "verify" and data["passed"]


def test_a_folder_without_manifest_never_finished(folder):
    (folder / "manifest.json").unlink()
    result = verify(folder)
    assert result.exit_code == EXIT_INTEGRITY
    assert "no manifest.json" in result.problems[0] and "never finished" in result.problems[0]


def test_missing_and_unlisted_files(folder):
    (folder / "reference" / "outputs.safetensors").unlink()
    (folder / "extra.so").write_bytes(b"\x7fELF")
    result = verify(folder)
    assert result.exit_code == EXIT_INTEGRITY
    text = " ".join(result.problems)
    assert "reference/outputs.safetensors is missing" in text and "extra.so is in the folder but not in" in text


def test_a_hidden_file_added_to_the_folder_fails(folder):
    """A dotfile is a file too: a ``.hidden.so`` slipped in beside the artifacts is unlisted, and fails."""
    (folder / ".hidden.so").write_bytes(b"\x7fELF")
    result = verify(folder)
    assert result.exit_code == EXIT_INTEGRITY
    assert ".hidden.so is in the folder but not in manifest.json" in " ".join(result.problems)


def test_a_resigned_artifact_that_computes_differently_fails_numerics(folder):
    """Hashes all consistent, but the ONNX weights changed: only re-running against the stored reference sees it."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(folder / "model.onnx"))
    weight = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)) if t.data_type == 1 else 0)
    array = numpy_helper.to_array(weight) * np.float32(1.01)
    weight.CopyFrom(numpy_helper.from_array(array, weight.name))
    onnx.save(model, str(folder / "model.onnx"))
    resign(folder, "model.onnx")
    result = verify(folder)
    assert result.exit_code == 3, result.problems
    (problem,) = result.problems
    assert problem.startswith("onnx: output") and "> allowed" in problem


def test_a_resigned_artifact_that_no_longer_loads(folder):
    (folder / "model.pt2").write_bytes(b"not a torch.export archive")
    resign(folder, "model.pt2")
    result = verify(folder)
    assert result.exit_code == 4, result.problems
    assert result.problems[0].startswith("exported_program: no longer loads")


def test_usage_errors(tmp_path, folder):
    with pytest.raises(UsageError, match="does not exist"):
        verify(tmp_path / "nope")
    run = run_cli(["verify", folder, "--junit", folder / "model.onnx" / "x.xml"], timeout=120)
    assert run.returncode == 5 and "JUnit" in run.stderr


def test_a_published_folder_names_no_host_and_verifies_where_it_moved(converted, tmp_path, tiny_models):
    """report.json and manifest.json hold relative paths and no host name; a moved copy verifies, and the run
    it records can be repeated from its recipe.json."""
    import platform

    moved = tmp_path / "elsewhere" / "release"
    shutil.copytree(converted, moved)
    for name in ("report.json", "manifest.json", "recipe.json"):
        text = (converted / name).read_text()
        assert str(converted.parent) not in text and str(Path.home()) + "/" not in text
        assert f'"{platform.node()}"' not in text, name
    report = json.loads((converted / "report.json").read_text())
    manifest = json.loads((converted / "manifest.json").read_text())
    assert "host" not in report["environment"]["device"]

    paths = [e["path"] for e in manifest["files"] + manifest["checkpoint"] + manifest["artifacts"]]
    assert paths and not [p for p in paths if Path(p).is_absolute() or ".." in Path(p).parts]
    assert report["recipe"]["source"] == "cpu-fp32 (built-in)"
    recorded = Path(report["model"]["checkpoint"])  # relative to the output folder
    assert not recorded.is_absolute() and (converted / recorded).resolve() == tiny_models["bert"].resolve()
    result = verify(moved)
    assert result.exit_code == 0, result.problems
    again = load_recipe(moved / "recipe.json")
    assert dataclasses.replace(again, source="") == dataclasses.replace(
        load_recipe(converted / "recipe.json"), source="")
    assert again.targets.build == ("exported_program", "onnx") and again.bench.iterations == 2


def test_aoti_weights_kept_apart_load_and_verify(tiny_models, tmp_path, monkeypatch):
    """Above a size (here: any), an AOTI package is built without its weights, which go beside it as safetensors;
    the shipped loader hands them over, in a server process that has only torch, and verify re-runs it."""
    monkeypatch.setenv("EXPORTER_AOTI_WEIGHTS_APART_ABOVE", "0")
    out = tmp_path / "apart"
    result = exporter.convert(tiny_models["llama"], "cpu-fp32", out, targets=("aoti",))
    assert result.exit_code == 0, result.problems
    entry = result.report["artifacts"][0]
    files = {f["path"] for f in entry["files"]}
    assert {"model.aoti.pt2", "model.aoti.weights.safetensors", "aoti_loader.py"} <= files
    assert any("beside the package" in note for note in entry["notes"])
    weights = (out / "model.aoti.weights.safetensors").stat().st_size
    from exporter.checkpoint import load_model

    params = sum(p.numel() * 4 for p in load_model(tiny_models["llama"]).model.parameters())
    assert weights >= params  # every weight is in the file beside the package
    server = subprocess.run(
        [sys.executable, "-c", "import torch; from aoti_loader import load_package; "
         "m = load_package('model.aoti.pt2'); x = torch.ones(1, 8, dtype=torch.long); "
         "print(len(m.constants), tuple(m(x, x)[0].shape))"],
        cwd=out, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert server.returncode == 0, server.stderr
    count, shape = server.stdout.strip().split(" ", 1)
    assert int(count) > 0 and shape == "(1, 8, 1000)"
    assert verify(out).passed
