"""Models autoshard is tested and demonstrated on, built from config with random weights.

``GPT`` is a GPT-2-style decoder (pre-LayerNorm, fused QKV, GELU MLP, causal SDPA, LM head tied
to the token embedding) whose forward
takes token ids and targets and returns the mean cross-entropy loss; ``MLP`` a regression MLP
returning the mean squared error. Both trace to the ops a transformer training step needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    seq: int = 16
    hidden: int = 64
    heads: int = 4
    layers: int = 2

    @classmethod
    def tiny(cls) -> "GPTConfig":
        return cls()

    @classmethod
    def gpt2_small(cls) -> "GPTConfig":
        # GPT-2 124M with the vocabulary padded to a multiple of 64 (50257 -> 50304), as nanoGPT
        # does, so it shards evenly.
        return cls(vocab=50304, seq=1024, hidden=768, heads=12, layers=12)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.heads = c.heads
        self.ln1 = nn.LayerNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, 3 * c.hidden)
        self.proj = nn.Linear(c.hidden, c.hidden)
        self.ln2 = nn.LayerNorm(c.hidden)
        self.fc = nn.Linear(c.hidden, 4 * c.hidden)
        self.out = nn.Linear(4 * c.hidden, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def example_inputs(self, batch: int, device="cpu", generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        idx = torch.randint(0, c.vocab, (batch, c.seq), device=device, generator=generator)
        return idx, torch.randint(0, c.vocab, (batch, c.seq), device=device, generator=generator)


class MLP(nn.Module):
    def __init__(self, dims=(32, 64, 64, 16)):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, y)
