"""--task text2text-generation (T5, BART, Marian) and automatic-speech-recognition (Whisper): the prefill (encoder and
the first decoder step, cross-attention keys and values written once) and the decode step, exported, judged step
by step against the float64 reference, and their tokens equal to the float32 eager model's greedy generation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import exporter
from exporter import verify  # the function: no module shadows it (tests/test_layout.py)
from exporter.errors import ArchitectureError

transformers = pytest.importorskip("transformers")


def save_t5(folder):
    """A tiny T5 whose greedy tokens vary (untied head, wider initialisation), so equal tokens mean something."""
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=8.0,
                                   tie_word_embeddings=False)
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


def save_whisper(folder):
    torch.manual_seed(0)
    config = transformers.WhisperConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
                                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                                        decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=64,
                                        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
                                        init_std=0.2, tie_word_embeddings=False)
    transformers.WhisperForConditionalGeneration(config).save_pretrained(folder)
    return folder


def eager_greedy(model, source: dict, start: int, steps: int) -> list[int]:
    """Greedy tokens of the float32 eager model re-reading the whole decoded prefix (no cache, no exporter code)."""
    decoded = torch.tensor([[start]])
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(**source, decoder_input_ids=decoded, use_cache=False).logits[:, -1]
            decoded = torch.cat([decoded, logits.argmax(-1, keepdim=True)], dim=1)
    return decoded[0, 1:].tolist()


def source_rows(out, speech: bool) -> list[dict]:
    stored = load_file(str(out / "reference" / "generation.safetensors"))
    rows = []
    for row in range(stored["source_values"].shape[0]):
        if speech:
            rows.append({"input_features": stored["source_values"][row:row + 1].float()})
        else:
            keep = stored["source_mask"][row].bool()
            ids = stored["source_values"][row:row + 1, keep]
            rows.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return rows


def assert_generates_as_eager(report, out, model, speech: bool, built: tuple[str, ...]):
    assert report["passed"], report["problems"]
    gen = report["generation"]
    tokens = gen["reference_tokens"]
    assert len({t for row in tokens for t in row}) > 2  # the tokens vary: an equal sequence is a real check
    start = gen["encoder_decoder"]["start_token"]
    eager = [eager_greedy(model, row, start, gen["new_tokens"]) for row in source_rows(out, speech)]
    entries = {a["name"]: a for a in report["artifacts"]}
    for name in built:
        numerics = entries[name]["numerics"]
        assert entries[name]["status"] == "ok" and all(step["passed"] for step in numerics["steps"])
        assert numerics["free_running"]["tokens"] == eager  # the programs' own greedy = float32 eager's
        assert entries[name]["programs"]["decode"]["sdpa"] == 4  # self- and cross-attention of 2 layers, fused
        assert entries[name]["bench"]["batch"]["decode"]["median_ms"] > 0
    return eager


@pytest.mark.slow
def test_t5_generates_from_exported_programs_as_float32_eager(tmp_path, generate_cli):
    ckpt = save_t5(tmp_path / "t5")
    result = exporter.convert(ckpt, "cpu-fp32", tmp_path / "out", task="text2text-generation",
                              targets=("exported_program", "aoti", "onnx"))
    report = result.report
    assert result.exit_code == 0 and report["task"] == "text2text-generation"
    assert report["generation"]["padded_rows"] == [1]  # the odd source row right-padded, judged against itself alone
    model = transformers.T5ForConditionalGeneration.from_pretrained(ckpt).eval()
    eager = assert_generates_as_eager(report, result.out, model, False, ("exported_program", "aoti", "onnx"))
    onnx = pytest.importorskip("onnx")
    decode = onnx.load(str(result.out / "decode.onnx"), load_external_data=False)
    assert [i.name for i in decode.graph.input][:5] == [  # Optimum's names for an encoder-decoder's caches
        "encoder_attention_mask", "decoder_input_ids", "cache_position", "past_key_values.0.decoder.key",
        "past_key_values.0.decoder.value"]
    assert "past_key_values.1.encoder.value" in [i.name for i in decode.graph.input]
    assert [o.name for o in decode.graph.output][-1] == "present.1.decoder.value"
    # every weight of the decode program lies once, in the file the prefill's lie in (none held twice)
    assert not [t.name for t in decode.graph.initializer if len(t.raw_data) > 1024]
    sites = report["attention"]["sites"]  # encoder self, decoder self and cross attention of both layers
    assert len(sites) == 6 and all(site["status"] == "rewritten" for site in sites)
    assert {f["path"] for a in report["artifacts"] for f in a["files"]} >= {
        "prefill.pt2", "decode.pt2", "prefill.aoti.pt2", "decode.aoti.pt2", "prefill.onnx", "decode.onnx",
        "generation.onnx.data"}
    source = source_rows(result.out, False)[1]["input_ids"][0].tolist()
    for target in ("exported_program", "aoti", "onnx"):
        done = generate_cli(str(result.out), "-t", target, "--input-ids", ",".join(map(str, source)), "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["generated"] == [eager[1]]
    assert verify(result.out).exit_code == 0
    assert "text-to-text generation" in (result.out / "report.md").read_text()


def test_whisper_generates_from_exported_programs_as_float32_eager(tmp_path, generate_cli):
    ckpt = save_whisper(tmp_path / "whisper")
    result = exporter.convert(ckpt, "cpu-fp32", tmp_path / "out", task="automatic-speech-recognition",
                              targets=("exported_program",))
    report = result.report
    assert result.exit_code == 0 and report["task"] == "automatic-speech-recognition"
    seq2seq = report["generation"]["encoder_decoder"]
    assert seq2seq["source"] == "features 80x128" and seq2seq["encoder_length"] == 64  # the convolutions halve it
    model = transformers.WhisperForConditionalGeneration.from_pretrained(ckpt).eval()
    eager = assert_generates_as_eager(report, result.out, model, True, ("exported_program",))
    features = tmp_path / "mel.safetensors"
    save_file({"mel": source_rows(result.out, True)[0]["input_features"][0].contiguous()}, str(features))
    done = generate_cli(str(result.out), "-t", "exported_program", "--input-features", str(features), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["generated"] == [eager[0]], done.stderr
    wrong = generate_cli(str(result.out), "-t", "exported_program", "--input-ids", "1,2,3")
    assert wrong.returncode == 2 and "--input-features" in wrong.stderr
    assert verify(result.out).exit_code == 0


def test_a_task_that_does_not_fit_the_model_is_refused_before_writing(tmp_path, tiny_models):
    with pytest.raises(ArchitectureError, match="--task text-generation"):  # a decoder-only model
        exporter.convert(tiny_models["llama"], "cpu-fp32", tmp_path / "llama", task="text2text-generation",
                         targets=("exported_program",))
    with pytest.raises(ArchitectureError, match="convert with --task text2text-generation"):  # T5 reads ids
        exporter.convert(save_t5(tmp_path / "t5"), "cpu-fp32", tmp_path / "t5-out",
                         task="automatic-speech-recognition", targets=("exported_program",))
    assert not (tmp_path / "llama").exists() and not (tmp_path / "t5-out").exists()
