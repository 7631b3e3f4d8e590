"""Mapping between megazero's GPT and Hugging Face ``transformers.GPT2LMHeadModel`` / ``LlamaForCausalLM``.

GPT-2: megazero's linear weights are ``[out, in]`` (``nn.Linear``); GPT-2's ``Conv1D`` weights are ``[in, out]``,
so the four matrices of a block are transposed. The token embedding is stored once (``lm_head`` is tied to it)
and vocabulary padding is removed. :func:`to_hf_gpt2_tensor` converts one tensor at a time (the checkpoint
converter streams with it); :func:`to_hf_gpt2_state_dict` converts a whole state dict.

Llama: every weight is ``[out, in]`` on both sides, no transposes and no permutation (rotary embeddings use
Hugging Face's rotate-half layout). Two megazero weights stack several Hugging Face ones along dim 0
(:func:`llama_parts`): ``attn.qkv`` is ``q_proj; k_proj; v_proj`` and ``mlp.fc`` is ``gate_proj; up_proj``.
Tensor parallelism splits each part alike (a rank's rows of ``attn.qkv`` are its rows of q_proj, then of k_proj,
then of v_proj), so a rank can read its slices of the Hugging Face tensors directly. ``wte`` is
``model.embed_tokens``, ``lm_head`` (untied models) is ``lm_head``; vocabulary padding is removed.

Both families: :func:`hf_parts` describes any parameter as its Hugging Face tensors (name, rows along
megazero's dim 0, transposed or not), which is all a reader of Hugging Face files needs to cut out one TP
shard (:mod:`megazero.checkpoint.hf_import`); :func:`to_hf_tensors` and :func:`hf_config` are the export side
for either family (``tools/convert_checkpoint.py --format hf``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from megazero.config.schema import ModelConfig

__all__ = ["HF_ARCHITECTURES", "HFPart", "from_hf_llama_tensors", "hf_config", "hf_gpt2_config", "hf_llama_config",
           "hf_parts", "llama_parts", "to_hf_gpt2_state_dict", "to_hf_gpt2_tensor", "to_hf_llama_state_dict",
           "to_hf_llama_tensors", "to_hf_tensors"]

#: ``config.json``'s ``model_type`` and ``architectures`` of each family's Hugging Face model
HF_ARCHITECTURES = {"gpt2": ("gpt2", "GPT2LMHeadModel"), "llama": ("llama", "LlamaForCausalLM")}

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


def _gpt2_name(name: str) -> tuple[str, bool]:
    """The GPT2LMHeadModel name of megazero parameter ``name`` and whether it is transposed (Conv1D)."""
    if name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        return f"transformer.{name}", False
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise KeyError(f"{name!r} is not a parameter of megazero's GPT-2")
    return f"transformer.h.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}", m.group(2) in _TRANSPOSED


def to_hf_gpt2_tensor(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> tuple[str, torch.Tensor]:
    """One full (unsharded) megazero parameter as ``(GPT2LMHeadModel name, tensor in its layout)``."""
    if cfg.arch != "gpt2":
        raise ValueError(f"a megazero {cfg.arch} model has no GPT-2 layout; map it with to_hf_llama_tensors")
    hf_name, transposed = _gpt2_name(name)
    if name == "wte.weight":
        tensor = tensor[: cfg.vocab_size]
    return hf_name, tensor.t().contiguous() if transposed else tensor


def to_hf_gpt2_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Convert a full (unsharded) megazero GPT state dict into GPT2LMHeadModel's names and layouts."""
    out = dict(to_hf_gpt2_tensor(name, t, cfg) for name, t in state.items())
    out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


def hf_llama_config(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The ``LlamaConfig`` keyword arguments of an equivalent Hugging Face model: ``max_position_embeddings`` is
    ``cfg.max_positions`` (else the sequence length), and Llama 3.1's rope scaling is written as the published
    config.json files write it, ``rope_scaling`` with ``rope_type: "llama3"``."""
    scaling = {} if cfg.rope_scaling is None else {"rope_scaling": dict(
        rope_type="llama3", factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor, original_max_position_embeddings=cfg.rope_original_max_positions)}
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.max_positions or cfg.seq_len,
        rms_norm_eps=cfg.layernorm_eps, rope_theta=cfg.rope_theta, **scaling, tie_word_embeddings=cfg.tied,
        attention_bias=False, mlp_bias=False, attention_dropout=cfg.dropout, initializer_range=cfg.init_std, **extra,
    )


_LLAMA_BLOCK = {
    "ln_1.weight": ("input_layernorm.weight",),
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attn.proj.weight": ("self_attn.o_proj.weight",),
    "ln_2.weight": ("post_attention_layernorm.weight",),
    "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.proj.weight": ("mlp.down_proj.weight",),
}


def llama_parts(name: str, cfg: ModelConfig) -> list[tuple[str, int | None]]:
    """The ``LlamaForCausalLM`` tensors that make up megazero parameter ``name``, in order along dim 0, each with
    its row count (None: the whole tensor, one part)."""
    if name == "wte.weight":
        return [("model.embed_tokens.weight", cfg.vocab_size)]
    if name == "lm_head.weight":
        return [("lm_head.weight", cfg.vocab_size)]
    if name == "ln_f.weight":
        return [("model.norm.weight", None)]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in _LLAMA_BLOCK:
        raise KeyError(f"{name!r} is not a parameter of megazero's Llama")
    hf = [f"model.layers.{m.group(1)}.{part}" for part in _LLAMA_BLOCK[m.group(2)]]
    q, kv, ffn = cfg.hidden_size, cfg.kv_heads * cfg.head_dim, cfg.ffn_hidden_size
    rows = {"attn.qkv.weight": (q, kv, kv), "mlp.fc.weight": (ffn, ffn)}.get(m.group(2), (None,))
    return list(zip(hf, rows))


def to_hf_llama_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One full (unsharded) megazero parameter as its ``(LlamaForCausalLM name, tensor)`` parts."""
    parts, start = [], 0
    for hf_name, rows in llama_parts(name, cfg):
        parts.append((hf_name, tensor if rows is None else tensor[start: start + rows]))
        start += rows or 0
    return parts


def from_hf_llama_tensors(name: str, hf: Mapping[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """Megazero parameter ``name`` (full, unpadded) from the ``LlamaForCausalLM`` tensors in ``hf``."""
    return torch.cat([hf[hf_name] for hf_name, _ in llama_parts(name, cfg)], dim=0)


def to_hf_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Convert a full (unsharded) megazero Llama state dict into LlamaForCausalLM's names (``lm_head`` is the
    token embedding when tied)."""
    out = dict(part for name, t in state.items() for part in to_hf_llama_tensors(name, t, cfg))
    if cfg.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


@dataclass(frozen=True)
class HFPart:
    """One Hugging Face tensor inside a megazero parameter: ``rows`` rows of the parameter's dim 0 (the
    parameter stacks its parts along dim 0), stored ``[in, out]`` when ``transposed`` (GPT-2's Conv1D)."""

    name: str
    rows: int
    transposed: bool = False


def hf_parts(name: str, cfg: ModelConfig, rows: int) -> list[HFPart]:
    """The Hugging Face tensors that make up megazero parameter ``name``, in order along its dim 0; ``rows`` is
    the parameter's full, unpadded dim-0 size (the row count of a parameter made of one tensor)."""
    if cfg.arch == "llama":
        return [HFPart(n, r if r is not None else rows) for n, r in llama_parts(name, cfg)]
    hf_name, transposed = _gpt2_name(name)
    return [HFPart(hf_name, rows, transposed)]


def to_hf_tensors(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """One full (unsharded) megazero parameter of either family as its ``(Hugging Face name, tensor)`` parts."""
    if cfg.arch == "llama":
        return to_hf_llama_tensors(name, tensor, cfg)
    return [to_hf_gpt2_tensor(name, tensor, cfg)]


def hf_config(cfg: ModelConfig, **extra: Any) -> dict[str, Any]:
    """The ``config.json`` of the equivalent Hugging Face model (``model_type`` and ``architectures`` included),
    written without ``transformers``: its loader fills every key left out with the class default."""
    model_type, architecture = HF_ARCHITECTURES[cfg.arch]
    fields = hf_llama_config(cfg) if cfg.arch == "llama" else hf_gpt2_config(cfg)
    return {"architectures": [architecture], "model_type": model_type, **fields, **extra}
