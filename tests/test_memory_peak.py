"""The measured peak of a step (megazero/memory.py) and the estimator's prediction of it (megazero/estimate.py).

The tracker is checked against bytes it can be told exactly (allocations, views, storage resizes, frees) and
against an independent tracker, torch's ``MemTracker``, on a step both can follow (one forward). The records
it feeds (metrics.jsonl, W&B) are checked on a short training run.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from megazero.memory import CATEGORIES, PeakMemoryTracker
from megazero.metrics import wandb_series

MB = 1 << 20


def test_tracker_counts_storages_views_resizes_and_frees():
    owned = torch.empty(MB // 4)  # 1 MiB from before the step, registered as a parameter buffer
    stray = torch.empty(MB // 4)  # 1 MiB from before the step, not registered: not counted
    tracker = PeakMemoryTracker("cpu", lambda: {"params": [owned]})
    with tracker:
        a = torch.zeros(MB // 2)  # 2 MiB
        v = a[: MB // 4].view(-1, 4)  # a view: no new bytes
        s = stray + 0  # 1 MiB, new
        del s
        st = a.untyped_storage()
        st.resize_(0)  # ZeRO-3's release: 2 MiB freed without the tensor dying
        b = torch.ones(3 * MB // 4)  # 3 MiB: peak 1 + 3 (a is empty)
        del b
        st.resize_(2 * MB)  # gathered again: 1 + 2
        staging = torch.empty(MB // 8)  # 0.5 MiB, labelled by the owner at the peak below
        tracker.buffers = lambda: {"params": [owned], "comm_buffers": [staging]}
        c = torch.empty(MB // 8)  # peak: 1 + 2 + 0.5 + 0.5 = 4 MiB, not above the 4 MiB before
        d = torch.empty(MB // 4)  # 1 + 2 + 0.5 + 0.5 + 1 = 5 MiB: the peak
        del c, d, v, a, st
    r = tracker.result()
    assert r["peak_bytes"] == 5 * MB
    cats = r["peak_by_category"]
    assert set(cats) == set(CATEGORIES) and sum(cats.values()) == 5 * MB
    assert cats["params"] == MB and cats["comm_buffers"] == MB // 2 and cats["other"] == 3.5 * MB


def _train_step_peak(tracked: str):
    """One warm AdamW step of a small MLP, then a tracked one: (peak total, {category: bytes})."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(32, 128)

    def step():
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    if tracked == "torch":
        from torch.distributed._tools.mem_tracker import MemTracker

        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            step()
        return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"], None

    def buffers():
        return {"params": list(model.parameters()), "grads": [p.grad for p in model.parameters()],
                "optimizer_states": [t for s in opt.state.values() for t in s.values()]}

    tracker = PeakMemoryTracker("cpu", buffers, [model])
    with tracker:
        step()
    return tracker.result()["peak_bytes"], tracker.result()["peak_by_category"]


def test_tracker_agrees_with_torch_memtracker():
    ours, cats = _train_step_peak("ours")
    theirs, _ = _train_step_peak("torch")
    assert ours == theirs
    params = list(nn.Sequential(nn.Linear(128, 256), nn.Linear(256, 128)).parameters())
    n = sum(p.numel() for p in params)
    assert cats["params"] == 4 * n
    assert cats["optimizer_states"] == 8 * n + 4 * len(params)  # AdamW's moments and fp32 step counters


def _short_run(ctx, cache: str, log_dir: str) -> None:
    from megazero.cli import parse_args
    from megazero.trainer import run_training
    from tests.common import SMALL_FLAGS

    cfg = parse_args([*SMALL_FLAGS, "--train-steps", "3", "--log-interval", "2", "--micro-batch-size", "4",
                      "--cache-dir", cache, "--log-dir", log_dir, "--zero-stage", "2"])
    run_training(cfg.resolve(ctx.world_size), ctx)


def test_records_carry_the_measured_peak(data_cache, tmp_path):
    from tests.dist import run_world

    run_world(_short_run, 2, data_cache, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # logged steps: each tracked
    for rec in records:
        for m in rec["memory"]:
            cats = m["peak_by_category"]
            assert set(cats) == set(CATEGORIES) and sum(cats.values()) == m["peak_bytes"]
            states = m["params_bytes"] + m["grads_bytes"] + m["optimizer_states_bytes"]
            assert m["peak_bytes"] > states and cats["activations"] > 0
            assert m["device_step_peak_bytes"] is None  # CPU: no device allocator
        series = wandb_series(rec)
        for r, m in enumerate(rec["memory"]):
            assert series[f"memory/rank{r}/peak_gib"] == m["peak_bytes"] / 2**30
            assert series[f"memory/rank{r}/peak/activations_gib"] == m["peak_by_category"]["activations"] / 2**30
