"""``exporter generate`` from a built folder, and ``exporter verify`` re-running a short generation against the
stored reference (``validate`` points a generation folder there)."""

from __future__ import annotations

import json

import pytest

import exporter
from exporter import verify  # the function: no module shadows it (tests/test_layout.py)
from exporter.published.revalidate import validate_folder


def test_generate_prints_the_reference_tokens(llama_generation, generate_cli):
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


def test_generate_refuses_what_it_cannot_run(llama_generation, generate_cli, tmp_path):
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


@pytest.mark.parametrize("damage", ["truncated", "cache_length", "not utf-8"])
def test_generate_refuses_a_changed_or_damaged_setup_in_one_line(damage, llama_generation, generate_cli, tmp_path):
    """generate checks what it reads as data against manifest.json, as verify does (exit 6); a damaged setup that
    matches a rewritten manifest is refused as damaged (exit 2). Never a traceback."""
    import shutil

    from exporter.testing.payloads import rehash

    copy = tmp_path / "copy"
    shutil.copytree(llama_generation.out, copy)
    text = (copy / "generation.json").read_text()
    setup = json.loads(text)
    damaged = {"truncated": text[: len(text) // 2].encode(), "not utf-8": b"\xff\xfe{",
               "cache_length": json.dumps({**setup, "cache_length": setup["cache_length"] * 2}).encode()}[damage]
    (copy / "generation.json").write_bytes(damaged)
    changed = generate_cli(str(copy), "-t", "exported_program", "--input-ids", "1,2")
    assert changed.returncode == 6 and "generation.json does not match its SHA-256" in changed.stderr, changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1 and "Traceback" not in changed.stderr
    if damage != "cache_length":
        rehash(copy)
        unreadable = generate_cli(str(copy), "-t", "exported_program", "--input-ids", "1,2")
        assert unreadable.returncode == 2 and "generation setup is damaged" in unreadable.stderr, unreadable.stderr
        assert len(unreadable.stderr.strip().splitlines()) == 1 and "Traceback" not in unreadable.stderr


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


def test_a_pickle_in_a_generation_program_never_runs(llama_generation, generate_cli, tmp_path):
    """generate and verify read a folder's programs as data: a pickle planted in one (and its manifest rewritten
    to match, as anyone who can write the folder can) is refused by both, and never runs."""
    import shutil

    from exporter.testing.payloads import pickle_program, rehash

    copy = tmp_path / "copy"
    shutil.copytree(llama_generation.out, copy)
    marker = tmp_path / "ran"
    clean = tmp_path / "prefill.pt2"
    shutil.copy(copy / "prefill.pt2", clean)
    pickle_program(clean, copy / "prefill.pt2", marker, "weight")
    rehash(copy)
    done = generate_cli(str(copy), "--target", "exported_program", "--input-ids", "1,2,3")
    assert done.returncode == 2 and "holds pickled data" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    result = verify(copy)
    refused = [c for c in result.checks if c.subject == "exported_program" and c.passed is False]
    assert refused and "pickled data" in refused[0].message, result.problems
    assert {c.subject for c in result.checks if c.name == "numerics" and c.passed} == {"aoti", "onnx"}
    assert not marker.exists()
