"""Attention written every way the rewrite must handle: user code, as model authors write it.

Each case is a two-layer model ``forward(x, mask) -> (y,)`` (x: batch × seq × 32 floats; mask:
batch × seq, 1 for tokens, 0 for padding) with one attention per layer, and what the rewrite
must make of it. Used by tests/test_rewrite_*.py and scripts/attention_coverage.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, HEADS, HEAD_DIM, MAX_LEN = 32, 4, 8, 64
LAYERS = 2


class Attention(nn.Module):
    """q, k, v projections and an output projection; subclasses write ``attend``."""

    kv_heads = HEADS

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.k = nn.Linear(DIM, self.kv_heads * HEAD_DIM)
        self.v = nn.Linear(DIM, self.kv_heads * HEAD_DIM)
        self.o = nn.Linear(HEADS * HEAD_DIM, DIM)
        self.register_buffer("bias", torch.tril(torch.ones(MAX_LEN, MAX_LEN)).view(1, 1, MAX_LEN, MAX_LEN),
                             persistent=False)

    @staticmethod
    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, HEAD_DIM).transpose(1, 2)

    def forward(self, x, mask):
        q, k, v = self.heads(self.q(x), HEADS), self.heads(self.k(x), self.kv_heads), self.heads(self.v(x),
                                                                                                   self.kv_heads)
        y = self.attend(q, k, v, mask)
        b, h, s, d = y.shape
        return self.o(y.transpose(1, 2).reshape(b, s, h * d))

    def attend(self, q, k, v, mask):
        raise NotImplementedError


class Block(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = attention

    def forward(self, x, mask):
        return x + self.attn(self.norm(x), mask)


class Stack(nn.Module):
    def __init__(self, make: Callable[[], nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList([Block(make()) for _ in range(LAYERS)])

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return (x,)


# --------------------------------------------------------------------------- spellings that must be rewritten


class MatmulDiv(Attention):
    def attend(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)
        return torch.matmul(torch.softmax(scores, dim=-1), v)


class MatmulMul(Attention):
    scale = HEAD_DIM ** -0.5

    def attend(self, q, k, v, mask):
        return (q @ k.transpose(-1, -2) * self.scale).softmax(-1) @ v


class PrescaledQuery(Attention):
    def attend(self, q, k, v, mask):
        q = q * HEAD_DIM ** -0.5
        return F.softmax(q @ k.mT, dim=-1) @ v


class ScaleBuffer(Attention):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(HEAD_DIM ** -0.5), persistent=False)

    def attend(self, q, k, v, mask):
        return (q @ k.transpose(-2, -1) * self.scale).softmax(dim=-1) @ v


class PermutedKey(Attention):
    """k laid out (batch, heads, dim, seq) by a permute: kᵀ comes from a permute, not a transpose."""

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.heads(self.q(x), HEADS)
        kt = self.k(x).view(b, s, HEADS, HEAD_DIM).permute(0, 2, 3, 1)
        v = self.heads(self.v(x), HEADS)
        y = torch.softmax(q @ kt / math.sqrt(HEAD_DIM), -1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class CausalMaskedFill(Attention):
    """GPT-2 style: a tril buffer sliced to the length, masked_fill with -inf."""

    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        return scores.softmax(-1) @ v


class CausalWhere(Attention):
    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        scores = torch.where(keep, q @ k.transpose(-2, -1) * HEAD_DIM ** -0.5, float("-inf"))
        return scores.softmax(-1) @ v


class CausalAdditive(Attention):
    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        future = torch.triu(torch.full((n, n), float("-inf"), device=q.device), diagonal=1)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM) + future, dim=-1) @ v


class CausalArange(Attention):
    """Causal mask from comparing positions, with a finite fill (finfo.min), as transformers builds it."""

    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        pos = torch.arange(n, device=q.device)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], torch.finfo(scores.dtype).min)
        return scores.softmax(-1) @ v


class PaddingAdditive(Attention):
    """BERT style: (1 - mask) * -10000 added to the scores."""

    def attend(self, q, k, v, mask):
        extended = (1.0 - mask[:, None, None, :].to(q.dtype)) * -10000.0
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM) + extended, -1) @ v


class PaddingBoolean(Attention):
    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        return scores.softmax(-1) @ v


class InPlaceOps(Attention):
    """Falcon's spelling: the scores scaled and masked in place (``/=``, ``masked_fill_``)."""

    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-1, -2)
        scores /= math.sqrt(HEAD_DIM)
        scores.masked_fill_(mask[:, None, None, :] == 0, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class PaddingBothSides(Attention):
    """DeBERTa's mask: padded queries and keys both masked with finfo.min, so a padded query's row masks every key
    and eager's softmax gives it uniform weights (with -inf it would be NaN)."""

    def attend(self, q, k, v, mask):
        pair = (mask[:, None, :, None] * mask[:, None, None, :]).bool()
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(~pair, torch.finfo(q.dtype).min)
        return scores.softmax(-1) @ v


class PaddingWhere(Attention):
    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        scores = torch.where(mask[:, None, None, :].bool(), scores, torch.full_like(scores, float("-inf")))
        return scores.softmax(-1) @ v


class CausalAndPadding(Attention):
    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(self.bias[:, :, :n, :n] == 0, float("-inf"))
        scores = scores + (1.0 - mask[:, None, None, :].to(q.dtype)) * -10000.0
        return scores.softmax(-1) @ v


class RelativeBias(Attention):
    """A learned additive bias per head and position pair (T5/ALiBi-like)."""

    def __init__(self):
        super().__init__()
        self.rel = nn.Parameter(torch.randn(HEADS, MAX_LEN, MAX_LEN) * 0.1)

    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        return torch.softmax(q @ k.transpose(-2, -1) * HEAD_DIM ** -0.5 + self.rel[:, :n, :n], -1) @ v


class Dropout(Attention):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def attend(self, q, k, v, mask):
        probs = self.drop(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1))
        return F.dropout(probs, 0.1, training=self.training) @ v


class SoftmaxFloat32(Attention):
    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        return F.softmax(scores.float(), dim=-1).to(q.dtype) @ v


class SoftmaxDtypeArgument(Attention):
    def attend(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        return torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(q) @ v


def repeat_kv(t: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' repeat_kv: (b, kv, s, d) -> (b, kv * n, s, d)."""
    b, kv, s, d = t.shape
    return t[:, :, None, :, :].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)


class GroupedQueryExpand(Attention):
    kv_heads = 2

    def attend(self, q, k, v, mask):
        k, v = repeat_kv(k, HEADS // self.kv_heads), repeat_kv(v, HEADS // self.kv_heads)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v


class GroupedQueryRepeatInterleave(Attention):
    kv_heads = 2

    def attend(self, q, k, v, mask):
        k = torch.repeat_interleave(k, HEADS // self.kv_heads, dim=1)
        v = torch.repeat_interleave(v, HEADS // self.kv_heads, dim=1)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v


class GroupedQueryTiled(Attention):
    """k/v heads tiled with .repeat (head i uses kv head i % kv): not enable_gqa's order."""

    kv_heads = 2

    def attend(self, q, k, v, mask):
        k, v = k.repeat(1, HEADS // self.kv_heads, 1, 1), v.repeat(1, HEADS // self.kv_heads, 1, 1)
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v


class MultiQueryBroadcast(Attention):
    """One k/v head shared by all query heads through matmul broadcasting."""

    kv_heads = 1

    def attend(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v


class Einsum(Attention):
    def attend(self, q, k, v, mask):
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * HEAD_DIM ** -0.5
        return torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v)


class EinsumSequenceMajor(Attention):
    """einsum straight on (batch, seq, heads, dim) tensors, output back in that layout."""

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, HEAD_DIM) for p in (self.q, self.k, self.v))
        probs = torch.einsum("bqhd,bkhd->bhqk", q, k).div(math.sqrt(HEAD_DIM)).softmax(-1)
        return self.o(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1))


class BmmReshape(Attention):
    """Heads folded into the batch, torch.bmm on 3-D tensors."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        probs = torch.bmm(q3, k3.transpose(1, 2)).mul(d ** -0.5).softmax(dim=-1)
        return torch.bmm(probs, v3).view(b, h, s, d)


class BaddbmmMask(Attention):
    """nn.MultiheadAttention's own weights path: baddbmm(mask, q·scale, kᵀ)."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        additive = ((1.0 - mask.to(q.dtype)) * -10000.0)[:, None, None, :].expand(b, h, 1, s).reshape(b * h, 1, s)
        probs = torch.baddbmm(additive, q3 * d ** -0.5, k3.transpose(-2, -1)).softmax(-1)
        return torch.bmm(probs, v3).view(b, h, s, d)


class BmmViewPaddingMask(Attention):
    """bmm on (b·h, s, d), .view(b, h, s, s) to add a (b, 1, 1, s) padding mask, softmax, .view(b·h, s, s) for
    the bmm with v: the layout steps sit on both sides of the softmax."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        scores = torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d)
        additive = ((1.0 - mask.to(q.dtype)) * torch.finfo(q.dtype).min)[:, None, None, :]
        probs = (scores.view(b, h, s, s) + additive).softmax(dim=-1).view(b * h, s, s)
        return torch.bmm(probs, v3).view(b, h, s, d)


class BaddbmmViewCausal(Attention):
    """GPT-NeoX/Bloom style: baddbmm(beta=0, alpha=scale) on (b·h, s, d), reshaped to (b, h, s, s) for a causal
    masked_fill, softmax in float32, flattened back for the bmm with v."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        empty = torch.zeros(b * h, s, s, dtype=q.dtype, device=q.device)
        scores = torch.baddbmm(empty, q3, k3.transpose(1, 2), beta=0.0, alpha=d ** -0.5).reshape(b, h, s, s)
        scores = scores.masked_fill(self.bias[:, :, :s, :s] == 0, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).flatten(0, 1)
        return torch.bmm(probs, v3).unflatten(0, (b, h))


class FlattenedSoftmax(Attention):
    """4-D scores flattened over batch·heads for the softmax, unflattened for the product with v."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        scores = (q @ k.transpose(-2, -1) * d ** -0.5).masked_fill((mask == 0)[:, None, None, :], float("-inf"))
        return scores.flatten(0, 1).softmax(-1).unflatten(0, (b, h)) @ v


class SoftmaxOverPairs(Attention):
    """A view that merges the query and key dims: softmax over all (query, key) pairs of a head."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)
        return scores.view(b, h, s * s).softmax(-1).view(b, h, s, s) @ v


class FlattenedMaskedScores(Attention):
    """A padding mask laid out over the flattened (b·h, 1, s) scores, then a view to (b, h, s, s) for the softmax."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        keep = (mask != 0)[:, None, None, :].expand(b, h, 1, s).reshape(b * h, 1, s)
        scores = torch.bmm(q3, k3.transpose(1, 2)).masked_fill(~keep, float("-inf")) / math.sqrt(d)
        probs = scores.view(b, h, s, s).softmax(-1).view(b * h, s, s)
        return torch.bmm(probs, v3).view(b, h, s, d)


class HeadsIntoRows(Attention):
    """A view that merges the heads into the query rows, (b·h, s, s) -> (b, h·s, s): the softmax rows are the same,
    but the rule sees through batch and head regrouping only, so it is left alone, with the reason."""

    def attend(self, q, k, v, mask):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        probs = (torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d)).view(b, h * s, s).softmax(-1).view(b * h, s, s)
        return torch.bmm(probs, v3).view(b, h, s, d)


class CrossAttention(Attention):
    """Queries from every token, keys and values from the first half: query and key lengths differ."""

    def forward(self, x, mask):
        b, s, _ = x.shape
        memory = x[:, : s // 2]
        q, k, v = self.heads(self.q(x), HEADS), self.heads(self.k(memory), HEADS), self.heads(self.v(memory), HEADS)
        y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1) @ v
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class PaddingSquare(Attention):
    """A (query, key) mask built from the padding input: square, but data, not causal."""

    def attend(self, q, k, v, mask):
        pair = (mask[:, None, :, None] * mask[:, None, None, :]).bool() | torch.eye(
            q.shape[-2], dtype=torch.bool, device=q.device)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(~pair, float("-inf"))
        return scores.softmax(-1) @ v


class AntiCausal(Attention):
    """A triu buffer (each token sees the future): a constant square mask that is not causal."""

    def __init__(self):
        super().__init__()
        self.register_buffer("future", torch.triu(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool)), persistent=False)

    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(~self.future[:n, :n], float("-inf"))
        return scores.softmax(-1) @ v


class SlidingWindow(Attention):
    """Causal within a window of 40 tokens: equals tril(ones) up to length 40, the example's 32 included, so
    only trying other lengths tells it is not causal."""

    window = 40

    def attend(self, q, k, v, mask):
        n = q.shape[-2]
        ones = torch.ones(n, n, dtype=torch.bool, device=q.device)
        band = ones.tril() & ~ones.tril(diagonal=-self.window)
        scores = (q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)).masked_fill(~band, float("-inf"))
        return scores.softmax(-1) @ v


class AlreadySDPA(Attention):
    def attend(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --------------------------------------------------------------------------- must be left alone


class WeightsUsed(Attention):
    def attend(self, q, k, v, mask):
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1)
        return probs @ v + probs.mean(dim=-1, keepdim=True)


class WeightsReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MatmulDiv()

    def forward(self, x, mask):
        a = self.attn
        q, k, v = a.heads(a.q(x), HEADS), a.heads(a.k(x), HEADS), a.heads(a.v(x), HEADS)
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1)
        y = (probs @ v).transpose(1, 2).flatten(2)
        return a.o(y), probs


class SoftmaxOverQueries(Attention):
    def attend(self, q, k, v, mask):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), dim=-2) @ v


class DropoutActive(Attention):
    def attend(self, q, k, v, mask):
        probs = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM), -1)
        return F.dropout(probs, 0.1, training=True) @ v


class ZeroFill(Attention):
    """masked_fill with 0: zeroes scores, which is not a mask."""

    def attend(self, q, k, v, mask):
        scores = (q @ k.transpose(-2, -1)).masked_fill(mask[:, None, None, :] == 0, 0.0)
        return scores.softmax(-1) @ v


class PerKeyScale(Attention):
    """Scores multiplied per key: no single scale."""

    def __init__(self):
        super().__init__()
        self.key_scale = nn.Parameter(torch.rand(MAX_LEN) + 0.5)

    def attend(self, q, k, v, mask):
        n = k.shape[-2]
        return torch.softmax(q @ k.transpose(-2, -1) * self.key_scale[:n], -1) @ v


class SoftCapping(Attention):
    """Gemma-2 style tanh capping of the logits: SDPA has no such step."""

    def attend(self, q, k, v, mask):
        scores = torch.tanh(q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM) / 30.0) * 30.0
        return scores.softmax(-1) @ v


class NotAttention(nn.Module):
    """A softmax over a classifier's logits: no q·kᵀ before it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 10)

    def forward(self, x, mask):
        return (torch.softmax(self.head(torch.relu(self.proj(x))), dim=-1),)


# --------------------------------------------------------------------------- torch's own modules


class MHABlock(nn.Module):
    def __init__(self, need_weights: bool | None = None, use_weights: bool = False):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.need_weights, self.use_weights = need_weights, use_weights

    def forward(self, x, mask):
        kwargs = {} if self.need_weights is None else {"need_weights": self.need_weights}
        y, weights = self.attn(x, x, x, key_padding_mask=mask == 0, **kwargs)
        return x + (y + weights.mean(dim=-1, keepdim=True) if self.use_weights else y)


class TorchModules(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        if kind == "encoder":
            self.layers = nn.ModuleList([nn.TransformerEncoderLayer(DIM, HEADS, 64, batch_first=True)
                                         for _ in range(LAYERS)])
        elif kind == "decoder":
            self.layers = nn.ModuleList([nn.TransformerDecoderLayer(DIM, HEADS, 64, batch_first=True)
                                         for _ in range(LAYERS)])
        else:
            need = {"mha": None, "mha_no_weights": False, "mha_weights_used": None}[kind]
            self.layers = nn.ModuleList([MHABlock(need, kind == "mha_weights_used") for _ in range(LAYERS)])
        self.kind = kind

    def forward(self, x, mask):
        for layer in self.layers:
            if self.kind == "decoder":
                x = layer(x, x, tgt_key_padding_mask=mask == 0, memory_key_padding_mask=mask == 0)
            elif self.kind == "encoder":
                x = layer(x, src_key_padding_mask=mask == 0)
            else:
                x = layer(x, mask)
        return (x,)


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    name: str
    family: str
    spelling: str
    make: Callable[[], nn.Module]
    expect: str  # rewritten | already_sdpa | skipped | none
    sites: int = LAYERS
    causal: bool = False
    masked: bool = False
    grouped_query: bool = False
    reason: str = ""  # part of the skip reason


def stack(cls):
    return lambda: Stack(cls)


HAND = "hand-written"
CASES = [
    Case("matmul_div", HAND, "matmul, scale by divide", stack(MatmulDiv), "rewritten"),
    Case("matmul_mul", HAND, "@ operator, scale by multiply", stack(MatmulMul), "rewritten"),
    Case("prescaled_q", HAND, "pre-scaled q, k.mT", stack(PrescaledQuery), "rewritten"),
    Case("scale_buffer", HAND, "scale as a 0-d buffer", stack(ScaleBuffer), "rewritten"),
    Case("permuted_key", HAND, "kᵀ from permute(0, 2, 3, 1)", stack(PermutedKey), "rewritten"),
    Case("causal_masked_fill", HAND, "causal: masked_fill(-inf) from a tril buffer", stack(CausalMaskedFill),
         "rewritten", causal=True),
    Case("causal_where", HAND, "causal: where(tril(ones), s, -inf)", stack(CausalWhere), "rewritten", causal=True),
    Case("causal_additive", HAND, "causal: additive triu(full(-inf), 1)", stack(CausalAdditive), "rewritten",
         causal=True),
    Case("causal_arange", HAND, "causal: arange comparison, finfo.min fill", stack(CausalArange), "rewritten",
         causal=True),
    Case("padding_additive", HAND, "additive padding mask (1 - m) * -1e4", stack(PaddingAdditive), "rewritten",
         masked=True),
    Case("padding_boolean", HAND, "boolean padding mask, masked_fill(-inf)", stack(PaddingBoolean), "rewritten",
         masked=True),
    Case("in_place", HAND, "scaled and masked in place (/=, masked_fill_), as Falcon does", stack(InPlaceOps),
         "rewritten", masked=True),
    Case("padding_both_sides", HAND, "padded queries and keys masked with finfo.min (DeBERTa: whole rows masked)",
         stack(PaddingBothSides), "rewritten", masked=True),
    Case("padding_where", HAND, "boolean padding mask, where(m, s, full_like(-inf))", stack(PaddingWhere),
         "rewritten", masked=True),
    Case("causal_and_padding", HAND, "causal buffer + additive padding", stack(CausalAndPadding), "rewritten",
         causal=True, masked=True),
    Case("relative_bias", HAND, "learned additive bias (T5/ALiBi-like)", stack(RelativeBias), "rewritten",
         masked=True),
    Case("dropout", HAND, "dropout on the weights (nn.Dropout, F.dropout), eval", stack(Dropout), "rewritten"),
    Case("softmax_float32", HAND, "softmax(s.float()).to(q.dtype)", stack(SoftmaxFloat32), "rewritten"),
    Case("softmax_dtype", HAND, "softmax(s, dtype=float32).type_as(q)", stack(SoftmaxDtypeArgument), "rewritten"),
    Case("gqa_expand", HAND, "grouped-query: repeat_kv (expand + reshape)", stack(GroupedQueryExpand), "rewritten",
         grouped_query=True),
    Case("gqa_repeat_interleave", HAND, "grouped-query: repeat_interleave", stack(GroupedQueryRepeatInterleave),
         "rewritten", grouped_query=True),
    Case("gqa_tiled", HAND, "grouped-query: k.repeat (tiled heads)", stack(GroupedQueryTiled), "rewritten",
         grouped_query=True),
    Case("mqa_broadcast", HAND, "multi-query: one k/v head, broadcast", stack(MultiQueryBroadcast), "rewritten",
         grouped_query=True),
    Case("einsum", HAND, "einsum bhqd,bhkd->bhqk", stack(Einsum), "rewritten"),
    Case("einsum_sequence_major", HAND, "einsum on (b, s, h, d), output (b, s, h, d)", stack(EinsumSequenceMajor),
         "rewritten"),
    Case("bmm_reshape", HAND, "bmm on (b·h, s, d) with reshapes", stack(BmmReshape), "rewritten"),
    Case("baddbmm_mask", HAND, "baddbmm(additive mask, q·scale, kᵀ)", stack(BaddbmmMask), "rewritten", masked=True),
    Case("bmm_view_padding", HAND, "bmm on (b·h, s, d), view to (b, h, s, s) for a padding mask, view back",
         stack(BmmViewPaddingMask), "rewritten", masked=True),
    Case("baddbmm_view_causal", HAND, "baddbmm(beta=0), reshape for a causal mask, flatten back",
         stack(BaddbmmViewCausal), "rewritten", causal=True),
    Case("flattened_softmax", HAND, "softmax on scores flattened over batch·heads, unflatten for v",
         stack(FlattenedSoftmax), "rewritten", masked=True),
    Case("flattened_mask_view", HAND, "bmm with a (b·h, 1, s) mask, view to (b, h, s, s) for the softmax",
         stack(FlattenedMaskedScores), "rewritten", masked=True),
    Case("cross_attention", HAND, "cross-attention, key length ≠ query length", stack(CrossAttention), "rewritten"),
    Case("padding_square", HAND, "square mask from input data (must stay a mask)", stack(PaddingSquare),
         "rewritten", masked=True),
    Case("anti_causal", HAND, "triu buffer (must not become causal)", stack(AntiCausal), "rewritten", masked=True),
    Case("sliding_window", HAND, "sliding window of 40 (must not become causal)", stack(SlidingWindow), "rewritten",
         masked=True),
    Case("already_sdpa", HAND, "F.scaled_dot_product_attention in user code", stack(AlreadySDPA), "already_sdpa",
         causal=True),
    Case("mha", "nn.MultiheadAttention", "need_weights=True (default), weights unused",
         lambda: TorchModules("mha"), "rewritten", masked=True),
    Case("mha_no_weights", "nn.MultiheadAttention", "need_weights=False", lambda: TorchModules("mha_no_weights"),
         "already_sdpa", masked=True),
    Case("transformer_encoder", "nn.TransformerEncoderLayer", "self-attention",
         lambda: TorchModules("encoder"), "already_sdpa", masked=True),
    Case("transformer_decoder", "nn.TransformerDecoderLayer", "self- and cross-attention",
         lambda: TorchModules("decoder"), "already_sdpa", sites=2 * LAYERS, masked=True),
    # left alone, with the reason
    Case("weights_used", "unsafe", "attention weights used again", stack(WeightsUsed), "skipped",
         reason="also used elsewhere"),
    Case("weights_returned", "unsafe", "attention weights returned", WeightsReturned, "skipped", sites=1,
         reason="also used elsewhere"),
    Case("mha_weights_used", "unsafe", "nn.MultiheadAttention weights used", lambda: TorchModules("mha_weights_used"),
         "skipped", reason="uses the attention weights"),
    Case("softmax_over_queries", "unsafe", "softmax over dim -2", stack(SoftmaxOverQueries), "skipped",
         reason="softmax over dim"),
    Case("dropout_active", "unsafe", "dropout(training=True) on the weights", stack(DropoutActive), "skipped",
         reason="active"),
    Case("zero_fill", "unsafe", "masked_fill(m, 0.0)", stack(ZeroFill), "skipped", reason="not a mask"),
    Case("per_key_scale", "unsafe", "scores × per-key weights", stack(PerKeyScale), "skipped", reason="not by one"),
    Case("softmax_over_pairs", "unsafe", "view(b, h, s·s): softmax over (query, key) pairs",
         stack(SoftmaxOverPairs), "skipped", reason="changes the (query, key) dims"),
    Case("heads_into_rows", "unsafe", "view(b, h·s, s): heads merged into the query rows",
         stack(HeadsIntoRows), "skipped", reason="changes the (query, key) dims"),
    Case("soft_capping", "unsafe", "tanh soft-capping of the logits", stack(SoftCapping), "skipped",
         reason="no SDPA equivalent"),
    Case("not_attention", "unsafe", "softmax over classifier logits", NotAttention, "none", sites=0),
]
BY_NAME = {c.name: c for c in CASES}


def inputs(batch: int = 2, seq: int = 32, seed: int = 0) -> list[torch.Tensor]:
    """x and a padding mask with real padding (the last rows end early)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, DIM, generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(1, batch):
        mask[row, seq - 3 * row:] = 0
    return [x, mask]


def build(case: Case, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return case.make().eval()


def io_module(model: nn.Module):
    """The model behind exporter's calling convention (inputs x, mask; every output)."""
    from exporter.modelio import Signature, discover_outputs, make_io_module

    example = inputs()
    outputs = discover_outputs(model, {"x": example[0], "mask": example[1]})
    return make_io_module(model, Signature(("x", "mask"), outputs))


def export_named(module: nn.Module, example: list[torch.Tensor], names=("x", "mask")):
    """Export as the pipeline does: named dims batch 1..8 and sequence 2..64 (Dim.DYNAMIC hints of the same
    range where torch rejects a guard), decomposed keeping SDPA."""
    from torch.export import Dim

    from exporter.targets.exported_program import decomposition_table

    for make in (lambda: (Dim("batch", min=1, max=8), Dim("sequence", min=2, max=64)),
                 lambda: (Dim.DYNAMIC(min=1, max=8), Dim.DYNAMIC(min=2, max=64))):
        batch, seq = make()
        try:
            program = torch.export.export(module, tuple(example), strict=False,
                                          dynamic_shapes={n: {0: batch, 1: seq} for n in names})
            return program.run_decompositions(decomposition_table())
        except Exception as exc:
            if "Constraints violated" not in str(exc):
                raise
    raise AssertionError("export failed with named dims and with Dim.DYNAMIC hints")


def sdpa_nodes(graph) -> list:
    return [n for n in graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
