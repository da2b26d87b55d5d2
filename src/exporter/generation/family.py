"""A generation family: what one kind of model says about itself, so that one corridor converts, judges, times and
runs them all (``run.convert_generation``, ``session.run``).

Two families: decoder-only models (:mod:`exporter.generation.decoder`, ``--task text-generation``) and
encoder-decoders (:mod:`exporter.generation.encoder_decoder`, ``text2text-generation`` and
``automatic-speech-recognition``). A family says how to read the model's cache layout (checking the recipe fits it),
what a prompt is (token ids, or an encoder's source) and how the float64 reference generates from it, which
attention its step dispatches, the steps it runs and exports, and how they are loaded, generated from and timed.
A third family (a vision-language decoder, say) is one more module with these members and one more line in
:func:`family_for`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from ..recipe import Recipe
from ..rewrite.audit import AttentionAudit
from ..targets.context import DecoderPrograms
from .decoder import DECODER
from .encoder_decoder import ENCODER_DECODER, TASKS


class Family(Protocol):
    prompt_class: type  # ``Prompt`` or ``Source``: two tensors, the values and their mask
    stored: tuple[str, str]  # the stored reference's names for those two tensors
    rows_alone: bool  # also judged at batch 1, each prompt row alone (``session.judge_rows_alone``)
    programs: str  # what the export stage says it exports

    def probe(self, model: torch.nn.Module, recipe: Recipe, transformers: bool) -> Any:
        """The model's cache layout, read from one step on the recipe's device; refuses a model or a recipe the
        family cannot generate with (an ArchitectureError naming the fix)."""

    def prompt(self, layout: Any, recipe: Recipe) -> Any:
        """The seeded prompts the reference generates from (a ``Prompt`` or a ``Source``), floats in float64."""

    def reference(self, model: torch.nn.Module, prompt: Any, layout: Any, new_tokens: int, device: str,
                  transformers: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy tokens ``[B, N]`` and each step's logits ``[N, B, vocab]``, without a cache."""

    def forced(self, model: torch.nn.Module, prompt: Any, layout: Any, tokens: torch.Tensor, device: str,
               transformers: bool) -> torch.Tensor:
        """Each step's logits ``[N, B, vocab]`` with the model reading ``tokens`` (teacher forcing)."""

    def audit(self, model: torch.nn.Module, layout: Any, device: str, transformers: bool) -> AttentionAudit:
        """The attention sites one step dispatches through transformers' SDPA entry."""

    def local_steps(self, model: torch.nn.Module, layout: Any, recipe: Recipe, transformers: bool) -> Any:
        """The model itself as the two steps, not exported (the rewritten model, judged and timed)."""

    def refusal(self, target: str, device: str, dtype: str) -> str | None:
        """Why ``target`` builds no programs of this family here (None: it does)."""

    def export(self, model: torch.nn.Module, layout: Any, recipe: Recipe, transformers: bool, past: bool,
               one: bool) -> DecoderPrograms:
        """The prefill and decode programs (``past``: also in the form ONNX can express; ``one``: also the decode
        program of batch 1, where the family has one)."""

    def eager_generate(self, model: torch.nn.Module, prompt: Any, layout: Any, recipe: Recipe) -> dict[str, Any]:
        """transformers' own ``generate()`` from ``prompt``, timed."""

    def weight_bytes(self, model: torch.nn.Module) -> int:
        """The bytes of weights one decode step reads."""

    def setup(self, model: torch.nn.Module, layout: Any, recipe: Recipe) -> dict[str, Any]:
        """What ``generation.json`` holds beyond what every family's holds."""

    def section(self, layout: Any, prompt: Any, setup: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
        """The report's generation section beyond what every family's holds."""

    def load_steps(self, target: str, folder: Path, setup: dict[str, Any]) -> Any:
        """A built target's two programs in ``folder``, as steps."""

    def generate(self, steps: Any, prompt: Any, new_tokens: int, forced: torch.Tensor | None = None,
                 keep_logits: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy tokens ``[B, new_tokens]`` and each step's logits (``forced``: teacher forcing)."""

    def time(self, steps: Any, prompt: Any, timing: dict[str, Any]) -> dict[str, Any]:
        """The steps timed at batch 1 and at the recipe's batch."""


def family_for(task: str | None) -> Family:
    """The family that generates for ``task`` (a folder from before the task was recorded is a decoder's)."""
    return ENCODER_DECODER if task in TASKS else DECODER


def stored_prompt(family: Family, stored: dict[str, torch.Tensor]) -> Any:
    """The prompt kept in the stored reference (``run.write_setup`` wrote it)."""
    return family.prompt_class(*(stored[name] for name in family.stored))


__all__ = ["Family", "family_for", "stored_prompt"]
