"""Greedy generation from a prefill and a decode step (eager modules, exported programs or AOTI packages alike).

``Steps`` pairs two callables with ``DecoderStep``'s signature. ``generate`` runs them: the prefill over the
prompt, then one decode per new token, over a cache it allocates. With ``forced`` tokens it feeds those
instead of its own picks (teacher forcing), so every step's logits can be compared with the reference's at
the same prefix; the tokens it returns are still its own picks at each step. A batch of one row decodes with
the decode program of batch 1 where the target built one (``Steps.decode_for``). ``load_steps`` loads a built
target's two programs back as ``Steps`` (each target loads its own files: ``Target.load_decoder``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import targets
from ..targets.spec import Step as Step
from .cache import CacheLayout


@dataclass
class Steps:
    prefill: Step
    decode: Step
    layout: CacheLayout
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
class Prompt:
    input_ids: torch.Tensor  # [B, P] int64, left-padded
    mask: torch.Tensor  # [B, P] int64: 0 for padding

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def row(self, index: int) -> "Prompt":
        """Row ``index`` alone, its padding removed (a batch-1 prompt)."""
        keep = self.mask[index].bool()
        return Prompt(self.input_ids[index:index + 1, keep], self.mask[index:index + 1, keep])

    def padding(self, cache_length: int) -> torch.Tensor:
        """The step's ``padding_mask`` over every cache slot: the prompt's, then 1 for every slot after it."""
        batch = self.input_ids.shape[0]
        rest = torch.ones(batch, cache_length - self.length, dtype=torch.long, device=self.mask.device)
        return torch.cat([self.mask.long(), rest], dim=1).contiguous()


def check_fits(prompt: Prompt, new_tokens: int, cache_length: int) -> None:
    from ..errors import InputsError  # noqa: PLC0415

    if prompt.length + new_tokens > cache_length:
        raise InputsError(f"a {prompt.length}-token prompt plus {new_tokens} new tokens does not fit the "
                          f"{cache_length}-slot cache the artifact was built for",
                          "shorten the prompt or --max-new-tokens, or convert with a larger generation.max_cache_len")


def generate(steps: Steps, prompt: Prompt, new_tokens: int, forced: torch.Tensor | None = None,
             keep_logits: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens ``[B, new_tokens]`` and each step's logits ``[B, vocab]`` (on the CPU, float32 or wider)."""
    check_fits(prompt, new_tokens, steps.cache_length)
    device = steps.device
    ids = prompt.input_ids.to(device).contiguous()
    batch = ids.shape[0]
    padding = prompt.padding(steps.cache_length).to(device)
    kv = steps.layout.allocate(batch, steps.cache_length, steps.dtype, device)
    decode = steps.decode_for(batch)
    with torch.inference_mode():
        if prompt.length > 1:
            out = steps.prefill(ids, padding, torch.arange(prompt.length, device=device), kv)
        else:
            out = decode(ids, padding, torch.zeros(1, dtype=torch.long, device=device), kv)
        picks, logits = greedy(out, lambda feed, step: decode(feed, padding, torch.tensor([prompt.length + step],
                                                                                           device=device), kv),
                               new_tokens, forced, keep_logits, device)
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


def load_steps(target: str, folder: Path, layout: CacheLayout, cache_length: int, dtype: torch.dtype,
               device: str) -> Steps:
    """A built target's prefill and decode programs in ``folder``, callable as ``Steps``."""
    loaded = targets.get(target).load_decoder(folder)
    return Steps(loaded.prefill, loaded.decode, layout, cache_length, dtype, device, loaded.fresh_decode,
                 loaded.decode_one, loaded.fresh_decode_one)
