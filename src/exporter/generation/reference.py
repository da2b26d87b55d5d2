"""The reference a generation is judged against: the original model, without any cache.

``reference_generation`` is greedy generation by the original model (eager attention, float64 for the
reference) that re-reads the whole sequence at every step: no KV cache, no exported step, nothing the
artifacts share. Each prompt row runs on its own, without its left padding: a
padded row generates exactly what its unpadded prompt generates, so the reference needs no padding mask
at all (in float64 transformers' eager attention turns a padded query row into NaN, which then reaches
every token of that row through the values). A transformers model builds its own causal mask there; a
factory model gets the additive mask of the decoder contract. ``forced_logits`` is the same model in
the candidates' dtype reading the reference's tokens (teacher forcing, one forward): the baseline error the
tolerance rule scales.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .cache import keeps_last_logits, logits_of, step_mask
from .driver import Prompt


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def full_forward(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, keep: int,
                 transformers: bool) -> torch.Tensor:
    """Logits ``[B, keep, vocab]`` of the last ``keep`` positions of ``ids`` read whole, without a cache."""
    positions = _positions(mask)
    extra = {"logits_to_keep": keep} if keeps_last_logits(model) else {}
    if transformers:
        result = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, **extra)
    else:
        dtype = next(model.parameters()).dtype
        additive = step_mask(mask.long(), torch.arange(ids.shape[1], device=ids.device), dtype)
        result = model(input_ids=ids, attention_mask=additive, position_ids=positions, past_key_values=None,
                       use_cache=False, **extra)
    return logits_of(result)[:, -keep:]


def unpadded_rows(prompt: Prompt) -> list[torch.Tensor]:
    """Each prompt row's real tokens ``[1, length]``."""
    return [prompt.input_ids[row, prompt.mask[row].bool()][None] for row in range(prompt.input_ids.shape[0])]


def reference_generation(model: nn.Module, prompt: Prompt, new_tokens: int, device: str,
                         transformers: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[B, N]`` and each step's logits ``[N, B, vocab]`` (in the model's dtype, on the CPU),
    row by row without padding."""
    rows = [_greedy(model, ids, new_tokens, device, transformers) for ids in unpadded_rows(prompt)]
    return torch.cat([t for t, _ in rows], dim=0), torch.cat([lg for _, lg in rows], dim=1)


def _greedy(model: nn.Module, ids: torch.Tensor, new_tokens: int, device: str,
            transformers: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    tokens, logits = [], []
    with torch.inference_mode():
        for _ in range(new_tokens):
            last = full_forward(model, ids, mask, 1, transformers)[:, -1]
            pick = last.argmax(-1)
            tokens.append(pick.cpu())
            logits.append(last.cpu())
            ids = torch.cat([ids, pick[:, None]], dim=1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return torch.stack(tokens, dim=1), torch.stack(logits)


def forced_logits(model: nn.Module, prompt: Prompt, tokens: torch.Tensor, device: str,
                  transformers: bool) -> torch.Tensor:
    """Each step's logits ``[N, B, vocab]`` when the model reads the prompt and ``tokens`` (one forward per
    row, without its padding)."""
    steps = tokens.shape[1]
    out = []
    for row, real in enumerate(unpadded_rows(prompt)):
        ids = torch.cat([real, tokens[row:row + 1, :-1]], dim=1).to(device)
        with torch.inference_mode():
            out.append(full_forward(model, ids, torch.ones_like(ids), steps, transformers).cpu())
    return torch.cat(out, dim=0).transpose(0, 1)
