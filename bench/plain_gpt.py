"""A plain single-file PyTorch GPT-2, the baseline bench/gpu.py runs beside megazero.

What a careful single-GPU script does (nanoGPT's recipe): fp32 weights under ``torch.autocast`` bf16,
``F.scaled_dot_product_attention`` (flash attention on a GPU), a fused QKV projection, tied embeddings, the
vocabulary padded to a multiple of 128, ``torch.optim.AdamW(fused=True)`` and ``torch.compile`` of the
whole model. No parallelism, no megazero code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainGPT", "make_optimizer"]


class _Block(nn.Module):
    def __init__(self, h: int, heads: int, n_layers: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.attn_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.mlp_proj = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        for lin in (self.qkv, self.attn_proj, self.fc, self.mlp_proj):
            std = 0.02 / math.sqrt(2 * n_layers) if lin in (self.attn_proj, self.mlp_proj) else 0.02
            nn.init.normal_(lin.weight, std=std)
            nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2: ``forward(ids [B, S], targets [B, S]) -> mean loss``."""

    def __init__(self, n_layers: int, hidden: int, heads: int, seq_len: int, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        padded = math.ceil(vocab / 128) * 128
        self.wte = nn.Embedding(padded, hidden)
        self.wpe = nn.Embedding(seq_len, hidden)
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.blocks = nn.ModuleList(_Block(hidden, heads, n_layers) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., : self.vocab]  # tied LM head
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def make_optimizer(model: nn.Module, lr: float = 3e-4, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW with decay on matrices only; torch's fused kernel where the device has one."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), fused=fused)
