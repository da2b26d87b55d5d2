"""A generation family: what one kind of model says about itself, so that one corridor converts, judges, times and
runs them all (``run.convert_generation``, ``session.run``).

Two families: decoder-only models (:mod:`exporter.generation.decoder`, ``--task text-generation``) and
encoder-decoders (:mod:`exporter.generation.encoder_decoder`, ``text2text-generation`` and
``automatic-speech-recognition``). A family says how to read the model's cache layout (checking the recipe fits it),
what a prompt is (token ids, or an encoder's source) and how the float64 reference generates from it, which
attention its step dispatches, the steps it runs and exports, and how they are loaded, generated from and timed.
A third family (a vision-language decoder, say) is one more module with a subclass of :class:`Family` and one more
line in ``session.family_for``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..dtypes import torch_dtype
from ..recipe import Recipe
from ..rewrite.audit import AttentionAudit
from ..targets.context import DecoderPrograms
from .bench import time_runs
from .driver import Steps, generate, load_steps


class Family:
    """What one kind of generation model says about itself (``Decoder``, ``EncoderDecoder``). A ``layout`` is the
    family's cache layout, a ``prompt`` its ``prompt_class`` (two tensors: the values and their mask), ``steps``
    its two callable steps (the model itself, or a built target's programs)."""

    def __init__(self, prompt_class: type, layout_class: Any, stored: tuple[str, str], rows_alone: bool,
                 programs: str, rows: str):
        self.prompt_class = prompt_class  # ``Prompt`` (token ids, left-padded) or ``Source`` (ids or features)
        self.layout_class = layout_class  # ``CacheLayout`` or ``Seq2SeqLayout``: what ``generation.json`` keeps
        self.stored = stored  # the stored reference's names for the prompt's two tensors
        self.rows_alone = rows_alone  # also judged at batch 1, each prompt row alone (``session.judge_rows_alone``)
        self.programs = programs  # what the export stage says it exports
        self.rows = rows  # what ``exporter generate`` calls a row of its input ("prompts", "sources")

    # convert: read the layout from one step on the recipe's device, refusing a model or recipe the family cannot
    # generate with (ArchitectureError); seeded prompts (floats in float64); greedy reference tokens [B, N] and
    # logits [N, B, vocab] without a cache; teacher-forced logits; the attention sites one step dispatches
    def probe(self, model: torch.nn.Module, recipe: Recipe, transformers: bool) -> Any:
        raise NotImplementedError

    def prompt(self, layout: Any, recipe: Recipe) -> Any:
        raise NotImplementedError

    def reference(self, model: torch.nn.Module, prompt: Any, layout: Any, new_tokens: int, device: str,
                  transformers: bool) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forced(self, model: torch.nn.Module, prompt: Any, layout: Any, tokens: torch.Tensor, device: str,
               transformers: bool) -> torch.Tensor:
        raise NotImplementedError

    def audit(self, model: torch.nn.Module, layout: Any, device: str, transformers: bool) -> AttentionAudit:
        raise NotImplementedError

    # the model itself as steps; why a target builds none of this family's programs (None: it does); the two
    # programs (``past``: also as ONNX expresses them; ``one``: the decode program of batch 1 where there is one)
    def local_steps(self, model: torch.nn.Module, layout: Any, recipe: Recipe, transformers: bool) -> Any:
        raise NotImplementedError

    def refusal(self, target: str, device: str, dtype: str) -> str | None:
        raise NotImplementedError

    def export(self, model: torch.nn.Module, layout: Any, recipe: Recipe, transformers: bool, past: bool,
               one: bool) -> DecoderPrograms:
        raise NotImplementedError

    # what the report and ``generation.json`` hold beyond every family's: transformers' own generate() timed, the
    # weight bytes a decode step reads, the setup's and the report section's own entries
    def eager_generate(self, model: torch.nn.Module, prompt: Any, layout: Any, recipe: Recipe) -> dict[str, Any]:
        raise NotImplementedError

    def weight_bytes(self, model: torch.nn.Module) -> int:
        raise NotImplementedError

    def setup(self, model: torch.nn.Module, layout: Any, recipe: Recipe) -> dict[str, Any]:
        return {}

    def section(self, layout: Any, prompt: Any, setup: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
        raise NotImplementedError

    # ``exporter generate``'s input (token ids, or a speech model's features file) as this family's prompt, each
    # problem an InputsError
    def user_prompt(self, prompts: list[list[int]], features: str | Path | None, setup: dict[str, Any]) -> Any:
        raise NotImplementedError

    # a built target's programs loaded as steps; greedy tokens [B, N] and each step's logits (``forced``: teacher
    # forcing); the steps timed at batch 1 and at the recipe's batch: the same for every family (``driver``, ``bench``)
    def load_steps(self, target: str, folder: Path, setup: dict[str, Any]) -> Steps:
        return load_steps(target, folder, self.layout_class.from_dict(setup["layout"]), setup["cache_length"],
                          torch_dtype(setup["dtype"]), setup["device"])

    def generate(self, steps: Steps, prompt: Any, new_tokens: int, forced: torch.Tensor | None = None,
                 keep_logits: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return generate(steps, prompt, new_tokens, forced, keep_logits)

    def time(self, steps: Steps, prompt: Any, timing: dict[str, Any]) -> dict[str, Any]:
        return time_runs(steps, prompt, timing)


__all__ = ["Family"]
