"""The dry run (megazero/plan/dryrun.py): the real step on a fake process group and the meta device.

* faithful: tests/test_dryrun_faithful.py (every figure against real gloo runs over a covering set);
* offload: offloaded states are reported as host bytes, outside the device peak;
* a guard for the GPU path: every ZeRO stage and schedule runs this way, and a CPU tensor that reaches a
  collective fails the dry run as it fails under NCCL;
* the headline topology (tp 8 x dp 16, 128 ranks) on a tiny model, and the command line.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.distributed.context import RankGrid
from megazero.plan.dryrun import dry_run, format_report
from megazero.plan.role import PlaceholderHost, rank_roles, run_role
from megazero.plan.roofline import cluster

TOPO = ["--tp", "2", "--pp", "2", "--dp", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]


def _cfg(extra: list[str], world: int = 8):
    return parse_args(TOPO + extra).resolve(world)


@pytest.mark.parametrize("extra", [
    ["--zero-stage", "0", "--pp-schedule", "gpipe"],
    ["--zero-stage", "1", "--pp-schedule", "1f1b"],
    ["--zero-stage", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--num-layers", "4"],
    ["--zero-stage", "3", "--pp-schedule", "1f1b", "--activation-checkpointing", "full"],
    ["--zero-stage", "2", "--sequence-parallel", "--precision", "bf16", "--activation-checkpointing", "selective"],
    ["--model", "llama-tiny", "--zero-stage", "3", "--sequence-parallel", "--precision", "bf16"],  # untied head
    ["--model", "llama-tiny", "--tie-embeddings", "--zero-stage", "1", "--pp-schedule", "interleaved",
     "--virtual-stages", "2"],
])
def test_every_stage_and_schedule_runs_on_meta(extra, tmp_path):
    cfg = _cfg(extra + ["--log-dir", str(tmp_path)])
    report = dry_run(cfg, cluster("h100", 8), str(tmp_path))
    assert report.fits and report.p2p_ok and report.p2p_replay.startswith("replay completed")
    assert {r.pp_rank for r in report.roles} == {0, 1}
    for r in report.roles:
        assert r.volumes.get("dp", 0) > 0 and r.volumes.get("tp", 0) > 0 and r.volumes.get("pp", 0) > 0
        assert r.peak_bytes > 0 and r.host_reads >= 1
    saved = json.loads((tmp_path / "dryrun.json").read_text())
    assert saved["fits"] and len(saved["roles"]) == len(report.roles)


def test_offloaded_states_are_host_bytes_outside_the_device_peak():
    """With --offload-optimizer the master and moments (and the gradient copy Adam reads) are host memory:
    counted in offloaded_bytes, not in the device peak; with --offload-param the parameter shards too. The
    faithfulness against real runs is tests/test_dryrun_faithful.py."""
    grid = RankGrid(8, 2, 2, 2)
    z3 = ["--zero-stage", "3", "--precision", "bf16", "--hidden-size", "256"]  # large enough to shard (> 1e5)
    base = run_role(_cfg(z3), grid, 0)
    opt = run_role(_cfg([*z3, "--offload-optimizer"]), grid, 0)
    both = run_role(_cfg([*z3, "--offload-optimizer", "--offload-param"]), grid, 0)
    s = base.states
    assert s["offloaded_bytes"] == 0 and base.peak_by_category["optimizer_states"] > 0
    states = s["master_params_bytes"] + s["optimizer_states_bytes"]
    grad_copy = s["master_params_bytes"]  # the fp32 host copy of the owned gradients, as large as the master
    assert opt.states["offloaded_bytes"] == states + grad_copy
    assert opt.peak_by_category["master_params"] == opt.peak_by_category["optimizer_states"] == 0
    assert opt.peak_bytes <= base.peak_bytes - states
    shards = both.states["offloaded_bytes"] - opt.states["offloaded_bytes"]
    assert 0 < shards <= s["params_bytes"] and both.peak_by_category["params"] < opt.peak_by_category["params"]
    report = dry_run(_cfg(["--zero-stage", "2", "--offload-optimizer"]), cluster("h100", 8))
    assert report.fits and "host MB" in format_report(report)


def test_the_verdict_takes_the_larger_of_the_step_and_an_evaluation_pass():
    """Each role also runs an evaluation pass (what a run does between steps) under the tracker; at ZeRO-3 it
    gathers block by block, so it peaks below the step (gathering the whole replica, it peaked above it at
    this size); the verdict names the larger of the two peaks and which it was."""
    dp8 = ["--dp", "8", "--global-batch-size", "8", "--micro-batch-size", "1", "--seq-len", "32"]
    cfg = parse_args([*dp8, "--zero-stage", "3", "--precision", "bf16", "--hidden-size", "256", "--num-layers", "8"])
    report = dry_run(cfg.resolve(8), cluster("h100", 8))
    for r in report.roles:
        assert 0 < r.eval_peak_bytes < r.peak_bytes, (r.rank, r.eval_peak_bytes, r.peak_bytes)
    phase, peak, _ = max((r.larger_peak() for r in report.roles), key=lambda x: x[1])
    assert phase == "training step" and f"{peak / 1e9:.2f} GB (training step)" in report.verdict
    role = report.roles[0]
    role.eval_peak_bytes, role.eval_peak_by_category = role.peak_bytes + 1, {"params": role.peak_bytes + 1}
    assert role.larger_peak() == ("evaluation", role.peak_bytes + 1, {"params": role.peak_bytes + 1})


def test_a_cpu_tensor_in_a_collective_fails_the_dry_run(monkeypatch):
    from megazero.train.engine import Engine

    def host_side_tokens(self, micro_batches):  # the bug NCCL refuses: a host tensor in a collective
        n = torch.ones(1, dtype=torch.float64)
        self.ctx.dp_group.all_reduce(n, tag="loss")
        return n[0].to(self.device)

    monkeypatch.setattr(Engine, "_global_tokens", host_side_tokens)
    with pytest.raises(Exception, match="cpu"):
        run_role(_cfg(["--zero-stage", "1"]), RankGrid(8, 2, 2, 2), 0)


def test_headline_topology_and_roles(tmp_path):
    grid = RankGrid(128, 8, 1, 16)
    roles = rank_roles(grid, 50257)
    assert roles == [(0, False), (7, True)]  # 50257 padded to 51200: only the last TP rank holds padding
    cfg = parse_args(["--tp", "8", "--dp", "16", "--zero-stage", "1", "--micro-batch-size", "2",
                      "--global-batch-size", "64", "--num-heads", "8", "--hidden-size", "64",
                      "--vocab-size", "50257"]).resolve(128)
    report = dry_run(cfg, cluster("h100", 8, memory_bytes=1e3), None)
    assert not report.fits and "does not fit: rank" in report.verdict
    assert report.roles[0].volumes["dp"] == report.roles[1].volumes["dp"]


def test_command_line(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "pretrain", "gpt.py"), "--dry-run", *TOPO,
                          "--zero-stage", "2", "--log-dir", str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "verdict: fits" in out.stdout and (tmp_path / "dryrun.json").exists()
    assert out.stderr == "", out.stderr[-2000:]  # no torch warnings before the table ("No backend of type 0")


def test_host_seam_is_scoped_and_tells_meta_storages_apart():
    from megazero.distributed import device_io

    t = torch.tensor([1.5, 2.0])
    assert device_io.read(t) == [1.5, 2.0]
    a = torch.empty(8, device="meta")
    with device_io.use(PlaceholderHost(3.0)) as h:
        assert device_io.read(a[:2]) == [3.0, 3.0] and device_io.read(t) == [1.5, 2.0] and h.reads == 2
    assert isinstance(device_io.current(), device_io.DeviceHost) and not isinstance(device_io.current(), PlaceholderHost)
    with pytest.raises(NotImplementedError):
        device_io.read(a)  # outside the dry run a meta read fails, as it should
    b = torch.empty(8, device="meta")
    assert device_io.storage_key(a) == device_io.storage_key(a[3:]) != device_io.storage_key(b)


def test_a_pipeline_order_that_deadlocks_under_nccl_fails_the_verdict(monkeypatch):
    import megazero.plan.dryrun as dr

    real_replay = dr.replay
    # rank 0 issuing its batched calls in reverse order: its first call waits for a gradient never produced
    monkeypatch.setattr(dr, "replay", lambda calls: real_replay({r: c[::-1] if r == 0 else c
                                                                 for r, c in calls.items()}))
    report = dry_run(_cfg(["--zero-stage", "1"]), cluster("h100", 8))
    assert not report.p2p_ok and not report.fits and "NCCL-order replay" in report.verdict


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_host_same_data_and_adjacent_agree_with_pointers(device):
    from megazero.distributed import device_io

    a = torch.empty(10, device=device)
    b = torch.empty(10, device=device)
    assert device_io.same_data(a[2:], a[2:5]) and not device_io.same_data(a, a[1:]) and not device_io.same_data(a, b)
    assert device_io.adjacent(a[:4], a[4:]) and not device_io.adjacent(a[:4], a[5:]) and not device_io.adjacent(a, b)
    if device == "cpu":  # the same answers as data pointers give
        assert device_io.same_data(a[2:], a[2:5]) == (a[2:].data_ptr() == a[2:5].data_ptr())
        assert device_io.adjacent(a[:4], a[4:]) == (a[:4].data_ptr() + 16 == a[4:].data_ptr())


def test_tied_stages_use_the_bucket_a_real_run_agrees_on():
    """A real run agrees the Ψ-derived ZeRO-2 bucket over the tied-embedding stages (all-reduce min at
    construction), so both hold the same staging pool; on meta there is nothing to read back, and the dry run
    computes the agreed size itself. The stages' own sizes differ here (the first holds the positions)."""
    cfg = parse_args(["--pp", "2", "--dp", "2", "--zero-stage", "2", "--num-layers", "2", "--hidden-size", "1024",
                      "--num-heads", "8", "--vocab-size", "50257", "--seq-len", "32", "--micro-batch-size", "1",
                      "--global-batch-size", "4"]).resolve(4)
    first, last = (run_role(cfg, RankGrid(4, 1, 2, 2), r) for r in (0, 2))
    assert first.states["params_bytes"] != last.states["params_bytes"]
    assert first.states["comm_buffers_bytes"] == last.states["comm_buffers_bytes"] > 0
