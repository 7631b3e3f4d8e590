"""The measured peak of a step (megazero/observe/memory.py) and the estimator's prediction of it (megazero/plan/estimate.py).

The tracker is checked against bytes it can be told exactly (allocations, views, storage resizes, frees) and
against an independent tracker, torch's ``MemTracker``, on a step both can follow (one forward). The records
it feeds (metrics.jsonl, W&B) are checked on a short training run.
"""

from __future__ import annotations

import json

import torch
from torch import nn

from megazero.observe.memory import CATEGORIES, PeakMemoryTracker
from megazero.observe.metrics import wandb_series

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


def test_tracker_follows_memory_swapped_between_storages():
    """ZeRO-3 lends a slot's memory to a unit's storage and takes it back by swapping data pointers, which the
    dispatcher does not see: the tracker follows both storages, so the bytes count once, under the borrower."""
    slot = torch.empty(MB // 4)  # 1 MiB from before the step: an idle slot (communication buffer)
    unit = torch.empty(MB // 4)
    unit.untyped_storage().resize_(0)  # a released unit: no memory
    tracker = PeakMemoryTracker("cpu", lambda: {"comm_buffers": [slot], "params": [unit]})
    with tracker:
        unit.untyped_storage()._swap_data_ptr_(slot.untyped_storage())  # gathered into the slot
        x = unit + 1  # 1 MiB: the peak, 2 MiB
        del x
        unit.untyped_storage()._swap_data_ptr_(slot.untyped_storage())  # released: back to the slot
    r = tracker.result()
    assert r["peak_bytes"] == 2 * MB
    assert r["peak_by_category"]["params"] == MB and r["peak_by_category"]["comm_buffers"] == 0, r


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
    from megazero.config.cli import parse_args
    from megazero.train.loop import run_training
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


# A pairwise covering array over ZeRO stage x tp x pp x recomputation x optimizer offload: every pair of
# settings appears in at least one run (offload needs stage >= 1). One world per (tp, pp), four runs each.
COVERING = {  # (tp, pp): [(stage, recompute, offload), ...]
    (1, 1): [(0, "none", False), (1, "full", True), (2, "full", False), (3, "none", True)],
    (2, 1): [(0, "full", False), (1, "none", False), (2, "none", True), (3, "full", True)],
    (1, 2): [(0, "none", False), (1, "full", True), (2, "none", True), (3, "full", False)],
    (2, 2): [(0, "full", False), (1, "none", True), (2, "full", False), (3, "none", False)],
}
PEAK_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32",
              "--vocab-size", "512", "--micro-batch-size", "2"]


def _measured_peaks(ctx, runs, cache: str) -> list[tuple]:
    from dataclasses import replace

    from megazero.config.cli import parse_args
    from megazero.observe.memory import zero_buffers
    from megazero.train.engine import Engine

    out = []
    for stage, recompute, offload in runs:
        flags = [*PEAK_FLAGS, "--tp", str(ctx.tp_size), "--pp", str(ctx.pp_size), "--zero-stage", str(stage),
                 "--activation-checkpointing", recompute, "--global-batch-size", str(4 * ctx.dp_size),
                 "--cache-dir", cache, *(["--offload-optimizer"] if offload else [])]
        cfg = parse_args(flags).resolve(ctx.world_size)
        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=1000))
        engine = Engine(cfg, ctx)
        g = torch.Generator().manual_seed(0)
        batch = [(torch.randint(0, 512, (2, 32), generator=g), torch.randint(0, 512, (2, 32), generator=g))
                 for _ in range(cfg.training.gradient_accumulation_steps)]
        engine.train_step(batch)  # buffers that persist between steps exist from here on
        tracker = PeakMemoryTracker("cpu", lambda e=engine: zero_buffers(e.optimizer), engine.chunks)
        with tracker:
            engine.train_step(batch)
        out.append((stage, recompute, offload, ctx.rank, ctx.pp_rank, cfg, tracker.result()))
    return out


def test_measured_peak_matches_the_estimate(data_cache):
    """Every run of the covering array: the measured peak is at most 5% above the estimate, and at most 5% (or
    one gradient buffer e·Ψ_r, where staging fills only as activations are freed) below it."""
    from megazero.plan.estimate import peak_bytes, rank_parameter_numels
    from tests.dist import run_world

    lines, bad = [], 0
    for (tp, pp), runs in COVERING.items():
        for rank_result in run_world(_measured_peaks, 2 * tp * pp, runs, data_cache, tp=tp, pp=pp, timeout=300):
            for stage, recompute, offload, rank, pp_rank, cfg, got in rank_result:
                z, t = cfg.zero, cfg.training
                est = peak_bytes(cfg.model, t.micro_batch_size, stage=stage, dp_size=2, tp_size=tp, pp_size=pp,
                                 pp_rank=pp_rank, precision=t.precision, checkpointing=recompute,
                                 micro_batches=t.gradient_accumulation_steps, offload_optimizer=offload,
                                 host_counts=True, persistence_threshold=z.stage3_param_persistence_threshold,
                                 bucket_numel=None if z.reduce_bucket_size is None else min(
                                     z.reduce_bucket_size, z.allgather_bucket_size), max_inflight=z.max_inflight_buckets,
                                 overlap_comm=z.overlap_comm, fused_attention=True, mask_bytes=4)
                diff = got["peak_bytes"] - est.total
                # the estimate adds the staging buckets to the stash at the start of backward; where they
                # fill only as activations are freed (the last pipeline stage), it overestimates by up to one
                # gradient buffer, e·Ψ_r
                margin = max(0.05 * est.total, 4 * sum(rank_parameter_numels(cfg.model, tp, pp, pp_rank).values()))
                ok = -margin <= diff <= 0.05 * est.total
                bad += not ok
                lines.append(f"tp{tp} pp{pp} r{rank} stage {stage} {recompute:4s} offload {offload!s:5s} measured "
                             f"{got['peak_bytes']:>9,d} estimate {est.total:>11,.0f} ({diff / est.total:+.1%})"
                             + ("" if ok else "  <-- outside"))
    print("\n" + "\n".join(lines))
    assert not bad, "\n".join(lines)


def _default_bucket_peak(ctx, stage: int) -> tuple[dict, int]:
    """A tracked step at ``stage`` with the default buckets on a 36M-parameter MLP (above the 2^20-element
    bucket floor, so stage 2's staging pool follows Ψ/16): the peak by category and the rank's Ψ."""
    from megazero.config.schema import OptimizerConfig, ZeroConfig
    from megazero.observe.memory import zero_buffers
    from megazero.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3000, 3000, bias=False) for _ in range(4)])
    opt = ZeroOptimizer(model, ZeroConfig(stage=stage), OptimizerConfig(), ctx.dp_group)
    x = torch.randn(2, 3000)

    def step():
        opt.zero_grad()
        opt.backward(model(x).square().mean())
        opt.step(1e-3)

    step()
    tracker = PeakMemoryTracker("cpu", lambda: zero_buffers(opt), [model])
    with tracker:
        step()
    return tracker.result(), sum(p.numel() for p in model.parameters())


def _default_bucket_peaks(ctx) -> dict:
    return {stage: _default_bucket_peak(ctx, stage) for stage in (1, 2)}


def test_stage2_default_buckets_keep_its_peak_below_stage1():
    """Issue 13 item 6 at a size where the default bucket matters (dp 2, fp32, Ψ = 36M): stage 2's gradient
    staging at the peak is at most Ψ/16 elements, its model-state part (params, grads, optimizer states, staging)
    within 10% of the formula 4Ψ + 12Ψ/Nd, and its peak below stage 1's."""
    from tests.dist import run_world

    for got in run_world(_default_bucket_peaks, 2, timeout=300):
        (s1, psi), (s2, _) = got[1], got[2]
        comm = s2["peak_by_category"]["comm_buffers"]
        assert 0 < comm <= 4 * psi / 16, (comm, psi)
        states = sum(s2["peak_by_category"][k] for k in ("params", "grads", "master_params", "optimizer_states"))
        formula = 4 * psi + 12 * psi / 2
        assert abs(states + comm - formula) <= 0.1 * formula, (states, comm, formula)
        assert s2["peak_bytes"] < s1["peak_bytes"], (s2["peak_bytes"], s1["peak_bytes"])


# A tied GPT whose table outweighs its blocks, as GPT-2 124M's does: 32 tokens are under the TiedGrad rule's bound
# (b·s·(V + h) < V·h: the head's weight-gradient GEMM waits for the lookup's backward), 256 above it
TIED_HEAD = dict(num_layers=2, hidden_size=256, num_heads=4, seq_len=32, vocab_size=8192)


def _tied_head_peaks(ctx) -> dict:
    """Tracked peaks of a ZeroOptimizer step (fp32, persistence threshold 1000) by (stage, micro-batch)."""
    from megazero.config.schema import ModelConfig, OptimizerConfig, ZeroConfig
    from megazero.model import GPT, init_parameters
    from megazero.observe.memory import zero_buffers
    from megazero.zero import ZeroOptimizer

    cfg, out = ModelConfig(**TIED_HEAD), {}
    for stage, mb in ((3, 1), (3, 8), (2, 1), (2, 8)):
        model = GPT(cfg)
        init_parameters(model, 0)
        opt = ZeroOptimizer(model, ZeroConfig(stage=stage, stage3_param_persistence_threshold=1000),
                            OptimizerConfig(), ctx.dp_group)
        g = torch.Generator().manual_seed(ctx.rank)
        _tied_head_step(model, opt, g, mb)
        tracker = PeakMemoryTracker("cpu", lambda o=opt: zero_buffers(o), [model])
        with tracker:
            _tied_head_step(model, opt, g, mb)
        out[stage, mb] = tracker.result()["peak_bytes"]
    return out


def _tied_head_step(model, opt, g: torch.Generator, mb: int) -> None:
    x, y = (torch.randint(0, TIED_HEAD["vocab_size"], (mb, TIED_HEAD["seq_len"]), generator=g) for _ in range(2))
    opt.zero_grad()
    opt.backward(model(x, y).mean())
    opt.step(1e-3)


def test_estimate_follows_where_the_tied_head_makes_its_gradient(monkeypatch):
    """TiedGrad's rule on a tied GPT at dp 4: with 32 tokens the head's GEMM waits for the lookup and no table
    gradient exists through the blocks' backward; with 256 the head makes it at once. The stage-3 estimate is
    within 2% of the tracked peak in both regimes, and the same estimate with the rule turned round
    (``head_gemm_deferred`` negated) misses by over 10% in both (measured -0.8% / +0.0%; turned round +28.9% /
    -16.2%). Stage 2 does not depend on the rule (its fresh-gradient term is the filed gradients' bound, the
    largest parameter's size): within 3% above in both."""
    from megazero.config.schema import ModelConfig
    from megazero.plan import estimate
    from tests.dist import run_world

    cfg = ModelConfig(**TIED_HEAD)
    assert estimate.head_gemm_deferred(cfg, 1) and not estimate.head_gemm_deferred(cfg, 8)
    measured = run_world(_tied_head_peaks, 4, timeout=300)
    rule = estimate.head_gemm_deferred

    def est(stage: int, mb: int) -> float:
        return estimate.peak_bytes(cfg, mb, stage=stage, dp_size=4, precision="fp32", persistence_threshold=1000,
                                   host_counts=True, mask_bytes=4).total

    lines = []
    for (stage, mb), got in measured[0].items():
        assert all(m[stage, mb] == got for m in measured), [m[stage, mb] for m in measured]
        right = est(stage, mb) / got - 1
        with monkeypatch.context() as m:
            m.setattr(estimate, "head_gemm_deferred", lambda *a, **k: not rule(*a, **k))
            turned = est(stage, mb) / got - 1
        lines.append(f"stage {stage} micro-batch {mb}: tracked {got:,} estimate {right:+.2%} rule turned {turned:+.2%}")
        if stage == 3:
            assert abs(right) <= 0.02 and abs(turned) > 0.10, lines
        else:
            assert 0 <= right <= 0.03 and turned == right, lines
    print("\n" + "\n".join(lines))
