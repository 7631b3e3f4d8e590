"""ZeRO building blocks without a process group: sharding table, flat layouts, buckets, loss scaler, storage walk."""

from __future__ import annotations

import pytest
import torch

from megazero.config import LossScaleConfig
from megazero.zero import (
    DynamicLossScaler,
    FlatLayout,
    LossScaleError,
    StaticLossScaler,
    build_buckets,
    make_loss_scaler,
    sharded_state,
)
from megazero.zero.partition import storage_bytes


def test_sharded_state_per_stage() -> None:
    table = {s: tuple(vars(sharded_state(s)).values()) for s in range(4)}
    assert table == {0: (False, False, False), 1: (True, False, False), 2: (True, True, False),
                     3: (True, True, True)}
    with pytest.raises(ValueError, match="--zero-stage"):
        sharded_state(4)


def test_flat_layout_pads_to_equal_aligned_shards_and_params_straddle() -> None:
    lay = FlatLayout([10, 7, 30], dp_size=4, align=4)
    assert (lay.numel, lay.padded_numel, lay.shard_numel) == (47, 48, 12)
    assert [lay.shard_range(r) for r in range(4)] == [(0, 12), (12, 24), (24, 36), (36, 48)]
    # rank 0 holds all of tensor 0 and the first 2 elements of tensor 1; rank 1 the rest of tensor 1 ...
    p0 = [(pc.index, pc.param_offset, pc.offset, pc.numel) for pc in lay.pieces(*lay.shard_range(0))]
    p1 = [(pc.index, pc.param_offset, pc.offset, pc.numel) for pc in lay.pieces(*lay.shard_range(1))]
    p3 = [(pc.index, pc.param_offset, pc.offset, pc.numel) for pc in lay.pieces(*lay.shard_range(3))]
    assert p0 == [(0, 0, 0, 10), (1, 0, 10, 2)]
    assert p1 == [(1, 2, 0, 5), (2, 0, 5, 7)]
    assert p3 == [(2, 19, 0, 11)]  # the last element of the flat buffer is padding
    # every element of every tensor is owned exactly once
    owned = sorted((pc.index, pc.param_offset + i) for r in range(4) for pc in lay.pieces(*lay.shard_range(r))
                   for i in range(pc.numel))
    assert owned == sorted((i, j) for i, n in enumerate([10, 7, 30]) for j in range(n))
    ts = [torch.arange(n, dtype=torch.float32) + 100 * i for i, n in enumerate([10, 7, 30])]
    flat = lay.flatten(ts)
    assert flat.numel() == 48 and flat[-1] == 0
    assert all(torch.equal(v, t) for v, t in zip(lay.views(flat, [t.shape for t in ts]), ts))
    assert FlatLayout([], 2, 8).padded_numel == 16  # empty layouts still give every rank an aligned slice


def test_build_buckets_bounds_size_and_keeps_order() -> None:
    assert build_buckets([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]
    assert build_buckets([5, 5, 5], 0) == [[0, 1, 2]]
    assert build_buckets([], 10) == []


def test_dynamic_loss_scaler_follows_deepspeed() -> None:
    s = DynamicLossScaler(init_scale=2.0 ** 8, scale_window=3, hysteresis=2, min_scale=32.0)
    trace = []
    for overflow in [False, True, True, False, False, False, True, True, True]:
        s.update(overflow)
        trace.append(s.scale)
    # 1st overflow spends hysteresis, 2nd halves; 3 good steps double and restore hysteresis; then the
    # 1st overflow is absorbed again, the next ones halve
    assert trace == [256, 256, 128, 128, 128, 256, 256, 128, 64]
    s2 = DynamicLossScaler(init_scale=2.0, scale_window=100, hysteresis=1, min_scale=1.0)
    s2.update(True)
    assert s2.scale == 1.0
    with pytest.raises(LossScaleError, match="min_loss_scale"):
        s2.update(True)


def test_make_loss_scaler_by_precision() -> None:
    assert make_loss_scaler("bf16", LossScaleConfig()) is None
    assert make_loss_scaler("fp32", None) is None
    dyn = make_loss_scaler("fp16", LossScaleConfig(initial_scale_power=12))
    assert isinstance(dyn, DynamicLossScaler) and dyn.scale == 4096
    static = make_loss_scaler("fp16", LossScaleConfig(loss_scale=128.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 128.0
    static.update(True)
    assert static.scale == 128.0


def test_storage_bytes_counts_each_storage_once() -> None:
    a = torch.zeros(100)
    b = torch.zeros(10, dtype=torch.bfloat16)
    seen: set[int] = set()
    assert storage_bytes([a[:10], a[50:], b], seen) == 400 + 20
    assert storage_bytes([a], seen) == 0  # already counted
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)
    assert storage_bytes([freed]) == 0
