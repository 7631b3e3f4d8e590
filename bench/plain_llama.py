"""A plain single-file PyTorch Llama, the baseline bench/gpu.py runs beside megazero's Llama (llama-3.2-1b).

The same recipe as bench/plain_gpt.py (fp32 weights under ``torch.autocast`` bf16, ``torch.compile`` of the
whole model, ``torch.optim.AdamW(fused=True)``) over Llama's block: RMSNorm (``F.rms_norm``), rotary positions,
grouped-query attention through ``F.scaled_dot_product_attention(enable_gqa=True)`` (K/V never repeated), a
SwiGLU MLP with its gate and up projections fused into one matrix, no biases, the vocabulary padded to a multiple
of 128 and the output layer tied to the embedding or not, as the model says. Rotary frequencies are plain
(``theta ** (-2i / d)``): Llama 3.1's rope scaling changes their values, not the work. No megazero code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PlainLlama"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in Hugging Face's half-split layout: x [B, heads, S, D], cos/sin [S, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class _Block(nn.Module):
    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int, n_layers: int, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.ffn, self.eps = heads, kv_heads, h // heads, ffn, eps
        kv = kv_heads * self.head_dim
        self.attn_norm, self.mlp_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.qkv = nn.Linear(h, h + 2 * kv, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.gate_up = nn.Linear(h, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, h, bias=False)
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            std = 0.02 / math.sqrt(2 * n_layers) if lin in (self.o, self.down) else 0.02
            nn.init.normal_(lin.weight, std=std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(F.rms_norm(x, (h,), self.attn_norm, self.eps)).split([h, kv, kv], dim=-1)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # bf16 under autocast: q, k keep the projection's dtype
        q = _rotate(q.view(b, s, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(F.rms_norm(x, (h,), self.mlp_norm, self.eps)).split(self.ffn, dim=-1)
        return x + self.down(F.silu(gate) * up)


class PlainLlama(nn.Module):
    """Llama: ``forward(ids [B, S], targets [B, S]) -> mean loss``."""

    def __init__(self, n_layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, seq_len: int, vocab: int,
                 tied: bool = True, rope_theta: float = 500000.0, eps: float = 1e-5) -> None:
        super().__init__()
        self.vocab, self.eps = vocab, eps
        padded = math.ceil(vocab / 128) * 128
        self.wte = nn.Embedding(padded, hidden)
        nn.init.normal_(self.wte.weight, std=0.02)
        self.lm_head = None if tied else nn.Linear(hidden, padded, bias=False)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, std=0.02)
        self.blocks = nn.ModuleList(_Block(hidden, heads, kv_heads, ffn, n_layers, eps) for _ in range(n_layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        d = hidden // heads
        freqs = rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs).repeat(1, 2)  # [S, D]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.wte(ids)
        cos, sin = self.cos[:s], self.sin[:s]
        for block in self.blocks:
            x = block(x, cos, sin)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.eps)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)[..., : self.vocab]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
