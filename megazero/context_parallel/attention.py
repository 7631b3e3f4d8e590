"""The attention call a model makes under context parallelism, and its second mode: all-gather K/V.

:func:`context_parallel_attention` takes this rank's ``q [B, Hq, S_local, D]`` and ``k``, ``v``
``[B, Hkv, S_local, D]`` (two load-balanced chunks, :mod:`.sharding`) and returns the attention output of these
queries over the whole sequence, ``[B, Hq, S_local, D]``, in one of two modes:

* ``"ring"`` (the default, :mod:`.ring`): K/V blocks pass around the CP ring. A rank never holds more than two
  K/V blocks of ``S / cp`` tokens, each hop can overlap the block in hand, and the causal work per step is
  balanced. It is Megatron-Core's default (``cp_comm_type="p2p"``) and the choice that keeps memory at 1/cp
  when K/V are large (many KV heads, long sequences).
* ``"allgather"``: one all-gather of K/V per layer, then ordinary attention of the local queries over the full
  K/V with a mask from their true positions; the backward reduce-scatters dK/dV. This is Llama 3's choice:
  with grouped-query attention K/V are small next to Q, one collective is simpler to overlap and to reason
  about than a ring, and any mask (documents, sliding windows) follows from positions. It holds the whole
  sequence's K/V on every rank and computes the masked-out half of the scores, so it is the second mode.

Both use ``scaled_dot_product_attention``'s semantics (scale ``1/sqrt(D)`` by default, query head ``h`` on K/V
head ``h // (Hq / Hkv)``) and with a CP group of one they are that function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.context_parallel.ring import check_qkv, ring_attention
from megazero.context_parallel.sharding import local_positions, shard_sequence, unshard_sequence
from megazero.distributed.group import Group

__all__ = ["CP_ATTENTION_MODES", "allgather_attention", "context_parallel_attention"]

CP_ATTENTION_MODES = ("ring", "allgather")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Group, *,
                               mode: str = "ring", causal: bool = True, scale: float | None = None,
                               kernel: str = "auto") -> torch.Tensor:
    """This rank's rows of attention over the sequence split across ``cp_group`` (module docstring); ``kernel``
    selects the ring's block kernel (:func:`~megazero.context_parallel.ring.ring_attention`)."""
    if mode == "ring":
        return ring_attention(q, k, v, cp_group, causal=causal, scale=scale, kernel=kernel)
    if mode == "allgather":
        return allgather_attention(q, k, v, cp_group, causal=causal, scale=scale)
    raise ValueError(f"unknown context-parallel attention mode {mode!r}; expected one of {CP_ATTENTION_MODES}")


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group: Group, *, causal: bool = True,
                        scale: float | None = None) -> torch.Tensor:
    """Gather K/V over ``cp_group`` (one collective), attend with the causal mask of the true positions."""
    check_qkv(q, k, v)
    gqa = q.shape[1] != k.shape[1]
    if cp_group.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    k_full, v_full = _GatherSequence.apply(torch.stack([k, v]), cp_group)
    mask = None
    if causal:
        seq_len = k_full.shape[2]
        q_pos = local_positions(seq_len, cp_group.rank, cp_group.size, device=q.device)
        mask = torch.arange(seq_len, device=q.device) <= q_pos.unsqueeze(1)  # [S_local, S]: key at or before query
    return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=scale, enable_gqa=gqa)


class _GatherSequence(torch.autograd.Function):
    """``[2, B, H, S_local, D]`` shards -> ``[2, B, H, S, D]`` in true order; backward: reduce-scatter."""

    SEQ_DIM = 3

    @staticmethod
    def forward(ctx, kv: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        gathered = kv.new_empty((group.size, *kv.shape))
        group.all_gather_into(gathered, kv.contiguous(), tag="kv")
        return unshard_sequence(list(gathered.unbind(0)), _GatherSequence.SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        group = ctx.group
        n = group.size
        by_rank = torch.stack([shard_sequence(grad, r, n, _GatherSequence.SEQ_DIM) for r in range(n)])
        flat = by_rank.reshape(-1)
        m = flat.numel() // n
        mine = flat[group.rank * m: (group.rank + 1) * m]  # in place: this rank's shard of the input
        group.reduce_scatter(mine, flat, tag="kv_grad")
        return mine.view(by_rank.shape[1:]), None
