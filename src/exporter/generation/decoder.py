"""The decoder-only family (``--task text-generation``): a prompt of token ids, left-padded; one step
(``cache.DecoderStep``) exported twice, as the prefill over the prompt and as the decode of one token; judged at
the recipe's batch and at batch 1, each prompt row alone (with the decode program of batch 1 where a target built
one). See :mod:`exporter.generation.family` for what a family says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .. import targets
from ..dtypes import torch_dtype
from ..errors import ArchitectureError, InputsError
from ..recipe import Recipe
from ..rewrite.audit import AttentionAudit
from ..targets.context import DecoderPrograms
from . import bench
from .attention import recorded_sites
from .cache import CacheLayout, DecoderStep, probe_layout
from .driver import Prompt, Steps, check_ids
from .family import Family
from .programs import export_steps
from .reference import forced_logits, reference_generation


class Decoder(Family):
    def __init__(self) -> None:
        super().__init__(Prompt, CacheLayout, ("prompt_ids", "prompt_mask"), rows_alone=True,
                         programs="prefill and decode programs", rows="prompts")

    def probe(self, model: torch.nn.Module, recipe: Recipe, transformers: bool) -> CacheLayout:
        """A sliding-window attention narrower than the cache, or a cache longer than the model has positions (a
        step past them reads a position embedding out of bounds), refused before anything is built."""
        from ..inputs import position_limit  # noqa: PLC0415

        cache_length, config = recipe.generation.max_cache_len, getattr(model, "config", None)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None) or []
        uses = getattr(config, "use_sliding_window", True) and (not layer_types or "sliding_attention" in layer_types)
        if isinstance(window, int) and uses and window < cache_length:
            raise ArchitectureError(f"the model's attention looks back at most {window} tokens (sliding_window) but "
                                    f"the cache holds {cache_length}: the static cache does not implement sliding "
                                    f"windows", f"convert with --set generation.max_cache_len={window} or less")
        found = position_limit(model, "input_ids")
        if found is not None and cache_length > found[0]:
            limit, source = found
            raise ArchitectureError(f"the model has {limit} positions ({source}) but the cache holds {cache_length}",
                                    f"convert with --set generation.max_cache_len={limit} or less")
        return probe_layout(model, transformers, recipe.runtime.device)

    def prompt(self, layout: CacheLayout, recipe: Recipe) -> Prompt:
        """Random token ids (seeded); odd rows left-padded by a quarter of the length (at least one token)."""
        gen = recipe.generation
        generator = torch.Generator().manual_seed(recipe.inputs.seed)
        ids = torch.randint(0, layout.vocab, (gen.batch, gen.prompt_length), generator=generator)
        mask = torch.ones(gen.batch, gen.prompt_length, dtype=torch.long)
        mask[1::2, :max(1, gen.prompt_length // 4)] = 0
        ids[mask == 0] = 0
        return Prompt(ids, mask)

    def reference(self, model: torch.nn.Module, prompt: Prompt, layout: CacheLayout, new_tokens: int, device: str,
                  transformers: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return reference_generation(model, prompt, new_tokens, device, transformers)

    def forced(self, model: torch.nn.Module, prompt: Prompt, layout: CacheLayout, tokens: torch.Tensor, device: str,
               transformers: bool) -> torch.Tensor:
        return forced_logits(model, prompt, tokens, device, transformers)

    def audit(self, model: torch.nn.Module, layout: CacheLayout, device: str, transformers: bool) -> AttentionAudit:
        """A transformers model's sites as one decode step records them; a factory model's attention is read from
        the exported programs' graphs (``decoder_attention``)."""
        if not transformers:
            return AttentionAudit(notes=["factory decoder: its attention runs as written; the programs' SDPA and "
                                         "softmax nodes are counted below"])
        return recorded_sites(model, lambda: probe_layout(model, True, device), decoder_only=True)

    def local_steps(self, model: torch.nn.Module, layout: CacheLayout, recipe: Recipe, transformers: bool) -> Steps:
        step = DecoderStep(model, transformers, layout.padding_mask_2d)
        return Steps(step, step, layout, recipe.generation.max_cache_len, torch_dtype(recipe.runtime.dtype),
                     recipe.runtime.device)

    def refusal(self, target: str, device: str, dtype: str) -> str | None:
        return targets.get(target).decoder_refusal(device, dtype)

    def export(self, model: torch.nn.Module, layout: CacheLayout, recipe: Recipe, transformers: bool, past: bool,
               one: bool) -> DecoderPrograms:
        gen = recipe.generation
        return export_steps(DecoderStep(model, transformers, layout.padding_mask_2d), layout, gen.batch,
                            gen.prompt_length, gen.max_cache_len, torch_dtype(recipe.runtime.dtype),
                            recipe.runtime.device, fuse=gen.fuse_projections, past=past, one=one,
                            attention_kernel=gen.decode_attention_kernel, gemv_kernel=gen.decode_gemv_kernel,
                            step_kernel=gen.decode_step_kernel)

    def eager_generate(self, model: torch.nn.Module, prompt: Prompt, layout: CacheLayout,
                       recipe: Recipe) -> dict[str, Any]:
        device = recipe.runtime.device
        inputs = {"input_ids": prompt.input_ids.to(device), "attention_mask": prompt.mask.to(device), "pad_token_id": 0}
        return bench.time_eager_generate(model, inputs, recipe.generation.bench_tokens, device, recipe.bench.rounds,
                                         recipe.bench.max_seconds / 2)  # two batch sizes

    def weight_bytes(self, model: torch.nn.Module) -> int:
        return bench.weight_bytes(model)

    def section(self, layout: CacheLayout, prompt: Prompt, setup: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
        gen = recipe.generation
        return {"layout": layout.to_dict(), "padded_rows": [r for r in range(gen.batch) if r % 2 == 1],
                "pad_tokens": max(1, gen.prompt_length // 4)}

    def user_prompt(self, prompts: list[list[int]], features: str | Path | None, setup: dict[str, Any]) -> Prompt:
        """The prompts, left-padded into one batch."""
        if features is not None:
            raise InputsError("--input-features given to a decoder's folder", "pass --input-ids; features are for a "
                              "speech model converted with --task automatic-speech-recognition")
        check_ids(prompts, CacheLayout.from_dict(setup["layout"]).vocab, "prompt")
        length = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), length, dtype=torch.long)
        mask = torch.zeros(len(prompts), length, dtype=torch.long)
        for row, tokens in enumerate(prompts):
            ids[row, length - len(tokens):] = torch.tensor(tokens)
            mask[row, length - len(tokens):] = 1
        return Prompt(ids, mask)


DECODER = Decoder()
