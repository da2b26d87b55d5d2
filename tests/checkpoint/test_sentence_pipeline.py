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


def test_the_run_checks_the_rebuild_against_sentence_transformers_own_modules(minilm_path):
    from exporter.checkpoint.sentence_pipeline import PipelineMismatch, cross_check

    loaded = load_model(minilm_path)
    model = loaded.model.to(torch.float64).eval()
    ids = torch.randint(0, 30000, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask)
    said = cross_check(minilm_path, out["token_embeddings"], mask, out["sentence_embedding"])
    assert said.startswith(f"sentence-transformers {st.__version__}'s own modules") and "max |difference|" in said
    wrong = out["sentence_embedding"].clone()
    wrong[1] = torch.nn.functional.normalize(out["token_embeddings"][1].mean(0), dim=-1)  # padding pooled too
    with pytest.raises(PipelineMismatch, match="max |difference|"):
        cross_check(minilm_path, out["token_embeddings"], mask, wrong)


def test_a_convert_whose_rebuilt_pipeline_disagrees_publishes_nothing(minilm_path, tmp_path, monkeypatch):
    """A planted defect in the rebuild (mean pooling over the padding as well) is caught by the run's own check
    before anything is built: exit 2 with the fix, no output folder."""
    import exporter
    from exporter.checkpoint import sentence_pipeline
    from exporter.errors import ArchitectureError

    monkeypatch.setattr(sentence_pipeline.Pooling, "forward", lambda self, tokens, mask: tokens.mean(1))
    with pytest.raises(ArchitectureError, match="differs from sentence-transformers' own modules") as caught:
        exporter.convert(minilm_path, "cpu-fp32", tmp_path / "out", targets=("exported_program",))
    assert caught.value.exit_code == 2 and "model.pipeline = false" in str(caught.value.hint)
    assert not (tmp_path / "out").exists()
