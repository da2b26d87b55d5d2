"""Inputs: generated from the config with a fixed seed and real padding, or read from a samples file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from exporter.checkpoint import load_model
from exporter.errors import InputsError
from exporter.inputs import padding_mask, plan_inputs
from exporter.recipe import load_recipe


def test_generated_text_inputs(tiny_models):
    model = load_model(tiny_models["bert"]).model
    section = load_recipe("cpu-fp32").inputs
    plan = plan_inputs(model, section)
    # BERT's tokenizer returns segment ids beside the mask: the artifacts take them too (both segments drawn)
    assert plan.names == ("input_ids", "attention_mask", "token_type_ids")
    segments = torch.cat([s["token_type_ids"].flatten() for s in plan.samples])
    assert set(segments.tolist()) == set(range(model.config.type_vocab_size)) == {0, 1}
    sample = plan.samples[0]
    assert sample["input_ids"].shape == (2, 32) and sample["input_ids"].dtype == torch.int64
    assert int(sample["input_ids"].max()) < model.config.vocab_size and int(sample["input_ids"].min()) >= 0
    mask = sample["attention_mask"]
    assert mask[0].all() and not mask[1].all() and mask[1, 0] == 1  # row 1 is padded at its end
    again = plan_inputs(model, section)
    assert torch.equal(again.samples[1]["input_ids"], plan.samples[1]["input_ids"])  # fixed seed
    assert not torch.equal(plan.samples[0]["input_ids"], plan.samples[1]["input_ids"])
    axes = plan.dynamic_axes()
    assert axes["input_ids"][0].name == "batch" and axes["attention_mask"][1].name == "sequence"


def test_the_sequence_dim_stays_within_the_models_positions(tiny_models):
    """A recipe's sequence range past the model's position embeddings is narrowed, and the plan says so
    (on a GPU, reading past them is a device-side assert that takes the whole process down)."""
    model = load_model(tiny_models["gpt2"]).model  # n_positions = 256
    recipe = load_recipe("cpu-fp32").with_inputs(("sequence=300:2:512",))
    plan = plan_inputs(model, recipe.inputs)
    sequence = next(d for d in plan.dims if d.name == "sequence")
    assert (sequence.size, sequence.min, sequence.max) == (256, 2, 256)
    assert plan.samples[0]["input_ids"].shape[1] == 256
    assert "token_type_ids" not in plan.names  # GPT-2's forward takes them, its config has no segment types
    assert any("max 512 narrowed to 256" in note and "max_position_embeddings" in note for note in plan.notes)
    within = plan_inputs(load_model(tiny_models["bert"]).model, load_recipe("cpu-fp32").inputs)  # 512 <= 512
    assert not within.notes and next(d for d in within.dims if d.name == "sequence").max == 512


def test_padding_mask_keeps_a_token_per_row():
    mask = padding_mask(8, 4)
    assert mask.sum(dim=1).min() >= 1 and mask[0].all()


def test_generated_pixels(tiny_models):
    model = load_model(tiny_models["vit"]).model
    plan = plan_inputs(model, load_recipe("cpu-fp32").inputs)
    assert plan.names == ("pixel_values",)
    assert plan.samples[0]["pixel_values"].shape == (2, 3, 32, 32)


def test_samples_file_single_and_indexed(tiny_models, tmp_path):
    model = load_model(tiny_models["gpt2"]).model
    section = load_recipe("cpu-fp32").inputs
    ids = torch.randint(0, 1000, (3, 10))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, str(tmp_path / "one.safetensors"))
    plan = plan_inputs(model, section, tmp_path / "one.safetensors")
    assert len(plan.samples) == 1 and torch.equal(plan.samples[0]["input_ids"], ids)
    assert plan.seed is None and plan.source.endswith("one.safetensors")
    np.savez(tmp_path / "two.npz", **{"0.input_ids": ids.numpy(), "0.attention_mask": np.ones((3, 10), np.int64),
                                       "1.input_ids": ids.numpy()[:1], "1.attention_mask": np.ones((1, 10), np.int64)})
    plan = plan_inputs(model, section, tmp_path / "two.npz")
    assert [s["input_ids"].shape[0] for s in plan.samples] == [3, 1]


@pytest.mark.parametrize("tensors, fragment", [
    ({"input_ids": torch.zeros(2, 8, dtype=torch.int64)}, "missing attention_mask"),
    ({"input_ids": torch.zeros(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.int64)}, "has dtype float32"),
    ({"input_ids": torch.zeros(2, 8, 3, dtype=torch.int64), "attention_mask": torch.ones(2, 8, dtype=torch.int64)},
     "has 3 dims"),
    ({"input_ids": torch.zeros(2, 999, dtype=torch.int64), "attention_mask": torch.ones(2, 999, dtype=torch.int64)},
     "outside the recipe's range 2..256"),  # gpt2's 256 positions narrow 512
    ({"input_ids": torch.zeros(2, 8, dtype=torch.int64), "attention_mask": torch.ones(2, 8, dtype=torch.int64),
      "labels": torch.zeros(2)}, "unexpected labels"),
])
def test_bad_samples_files(tiny_models, tmp_path, tensors, fragment):
    model = load_model(tiny_models["gpt2"]).model
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(InputsError, match=fragment):
        plan_inputs(model, load_recipe("cpu-fp32").inputs, path)


def test_unreadable_samples_file(tiny_models, tmp_path):
    model = load_model(tiny_models["gpt2"]).model
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(InputsError, match="too short"):
        plan_inputs(model, load_recipe("cpu-fp32").inputs, path)
    with pytest.raises(InputsError, match="does not exist"):
        plan_inputs(model, load_recipe("cpu-fp32").inputs, tmp_path / "nope.safetensors")


def test_custom_model_needs_declared_inputs(factory_checkpoint):
    path, factory = factory_checkpoint
    model = load_model(path, factory=factory).model
    with pytest.raises(InputsError, match="declare them in the recipe"):
        plan_inputs(model, load_recipe("cpu-fp32").inputs)


def _tiny(name: str):
    pytest.importorskip("transformers")
    from exporter.testing.architectures import by_name

    torch.manual_seed(0)
    return by_name(name).build().eval()


def test_an_encoder_decoder_gets_decoder_input_ids_on_a_dim_of_its_own():
    plan = plan_inputs(_tiny("bart"), load_recipe("cpu-fp32").inputs)
    assert plan.names == ("input_ids", "attention_mask", "decoder_input_ids")
    dims = {d.name: d for d in plan.dims}
    # BART has 256 positions for the encoder and the decoder alike: both dims are narrowed to them
    assert (dims["decoder_sequence"].min, dims["decoder_sequence"].max) == (1, 256)
    assert dims["sequence"].max == 256
    assert plan.samples[0]["decoder_input_ids"].shape == (2, dims["decoder_sequence"].size)
    assert any("decoder_sequence: not declared" in n for n in plan.notes)


def test_whisper_gets_its_fixed_mel_frames_and_the_decoders_positions():
    model = _tiny("whisper")
    plan = plan_inputs(model, load_recipe("cpu-fp32").inputs)
    assert plan.names == ("input_features", "decoder_input_ids")
    config = model.config
    assert plan.samples[0]["input_features"].shape == (2, config.num_mel_bins, 2 * config.max_source_positions)
    assert list(plan.dynamic_axes()["input_features"]) == [0]  # batch only: the encoder takes no other length
    decoder = next(d for d in plan.dims if d.name == "decoder_sequence")
    assert decoder.max == config.max_target_positions
    assert any("fixed at" in n and "max_source_positions" in n for n in plan.notes)


def test_raw_audio_gets_an_audio_dim_in_samples_the_feature_encoder_can_take():
    model = _tiny("wav2vec2")
    plan = plan_inputs(model, load_recipe("cpu-fp32").inputs)
    assert plan.names == ("input_values",)
    audio = next(d for d in plan.dims if d.name == "audio")
    sequence = next(d for d in plan.dims if d.name == "sequence")
    frames = model._get_feat_extract_output_lengths(torch.tensor([audio.min, audio.size, audio.max])).tolist()
    assert frames == [max(sequence.min, 2), sequence.size, sequence.max]
    assert model._get_feat_extract_output_lengths(torch.tensor(audio.min - 1)).item() < frames[0]


def test_a_text_and_image_model_gets_both_and_the_text_towers_positions():
    model = _tiny("clip")
    plan = plan_inputs(model, load_recipe("cpu-fp32").inputs)
    assert set(plan.names) == {"input_ids", "attention_mask", "pixel_values"}
    image = model.config.vision_config.image_size
    assert plan.samples[0]["pixel_values"].shape[-2:] == (image, image)
    assert next(d for d in plan.dims if d.name == "sequence").max == model.config.text_config.max_position_embeddings
    assert any("text_config.max_position_embeddings" in n for n in plan.notes)


def test_generated_padding_stays_inside_a_sliding_window():
    """A padded token whose whole window is padding has nothing to attend to: the model's own float64 output is
    NaN there, so generated padding stops short of it, and the plan says why."""
    model = _tiny("gemma2")  # sliding_window = 64
    recipe = load_recipe("cpu-fp32").with_inputs(("sequence=256:2:256", "batch=4:1:4"))
    plan = plan_inputs(model, recipe.inputs)
    assert plan.max_padding == 32
    mask = plan.samples[0]["attention_mask"]
    assert (mask.shape[1] - mask.sum(dim=1)).max() <= 32 and not mask[1:].all()
    assert any("sliding_window = 64" in n for n in plan.notes)
    with torch.no_grad():
        out = model.double()(**plan.samples[0]).logits
    assert torch.isfinite(out).all()
    unbounded = padding_mask(4, 256)
    assert (256 - unbounded.sum(dim=1)).max() > 64  # what the padding would have been
