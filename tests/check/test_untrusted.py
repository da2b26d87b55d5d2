"""What ``exporter check`` and ``verify`` never run, read or publish (docs/check.md, "Threat model").

Every file handed to them is untrusted: each test plants a harmless payload that creates a marker file if it ever
runs (``exporter.testing.payloads``), first shows the payload is live (torch's own loader, or the dynamic loader,
runs it), then asserts that the command refuses in one line and that the marker never appears.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exporter.testing.cli import run_cli
from exporter.testing.payloads import native_package, pickle_program, rehash, spec_module_program

QUICK = ["--set", "bench.warmup=0", "--set", "bench.rounds=1", "--set", "bench.iterations=2"]


def exporter(*args, cwd=None) -> subprocess.CompletedProcess:
    return run_cli(list(args), cwd, timeout=900)


def check(*args, cwd=None) -> subprocess.CompletedProcess:
    return exporter("check", *args, "-q", *QUICK, cwd=cwd)


def one_error(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    return lines[0]


def export_bert(folder: Path, path: Path, scale: float | None = None) -> Path:
    """torch.export of the checkpoint's BertModel by keyword; with ``scale``, layer 1's attention scale is wrong."""
    from transformers import BertModel

    model = BertModel.from_pretrained(folder, attn_implementation="sdpa").eval()
    if scale is not None:
        model.encoder.layer[1].attention.self.scaling *= scale
    ids = torch.randint(0, 1000, (2, 16))
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)
    program = torch.export.export(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                  dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                  "attention_mask": {0: batch, 1: seq}})
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, str(path))
    return path


@pytest.fixture(scope="module")
def bert_program(tiny_models, tmp_path_factory) -> Path:
    return export_bert(tiny_models["bert"], tmp_path_factory.mktemp("program") / "bert.pt2")


@pytest.fixture(scope="module")
def checked_program(bert_program, tiny_models, tmp_path_factory) -> Path:
    """A clean ``exporter check`` folder of the BERT program (what verify is later handed, tampered with)."""
    out = tmp_path_factory.mktemp("checked") / "out"
    done = check(bert_program, "--against", tiny_models["bert"], "--out", out)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# --------------------------------------------------------------------------- pickles


@pytest.mark.parametrize("where", ["sample_inputs", "weight"])
def test_a_pickle_in_a_pt2_is_refused_and_never_runs(where, bert_program, tiny_models, tmp_path):
    from exporter.targets.program_file import PickleRefused, load_program

    marker = tmp_path / "ran"
    planted = pickle_program(bert_program, tmp_path / "planted.pt2", marker, where)
    with pytest.raises(Exception):  # noqa: B017 - torch's loader runs the payload (then fails or not)
        torch.export.load(str(planted)).module()(torch.zeros(1, 1))
    assert marker.exists(), "the planted pickle must be live for this test to mean anything"
    marker.unlink()

    if where == "sample_inputs":  # the sample inputs are never read: the program loads, as data
        assert load_program(planted) is not None
    else:
        with pytest.raises(PickleRefused, match="pickled data"):
            load_program(planted)
    assert not marker.exists()
    if where == "sample_inputs":
        return
    done = check(planted, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 2
    line = one_error(done)
    assert "holds pickled data (weight " in line and "--allow-artifact-pickle" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_check_folder_with_a_pickle_swapped_in_is_not_loaded_by_verify(checked_program, bert_program, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(checked_program, folder)
    report = json.loads((folder / "report.json").read_text())
    (entry,) = report["artifacts"]
    marker = tmp_path / "ran"
    pickle_program(bert_program, folder / entry["path"], marker, "weight")
    rehash(folder)  # whoever can write the folder can write its manifest
    done = exporter("verify", folder)
    assert done.returncode == 2, done.stderr[-3000:]
    line = one_error(done)
    assert "not loaded: it holds pickled data" in line and "--allow-artifact-pickle" in line, line
    assert not marker.exists()


def test_a_program_with_the_sample_inputs_as_payload_passes_check_and_verify_without_running_it(
        bert_program, tiny_models, tmp_path):
    """torch.export.load unpickles the sample inputs, falling back to weights_only=False; exporter never reads
    them, so the program is judged (and passes) and the payload never runs."""
    marker = tmp_path / "ran"
    planted = pickle_program(bert_program, tmp_path / "planted.pt2", marker, "sample_inputs")
    done = check(planted, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    assert exporter("verify", tmp_path / "out").returncode == 0
    assert not marker.exists()


# --------------------------------------------------------------------------- native code


def test_an_aoti_package_is_not_loaded_without_the_opt_in(bert_program, tiny_models, tmp_path):
    marker = tmp_path / "ran"
    planted = native_package(tmp_path / "planted.aoti.pt2", marker)
    loaded = subprocess.run([sys.executable, "-c", "import ctypes, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); "
                             "open(sys.argv[2], 'wb').write(z.read('model/data/aotinductor/model/model.so')); "
                             "ctypes.CDLL(sys.argv[2])", str(planted), str(tmp_path / "x.so")], check=False)
    assert loaded.returncode == 0 and marker.exists(), "the planted constructor must be live"
    marker.unlink()
    done = check(planted, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 2
    line = one_error(done)
    assert "is an AOTInductor package" in line and "--allow-native-code" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- imports


def test_a_call_spec_naming_another_module_is_refused_and_nothing_is_imported(bert_program, tiny_models, tmp_path):
    marker = tmp_path / "ran"
    work = tmp_path / "work"
    work.mkdir()
    planted = spec_module_program(bert_program, work / "planted.pt2", "planted_spec", marker, [work])
    done = check(planted, "--against", tiny_models["bert"], "--out", tmp_path / "out", cwd=work)
    assert done.returncode == 2
    line = one_error(done)
    assert "names the type planted_spec." in line and "does not import" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_child_never_imports_from_the_folder_it_was_started_in(tmp_path):
    """A parent whose working folder is on its import path (``python script.py``, ``python -m exporter``) starts
    children that cannot import a module lying there."""
    marker = tmp_path / "ran"
    (tmp_path / "planted_probe.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    (tmp_path / "parent.py").write_text(
        "import json, os, subprocess\n"
        "from exporter.runners import CHILD_PYTHON, child_env, import_path\n"
        "child = subprocess.run([*CHILD_PYTHON, '-c', 'import planted_probe'], env=child_env(), capture_output=True,"
        " text=True)\n"
        "print(json.dumps({'path': import_path(), 'code': child.returncode, 'err': child.stderr[-300:]}))\n")
    done = subprocess.run([sys.executable, "parent.py"], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert str(tmp_path) not in seen["path"]
    assert seen["code"] == 1 and "No module named 'planted_probe'" in seen["err"], seen
    assert not marker.exists()


# --------------------------------------------------------------------------- files outside the folder


@pytest.fixture(scope="module")
def onnx_folder(tiny_models, tmp_path_factory) -> Path:
    """The tiny BERT as ONNX with its weights in ``model.onnx.data`` beside it."""
    import onnx
    from transformers import BertModel

    model = BertModel.from_pretrained(tiny_models["bert"], attn_implementation="sdpa").eval()
    folder = tmp_path_factory.mktemp("onnx") / "export"
    folder.mkdir()
    ids = torch.randint(0, 1000, (2, 16))
    torch.onnx.export(model, (), str(folder / "inline.onnx"),
                      kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state", "pooler_output"],
                      dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}},
                      dynamo=True)
    proto = onnx.load(str(folder / "inline.onnx"))
    (folder / "inline.onnx").unlink()
    onnx.save_model(proto, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")
    return folder


def test_a_symlink_out_of_the_folder_is_refused_and_never_published(onnx_folder, tiny_models, tmp_path):
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    shutil.copy(onnx_folder / "model.onnx.data", secret)
    folder = tmp_path / "given"
    folder.mkdir()
    shutil.copy(onnx_folder / "model.onnx", folder / "model.onnx")
    (folder / "model.onnx.data").symlink_to(secret)
    done = check(folder, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 2
    line = one_error(done)
    assert "is a link to" in line and "outside the judged folder" in line, line
    assert not (tmp_path / "out").exists()


def test_names_that_leave_the_folder_are_refused_before_anything_runs(onnx_folder, tiny_models, tmp_path):
    import onnx

    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(onnx_folder / "model.onnx.data", outside / "model.onnx.data")
    folder = tmp_path / "given"
    folder.mkdir()
    proto = onnx.load(str(onnx_folder / "model.onnx"), load_external_data=False)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../outside/model.onnx.data"
    onnx.save_model(proto, str(folder / "model.onnx"))
    done = check(folder / "model.onnx", "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 2
    assert "names the file '../outside/model.onnx.data', a path outside its own folder" in one_error(done)
    assert not (tmp_path / "out").exists()

    manifest = tmp_path / "exported"
    manifest.mkdir()
    (manifest / "export.json").write_text(json.dumps({"components": {"model": {"file": "../given/model.onnx"}}}))
    done = check(manifest, "--against", tiny_models["bert"], "--out", tmp_path / "out2")
    assert done.returncode == 2
    assert "export.json names the file '../given/model.onnx'" in one_error(done)


def test_verify_loads_no_artifact_outside_its_folder_or_its_manifest(checked_program, bert_program, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(checked_program, folder)
    (tmp_path / "outside").mkdir()
    shutil.copy(bert_program, tmp_path / "outside" / "model.pt2")
    report = json.loads((folder / "report.json").read_text())
    report["artifacts"][0]["path"] = "../outside/model.pt2"
    (folder / "report.json").write_text(json.dumps(report))
    rehash(folder)
    done = exporter("verify", folder)
    assert done.returncode == 6, done.stderr[-3000:]
    line = one_error(done)
    assert "not loaded: report.json names the file '../outside/model.pt2'" in line, line
    assert "verified" not in done.stderr.splitlines()[-1]


def test_the_published_files_are_copies_and_the_users_stay_loadable(onnx_folder, tiny_models, tmp_path):
    import onnx

    folder = tmp_path / "given"
    shutil.copytree(onnx_folder, folder)
    done = check(folder, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("model.onnx", "model.onnx.data"):
        mine, published = folder / name, tmp_path / "out" / "artifact" / name
        assert os.stat(mine).st_nlink == 1 and os.stat(published).st_nlink == 1
        assert os.stat(mine).st_ino != os.stat(published).st_ino
    onnx.load(str(folder / "model.onnx"))  # the user's own export still loads (no "hardlink attack" refusal)
    with open(folder / "model.onnx.data", "r+b") as data:  # re-saved in place: the published copy is untouched
        data.write(b"\0" * 64)
    assert exporter("verify", tmp_path / "out").returncode == 0


def test_a_hub_cache_snapshot_links_into_its_own_blobs(onnx_folder, tiny_models, tmp_path):
    """The one place a link may point out of the judged folder: snapshots/<rev>/[onnx/]x -> blobs/<sha>, the
    snapshot judged whole or a subfolder of it (onnx/, as ONNX repositories lay it out)."""
    repo = tmp_path / "models--org--bert"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abc"
    (snapshot / "onnx").mkdir(parents=True)
    for index, name in enumerate(("model.onnx", "model.onnx.data")):
        shutil.copy(onnx_folder / name, repo / "blobs" / f"blob{index}")
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / f"blob{index}")
        (snapshot / "onnx" / name).symlink_to(Path("..") / ".." / ".." / "blobs" / f"blob{index}")
    sub = check(snapshot / "onnx", "--against", tiny_models["bert"], "--out", tmp_path / "sub")
    assert sub.returncode == 0, sub.stderr[-3000:]
    done = check(snapshot, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    published = tmp_path / "out" / "artifact" / "model.onnx.data"
    assert published.is_file() and not published.is_symlink()


def test_verify_imports_no_module_a_tampered_report_names(checked_program, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(checked_program, folder)
    marker = tmp_path / "ran"
    for where in (folder, tmp_path):
        (where / "planted_spec.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    report = json.loads((folder / "report.json").read_text())
    report["artifacts"][0]["info"]["load"]["imports"] = ["planted_spec"]
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "planted_spec.py").unlink()
    rehash(folder)
    done = exporter("verify", folder, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "asks to import 'planted_spec'" in one_error(done)
    assert not marker.exists()


def test_localisation_reads_a_failing_program_as_data_too(tiny_models, tmp_path):
    """A program whose outputs fail is localised on its unflattened submodules: loaded by the same reader, so the
    payload in its sample inputs never runs there either."""
    source = export_bert(tiny_models["bert"], tmp_path / "wrong-scale.pt2", scale=1.5)
    marker = tmp_path / "ran"
    planted = pickle_program(source, tmp_path / "planted.pt2", marker, "sample_inputs")
    done = check(planted, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 3, done.stderr[-3000:]
    assert "first divergent module encoder.layer.1.attention" in done.stderr, done.stderr[-3000:]
    assert not marker.exists()


def test_only_the_program_reader_loads_a_pt2():
    """torch.export.load unpickles; every .pt2 exporter reads goes through targets/program_file.py instead."""
    root = Path(__file__).resolve().parents[2] / "src" / "exporter"
    found = [str(p.relative_to(root)) for p in root.rglob("*.py") if p.name not in ("program_file.py", "payloads.py")
             and "torch.export.load(" in p.read_text(encoding="utf-8")]
    assert found == []


@pytest.mark.parametrize("entry, damage", [("_weights_config.json", b"{not json"),
                                           ("models/model.json", b"{not json"), ("models/model.json", b"{}"),
                                           ("models/model.json", b"[1, 2]"), ("models/model.json", b"\xff\xfe")])
def test_a_damaged_archive_is_refused_in_one_line(entry, damage, bert_program, tiny_models, tmp_path):
    import zipfile

    damaged = tmp_path / "damaged.pt2"
    with zipfile.ZipFile(bert_program) as old, zipfile.ZipFile(damaged, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            new.writestr(info.filename, damage if info.filename.endswith(entry) else data)
    done = check(damaged, "--against", tiny_models["bert"], "--out", tmp_path / "out")
    assert done.returncode == 2 and "is not a readable torch.export archive" in one_error(done)
    assert not (tmp_path / "out").exists()


def test_a_programs_guards_are_kept_and_a_guard_that_is_code_is_refused(bert_program, tmp_path):
    """torch turns a program's guard strings into Python and runs them on every call; the program reader keeps the
    guards (a program is refused at sizes it was not traced for, as its users meet it) only where each is a plain
    comparison of sizes."""
    import zipfile

    from exporter.errors import UsageError
    from exporter.targets.program_file import load_program

    ids = torch.randint(0, 1000, (2, 16))
    program = load_program(bert_program).module()
    with pytest.raises(Exception, match="Guard failed"):  # sequence lengths the export tied together, untied
        program(input_ids=ids, attention_mask=torch.ones(2, 12, dtype=torch.long))
    marker = tmp_path / "ran"
    planted = tmp_path / "planted.pt2"
    with zipfile.ZipFile(bert_program) as old, zipfile.ZipFile(planted, "w") as new:
        for info in old.infolist():
            data = old.read(info.filename)
            if info.filename.endswith("models/model.json"):
                model = json.loads(data)
                model["guards_code"].append(f"__import__('pathlib').Path({str(marker)!r}).touch() is None")
                data = json.dumps(model).encode()
            new.writestr(info.filename, data)
    torch.export.load(str(planted)).module()(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert marker.exists(), "the planted guard must be live for this test to mean anything"
    marker.unlink()
    with pytest.raises(UsageError, match="input guard that is not a plain comparison of sizes"):
        load_program(planted)
    assert not marker.exists()


def test_with_the_pickle_opt_in_a_program_is_judged_and_its_weights_proof_says_why_not_run(
        bert_program, tiny_models, tmp_path):
    """--allow-artifact-pickle is the user's word that the file may run: the program is loaded by torch and
    judged; its pickled constants are not read as data, so the weights proof is not run, and the report says so."""
    marker = tmp_path / "ran"
    planted = pickle_program(bert_program, tmp_path / "planted.pt2", marker, "weight")
    done = check(planted, "--against", tiny_models["bert"], "--out", tmp_path / "out", "--allow-artifact-pickle")
    assert marker.exists()  # the opt-in really is what lets it run
    assert done.returncode in (3, 4), done.stderr[-3000:]  # the payload replaced a weight: it cannot pass
    entry = json.loads((tmp_path / "out" / "report.json").read_text())["artifacts"][0]
    assert entry["proofs"]["weights"]["passed"] is None and "pickled" in entry["proofs"]["weights"]["summary"]
