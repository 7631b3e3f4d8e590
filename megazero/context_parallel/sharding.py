"""Load-balanced sharding of one sample's sequence over the CP group, and each local token's true position.

The sequence is cut into ``2 * cp_size`` equal chunks and CP rank ``i`` holds chunks ``i`` and
``2 * cp_size - 1 - i``, in that order (Megatron-Core's layout). Under a causal mask a query at position p
attends to p + 1 keys, so contiguous halves would leave the last rank with most of the work; pairing an early
chunk with its mirror gives every rank the same number of query-key pairs, ``c^2 (2 cp - 1) + c (c + 1)`` for
chunks of ``c`` tokens, and the same number of attention blocks per ring step (:mod:`.ring`).

A rank's two chunks are concatenated in sequence order (chunk ``i`` first), so its local tokens are in
ascending true position and :func:`local_positions` is what learned position embeddings, rotary tables and
the causal mask must use instead of ``arange(S_local)``. With ``cp_size = 1`` every function is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megazero.distributed.group import Group

__all__ = ["chunk_ids", "gather_sequence", "local_positions", "shard_sequence", "unshard_sequence"]


def chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp_size``) that CP rank ``cp_rank`` holds, in local order."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside a CP group of {cp_size}")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _check_divisible(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp_size}: context parallelism cuts the "
            f"sequence into 2 x cp equal chunks; choose --seq-len as a multiple of {2 * cp_size} or change --cp")


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` (e.g. tokens ``[B, S]`` or hidden states ``[B, S, H]``): chunks ``cp_rank`` and
    ``2 cp - 1 - cp_rank`` of dimension ``seq_dim``, concatenated. Differentiable (slices and a concat)."""
    if cp_size == 1:
        return x
    _check_divisible(x.shape[seq_dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=seq_dim)
    first, second = chunk_ids(cp_rank, cp_size)
    return torch.cat([chunks[first], chunks[second]], dim=seq_dim)


def unshard_sequence(shards: Sequence[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """The full sequence from every CP rank's shard, given in CP-rank order (the inverse of
    :func:`shard_sequence` over all ranks)."""
    cp_size = len(shards)
    if cp_size == 1:
        return shards[0]
    pieces: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, shard in enumerate(shards):
        first, second = chunk_ids(rank, cp_size)
        pieces[first], pieces[second] = shard.chunk(2, dim=seq_dim)
    return torch.cat(pieces, dim=seq_dim)  # type: ignore[arg-type]


def gather_sequence(x: torch.Tensor, cp_group: Group, seq_dim: int = 1) -> torch.Tensor:
    """All-gather every rank's shard over the CP group and reassemble the full sequence (not differentiable;
    for checks, evaluation and logging, not for the training path)."""
    if cp_group.size == 1:
        return x
    return unshard_sequence(cp_group.all_gather_list(x.detach().contiguous(), tag="act"), seq_dim)


def local_positions(seq_len: int, cp_rank: int, cp_size: int,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The true positions (int64, ``[seq_len / cp_size]``) of this rank's tokens in a sequence of ``seq_len``."""
    _check_divisible(seq_len, cp_size)
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, seq_dim=0)
