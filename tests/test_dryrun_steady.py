"""megazero/plan/extrapolate.py: a role's figures from two small micro-batch counts equal a full-count dry run's.

The reference is :func:`megazero.plan.dryrun.run_role` at the full count (itself checked against real gloo runs in
tests/test_dryrun_faithful.py); the fast path must give the same peak (total and by category), states,
ledger entries, host reads and roofline, and must actually have taken the short counts.
"""

from __future__ import annotations

import pytest

from megazero.config.cli import parse_args
from megazero.distributed.context import RankGrid
from megazero.plan.dryrun import dry_run
from megazero.plan.extrapolate import extrapolate, run_role_steady, steady_counts
from megazero.plan.role import rank_roles, run_role
from megazero.plan.roofline import cluster

TINY = ["--hidden-size", "64", "--num-heads", "4", "--seq-len", "16", "--vocab-size", "1000", "--micro-batch-size", "1"]


@pytest.mark.parametrize("extra", [
    ["--zero-stage", "1", "--num-layers", "4"],
    ["--zero-stage", "2", "--num-layers", "4", "--activation-checkpointing", "selective", "--precision", "bf16"],
    ["--zero-stage", "3", "--num-layers", "4", "--precision", "bf16"],
    ["--zero-stage", "2", "--num-layers", "4", "--pp-schedule", "interleaved", "--virtual-stages", "2",
     "--global-batch-size", "32"],
])
def test_steady_state_extrapolation_equals_the_full_count(extra):
    flags = ["--tp", "2", "--pp", "2", "--dp", "2", "--global-batch-size", "20", *TINY, *extra]
    cfg = parse_args(flags).resolve(8, device_type="cuda")
    grid, c = RankGrid(8, 2, 2, 2), cluster("h100", 8)
    m = cfg.training.gradient_accumulation_steps
    counts = steady_counts(cfg.parallel.pp_schedule, 2, m)
    assert counts is not None
    for rank, _pad in rank_roles(grid, 1000):
        fast, full = run_role_steady(cfg, grid, rank, c), run_role(cfg, grid, rank, c)
        assert fast.micro_batches_run == list(counts), "the short counts did not agree: fell back"
        for name in ("peak_bytes", "peak_by_category", "states", "volumes", "breakdown", "host_reads", "steps",
                     "step_seconds"):
            assert getattr(fast, name) == getattr(full, name), (rank, name)


def test_counts_and_integer_extrapolation():
    assert steady_counts("1f1b", 16, 128) == (17, 18) and steady_counts("1f1b", 1, 8) == (2, 3)
    assert steady_counts("gpipe", 4, 128) is None and steady_counts("1f1b", 4, 11) is None
    assert steady_counts("interleaved", 4, 24) == (8, 12)
    assert extrapolate({"a": 10, "b": 7}, {"a": 12, "b": 7, "c": 1}, 3, 4, 10) == {"a": 24, "b": 7, "c": 7}
    assert extrapolate({"a": 10}, {"a": 13}, 4, 6, 9) is None  # 17.5: not a whole number
    assert extrapolate({"a": 10}, {"a": 5}, 1, 2, 9) is None  # negative


def test_gpipe_and_the_replay_run_as_before():
    cfg = parse_args(["--pp", "2", "--dp", "1", "--global-batch-size", "8", *TINY, "--pp-schedule", "gpipe"]
                     ).resolve(2, device_type="cuda")
    rep = dry_run(cfg, cluster("h100", 8))
    assert all(r.micro_batches_run == [8] for r in rep.roles) and rep.p2p_ok
    cfg = parse_args(["--pp", "2", "--dp", "1", "--global-batch-size", "8", *TINY]).resolve(2, device_type="cuda")
    rep = dry_run(cfg, cluster("h100", 8))
    assert all(r.micro_batches_run == [3, 4] for r in rep.roles) and rep.p2p_ok
    assert "at 3 micro-batches" in rep.p2p_replay
