"""Defects planted in a user's program of the trained GPT-NeoX (:mod:`exporter.testing.trained`), as a user's
script would make them: the checkpoint loaded with transformers, one thing changed, ``torch.export``.

All in layer 1: ``scale`` attention scale x1.05; ``layernorm`` the input LayerNorm's weight x1.01; ``noise`` 0.5%
relative noise on the MLP's first Linear; ``stale`` the attention's output projection from halfway through
training; ``gelu-tanh`` tanh-approximated GELU for the exact one; ``rope-base`` the rotary base x1.01;
``mask-shift`` the causal mask shifted by one (each position also sees the next); ``fp8-scale`` one fp8 linear's
scales x1.05 (a quantized convert only); ``kv-cache-slot`` the decode program's cache write one slot off
(``--task text-generation`` only; :data:`ONLY`). :data:`EXPECT` is what a
gate must name for each. Used by ``benchmarks/planted_matrix.py`` and the tests of the proofs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

import torch

LAYER = 1
EXPECT = {"scale": f"gpt_neox.layers.{LAYER}.attention", "layernorm": f"layers.{LAYER}.input_layernorm.weight",
          "noise": f"layers.{LAYER}.mlp.dense_h_to_4h.weight", "stale": f"layers.{LAYER}.attention.dense.weight",
          "gelu-tanh": f"gpt_neox.layers.{LAYER}.mlp", "rope-base": "rotary_emb.inv_freq",
          "mask-shift": f"gpt_neox.layers.{LAYER}.attention", "fp8-scale": f"layers.{LAYER}.mlp.dense_h_to_4h.scales",
          "kv-cache-slot": "decode step 1"}
# defects only one column of the matrix can carry: that column, and why the others cannot
ONLY = {
    "fp8-scale": ("convert", "fp8 scales exist only in exporter's quantized convert (exporter check refuses a "
                             "quantize recipe: a user's artifact was not built from exporter's quantization)"),
    "kv-cache-slot": ("generation", "a forward program has no KV cache (its write is judged by convert --task "
                                    "text-generation's step-by-step gate)"),
}
# also right for the RoPE base where the frequencies are no constant of the artifact: the rotary module (located by
# value), or the first attention the folded cos/sin tables enter (an ONNX optimizer folds them into constants)
ALSO = {"rope-base": ("gpt_neox.rotary_emb", "gpt_neox.layers.0.attention")}


def named(defect: str, text: str) -> bool:
    """Whether ``text`` (a failure's line) names what ``defect`` planted (:data:`EXPECT`, or one of :data:`ALSO`)."""
    return any(name in text for name in (EXPECT[defect], *ALSO.get(defect, ())))


def plant(model, defect: str, checkpoint: Path) -> Callable[[], None]:
    """Plant ``defect`` in ``model`` (a GPTNeoXForCausalLM); returns what undoes it. A changed tensor is a new one
    put in the old one's place, so whatever took the changed one (an exported program) keeps it after the undo."""
    from safetensors.torch import load_file  # noqa: PLC0415

    layer = model.gpt_neox.layers[LAYER]
    undo: list[Callable[[], None]] = []

    def replace(owner, name: str, value: torch.Tensor) -> None:
        old = getattr(owner, name)
        new = torch.nn.Parameter(value, requires_grad=False) if isinstance(old, torch.nn.Parameter) else value
        setattr(owner, name, new) if isinstance(old, torch.nn.Parameter) else owner.register_buffer(
            name, new, persistent=name in owner.state_dict())
        undo.append(lambda: setattr(owner, name, old) if isinstance(old, torch.nn.Parameter) else
                    owner.register_buffer(name, old, persistent=name in owner.state_dict()))

    with torch.no_grad():
        if defect == "scale":
            scaling = layer.attention.scaling
            layer.attention.scaling = scaling * 1.05
            undo.append(lambda: setattr(layer.attention, "scaling", scaling))
        elif defect == "layernorm":
            replace(layer.input_layernorm, "weight", layer.input_layernorm.weight * 1.01)
        elif defect == "noise":
            weight = layer.mlp.dense_h_to_4h.weight
            noise = torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)).to(weight.device)
            replace(layer.mlp.dense_h_to_4h, "weight",
                    (weight + noise * 0.005 * weight.pow(2).mean().sqrt()).to(weight.dtype))
        elif defect == "stale":
            earlier = load_file(str(checkpoint / "earlier" / "model.safetensors"))
            stale = earlier[f"gpt_neox.layers.{LAYER}.attention.dense.weight"]
            replace(layer.attention.dense, "weight", stale.to(layer.attention.dense.weight))
        elif defect == "gelu-tanh":
            act = layer.mlp.act
            layer.mlp.act = torch.nn.GELU(approximate="tanh")
            undo.append(lambda: setattr(layer.mlp, "act", act))
        elif defect == "rope-base":
            rotary = model.gpt_neox.rotary_emb
            dim = rotary.inv_freq.numel() * 2
            base = model.config.rope_parameters["rope_theta"] * 1.01
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            replace(rotary, "inv_freq", inv_freq.to(rotary.inv_freq))
        elif defect == "fp8-scale":  # one fp8 linear's per-row scales x1.05 (the model quantized before tracing)
            linear = layer.mlp.dense_h_to_4h
            if not hasattr(linear, "scales"):
                raise ValueError("fp8-scale needs a quantized model (a recipe with [quantize])")
            replace(linear, "scales", linear.scales * 1.05)
        elif defect not in ("clean", "mask-shift", "kv-cache-slot"):  # planted while exporting: shifted_mask,
            # slot_off
            raise ValueError(defect)

    def undo_all() -> None:
        for step in reversed(undo):
            step()

    return undo_all


@contextlib.contextmanager
def planted_sdpa(defect: Callable):
    """Route transformers' "sdpa" attention through ``defect(module, query, key, value, mask, kwargs)`` (which
    returns them, changed or not), then the real SDPA function, through transformers' public AttentionInterface;
    the function registered before is registered again on exit."""
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: PLC0415
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

    before: Callable = ALL_ATTENTION_FUNCTIONS._global_mapping["sdpa"]  # type: ignore[assignment]

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        query, key, value, attention_mask, kwargs = defect(module, query, key, value, attention_mask, kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    AttentionInterface.register("sdpa", attention)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", before)


def _next_position_seen(module, query, key, value, mask, kwargs):
    """Layer ``LAYER``'s attention lets each position see the next one too (its causal mask shifted by one)."""
    if getattr(module, "layer_idx", None) == LAYER:
        ones = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device)
        allowed, next_one = ones.tril(1), ones.tril(1) & ~ones.tril(0)  # the causal mask, and its shift
        if mask is None:
            mask = allowed
        elif mask.dtype == torch.bool:
            mask = mask | next_one
        else:
            mask = mask.masked_fill(next_one, 0.0)
        kwargs = {**kwargs, "is_causal": False}
    return query, key, value, mask, kwargs


@contextlib.contextmanager
def shifted_mask(defect: str):
    """While exporting: layer 1's attention lets each position see the next one too (its causal mask shifted by
    one)."""
    if defect != "mask-shift":
        yield
        return
    with planted_sdpa(_next_position_seen):
        yield


def export(checkpoint: Path, path: Path, defect: str, device: str, dtype: torch.dtype, seed: int = 0) -> Path:
    from transformers import GPTNeoXForCausalLM  # noqa: PLC0415

    model = GPTNeoXForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    plant(model, defect, checkpoint)
    model.config.use_cache = False
    model.to(device=device, dtype=dtype)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(seed)).to(device)
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)
    with shifted_mask(defect):
        program = torch.export.export(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                      dynamic_shapes={"input_ids": {0: batch, 1: seq},
                                                      "attention_mask": {0: batch, 1: seq}})
    torch.export.save(program, str(path))
    return path


class _Logits(torch.nn.Module):
    """The wrapper a user's TorchScript export script writes: two tensors in, the logits out (the tracer would
    otherwise take ``logits_to_keep`` as a third input)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def export_onnx(checkpoint: Path, path: Path, defect: str, dynamo: bool = True) -> Path:
    """A user's float32 ONNX of the trained model with ``defect`` planted: ``torch.onnx.export`` with the dynamo
    exporter, or TorchScript's (``dynamo=False``, what Optimum uses), as a user's script would call it."""
    from transformers import GPTNeoXForCausalLM  # noqa: PLC0415

    model = GPTNeoXForCausalLM.from_pretrained(checkpoint, attn_implementation="sdpa").eval()
    plant(model, defect, checkpoint)
    model.config.use_cache = False
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    names = ["input_ids", "attention_mask"]
    with shifted_mask(defect), torch.no_grad():
        if dynamo:
            torch.onnx.export(model, (), str(path), kwargs={"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                              dynamic_shapes={n: {0: "batch", 1: "sequence"} for n in names}, dynamo=True,
                              input_names=names, output_names=["logits"])
        else:
            torch.onnx.export(_Logits(model), (ids, torch.ones_like(ids)), str(path), dynamo=False,
                              input_names=names, output_names=["logits"], opset_version=17,
                              dynamic_axes={n: {0: "batch", 1: "sequence"} for n in [*names, "logits"]})
    return path


# what a checkpoint folder (all another tool such as Optimum's exporter is given) cannot carry
NOT_IN_A_FOLDER = {
    "scale": "the attention's scale is code, not a weight or a config key a folder holds",
    "mask-shift": "the causal mask is code, not a weight or a config key a folder holds",
    "gelu-tanh": "a folder's config (hidden_act) changes every layer's activation, not layer 1's alone",
}


def planted_folder(checkpoint: Path, defect: str, folder: Path) -> Path:
    """A copy of the trained model's folder with ``defect`` planted as a folder can carry it: a weight of
    :func:`plant` written into its safetensors, or the rotary base in its config. The config also carries the
    rotary keys transformers 4 reads (``rotary_pct``, ``rotary_emb_base``), so a tool running transformers 4 (Optimum)
    builds the same model. :data:`NOT_IN_A_FOLDER`: the defects it cannot carry."""
    import json  # noqa: PLC0415
    import shutil  # noqa: PLC0415

    from safetensors.torch import load_file, save_file  # noqa: PLC0415
    from transformers import GPTNeoXForCausalLM  # noqa: PLC0415

    if defect in NOT_IN_A_FOLDER:
        raise ValueError(f"{defect}: {NOT_IN_A_FOLDER[defect]}")
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(checkpoint, folder, ignore=shutil.ignore_patterns("earlier", "training.json"))
    config = json.loads((folder / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", 10000.0)) * (1.01 if defect == "rope-base" else 1.0)
    rope["rope_theta"] = theta
    config.update(rope_parameters=rope, rotary_pct=rope.get("partial_rotary_factor", 0.25), rotary_emb_base=theta)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if defect in ("layernorm", "noise", "stale"):
        tensors = load_file(str(folder / "model.safetensors"))
        model = GPTNeoXForCausalLM.from_pretrained(checkpoint).eval()
        plant(model, defect, checkpoint)
        state = model.state_dict()
        save_file({name: state[name].detach().contiguous() if name in state else tensor
                   for name, tensor in tensors.items()}, str(folder / "model.safetensors"))
    elif defect not in ("clean", "rope-base"):
        raise ValueError(f"{defect}: not a defect a folder carries")
    return folder


@contextlib.contextmanager
def planted_in_convert(checkpoint: Path, defect: str):
    """While inside, ``exporter convert`` plants ``defect`` only while it traces the model with ``torch.export``
    (as a bug in its export path would): every artifact built from that program carries it; the float64
    reference, the eager baseline and the rewritten model do not."""
    from ..targets import exported_program  # noqa: PLC0415

    real = exported_program._export_module

    def traced(module, example, plan, notes, hints_first=False):
        undo = plant(module.model, defect, checkpoint)
        try:
            with shifted_mask(defect):
                return real(module, example, plan, notes, hints_first)
        finally:
            undo()

    exported_program._export_module = traced
    try:
        with slot_off(defect):
            yield
    finally:
        exported_program._export_module = real


@contextlib.contextmanager
def slot_off(defect: str):
    """``kv-cache-slot``: while ``convert --task text-generation`` exports its decode program, layer
    :data:`LAYER`'s cache write lands one slot after the step's position (the last slot stays the last): the
    prefill programs, the float64 generation and the eager models write where they should."""
    if defect != "kv-cache-slot":
        yield
        return
    from ..generation import cache  # noqa: PLC0415

    real = cache.transformers_cache

    def planted(kv, positions):
        made = real(kv, positions)
        layer = made.layers[LAYER]
        update = layer.update

        def shifted(key_states, value_states, *args, **kwargs):
            if not (torch.compiler.is_exporting() and key_states.shape[2] == 1):  # the decode step's trace only
                return update(key_states, value_states, *args, **kwargs)
            slots = (positions + 1).clamp(max=layer.keys.shape[2] - 1)
            layer.keys.index_copy_(2, slots, key_states.to(layer.keys.dtype))
            layer.values.index_copy_(2, slots, value_states.to(layer.values.dtype))
            return layer.keys, layer.values

        layer.update = shifted
        return made

    cache.transformers_cache = planted
    try:
        yield
    finally:
        cache.transformers_cache = real


__all__ = ["ALSO", "EXPECT", "LAYER", "NOT_IN_A_FOLDER", "ONLY", "export", "export_onnx", "named", "plant",
           "planted_folder", "planted_in_convert", "planted_sdpa", "shifted_mask", "slot_off"]
