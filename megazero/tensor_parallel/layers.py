"""Tensor-parallel layers and the sharding metadata every parameter carries.

Every parameter created here carries a :class:`ShardSpec` (``param.shard_spec``): its full, unpadded shape,
the dimension split across TP ranks (``None`` when replicated), how many interleaved blocks that dimension
holds (3 for a fused QKV weight, so each rank gets its own heads' q, k and v; their relative sizes when they
differ, as q, k and v do under grouped-query attention), how many consecutive TP ranks share each block's shard
(K/V heads when tp exceeds them: ``replicas``), the padded size of that dimension and how to initialise the full
tensor. Initialisation, checkpoint merging and gradient-norm
accounting all read the spec, so they agree on what a shard is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from megazero.distributed.group import Group
from megazero.tensor_parallel.mappings import (
    all_reduce_async,
    gather_from_tp_region,
    gather_sequence,
    gather_sequence_async,
    reduce_from_tp_region,
    reduce_scatter_sequence_async,
    reduce_scatter_to_sequence_parallel_region,
    sum_shared_rows_grad,
)
from megazero.tensor_parallel.weight_grad import TiedGrad, deferring_store, has_store

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "VocabParallelEmbedding",
    "column_parallel_linear",
    "pad_size",
    "replicated_parameter",
    "sequence_parallel_linear",
    "shard_full_tensor",
    "tp_size_rank",
    "unshard_tensor",
]


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter relates to its full, unsharded tensor."""

    full_shape: tuple[int, ...]
    init: str  # "normal", "zeros" or "ones"
    std: float = 0.0
    partition_dim: int | None = None  # None: replicated on every TP rank
    stride: int = 1  # interleaved blocks along partition_dim (qkv: 3)
    padded_dim_size: int | None = None  # partition_dim size after zero padding (vocab)
    blocks: tuple[int, ...] | None = None  # the blocks' relative sizes (GQA's qkv: heads, kv heads, kv heads)
    # per block, how many consecutive TP ranks hold the same shard of it (None: 1 each). qkv with tp > kv heads:
    # (1, tp / kv, tp / kv), each KV head on tp / kv ranks (Megatron-LM's replication of query groups)
    replicas: tuple[int, ...] | None = None

    def block_replicas(self) -> tuple[int, ...]:
        """:attr:`replicas`, or 1 for each of the ``stride`` blocks."""
        return self.replicas or (1,) * self.stride

    def block_sizes(self, size: int, local: bool = False) -> list[int]:
        """The sizes of the ``stride`` interleaved blocks of a ``size``-long partition dim: the full one, or with
        ``local`` one rank's shard (a block shared by ``r`` ranks is ``r`` times its even share there); equal
        unless ``blocks`` is set."""
        weights = self.blocks or (1,) * self.stride
        if local:
            weights = tuple(w * r for w, r in zip(weights, self.block_replicas()))
        return [size * w // sum(weights) for w in weights]

    def rank_rows(self, tp_rank: int, tp_size: int, size: int | None = None) -> list[tuple[int, int]]:
        """``[lo, hi)`` along ``partition_dim`` of the full ``size``-long (default: padded) dim that TP rank
        ``tp_rank`` holds, block by block: its even share of each block, one share per ``replicas`` ranks."""
        size = size or self.padded_dim_size or self.full_shape[self.partition_dim]
        rows, start = [], 0
        for n, rep in zip(self.block_sizes(size), self.block_replicas()):
            share, i = n // (tp_size // rep), tp_rank // rep
            rows.append((start + i * share, start + (i + 1) * share))
            start += n
        return rows

    def unique_numel(self, local_shape: tuple[int, ...], tp_rank: int) -> int:
        """How many leading elements of TP rank ``tp_rank``'s flattened shard no other rank also holds first:
        all of them, except on ranks that repeat a replicated block (the gradient norm counts each element
        once). Replicated blocks come last along dim 0 (qkv's k and v)."""
        total, reps = math.prod(local_shape), self.block_replicas()
        if self.partition_dim != 0 or all(tp_rank % r == 0 for r in reps):
            return total
        first = next(b for b, r in enumerate(reps) if r > 1)
        if any(r == 1 for r in reps[first:]):
            raise NotImplementedError("replicated blocks must come last along the partition dim")
        rows = sum(self.block_sizes(local_shape[0], local=True)[:first])
        return rows * total // local_shape[0]

    def make_full(self, generator: torch.Generator) -> torch.Tensor:
        """The full, unpadded fp32 tensor this parameter is a slice of, drawn from ``generator``."""
        if self.init == "normal":
            return torch.randn(self.full_shape, generator=generator) * self.std
        if self.init == "zeros":
            return torch.zeros(self.full_shape)
        if self.init == "ones":
            return torch.ones(self.full_shape)
        raise ValueError(f"unknown init {self.init!r}")


VOCAB_PAD_MULTIPLE = 128  # the vocabulary is padded to a multiple of this times the TP size


def tp_size_rank(group: Group | None) -> tuple[int, int]:
    return (1, 0) if group is None else (group.size, group.rank)


def pad_size(size: int, multiple: int) -> int:
    return int(math.ceil(size / multiple) * multiple)


def shard_full_tensor(full: torch.Tensor, spec: ShardSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Zero-pad the full tensor along ``partition_dim`` and keep this rank's slice (blocks interleaved)."""
    if spec.partition_dim is None:
        return full
    dim = spec.partition_dim
    if spec.padded_dim_size is not None and spec.padded_dim_size > full.shape[dim]:
        pad_shape = list(full.shape)
        pad_shape[dim] = spec.padded_dim_size - full.shape[dim]
        full = torch.cat([full, full.new_zeros(pad_shape)], dim=dim)
    rows = spec.rank_rows(tp_rank, tp_size, full.shape[dim])
    return torch.cat([full.narrow(dim, lo, hi - lo) for lo, hi in rows], dim=dim)


def unshard_tensor(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """Inverse of :func:`shard_full_tensor`: the full, unpadded tensor from every TP rank's shard, in rank order
    (a replicated block taken once, from the first rank of each set that shares it)."""
    if spec.partition_dim is None:
        return shards[0]
    dim = spec.partition_dim
    per_rank = [s.split(spec.block_sizes(s.shape[dim], local=True), dim=dim) for s in shards]
    full = torch.cat([torch.cat([blocks[b] for blocks in per_rank[::rep]], dim=dim)
                      for b, rep in enumerate(spec.block_replicas())], dim=dim)
    return full.narrow(dim, 0, spec.full_shape[dim])


class _ColumnLinear(torch.autograd.Function):
    """``F.linear`` at the input of a column-parallel layer, its TP collective overlapped in backward.

    Forward: ``y = x W^T + b`` on ``x`` itself (its gradient is all-reduced over TP in backward), or under
    sequence parallelism on the all-gather of the sequence shard ``x`` [B, S/tp, in] -> [B, S, in] (its gradient
    reduce-scattered back to the shard). Only ``x`` is saved, so under SP the full-sequence input never stays
    alive between forward and backward.

    Backward follows Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``: (SP) start the all-gather
    of ``x`` again; compute the input gradient ``g W``; start its all-reduce (reduce-scatter under SP) without
    waiting; compute the weight gradient ``g^T x`` while it runs; wait last. On a GPU the collective's stream
    runs beside the weight-gradient GEMM; on gloo the order is the same (tests/test_tp_overlap.py checks it).

    In a zero-bubble B pass (:mod:`.weight_grad`) the weight and bias gradients are deferred to W instead, with
    the SP all-gather of ``x`` they need; B keeps the input gradient and its collective. With ``tied`` (the LM
    head of a tied embedding, :class:`~.weight_grad.TiedGrad`) the weight gradient is filed there, not returned.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, tied=None):
        ctx.group, ctx.sequence_parallel, ctx.has_bias, ctx.tied = group, sequence_parallel, bias is not None, tied
        ctx.params = (weight, bias)
        ctx.save_for_backward(x, weight)
        return F.linear(gather_sequence(x, group) if sequence_parallel else x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        store = deferring_store(ctx.params[0])
        gather = gather_sequence_async(x, ctx.group) if ctx.sequence_parallel and store is None else None
        grad_in = grad_out.matmul(weight)  # [B, S, in], a partial sum over this rank's output features
        if ctx.sequence_parallel:
            x = gather.wait() if gather is not None else x
            pending = reduce_scatter_sequence_async(grad_in, ctx.group)
        else:
            pending = all_reduce_async(grad_in, ctx.group)
        needs = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        if store is not None:
            group, sp = ctx.group, ctx.sequence_parallel
            store.defer(ctx.params, lambda: _linear_weight_grads(
                grad_out, gather_sequence(x, group) if sp else x, *needs))
            return pending.wait(), None, None, None, None, None
        grad_w, grad_b = _weight_grads(ctx.tied, grad_out, x, weight, *needs)  # while the collective runs
        return pending.wait(), grad_w, grad_b, None, None, None


def _weight_grads(tied: TiedGrad | None, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  need_w: bool, need_b: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """:func:`_linear_weight_grads`, the weight's filed with ``tied`` instead of returned (the lookup's backward
    returns the table's gradient), as a GEMM run there where its inputs are smaller than the table."""
    if tied is None or not need_w:
        return _linear_weight_grads(grad_out, x, need_w, need_b)
    tied.file(lambda: _linear_weight_grads(grad_out, x, True, False)[0], grad_out.numel() + x.numel(),
              weight.numel())
    return None, _linear_weight_grads(grad_out, x, False, need_b)[1]


def _linear_weight_grads(grad_out: torch.Tensor, x: torch.Tensor, weight: bool, bias: bool
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(``g^T x``, ``sum g``) of a linear from its output gradient [..., out] and input [..., in]."""
    g = grad_out.reshape(-1, grad_out.shape[-1])
    grad_w = g.t().matmul(x.reshape(-1, x.shape[-1])) if weight else None
    return grad_w, (g.sum(0) if bias else None)


class _Linear(torch.autograd.Function):
    """``F.linear`` whose weight (and bias) gradient a zero-bubble B pass defers to W (:mod:`.weight_grad`), or
    which files it with ``tied`` (:class:`~.weight_grad.TiedGrad`); used instead of ``F.linear`` only on ranks
    that run a split backward and for a tied LM head."""

    @staticmethod
    def forward(ctx, x, weight, bias, tied=None):
        ctx.params, ctx.has_bias, ctx.tied = (weight, bias), bias is not None, tied
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_in = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        needs = ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
        store = deferring_store(ctx.params[0])
        if store is not None:
            store.defer(ctx.params, lambda: _linear_weight_grads(grad_out, x, *needs))
            return grad_in, None, None, None
        return grad_in, *_weight_grads(ctx.tied, grad_out, x, weight, *needs), None


class _Embedding(torch.autograd.Function):
    """``F.embedding`` whose table gradient a zero-bubble B pass defers to W (only the ids are kept for it).
    With ``tied`` holding the LM head's gradient of the same table (:class:`~.weight_grad.TiedGrad`), the looked-up
    rows' gradients are added into that tensor in place, which becomes the table's gradient."""

    @staticmethod
    def forward(ctx, ids, weight, tied=None):
        ctx.params, ctx.num_weights, ctx.tied = (weight,), weight.shape[0], tied
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        num_weights = ctx.num_weights

        def grads() -> tuple[torch.Tensor]:
            return (torch.ops.aten.embedding_dense_backward(grad_out, ids, num_weights, -1, False),)

        store = deferring_store(ctx.params[0])
        if store is not None:
            store.defer(ctx.params, grads)
            return None, None, None
        table = ctx.tied.take() if ctx.tied is not None else None
        if not ctx.needs_input_grad[1]:
            return None, None, None
        if table is None:
            return None, grads()[0], None
        rows = grad_out.reshape(-1, grad_out.shape[-1])  # [B*S, H] into [V, H]: no second table, no sum
        return None, table.index_put_((ids.reshape(-1),), rows, accumulate=True), None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tied: TiedGrad | None = None) -> torch.Tensor:
    """``F.linear``, through :class:`_Linear` where the weight belongs to a split-backward rank or is ``tied``."""
    if has_store(weight) or tied is not None:
        return _Linear.apply(x, weight, bias, tied)
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor, tied: TiedGrad | None = None) -> torch.Tensor:
    """``F.embedding``, through :class:`_Embedding` where the table belongs to a split-backward rank or is
    ``tied``."""
    return _Embedding.apply(ids, weight, tied) if has_store(weight) or tied is not None else F.embedding(ids, weight)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group | None,
                           sequence_parallel: bool = False, tied: TiedGrad | None = None) -> torch.Tensor:
    """The linear of a column-parallel layer: [B, S, in] (a sequence shard [B, S/tp, in] under
    ``sequence_parallel``) -> [B, S, out/tp], with the TP collective of :class:`_ColumnLinear`; ``tied``: the
    weight gradient goes there (:class:`~.weight_grad.TiedGrad`)."""
    if group is None or group.size == 1:
        return linear(x, weight, bias, tied)
    return _column_linear(x, weight, bias, group, sequence_parallel, tied)


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             group: Group | None) -> torch.Tensor:
    """A column-parallel linear on a sequence shard [B, S/tp, in] -> [B, S, out/tp] (all-gather inside)."""
    return column_parallel_linear(x, weight, bias, group, sequence_parallel=True)


@torch.compiler.disable
def _column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Group,
                   sequence_parallel: bool, tied: TiedGrad | None = None) -> torch.Tensor:
    """Eager under torch.compile: the collectives inside are not traced (see ``mappings._apply``)."""
    return _ColumnLinear.apply(x, weight, bias, group, sequence_parallel, tied)


def _param(shape: tuple[int, ...], spec: ShardSpec) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape))
    p.shard_spec = spec  # type: ignore[attr-defined]
    return p


def replicated_parameter(shape: tuple[int, ...], init: str, std: float = 0.0) -> nn.Parameter:
    """A parameter that every TP rank holds in full (LayerNorms, position embeddings, row-parallel biases)."""
    return _param(shape, ShardSpec(tuple(shape), init, std))


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size ({d})")
    return n // d


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by output rows: each rank computes its slice of the outputs.

    ``stride`` > 1 interleaves blocks (a fused QKV weight keeps each rank's q, k and v together); ``blocks``
    gives their relative sizes where they differ (grouped-query attention's q, k, v: heads, kv heads, kv heads),
    ``replicas`` how many consecutive ranks share each block's shard (K/V heads fewer than the TP ranks); the
    gradient of those rows is then summed over ``replica_group`` (the ranks sharing this rank's; without it the
    layer runs forward only).
    With ``gather_output`` the full output is all-gathered; otherwise it stays split (feed a row-parallel layer).
    With ``sequence_parallel`` the input arrives as a sequence shard [B, S/tp, in] and is all-gathered along
    the sequence (its gradient reduce-scattered) instead of copied into the TP region.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group | None, *, bias: bool = True,
                 std: float = 0.02, gather_output: bool = False, stride: int = 1,
                 blocks: tuple[int, ...] | None = None, sequence_parallel: bool = False,
                 replicas: tuple[int, ...] | None = None, replica_group: Group | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        tp_size, _ = tp_size_rank(tp_group)
        if blocks is not None:
            stride = len(blocks)
        replicas = replicas if replicas is not None and any(r > 1 for r in replicas) else None
        split = {"partition_dim": 0, "stride": stride, "blocks": blocks, "replicas": replicas}
        spec = ShardSpec((out_features,), "zeros", **split)
        for size, rep in zip(spec.block_sizes(out_features), spec.block_replicas()):
            _divide(size, _divide(tp_size, rep, "ranks sharing a block"), "output features of each interleaved block")
        local_out = sum(n * rep // tp_size for n, rep in zip(spec.block_sizes(out_features), spec.block_replicas()))
        # rows [shared_from:) of this rank's shard are shared with replica_group (replicated blocks come last)
        reps = spec.block_replicas()
        self.shared_from = sum(spec.block_sizes(local_out, local=True)[: reps.index(max(reps))]) if replicas else None
        if replica_group is not None and replica_group.size != max(reps):
            raise ValueError(f"replica_group of {replica_group.size} ranks for blocks shared by {max(reps)}")
        self.replica_group = replica_group if replicas else None
        self.weight = _param((local_out, in_features), ShardSpec((out_features, in_features), "normal", std, **split))
        self.bias = _param((local_out,), ShardSpec((out_features,), "zeros", **split)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.shared_from is not None and torch.is_grad_enabled():  # sum the shared rows' gradient over replicas
            if self.replica_group is None:
                raise RuntimeError("a layer with blocks shared by TP ranks needs replica_group to train")
            weight, bias = (None if t is None else sum_shared_rows_grad(t, self.shared_from, self.replica_group)
                            for t in (weight, bias))
        # [B, S, in] (SP: [B, S/tp, in] -> all-gather) -> [B, S, out/tp]
        y = column_parallel_linear(x, weight, bias, self.tp_group, self.sequence_parallel)
        return gather_from_tp_region(y, self.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by input columns; partial outputs are summed over the TP group.

    The input is expected split along its last dimension (``input_is_parallel``, the output of a
    column-parallel layer). The bias is replicated and added once, after the reduction. With
    ``sequence_parallel`` the partial outputs are reduce-scattered along the sequence instead of all-reduced.
    """

    def __init__(self, in_features: int, out_features: int, tp_group: Group | None, *, bias: bool = True,
                 std: float = 0.02, input_is_parallel: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        if not input_is_parallel:
            raise NotImplementedError("RowParallelLinear expects input_is_parallel=True")
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        tp_size, _ = tp_size_rank(tp_group)
        local_in = _divide(in_features, tp_size, "input features")
        self.weight = _param((out_features, local_in),
                             ShardSpec((out_features, in_features), "normal", std, partition_dim=1))
        self.bias = _param((out_features,), ShardSpec((out_features,), "zeros")) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)  # partial sums [B, S, out]
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)  # [B, S/tp, out]
        else:
            y = reduce_from_tp_region(y, self.tp_group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split across TP ranks.

    Ids outside this rank's range look up zeros and the partial results are summed over the group. The same
    weight serves as the tied LM head through :meth:`logits` (an untied output layer is a second instance used
    through :meth:`logits` only), which returns this rank's vocabulary slice of the logits (padded entries at ``-inf`` so they never reach a softmax, unless ``mask_padding=False``: the loss then skips them itself). With ``sequence_parallel``
    the lookup's partial sums are reduce-scattered along the sequence and the LM head's input is all-gathered.
    A forward pass that runs both uses (the tied GPT-2 on one chunk) passes one :class:`~.weight_grad.TiedGrad` to
    both as ``tied``, so backward makes the table's gradient once.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp_group: Group | None, *, std: float = 0.02,
                 pad_multiple: int = VOCAB_PAD_MULTIPLE, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.sequence_parallel = sequence_parallel
        tp_size, tp_rank = tp_size_rank(tp_group)
        self.vocab_size = vocab_size
        self.padded_vocab_size = pad_size(vocab_size, pad_multiple * tp_size)
        self.local_vocab = self.padded_vocab_size // tp_size
        self.vocab_start = tp_rank * self.local_vocab
        self.weight = _param((self.local_vocab, hidden_size),
                             ShardSpec((vocab_size, hidden_size), "normal", std, partition_dim=0,
                                       padded_dim_size=self.padded_vocab_size))

    def forward(self, ids: torch.Tensor, tied: TiedGrad | None = None) -> torch.Tensor:
        if self.tp_group is None or self.tp_group.size == 1:
            return embedding(ids, self.weight, tied)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = embedding(local.masked_fill(outside, 0), self.weight, tied)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # this rank's rows only: a partial sum
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)  # [B, S/tp, H]
        return reduce_from_tp_region(out, self.tp_group)  # [B, S, H]

    @property
    def local_real_vocab(self) -> int:
        """How many of this rank's ``local_vocab`` columns are real words (the rest is padding)."""
        return min(max(self.vocab_size - self.vocab_start, 0), self.local_vocab)

    def logits(self, x: torch.Tensor, mask_padding: bool = True, tied: TiedGrad | None = None) -> torch.Tensor:
        """This rank's vocabulary slice of ``x @ E^T``, padded entries at ``-inf`` unless ``mask_padding`` is
        False: the loss is told the real vocabulary instead and never reads them, which saves a pass over the
        logits (their values there are ``x @ 0``, finite)."""
        # [B, S, H] (SP: [B, S/tp, H] -> all-gather) -> [B, S, V/tp]
        logits = column_parallel_linear(x, self.weight, None, self.tp_group, self.sequence_parallel, tied)
        n_real = self.local_real_vocab
        if mask_padding and n_real < self.local_vocab:
            mask = torch.arange(self.local_vocab, device=logits.device) >= n_real
            logits = logits.masked_fill(mask, float("-inf"))
        return logits
