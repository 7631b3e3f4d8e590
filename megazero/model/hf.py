"""Mapping between megazero's GPT and Hugging Face ``transformers.GPT2LMHeadModel``.

megazero's linear weights are ``[out, in]`` (``nn.Linear``); GPT-2's ``Conv1D`` weights are ``[in, out]``, so
the four matrices of a block are transposed. The token embedding is stored once (``lm_head`` is tied to it)
and vocabulary padding is removed. :func:`to_hf_gpt2_tensor` converts one tensor at a time (the checkpoint
converter streams with it); :func:`to_hf_gpt2_state_dict` converts a whole state dict.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from megazero.config.schema import ModelConfig

__all__ = ["hf_gpt2_config", "to_hf_gpt2_state_dict", "to_hf_gpt2_tensor"]

_TRANSPOSED = ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")
_BLOCK_NAMES = {
    "ln_1.weight": "ln_1.weight", "ln_1.bias": "ln_1.bias",
    "attn.qkv.weight": "attn.c_attn.weight", "attn.qkv.bias": "attn.c_attn.bias",
    "attn.proj.weight": "attn.c_proj.weight", "attn.proj.bias": "attn.c_proj.bias",
    "ln_2.weight": "ln_2.weight", "ln_2.bias": "ln_2.bias",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.fc.bias": "mlp.c_fc.bias",
    "mlp.proj.weight": "mlp.c_proj.weight", "mlp.proj.bias": "mlp.c_proj.bias",
}


def hf_gpt2_config(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The ``GPT2Config`` keyword arguments of an equivalent Hugging Face model."""
    return dict(
        vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
        n_head=cfg.num_heads, n_inner=cfg.ffn_hidden_size, activation_function="gelu_new",
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.layernorm_eps, initializer_range=cfg.init_std, tie_word_embeddings=True,
        **extra,
    )


def to_hf_gpt2_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    """One full (unsharded) megazero parameter as ``(GPT2LMHeadModel name, tensor in its layout)``."""
    if name == "wte.weight":
        return "transformer.wte.weight", tensor[: cfg.vocab_size]
    if name in ("wpe.weight", "ln_f.weight", "ln_f.bias"):
        return f"transformer.{name}", tensor
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise KeyError(f"{name!r} is not a parameter of megazero's GPT-2")
    ours = m.group(2)
    return (f"transformer.h.{m.group(1)}.{_BLOCK_NAMES[ours]}",
            tensor.t().contiguous() if ours in _TRANSPOSED else tensor)


def to_hf_gpt2_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Convert a full (unsharded) megazero GPT state dict into GPT2LMHeadModel's names and layouts."""
    out = dict(to_hf_gpt2_tensor(name, t, cfg) for name, t in state.items())
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
