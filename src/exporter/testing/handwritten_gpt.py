"""A GPT-style decoder whose attention is written out by hand, the way model code outside libraries spells it.

    python -m exporter.testing.handwritten_gpt OUT_DIR [--size tiny|small|base] [--layout heads|flattened|mixed]
                                                                          # model.safetensors + config.json

Then convert it with the factory:

    exporter convert OUT_DIR --model exporter.testing.handwritten_gpt:build --recipe h100-bf16 \\
        --input input_ids:int64:batch,sequence:0:8192 --input attention_mask:int64:batch,sequence

Each block computes ``softmax(q @ kᵀ / √d + causal + padding) @ v`` with a registered lower-triangular
buffer for the causal mask (``masked_fill`` with -inf), an additive padding mask built from
``attention_mask``, the softmax in float32 cast back, and dropout (p = 0.1, inactive in eval).
Nothing in it calls ``scaled_dot_product_attention``: every site must be found in the traced graph.

``--layout flattened`` spells the same attention with the heads folded into the batch: ``torch.bmm`` on
``(batch·heads, s, d)``, ``.view(batch, heads, s, s)`` for the causal and padding masks, the softmax,
``.view(batch·heads, s, s)`` again and ``torch.bmm`` with v: layout steps on both sides of the softmax.

``--layout mixed`` writes the attention four ways, block ``i`` taking spelling ``i % 4``: ``heads``,
``flattened``, ``baddbmm`` (heads folded into the batch, causal and padding masks summed into one additive mask
that is expanded over the heads and folded with them, ``torch.baddbmm(mask, q, kᵀ, alpha=1/√d)``) and
``einsum`` (``torch.einsum`` on (batch, heads, s, d), the causal mask compared from ``arange`` positions,
``torch.where`` with a finite fill). It is the model a team migrating several code bases ships: every site must
be found, and no artifact may be slower than the rewritten model (issue: masks built per head).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn

SPELLINGS = ("heads", "flattened", "baddbmm", "einsum")  # --layout mixed: block i is written SPELLINGS[i % 4]
SIZES = {  # d_model, heads, layers, vocab, max positions
    "tiny": {"d_model": 64, "heads": 4, "layers": 2, "vocab": 256, "positions": 256},
    "small": {"d_model": 512, "heads": 8, "layers": 4, "vocab": 8192, "positions": 4096},
    "base": {"d_model": 768, "heads": 12, "layers": 12, "vocab": 8192, "positions": 4096},  # GPT-2 small's body
}


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, positions: int, layout: str = "heads"):
        super().__init__()
        self.heads, self.head_dim, self.layout = heads, d_model // heads, layout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(0.1)
        self.register_buffer("tril", torch.tril(torch.ones(positions, positions, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.layout in ("flattened", "baddbmm", "einsum"):
            y = getattr(self, self.layout)(q, k, v, padding)
            return self.out(y.transpose(1, 2).reshape(b, s, d))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        tril: torch.Tensor = self.tril  # type: ignore[assignment]  # a registered buffer
        scores = scores.masked_fill(~tril[:s, :s], float("-inf"))
        scores = scores + padding
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        y = self.dropout(weights) @ v
        return self.out(y.transpose(1, 2).reshape(b, s, d))


    def flattened(self, q, k, v, padding):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        scores = torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d)
        scores = scores.view(b, h, s, s).masked_fill(~self.tril[:s, :s], float("-inf")) + padding
        weights = torch.softmax(scores.float(), dim=-1).to(q.dtype).view(b * h, s, s)
        return torch.bmm(self.dropout(weights), v3).view(b, h, s, d)

    def baddbmm(self, q, k, v, padding):
        b, h, s, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, s, d) for t in (q, k, v))
        causal = torch.zeros(s, s, dtype=q.dtype, device=q.device).masked_fill(~self.tril[:s, :s], float("-inf"))
        mask = (causal + padding).expand(b, h, s, s).reshape(b * h, s, s)
        weights = torch.baddbmm(mask, q3, k3.transpose(1, 2), alpha=1.0 / math.sqrt(d)).softmax(dim=-1)
        return torch.bmm(self.dropout(weights), v3).view(b, h, s, d)

    def einsum(self, q, k, v, padding):
        s, d = q.shape[2], q.shape[3]
        positions = torch.arange(s, device=q.device)
        scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * d ** -0.5
        scores = torch.where(positions[None, :] <= positions[:, None], scores, torch.finfo(q.dtype).min) + padding
        weights = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("bhqk,bhkd->bhqd", self.dropout(weights), v)


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int, positions: int, layout: str = "heads"):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, positions, layout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x, padding):
        x = x + self.attn(self.ln1(x), padding)
        return x + self.mlp(self.ln2(x))


class HandwrittenGPT(nn.Module):
    def __init__(self, d_model: int, heads: int, layers: int, vocab: int, positions: int, layout: str = "heads"):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Embedding(positions, d_model)
        layouts = [SPELLINGS[i % len(SPELLINGS)] if layout == "mixed" else layout for i in range(layers)]
        self.blocks = nn.ModuleList(Block(d_model, heads, positions, layouts[i]) for i in range(layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        s = input_ids.shape[1]
        x = self.embed(input_ids) + self.position(torch.arange(s, device=input_ids.device))
        # additive padding mask over keys: 0 where attended, a large negative where padded
        padding = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for block in self.blocks:
            x = block(x, padding)
        return self.head(self.ln(x))


def build(config: dict | None = None) -> HandwrittenGPT:
    """The factory exporter calls (``--model exporter.testing.handwritten_gpt:build``), with config.json as a
    dict."""
    config = dict(config or SIZES["tiny"])
    return HandwrittenGPT(config["d_model"], config["heads"], config["layers"], config["vocab"], config["positions"],
                          config.get("layout", "heads"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", default="small", choices=sorted(SIZES))
    parser.add_argument("--layout", default="heads", choices=[*SPELLINGS[:2], "mixed"])
    args = parser.parse_args()
    from safetensors.torch import save_model

    torch.manual_seed(0)
    config = {**SIZES[args.size], "layout": args.layout}
    model = build(config).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.out}: {params / 1e6:.1f} M parameters, {config}")


if __name__ == "__main__":
    main()
