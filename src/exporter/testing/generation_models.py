"""A tiny decoder written by hand that follows the decoder contract of ``--task text-generation``
(docs/generation.md), for the tests: ``build(config)`` is its factory. With ``"cache_bug": true`` in its
config.json its decode steps (one token) write the step's keys where the values belong: a defect in the cache
update that a run without a cache never sees."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, index: int, cache_bug: bool):
        super().__init__()
        self.heads, self.index, self.cache_bug = heads, index, cache_bug
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, mask, cache):
        b, q, h = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, q, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        query, key, value = qkv[0], qkv[1], qkv[2]
        if cache is not None:
            written = key if (self.cache_bug and q == 1) else value
            key, value = cache.update(key, written, self.index)
        attended = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(b, q, h))
        return x + self.mlp(self.norm2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab=300, hidden=32, heads=2, layers=2, positions=128, cache_bug=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(positions, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, i, cache_bug) for i in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=False):
        x = self.embed(input_ids) + self.position(position_ids)
        for block in self.blocks:
            x = block(x, attention_mask, past_key_values)
        return self.head(self.norm(x))


def build(config=None):
    config = config or {}
    return TinyDecoder(cache_bug=bool(config.get("cache_bug", False)))
