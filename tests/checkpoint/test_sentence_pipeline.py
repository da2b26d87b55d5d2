"""A sentence-transformers folder loads as its whole pipeline, equal to ``SentenceTransformer`` in float64."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from exporter.checkpoint import load_model
from exporter.checkpoint.sentence_pipeline import SentencePipeline

st = pytest.importorskip("sentence_transformers")

TEXTS = ["A cat sits on the mat.", "Release engineers want proof before they ship a model to production.", "x"]


def encode_both(folder, loaded):
    """(ours, sentence-transformers') sentence embeddings of TEXTS in float64, from the same token ids."""
    reference = st.SentenceTransformer(str(folder), device="cpu").to(torch.float64).eval()
    features = reference.preprocess(TEXTS)
    model = loaded.model.to(torch.float64).eval()
    with torch.inference_mode():
        ours = model(input_ids=features["input_ids"], attention_mask=features["attention_mask"],
                     token_type_ids=features.get("token_type_ids"))
        theirs = reference.encode(TEXTS, convert_to_tensor=True)
    return ours, theirs


def test_minilm_loads_with_its_pooling_and_normalisation(minilm_path):
    loaded = load_model(minilm_path)
    assert isinstance(loaded.model, SentencePipeline)
    assert loaded.pipeline.included and loaded.pipeline.modules == ["0 Transformer", "1 Pooling (mean)",
                                                                    "2 Normalize"]
    ours, theirs = encode_both(minilm_path, loaded)
    assert set(ours) == {"token_embeddings", "sentence_embedding"}
    assert ours["sentence_embedding"].dtype == torch.float64
    assert (ours["sentence_embedding"] - theirs).abs().max().item() < 1e-12
    assert torch.allclose(ours["sentence_embedding"].norm(dim=-1), torch.ones(len(TEXTS), dtype=torch.float64))


def test_every_pooling_mode_a_dense_layer_and_dropout_match_sentence_transformers(minilm_path, tmp_path):
    modules = st.sentence_transformer.modules
    transformer = modules.Transformer(str(minilm_path))
    pooling = modules.Pooling(384, pooling_mode=("cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"))
    dense = modules.Dense(5 * 384, 24, activation_function=torch.nn.GELU())
    torch.nn.init.normal_(dense.linear.weight, std=0.05)
    model = st.SentenceTransformer(modules=[transformer, pooling, modules.Dropout(0.1), dense, modules.Normalize()])
    model.save(str(tmp_path / "st"))
    loaded = load_model(tmp_path / "st")
    assert loaded.pipeline.included, loaded.pipeline.reason
    assert [m.split(" ", 1)[1] for m in loaded.pipeline.modules] == [
        "Transformer", "Pooling (cls+max+mean_sqrt_len_tokens+weightedmean+lasttoken)",
        "Dropout (identity at inference)", "Dense (1920->24, GELU)", "Normalize"]
    ours, theirs = encode_both(tmp_path / "st", loaded)
    assert ours["sentence_embedding"].shape == theirs.shape == (len(TEXTS), 24)
    assert (ours["sentence_embedding"] - theirs).abs().max().item() < 1e-12


def test_a_module_it_does_not_rebuild_leaves_the_transformer_alone_and_says_which(minilm_path, tmp_path):
    folder = tmp_path / "lstm"
    shutil.copytree(minilm_path, folder)
    listed = json.loads((folder / "modules.json").read_text())
    listed.insert(1, {"idx": 1, "name": "1", "path": "1_LSTM", "type": "sentence_transformers.models.LSTM"})
    for i, entry in enumerate(listed):
        entry["idx"] = i
    (folder / "modules.json").write_text(json.dumps(listed))
    loaded = load_model(folder)
    assert not isinstance(loaded.model, SentencePipeline)
    assert not loaded.pipeline.included
    assert "module 1 LSTM (sentence_transformers.models.LSTM) is not rebuilt" in loaded.pipeline.reason


def test_pipeline_off_loads_the_bare_transformer(minilm_path):
    loaded = load_model(minilm_path, pipeline=False)
    assert type(loaded.model).__name__ == "BertModel" and loaded.pipeline is None
