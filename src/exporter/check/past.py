"""A decoder with past (Optimum's ``text-generation-with-past``), judged step by step.

The artifact takes ``input_ids``, ``attention_mask`` (past and new positions), ``position_ids`` and
``past_key_values.N.key`` / ``.value`` ``[batch, kv_heads, past, head_dim]``, and returns ``logits`` and
``present.N.key`` / ``.value`` (the cache with the new positions written). A serving loop runs it twice over:
once on the prompt with an empty cache (``past`` = 0), then once per next token, fed the cache it returned. So
the gate judges exactly that pair of steps, as one candidate with the outputs of both
(:func:`output_names`): the prompt's logits and cache, then one next token's logits and cache, the artifact
fed its own cache. The float64 reference is the checkpoint's model doing the same two steps with its own cache;
the eager baseline the same model in the artifact's dtype. Every output is held to the same rule as a forward
output; a cache written one position off fails ``prefill.present.N`` and the next token's logits.

Positions follow the padding mask (:func:`exporter.modelio.step_positions`), for the artifact and the reference
alike. The older split (``decoder_model.onnx`` for the prompt, ``decoder_with_past_model.onnx`` for the next
token) and the merged file (``use_cache_branch``) are run the same way; only the single file is tested here
(optimum-onnx 0.1 writes that one). The artifact's side runs in its own process (``targets/onnx.py``'s
``load_past_steps``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from ..modelio import IOModule, Signature, attention_implementation, step_positions
from ..recipe import Recipe, TensorSpec
from .artifacts import Artifact


def output_names(layers: int) -> tuple[str, ...]:
    names = []
    for step in ("prefill", "decode"):
        names.append(f"{step}.logits")
        for layer in range(layers):
            names += [f"{step}.present.{layer}.key", f"{step}.present.{layer}.value"]
    return tuple(names)


INPUTS = ("input_ids", "attention_mask", "next_ids")


def cache_tensors(cache: Any, layers: int) -> list[torch.Tensor]:
    """key, value of every layer from a transformers cache (``Cache.layers`` in transformers 5)."""
    out = []
    for layer in range(layers):
        if hasattr(cache, "layers"):
            out += [cache.layers[layer].keys, cache.layers[layer].values]
        else:
            out += [cache.key_cache[layer], cache.value_cache[layer]]
    return out


class PastSteps(IOModule):
    """The checkpoint's causal LM doing the two steps, returning :func:`output_names`' tensors."""

    def __init__(self, model: nn.Module, layers: int, attn_implementation: str | None = "eager"):
        super().__init__(model, Signature(INPUTS, output_names(layers)), attn_implementation)
        self.layers = layers

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache  # noqa: PLC0415

        input_ids, mask, next_ids = args
        prompt, following, position = step_positions(mask)
        config: Any = getattr(self.model, "config", None)
        with attention_implementation(self.model, self.attn_implementation):
            first = self.model(input_ids=input_ids, attention_mask=mask, position_ids=prompt,
                               past_key_values=DynamicCache(config=config), use_cache=True,
                               return_dict=True)
            prefill = [first.logits, *[t.clone() for t in cache_tensors(first.past_key_values, self.layers)]]
            second = self.model(input_ids=next_ids, attention_mask=following, position_ids=position,
                                past_key_values=first.past_key_values, use_cache=True, return_dict=True)
            decode = [second.logits, *cache_tensors(second.past_key_values, self.layers)]
        return tuple(prefill + decode)


def past_recipe(artifact: Artifact, model: nn.Module, recipe: Recipe) -> tuple[Recipe, list[str]]:
    """The recipe's inputs for the two steps: a padded prompt and one next token (within the model's positions,
    one kept for the next token)."""
    from ..inputs import infer_specs, within_positions  # noqa: PLC0415

    specs = {s.name: s for s in infer_specs(model, dataclasses.replace(recipe.inputs, tensors=()))}
    ids = specs.get("input_ids")
    if ids is None:
        raise ValueError("no input_ids")
    declared = (ids, dataclasses.replace(ids, name="attention_mask", low=0, high=2),
                TensorSpec("next_ids", (ids.shape[0], 1), "int64", ids.low, ids.high))
    dims, notes = within_positions(model, declared, recipe.inputs.dims)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    dims = tuple(dataclasses.replace(d, max=min(d.max, limit - 1), size=min(d.size, limit - 1))
                 if isinstance(limit, int) and d.name == ids.shape[-1] and d.max >= limit else d for d in dims)
    notes = [*notes, f"a decoder with past ({artifact.past.layers if artifact.past else 0} layers): judged on two "
             "steps, the prompt with an empty cache, then one next token fed the cache the artifact returned"]
    return dataclasses.replace(recipe, inputs=dataclasses.replace(recipe.inputs, tensors=declared, dims=dims)), notes


__all__ = ["PastSteps", "output_names", "past_recipe", "INPUTS"]
