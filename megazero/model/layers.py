"""The pieces a model family chooses among: its norm (LayerNorm or RMSNorm) and its positions (learned, in
:class:`~megazero.model.gpt.GPT`, or rotary, here). Norm weights are replicated on every TP rank.

Rotary embeddings follow Hugging Face Llama's layout ("rotate half": feature ``i`` of a head pairs with feature
``i + hd/2``, not with ``i + 1`` as in Meta's original code), so Hugging Face Llama weights need no permutation.
The tables are computed from the positions on the fly, in fp32 as Hugging Face does, then cast to the activations'
dtype: no buffer to materialise, shard or checkpoint, and the same on the meta device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megazero.model.kernels import rms_norm
from megazero.tensor_parallel.layers import replicated_parameter

__all__ = ["LayerNorm", "RMSNorm", "apply_rotary", "rotary_tables"]


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, replicated on every TP rank."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_parameter((hidden_size,), "ones")
        self.bias = replicated_parameter((hidden_size,), "zeros")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm with a weight and no bias, replicated on every TP rank: ``x / rms(x) * weight``.

    Normalised in fp32 and cast back before the weight is applied (``F.rms_norm``, as Hugging Face Llama); the dry
    run's meta tensors save what CUDA's fused kernel saves (:func:`megazero.model.kernels.rms_norm`)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_parameter((hidden_size,), "ones")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight.shape, self.weight, self.eps)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, hd] of the token ``positions`` [S] (any order: a context-parallel rank's chunks), in
    ``dtype``. Frequency ``theta ** (-2i / hd)`` for pair ``i``; angles in fp32, as Hugging Face computes them."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (pairs / head_dim))  # [hd/2]
    angles = torch.outer(positions.float(), inv_freq)  # [S, hd/2]
    angles = torch.cat((angles, angles), dim=-1)  # [S, hd]: feature i and i + hd/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's feature pairs (i, i + hd/2) of ``x`` [B, heads, S, hd] by their position's angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
