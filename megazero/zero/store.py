"""Where the model's parameters and gradients live under ZeRO: the store each stage builds and the bucket size
it is cut in.

Stages 0-2 keep the parameters whole in flat buckets (:class:`~megazero.zero.bucketed.BucketedParams`); stage 3
keeps only shards and gathers one unit at a time (:class:`~megazero.zero.stage3.params.Stage3Params`). Either
store installs the gradient hooks that accumulate and reduce, materialises a model built on the meta device
(one parameter, or one gather unit, at a time from ``param_init``) and hands the optimizer this rank's owned
segments. A model's hooks and buffers belong to one store, so a parameter is claimed once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from megazero.config.schema import ZeroConfig
from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.zero.bucketed import BucketedParams, sharded_state
from megazero.zero.flat import OwnedSegment
from megazero.zero.qgz import QuantizedReduce
from megazero.zero.stage3.params import Stage3Params

__all__ = ["build_store", "claim", "gathered", "local_tied_pairs", "walk"]


def claim(params: Sequence[nn.Parameter]) -> None:
    """Mark ``params`` as wrapped by one optimizer; raise if another already holds any of them."""
    if any(getattr(p, "_zero_wrapped", False) for p in params):
        raise ValueError("this model is already wrapped by a ZeroOptimizer (its gradient hooks and flat "
                         "buffers belong to it); build a fresh model for a new optimizer")
    for p in params:
        p._zero_wrapped = True


def _bucket_numel(zero_cfg: ZeroConfig, params: Sequence[nn.Parameter], dp_group: Group,
                  tied_group: Group | None) -> int:
    """:meth:`ZeroConfig.bucket_numel` for this rank's Ψ; when derived, the smallest over ``tied_group`` (the
    tied copies' stages hold different Ψ, and both copies of the tied embedding must be cut alike)."""
    bucket = zero_cfg.bucket_numel(sum(p.numel() for p in params), dp_group.size)
    if (zero_cfg.reduce_bucket_size is None and tied_group is not None and tied_group.size > 1
            and tied_group.device.type != "meta"):  # the dry run (meta) keeps its own: nothing to read back
        agreed = torch.tensor([bucket], dtype=torch.int64, device=tied_group.device)
        tied_group.all_reduce(agreed, op="min", tag="other")
        bucket = int(device_io.read(agreed)[0])
    return bucket


def build_store(model: nn.Module, params: Sequence[nn.Parameter], zero_cfg: ZeroConfig, dtype: torch.dtype,
                grad_dtype: torch.dtype, dp_group: Group, *, align: int, tied_params: Sequence[nn.Parameter],
                tied_group: Group | None, param_init: Callable[[nn.Parameter], torch.Tensor] | None,
                device: torch.device | None, reduce_group: Group | None = None) -> BucketedParams | Stage3Params:
    """The store of ``model``'s trainable ``params`` at ``zero_cfg.stage``, in ``dtype``, over ``dp_group``.

    ``tied_params`` get buckets (units) of their own, so each copy is partitioned alike; frozen parameters just
    follow the compute dtype. ``reduce_group`` (the DP ranks over a second communicator) carries stage 3's
    gradient reductions, so on NCCL they run on a stream of their own beside the prefetch gathers; stages 0-2
    gather nothing during backward and reduce over ``dp_group``.
    """
    sharded = sharded_state(zero_cfg.stage)
    # the model chunks of an interleaved pipeline: a backward reduces only the chunk that ran
    chunks = [[p for p in c.parameters() if p.requires_grad] for c in model] \
        if isinstance(model, nn.ModuleList) else None
    bucket = _bucket_numel(zero_cfg, params, dp_group, tied_group)
    if zero_cfg.stage == 3:
        store = Stage3Params(model, dtype, dp_group, replace(zero_cfg, reduce_bucket_size=bucket),
                             align=align, isolate=tied_params,
                             offload_param=zero_cfg.offload_param == "cpu", param_init=param_init,
                             device=device, grad_dtype=grad_dtype, reduce_group=reduce_group)
    else:
        store = BucketedParams(
            params, dtype, dp_group, shard_optimizer=sharded.optimizer_states,
            shard_gradients=sharded.gradients, bucket_numel=bucket, align=align,
            overlap_comm=zero_cfg.overlap_comm, reduce_scatter=zero_cfg.reduce_scatter, isolate=tied_params,
            grad_dtype=grad_dtype, max_inflight=zero_cfg.max_inflight_buckets, groups=chunks,
            param_init=param_init, device=device, qgz=QuantizedReduce.from_config(zero_cfg, dp_group))  # ZeRO++
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)
    return store


@contextmanager
def gathered(store: BucketedParams | Stage3Params) -> Iterator[None]:
    """Every parameter holds its whole value inside the block: a collective at stage 3, free otherwise."""
    gather = getattr(store, "gather_all", None)
    if gather is None:
        yield
        return
    gather()
    try:
        yield
    finally:
        store.release_all()


def walk(store: BucketedParams | Stage3Params, params: Sequence[nn.Parameter] | None = None
         ) -> Iterator[list[nn.Parameter]]:
    """Lists of the store's parameters (only ``params``, when given), each list holding its whole values until the
    caller moves on: one list at stages 0-2; at stage 3 one gather unit at a time, never the whole model (a
    collective over the DP group, :meth:`Stage3Params.walk <megazero.zero.stage3.params.Stage3Params.walk>`)."""
    if isinstance(store, Stage3Params):
        yield from store.walk(params)
        return
    wanted = None if params is None else {id(p) for p in params}
    yield [p for p in reversed(store.params) if wanted is None or id(p) in wanted]


def local_tied_pairs(segments: Sequence[OwnedSegment], tied: Sequence[nn.Parameter]
                     ) -> list[tuple[OwnedSegment, OwnedSegment]]:
    """The owned segments of two tied copies held by one rank, paired element for element (empty unless
    ``tied`` holds two parameters)."""
    if len(tied) != 2:
        return []
    first, second = ([s for s in segments if any(p is t for p, _, _ in s.pieces)] for t in tied)
    pairs = list(zip(first, second))
    if len(first) != len(second) or any([pc[1:] for pc in a.pieces] != [pc[1:] for pc in b.pieces]
                                         for a, b in pairs):
        raise ValueError("the two tied embedding copies on this rank are not partitioned alike")
    return pairs
