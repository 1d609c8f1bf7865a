"""A small GPT (decoder-only transformer) and a deterministic, resumable stream of training data."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = "0123456789+=;"
STOI = {c: i for i, c in enumerate(VOCAB)}


def make_corpus(n_examples: int, seed: int) -> torch.Tensor:
    """Generated text of additions, ``"17+25=42;"``: learnable, and shipped with no data files."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 100, (n_examples,), generator=g)
    b = torch.randint(0, 100, (n_examples,), generator=g)
    text = "".join(f"{x}+{y}={x + y};" for x, y in zip(a.tolist(), b.tolist()))
    return torch.tensor([STOI[c] for c in text], dtype=torch.long)


class DataStream:
    """Random windows of the corpus, in an order fixed by (seed, epoch); resumable via state_dict.

    This is the "data position" of the training state: restoring it makes the resumed run see exactly
    the batches the interrupted run would have seen.
    """

    def __init__(self, corpus: torch.Tensor, block: int, batch: int, seed: int) -> None:
        self.corpus, self.block, self.batch, self.seed = corpus, block, batch, seed
        self.n_windows = (len(corpus) - block - 1) // block
        self.epoch = 0
        self.position = 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.n_windows, generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.position + self.batch > self.n_windows:
            self.epoch += 1
            self.position = 0
            self._order = self._permutation()
        idx = self._order[self.position : self.position + self.batch] * self.block
        self.position += self.batch
        offsets = torch.arange(self.block + 1)
        windows = self.corpus[idx[:, None] + offsets[None, :]]
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._permutation()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, a language-model head tied to the embedding."""

    mask: torch.Tensor

    def __init__(
        self,
        vocab: int = len(VOCAB),
        block: int = 32,
        dim: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights: stored once in the checkpoint
        self.register_buffer("mask", torch.triu(torch.full((block, block), float("-inf")), diagonal=1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t)))
        for blk in self.blocks:
            x = blk(x, self.mask[:t, :t])
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
