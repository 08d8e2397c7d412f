"""A small GPT-style language model and the data it learns, shared by
``scripts/gpt.py`` (training with :func:`zerompi.torch.shard`) and the side-by-side
benchmark ``python -m zerompi.bench --model gpt`` (:mod:`zerompi.bench.gpt`).

The model: token and position embeddings, pre-norm blocks (causal self-attention
through ``scaled_dot_product_attention``, a GELU MLP), a final LayerNorm and an
output head tied to the token embedding. :func:`batch` makes sequences that are a
random half written twice, so the second half can be predicted from the first.
Kept importable (and free of MPI) so that every trainer times the same module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.norm2 = torch.nn.LayerNorm(dim)
        self.up = torch.nn.Linear(dim, 4 * dim)
        self.down = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(torch.nn.Module):
    """Token + position embeddings, ``layers`` :class:`Block` s, a final LayerNorm
    and a head tied to the token embedding (one parameter used twice). The head is a
    module that registers the tied weight, not ``x @ tok.weight.T`` in this forward:
    sharded per module, FSDP2 has a parameter whole only inside the forward of a
    module that registers it (zerompi's stage 3 gathers one read elsewhere), and the
    bench compares both on this model."""

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: registered in both modules that use it
        torch.nn.init.normal_(self.tok.weight, std=0.02)
        torch.nn.init.normal_(self.pos, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parameter_count(vocab: int, seq: int, dim: int, layers: int) -> int:
    """Trainable parameters of ``GPT(vocab, seq, dim, layers, heads)`` (any heads):
    embeddings, per block 12 dim² + 13 dim, the final norm's 2 dim."""
    return vocab * dim + seq * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim


def batch(step: int, rank: int, rows: int, seq: int, vocab: int) -> torch.Tensor:
    """This rank's ``rows`` sequences of the step: a random half written twice."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    half = torch.randint(0, vocab, (rows, seq // 2 + 1), generator=g)
    return torch.cat([half, half[:, : seq + 1 - half.shape[1]]], dim=1)  # seq + 1 tokens
