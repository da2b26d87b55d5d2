"""``generation.decode_batch_1``: the AOTI target's third package, the decode program with the batch fixed at 1
(compiled with coordinate-descent tuning), which a batch of one row decodes with; judged with each prompt row
alone against the same reference and bars, re-checked by ``exporter verify``, used by ``exporter generate``."""

from __future__ import annotations

import json

import pytest
import torch

import exporter
from exporter import verify


@pytest.fixture(scope="module")
def batch_1_generation(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("batch1") / "llama"
    return exporter.convert(tiny_models["llama"], "cpu-fp32", out, task="text-generation", targets=("aoti",),
                            settings=("generation.decode_batch_1=true",))


def test_the_batch_1_program_is_built_judged_and_timed(batch_1_generation):
    result = batch_1_generation
    assert result.exit_code == 0, result.problems
    entry = result.report["artifacts"][0]
    files = {f["path"] for f in entry["files"]}
    assert {"prefill.aoti.pt2", "decode.aoti.pt2", "decode1.aoti.pt2", "generation.aoti.weights.safetensors"} <= files
    assert (result.out / "decode1.aoti.pt2").is_file()
    alone = entry["numerics"]["batch_1"]
    assert alone["passed"] and entry["numerics"]["passed"]
    assert len(alone["steps"]) == len(entry["numerics"]["steps"])
    assert alone["free_running"]["identical"]  # every row alone generates the reference's tokens
    assert entry["programs"]["decode_batch_1"]["sdpa"] > 0
    assert entry["bench"]["batch_1"]["decode_program"] == "batch 1"
    assert entry["bench"]["batch"]["decode_program"] == "dynamic batch"
    assert entry["bench"]["batch_1_dynamic"]["decode_program"] == "dynamic batch"  # the comparison, same row
    text = (result.out / "report.md").read_text()
    assert "| aoti | 1, the any-batch decode program |" in text and "each row alone at batch 1 passed" in text
    assert any("decode1.aoti.pt2" in note for note in entry["notes"])


def test_verify_re_judges_it_and_a_changed_package_fails(batch_1_generation, tmp_path):
    import shutil

    assert verify(batch_1_generation.out).passed
    copy = tmp_path / "copy"
    shutil.copytree(batch_1_generation.out, copy)
    (copy / "decode1.aoti.pt2").write_bytes((copy / "decode.aoti.pt2").read_bytes())
    changed = verify(copy)
    assert not changed.passed
    assert any("decode1.aoti.pt2" in problem for problem in changed.problems)


def test_generate_with_one_prompt_uses_it(batch_1_generation, generate_cli):
    from safetensors.torch import load_file

    out = batch_1_generation.out
    stored = load_file(out / "reference" / "generation.safetensors")
    row = stored["prompt_ids"][0][stored["prompt_mask"][0].bool()].tolist()
    done = generate_cli(str(out), "-t", "aoti", "--input-ids", ",".join(map(str, row)), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["generated"] == [batch_1_generation.report["generation"]["reference_tokens"][0]]


def test_a_wrong_batch_1_program_fails_while_the_batch_program_passes(tiny_models):
    """A planted defect in the batch-1 program alone (one weight of another model's decode step): the batch verdict
    passes, the rows-alone verdict fails, and the merged verdict fails naming batch 1."""
    from exporter.checkpoint import load_model
    from exporter.generation.cache import DecoderStep, probe_layout
    from exporter.generation.decoder import DECODER
    from exporter.generation.driver import Steps, generate
    from exporter.generation.judge import judge_steps
    from exporter.generation.run import reference
    from exporter.generation.session import judge_rows_alone, merge_batch_1
    from exporter.recipe import load_recipe

    recipe = load_recipe("cpu-fp32")
    model = load_model(tiny_models["llama"], None, False, pipeline=False).model.eval()
    layout = probe_layout(model, True, "cpu")
    ref = reference(DECODER, model, layout, recipe, transformers=True)
    wrong = load_model(tiny_models["llama"], None, False, pipeline=False).model.eval()
    with torch.no_grad():
        wrong.model.layers[0].mlp.down_proj.weight.mul_(1.05)
    gen = recipe.generation
    step = DecoderStep(model, True)
    steps = Steps(step, step, layout, gen.max_cache_len, torch.float32, "cpu", decode_one=DecoderStep(wrong, True))
    numerics = {"bars": ref.bars, "k": ref.k, "atol": recipe.numerics.atol}
    _, logits = generate(steps, ref.prompt, gen.new_tokens, forced=ref.tokens)
    verdict = judge_steps("eager", ref.logits, ref.tokens, logits, None, ref.bars, ref.k, recipe.numerics.atol)
    assert verdict["passed"]
    alone = judge_rows_alone("eager", steps, ref.prompt, ref.tokens, ref.logits, gen.new_tokens, numerics)
    assert not alone["passed"]
    merge_batch_1(verdict, alone)
    assert not verdict["passed"] and verdict["failures"][0].startswith("batch 1: ")
