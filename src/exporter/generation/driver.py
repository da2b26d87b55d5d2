"""Greedy generation from a prefill and a decode step (eager modules, exported programs or AOTI packages alike),
for every family.

``Steps`` pairs two callables and the family's cache layout. A prompt (a decoder's ``Prompt`` here, an
encoder-decoder's ``seq2seq.Source``) says how its steps are called: ``feed(steps)`` allocates the cache and gives
the prefill and the arguments of each decode step (a :class:`Feed`). ``generate`` runs them: the prefill, then one
decode per new token. With ``forced`` tokens it feeds those instead of its own picks (teacher forcing), so every
step's logits can be compared with the reference's at the same prefix; the tokens it returns are still its own picks
at each step. A batch of one row decodes with the decode program of batch 1 where the target built one
(``Steps.decode_for``). ``load_steps`` loads a built target's two programs back as ``Steps`` (each target loads its
own files: ``Target.load_decoder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .. import targets
from ..errors import InputsError
from ..targets.spec import Step as Step


@dataclass
class Steps:
    prefill: Step
    decode: Step
    layout: Any  # the family's cache layout: ``CacheLayout``, ``seq2seq.Seq2SeqLayout``
    cache_length: int
    dtype: torch.dtype
    device: str
    # a second instance of the decode program, for a CUDA graph to capture: an AOTInductor container whose run
    # was captured cannot run outside the graph again (its completion event was recorded in the capture)
    fresh_decode: Optional[Callable[[], Step]] = None
    # the decode program of batch 1 (generation.decode_batch_1), used for a batch of one row, and a fresh instance
    decode_one: Optional[Step] = None
    fresh_decode_one: Optional[Callable[[], Step]] = None

    def decode_for(self, batch: int) -> Step:
        """The decode program a batch of ``batch`` rows runs: the one of batch 1 where there is one and it fits."""
        return self.decode_one if batch == 1 and self.decode_one is not None else self.decode

    def fresh_for(self, batch: int) -> Step:
        """A decode instance for a CUDA graph to capture, for ``batch`` rows."""
        if batch == 1 and self.decode_one is not None:
            return self.fresh_decode_one() if self.fresh_decode_one is not None else self.decode_one
        return self.fresh_decode() if self.fresh_decode is not None else self.decode


@dataclass
class Feed:
    """How one prompt's steps are called over the cache ``feed`` allocated: ``prefill()`` gives the first step's
    logits; ``args(token [B, 1], position [1])`` are a decode step's arguments; ``start`` is the first decode step's
    cache position."""

    prefill: Callable[[], torch.Tensor]
    args: Callable[[torch.Tensor, torch.Tensor], tuple]
    start: int
    bytes: int  # of cache a decode step reads


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [B, P] int64, left-padded
    mask: torch.Tensor  # [B, P] int64: 0 for padding

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def batch(self) -> int:
        return int(self.input_ids.shape[0])

    def check_fits(self, new_tokens: int, cache_length: int) -> None:
        if self.length + new_tokens > cache_length:
            raise InputsError(f"a {self.length}-token prompt plus {new_tokens} new tokens does not fit the "
                              f"{cache_length}-slot cache the artifact was built for", "shorten the prompt or "
                              "--max-new-tokens, or convert with a larger generation.max_cache_len")

    def feed(self, steps: "Steps") -> Feed:
        """The prefill over the prompt (a one-token prompt: the decode step at position 0), then each token at the
        slot after the last."""
        device = steps.device
        ids = self.input_ids.to(device).contiguous()
        padding = self.padding(steps.cache_length).to(device)
        kv = steps.layout.allocate(self.batch, steps.cache_length, steps.dtype, device)
        first = steps.prefill if self.length > 1 else steps.decode_for(self.batch)
        return Feed(lambda: first(ids, padding, torch.arange(self.length, device=device), kv),
                    lambda token, where: (token, padding, where, kv), self.length,
                    steps.layout.bytes(self.batch, steps.cache_length, steps.dtype))

    def row(self, index: int) -> "Prompt":
        """Row ``index`` alone, its padding removed (a batch-1 prompt)."""
        keep = self.mask[index].bool()
        return Prompt(self.input_ids[index:index + 1, keep], self.mask[index:index + 1, keep])

    def padding(self, cache_length: int) -> torch.Tensor:
        """The step's ``padding_mask`` over every cache slot: the prompt's, then 1 for every slot after it."""
        batch = self.input_ids.shape[0]
        rest = torch.ones(batch, cache_length - self.length, dtype=torch.long, device=self.mask.device)
        return torch.cat([self.mask.long(), rest], dim=1).contiguous()


def check_ids(prompts: list[list[int]], vocab: int, what: str) -> None:
    """``exporter generate``'s token ids: at least one in every row, each within the vocabulary."""
    if not prompts or any(not p for p in prompts):
        raise InputsError(f"no {what} tokens given", "pass --input-ids 1,2,3 (repeat it for more rows)")
    bad = sorted({t for p in prompts for t in p if not 0 <= t < vocab})
    if bad:
        raise InputsError(f"token id(s) {bad[:5]} outside the vocabulary (0..{vocab - 1})",
                          "pass token ids of this model's tokenizer")


def generate(steps: Steps, prompt: Any, new_tokens: int, forced: torch.Tensor | None = None,
             keep_logits: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens ``[B, new_tokens]`` and each step's logits ``[B, vocab]`` (on the CPU, float32 or wider)."""
    prompt.check_fits(new_tokens, steps.cache_length)
    feed = prompt.feed(steps)
    decode = steps.decode_for(prompt.batch)
    with torch.inference_mode():
        picks, logits = greedy(feed.prefill(), lambda token, step: decode(*feed.args(
            token, torch.tensor([feed.start + step], device=steps.device))), new_tokens, forced, keep_logits,
            steps.device)
    return torch.stack(picks, dim=1), logits


def greedy(out: torch.Tensor, decode: Callable[[torch.Tensor, int], torch.Tensor], new_tokens: int,
           forced: torch.Tensor | None, keep_logits: bool, device: str
           ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Greedy tokens, each ``[B]`` on the CPU, from the first step's logits ``out`` (``[B, vocab]``): each pick, or with
    ``forced`` the reference's token (teacher forcing), is fed as ``[B, 1]`` to ``decode(feed, step)`` for the next
    step's logits; and each step's logits on the CPU, float32 or wider (``keep_logits``)."""
    tokens: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    batch = out.shape[0]
    for step in range(new_tokens):
        pick = out.argmax(-1)
        tokens.append(pick.cpu())
        if keep_logits:
            logits.append(out.float().cpu() if out.dtype != torch.float64 else out.cpu())
        if step == new_tokens - 1:
            break
        feed = forced[:, step].to(device) if forced is not None else pick
        out = decode(feed.reshape(batch, 1).contiguous(), step)
    return tokens, logits


def load_steps(target: str, folder: Path, layout: Any, cache_length: int, dtype: torch.dtype,
               device: str) -> Steps:
    """A built target's prefill and decode programs in ``folder``, callable as ``Steps``."""
    loaded = targets.get(target).load_decoder(folder)
    return Steps(loaded.prefill, loaded.decode, layout, cache_length, dtype, device, loaded.fresh_decode,
                 loaded.decode_one, loaded.fresh_decode_one)
