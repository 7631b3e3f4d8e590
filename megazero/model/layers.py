"""The pieces a model family chooses among: its norm (LayerNorm or RMSNorm) and its positions (learned, in
:class:`~megazero.model.gpt.GPT`, or rotary, here). Norm weights are replicated on every TP rank.

Rotary embeddings follow Hugging Face Llama's layout ("rotate half": feature ``i`` of a head pairs with feature
``i + hd/2``, not with ``i + 1`` as in Meta's original code), so Hugging Face Llama weights need no permutation.
The tables are computed from the positions on the fly, in fp32 as Hugging Face does, then cast to the activations'
dtype: no buffer to materialise, shard or checkpoint, and the same on the meta device.

Llama 3.1's rope scaling (Hugging Face ``rope_type: "llama3"``; :attr:`ModelConfig.rope_scaling
<megazero.config.schema.ModelConfig.rope_scaling>`) stretches the long wavelengths of a model pre-trained at
``original`` positions so it reads contexts ``factor`` times longer: a pair whose wavelength ``2π / freq`` exceeds
``original / low_freq_factor`` tokens turns ``factor`` times slower, one shorter than ``original /
high_freq_factor`` keeps its frequency, and those between blend the two linearly in ``original / wavelength``.
The inverse frequencies are computed with the same fp32 operations as ``transformers``' ``llama3`` rope, so the
logits equal ``LlamaForCausalLM``'s; the attention scale is unchanged (``llama3`` has no attention factor).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazero.model.kernels import rms_norm
from megazero.tensor_parallel.layers import replicated_parameter

__all__ = ["LayerNorm", "RMSNorm", "apply_rotary", "rotary_frequencies", "rotary_tables"]


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


def rotary_frequencies(head_dim: int, theta: float, scaling: tuple[float, float, float, int] | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
    """The fp32 inverse frequencies [hd/2] of the rotary pairs: ``theta ** (-2i / hd)`` for pair ``i``, rescaled
    by Llama 3.1's rope scaling when ``scaling`` = ``(factor, low_freq_factor, high_freq_factor, original)``
    (module docstring)."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / (theta ** (pairs / head_dim))  # [hd/2]
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * math.pi / inv_freq
    blend = (original / wavelength - low) / (high - low)  # 0 at original / low tokens, 1 at original / high
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, blended)  # long ones: factor x slower
    return torch.where(wavelength < original / high, inv_freq, scaled)  # short ones: unchanged


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                  scaling: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, hd] of the token ``positions`` [S] (any order: a context-parallel rank's chunks), in
    ``dtype``, at :func:`rotary_frequencies` (``scaling``: Llama 3.1's); angles in fp32, as Hugging Face
    computes them."""
    inv_freq = rotary_frequencies(head_dim, theta, scaling, positions.device)  # [hd/2]
    angles = torch.outer(positions.float(), inv_freq)  # [S, hd/2]
    angles = torch.cat((angles, angles), dim=-1)  # [S, hd]: feature i and i + hd/2 share an angle
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's feature pairs (i, i + hd/2) of ``x`` [B, heads, S, hd] by their position's angle."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
