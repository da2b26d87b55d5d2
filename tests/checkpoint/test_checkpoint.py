"""Loading: one file, shards, folders; key checks; tied weights; pickle opt-in; memory-mapped weights."""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from safetensors.torch import save_file, save_model

from exporter.checkpoint import load_model, open_checkpoint
from exporter.errors import ArchitectureError, CheckpointError


def _shard(folder, tensors: dict, per_shard: int = 5):
    names = sorted(tensors)
    weight_map = {}
    for i in range(0, len(names), per_shard):
        shard = f"model-{i // per_shard + 1:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in names[i:i + per_shard]}, str(folder / shard))
        weight_map.update({n: shard for n in names[i:i + per_shard]})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_single_file_folder_and_shards_load_the_same_weights(tiny_models, tmp_path):
    folder = tiny_models["llama"]
    whole = load_model(folder)
    single = load_model(folder / "model.safetensors")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    tensors = dict(open_checkpoint(folder).tensors())
    _shard(sharded, tensors)
    for source in (sharded, sharded / "model.safetensors.index.json"):
        loaded = load_model(source)
        assert len(loaded.checkpoint.files) > 1
        reference = whole.model.state_dict()
        for name, tensor in loaded.model.state_dict().items():
            assert torch.equal(tensor, reference[name]), name
    assert single.architecture.name == "LlamaForCausalLM"


def test_weights_are_memory_mapped_not_copied(tiny_models):
    checkpoint = open_checkpoint(tiny_models["bert"])
    name, tensor = next(iter(checkpoint.tensors()))
    # a tensor read through safe_open maps the file: it owns no heap allocation of its own
    assert tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()


def test_gpt2_tied_head_is_tied(tiny_models):
    model = load_model(tiny_models["gpt2"]).model
    assert model.lm_head.weight is model.transformer.wte.weight


def test_missing_shard_is_named(tiny_models, tmp_path):
    tensors = dict(open_checkpoint(tiny_models["llama"]).tensors())
    _shard(tmp_path, tensors)
    (tmp_path / "model-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="names missing shard.*model-00002.safetensors"):
        open_checkpoint(tmp_path)


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="holds no weights"):
        open_checkpoint(tmp_path)


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint("/nonexistent/model.safetensors")


def test_hf_key_problems_are_all_listed(tiny_models, tmp_path):
    tensors = dict(open_checkpoint(tiny_models["llama"]).tensors())
    tensors = {k: v.clone() for k, v in tensors.items()}
    del tensors["model.norm.weight"]
    tensors["model.extra.weight"] = torch.zeros(3)
    tensors["model.embed_tokens.weight"] = torch.zeros(10, 64)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((tiny_models["llama"] / "config.json").read_text())
    with pytest.raises(CheckpointError) as info:
        load_model(tmp_path)
    message = info.value.message
    assert "mis-shaped: model.embed_tokens.weight" in message
    assert "missing: model.norm.weight" in message
    assert "unexpected: model.extra.weight" in message


def test_factory_model_with_tied_and_nonpersistent(factory_checkpoint):
    path, factory = factory_checkpoint
    loaded = load_model(path, factory=factory)
    model = loaded.model
    assert model.head.weight is model.embed.weight  # tie kept: one stored copy serves both names
    assert ("head.weight", "embed.weight") in loaded.report.tied
    assert model.scale.device.type == "cpu" and float(model.scale) > 0  # non-persistent buffer built for real
    assert not any(p.device.type == "meta" for p in model.parameters())


def test_factory_key_problems_are_all_listed(factory_checkpoint, tmp_path):
    path, factory = factory_checkpoint
    tensors = dict(open_checkpoint(path).tensors())
    tensors = {k: v.clone() for k, v in tensors.items()}
    del tensors["out.bias"]
    tensors["qkv.weight"] = torch.zeros(3, 3)
    tensors["surprise"] = torch.zeros(1)
    broken = tmp_path / "broken.safetensors"
    save_file(tensors, str(broken))
    with pytest.raises(CheckpointError) as info:
        load_model(broken, factory=factory)
    message = info.value.message
    assert "mis-shaped: qkv.weight (checkpoint [3, 3], model [96, 32])" in message
    assert "unexpected: surprise" in message
    tensors = dict(open_checkpoint(path).tensors())
    del tensors["out.bias"]
    save_file({k: v.clone() for k, v in tensors.items()}, str(broken))
    with pytest.raises(CheckpointError, match="1 missing: out.bias"):
        load_model(broken, factory=factory)


def test_pickle_is_refused_without_opt_in(factory_checkpoint, tmp_path):
    path, factory = factory_checkpoint
    state = {k: v.clone() for k, v in open_checkpoint(path).tensors()}
    pickle_path = tmp_path / "model.pt"
    torch.save(state, pickle_path)
    with pytest.raises(CheckpointError, match="pickle file.*--allow-pickle"):
        load_model(pickle_path, factory=factory)
    loaded = load_model(pickle_path, factory=factory, allow_pickle=True)
    assert loaded.checkpoint.format == "pickle"
    assert torch.equal(loaded.model.qkv.weight, state["qkv.weight"])


def test_pickle_with_code_is_refused_even_with_opt_in(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran code",))

    path = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(1), "x": Evil()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        open_checkpoint(path, allow_pickle=True)


def test_no_config_and_no_factory(factory_checkpoint):
    path, _ = factory_checkpoint
    with pytest.raises(ArchitectureError, match="no --model factory was given and there is no config.json"):
        load_model(path)


def test_factory_errors(factory_checkpoint):
    path, factory = factory_checkpoint
    module = factory.split(":")[0]
    with pytest.raises(ArchitectureError, match="returned int, not a torch.nn.Module"):
        load_model(path, factory=f"{module}:not_a_module")
    with pytest.raises(ArchitectureError, match="raised ValueError: bad config"):
        load_model(path, factory=f"{module}:raises")
    with pytest.raises(ArchitectureError, match="cannot import factory module 'no_such_module_xyz'"):
        load_model(path, factory="no_such_module_xyz:build")
    with pytest.raises(ArchitectureError, match="has no callable 'missing'"):
        load_model(path, factory=f"{module}:missing")
    importlib.invalidate_caches()


def test_unknown_architecture(tiny_models, tmp_path):
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    config["architectures"] = ["LlamaForTimeTravel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_model(torch.nn.Linear(2, 2), str(tmp_path / "model.safetensors"))
    with pytest.raises(ArchitectureError, match="'LlamaForTimeTravel' from config.json is not known to transformers"):
        load_model(tmp_path)
