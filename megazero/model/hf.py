"""Mapping between megazero's GPT and Hugging Face ``transformers.GPT2LMHeadModel``.

megazero's linear weights are ``[out, in]`` (``nn.Linear``); GPT-2's ``Conv1D`` weights are ``[in, out]``, so
the four matrices of a block are transposed. The token embedding is stored once (``lm_head`` is tied to it)
and vocabulary padding is removed.
"""

from __future__ import annotations

from typing import Any

import torch

from megazero.config import ModelConfig

__all__ = ["hf_gpt2_config", "to_hf_gpt2_state_dict"]

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


def to_hf_gpt2_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Convert a full (unsharded) megazero GPT state dict into GPT2LMHeadModel's names and layouts."""
    out: dict[str, torch.Tensor] = {
        "transformer.wte.weight": state["wte.weight"][: cfg.vocab_size],
        "transformer.wpe.weight": state["wpe.weight"],
        "transformer.ln_f.weight": state["ln_f.weight"],
        "transformer.ln_f.bias": state["ln_f.bias"],
    }
    for i in range(cfg.num_layers):
        for ours, theirs in _BLOCK_NAMES.items():
            t = state[f"blocks.{i}.{ours}"]
            out[f"transformer.h.{i}.{theirs}"] = t.t().contiguous() if ours in _TRANSPOSED else t
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out
