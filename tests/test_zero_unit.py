"""ZeRO building blocks without a process group: sharding table, flat layouts, buckets, loss scaler, storage walk."""

from __future__ import annotations

import pytest
import torch

from megazero.config.schema import LossScaleConfig
from megazero.zero import (
    DynamicLossScaler,
    FlatLayout,
    LossScaleError,
    StaticLossScaler,
    build_buckets,
    make_loss_scaler,
    sharded_state,
)
from megazero.zero.bucketed import storage_bytes


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


def test_build_buckets_fills_each_bucket_and_cuts_tensors() -> None:
    """Buckets are full (a tensor that does not fit is cut and continues in the next), keep the order, and end
    early only at a key change or around an isolated tensor; the size is rounded down to ``multiple``."""
    assert build_buckets([5, 5, 5, 20, 1], 10) == [
        [(0, 0, 5), (1, 0, 5)], [(2, 0, 5), (3, 0, 5)], [(3, 5, 10)], [(3, 15, 5), (4, 0, 1)]]
    assert build_buckets([5, 5, 5], 0) == [[(0, 0, 5), (1, 0, 5), (2, 0, 5)]]
    assert build_buckets([], 10) == []
    assert build_buckets([7, 9], 10, multiple=4) == [[(0, 0, 7), (1, 0, 1)], [(1, 1, 8)]]  # full at 8
    assert build_buckets([3, 12, 3], 5, isolate=[False, True, False]) == [
        [(0, 0, 3)], [(1, 0, 5)], [(1, 5, 5)], [(1, 10, 2)], [(2, 0, 3)]]
    assert build_buckets([3, 3, 3], 100, keys=[0, 0, 1]) == [[(0, 0, 3), (1, 0, 3)], [(2, 0, 3)]]


def test_bucket_numel_auto_and_explicit() -> None:
    """reduce_bucket_size unset: Megatron-LM's max(40M, 1M x dp) at stages 0-1, at stage 2 a staging pool (one
    buffer, max_inflight_buckets with overlap_comm) of at most Ψ/16 elements (at least 2^20 per bucket),
    DeepSpeed's 5e8 at stage 3;
    a value set in the config (CLI or DeepSpeed JSON) is used as given (capped by allgather_bucket_size)."""
    from megazero.config.schema import ZeroConfig

    psi = 50_417_664
    assert ZeroConfig(stage=0).bucket_numel(psi, 4) == ZeroConfig(stage=1).bucket_numel(psi, 4) == 40_000_000
    assert ZeroConfig(stage=1).bucket_numel(psi, 64) == 64_000_000
    assert ZeroConfig(stage=2).bucket_numel(psi, 4) == -(-psi // 16)  # one staging buffer
    assert ZeroConfig(stage=2, overlap_comm=True).bucket_numel(psi, 4) == -(-psi // 32)  # max_inflight_buckets 2
    assert ZeroConfig(stage=2, overlap_comm=True, max_inflight_buckets=4).bucket_numel(4 * psi, 4) == -(-psi // 16)
    assert ZeroConfig(stage=2).bucket_numel(10**6, 4) == 1 << 20
    assert ZeroConfig(stage=2).bucket_numel(10**11, 4) == 40_000_000
    assert ZeroConfig(stage=3).bucket_numel(psi, 4) == 500_000_000
    from megazero.config.cli import parse_args

    assert parse_args([]).resolve(1).zero.reduce_bucket_size is None
    assert parse_args(["--reduce-bucket-size", "3000"]).resolve(1).zero.reduce_bucket_size == 3000
    for stage in range(4):
        assert ZeroConfig(stage=stage, reduce_bucket_size=500_000_000).bucket_numel(psi, 4) == 500_000_000
        assert ZeroConfig(stage=stage, reduce_bucket_size=3000, allgather_bucket_size=2000).bucket_numel(psi, 4) == 2000


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


def test_grad_dtype_choices_and_deepspeed_keys(tmp_path) -> None:
    """--grad-dtype and DeepSpeed's communication_data_type / data_types.grad_accum_dtype choose the dtype
    gradients are accumulated and reduced in: fp32 in bf16 and the model dtype in fp16 by default."""
    import json

    from megazero.config.cli import build_parser, parse_args
    from megazero.config.schema import ConfigError
    from megazero.zero.grads import grad_dtype_for

    assert grad_dtype_for("bf16") == torch.float32 and grad_dtype_for("fp16") == torch.float16
    assert grad_dtype_for("bf16", "model") == torch.bfloat16 and grad_dtype_for("fp16", "fp32") == torch.float32
    assert grad_dtype_for("bf16", "bf16") == torch.bfloat16 and grad_dtype_for("fp32", "model") == torch.float32
    assert parse_args(["--grad-dtype", "model"]).zero.grad_dtype == "model"
    assert "--grad-dtype" in build_parser().format_help() and "--max-skipped-steps" in build_parser().format_help()

    def ds(cfg: dict, *flags: str):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(cfg))
        return parse_args(["--deepspeed-config", str(path), *flags]).resolve(1)

    assert ds({"bf16": {"enabled": True}, "communication_data_type": "fp32"}).zero.grad_dtype == "fp32"
    assert ds({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}).zero.grad_dtype == "bf16"
    with pytest.raises(ConfigError, match="disagree"):
        ds({"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "bf16"}})
    with pytest.raises(ConfigError, match="model dtype"):
        ds({"bf16": {"enabled": True}, "communication_data_type": "fp16"})
    with pytest.raises(ConfigError, match="--max-inflight-buckets"):
        parse_args(["--max-inflight-buckets", "0"]).resolve(1)


def test_split_runs_cuts_at_segment_bounds() -> None:
    from megazero.zero.grads import OwnedGrads, split_runs

    assert split_runs([(0, 10), (12, 15)], [0, 4, 8, 13]) == [(0, 4), (4, 8), (8, 10), (12, 13), (13, 15)]
    g = OwnedGrads([(0, torch.arange(4.0)), (4, torch.arange(3, dtype=torch.bfloat16))])
    g.scale_(0.5)
    assert g.fp32(1, 3).tolist() == [0.5, 1.0] and g.fp32(5, 7).tolist() == [0.5, 1.0]
    assert g.slice(4, 7).dtype == torch.bfloat16 and g.slice(4, 7).tolist() == [0, 1, 2]  # never scaled in 16 bits
    with pytest.raises(ValueError, match="spans two segments"):
        g.slice(2, 6)
