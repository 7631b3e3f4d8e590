"""How ZeRO's collectives behave where gloo and NCCL differ, on CPU ranks.

* Overlap: with ``overlap_comm`` no gradient reduction is waited on before the next bucket's backward has
  produced a gradient (stages 2 and 3), counted with a spy on the reduction group; without it every reduction
  is waited on at once. At stage 3 the reductions run on their own group, apart from the gathers.
* NCCL semantics: with gloo's fast paths off (``MEGAZERO_GLOO_FAST_PATHS=0``) the ZeRO stages still match the
  single-process reference; the test suite poisons what an in-place reduce-scatter leaves outside this rank's
  part (``MEGAZERO_POISON_REDUCE_SCATTER=1``, tests/conftest.py), so a reader of it fails: shown with a planted
  one that gloo's fast path would hide.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megazero.config.cli import parse_args
from megazero.config.schema import ZeroConfig
from megazero.distributed.group import Group
from megazero.model.gpt import GPT, init_parameters
from megazero.train.engine import Engine
from megazero.zero import ZeroOptimizer
from tests.dist import run_world
from tests.test_zero import (
    FP32_RUNS,
    MODEL,
    OPT,
    SEED,
    STEPS,
    global_batch,
    lr_at,
    normwise,
    reference_run,
    train,
)


class _Spied:
    def __init__(self, work, k: int, events: list) -> None:
        self.work, self.k, self.events = work, k, events

    def wait(self) -> None:
        self.work.wait()
        self.events.append(("wait", self.k))


def _spy(group: Group, events: list, calls: dict) -> None:
    """Record every gradient reduction ``group`` issues and each wait on it; count its calls by op and tag."""
    for name in ("reduce_scatter", "all_reduce", "all_gather_into"):
        real = getattr(group, name)

        def call(*args, tag="other", async_op=False, _real=real, _name=name, **kw):
            calls[(_name, tag)] = calls.get((_name, tag), 0) + 1
            work = _real(*args, tag=tag, async_op=async_op, **kw)
            if tag != "grad":
                return work
            k = sum(1 for e in events if e[0] == "issue")
            events.append(("issue", k))
            if not async_op:
                events.append(("wait", k))
                return work
            return _Spied(work, k, events)

        setattr(group, name, call)


def _overlap_world(ctx) -> dict:
    # ParallelContext's second communicator over the DP ranks for stage 3's reductions; the recipe hands it over
    second = ctx.zero_reduce_group
    cfg = parse_args(["--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512",
                      "--num-layers", "2", "--zero-stage", "3"]).resolve(ctx.world_size)
    out = {"groups": (second.ranks == ctx.dp_group.ranks, second.name == ctx.dp_group.name,
                      second.process_group is not ctx.dp_group.process_group,
                      Engine(cfg, ctx).optimizer.store.reduce_group is second)}
    for stage in (2, 3):
        for overlap in (True, False):
            model = GPT(replace(MODEL, num_layers=4))
            init_parameters(model, SEED)
            events: list = []
            for p in model.parameters():  # registered before the store's hooks: a gradient arrives, then reductions
                p.register_post_accumulate_grad_hook(lambda _p, events=events: events.append(("grad",)))
            gathers, reductions = {}, {}
            reduce_group = second if stage == 3 else None
            _spy(ctx.dp_group, events if stage == 2 else [], gathers)
            if reduce_group is not None:
                _spy(reduce_group, events, reductions)
            zero = ZeroConfig(stage=stage, reduce_bucket_size=5000, overlap_comm=overlap, max_inflight_buckets=2,
                              stage3_param_persistence_threshold=0)
            opt = ZeroOptimizer(model, zero, OPT, ctx.dp_group, reduce_group=reduce_group)
            x, y = global_batch(0)
            for step in range(2):  # the second follows the traced order (stage 3 prefetches)
                events.clear()
                opt.zero_grad()
                opt.backward(model(x[:4], y[:4]).sum() / y.numel())
                opt.step(lr_at(step))
            out[(stage, overlap)] = (list(events), gathers, reductions)
            for group in (ctx.dp_group, second):
                for name in ("reduce_scatter", "all_reduce", "all_gather_into"):
                    group.__dict__.pop(name, None)
    return out


def _early_waits(events: list) -> tuple[int, int, int]:
    """(reductions followed by another gradient, those waited on before that gradient, waits inside backward)."""
    last_grad = max(i for i, e in enumerate(events) if e[0] == "grad")
    followed = early = 0
    for i, e in enumerate(events):
        if e[0] != "issue" or i > last_grad:
            continue
        followed += 1
        nxt = next(j for j in range(i + 1, len(events)) if events[j][0] == "grad")
        early += ("wait", e[1]) in events[i + 1: nxt]
    inside = sum(1 for e in events[:last_grad] if e[0] == "wait")
    return followed, early, inside


def test_with_overlap_no_reduction_is_waited_on_before_the_next_bucket_backward() -> None:
    """A 4-layer GPT at stages 2 and 3, buckets of 5000 elements (above the largest parameter; stage 3: one block per unit), at
    most 2 reductions in flight:
    with overlap_comm each reduction issued during backward is waited on only after the next bucket's backward
    has produced a gradient (the waits inside backward are the in-flight limit's, for older buckets); without it
    each is waited on at once. Stage 3 gathers over the DP group and reduces over the second group only: the
    ParallelContext's ``zero_reduce_group`` (the DP ranks and ledger name, its own communicator), which the
    recipe hands to the optimizer."""
    for rank_res in run_world(_overlap_world, 2):
        for stage in (2, 3):
            followed, early, inside = _early_waits(rank_res[(stage, True)][0])
            assert followed >= 3 and early == 0, (stage, followed, early)
            followed_off, early_off, _ = _early_waits(rank_res[(stage, False)][0])
            assert early_off == followed_off >= 3, (stage, followed_off, early_off)
        assert rank_res["groups"] == (True, True, True, True), rank_res["groups"]
        _, gathers, reductions = rank_res[(3, True)]
        assert gathers.get(("all_gather_into", "param"), 0) > 0 and gathers.get(("reduce_scatter", "grad"), 0) == 0
        assert reductions.get(("reduce_scatter", "grad"), 0) > 0
        assert not any(op == "all_gather_into" for op, _ in reductions), reductions


def _nccl_runs(ctx) -> dict:
    assert not ctx.dp_group.fast_paths and ctx.dp_group.poison
    return {run.name: train(ctx, run) for run in FP32_RUNS if run.stage >= 1}


def test_zero_parity_with_gloo_fast_paths_off(monkeypatch) -> None:
    """MEGAZERO_GLOO_FAST_PATHS=0: reduce-scatters and all-gathers run as the collectives themselves (NCCL's
    semantics: an in-place reduce-scatter leaves the rest of its input local, then poisoned); stages 1-3 (with
    accumulation, overlap, prefetch, persistence) still match torch.optim.AdamW within 1e-5."""
    monkeypatch.setenv("MEGAZERO_GLOO_FAST_PATHS", "0")
    ref = run_world(reference_run, 1)[0]
    got = run_world(_nccl_runs, 2, timeout=300)[0]
    for name, r in got.items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
        assert len(r["losses"]) == STEPS and worst < 1e-5, (name, worst)
        assert normwise(r["weights"], ref["weights"]) < 1e-5, name


def _planted_read(ctx) -> dict:
    """Stage 1 with a planted bug: the gradient norm read from the whole reduce-scattered buffer (no DP sum);
    per (fast paths, poison), the step's norms."""
    out = {}
    for fast, poison in ((True, False), (False, False), (True, True)):
        ctx.dp_group.fast_paths, ctx.dp_group.poison = fast, poison
        norms = {}
        for planted in (False, True):
            model = GPT(MODEL)
            init_parameters(model, SEED)
            opt = ZeroOptimizer(model, ZeroConfig(stage=1, reduce_bucket_size=3000), OPT, ctx.dp_group)
            if planted:
                opt._global_sq_norm = lambda g, opt=opt: opt.store.grad_flat.double().square().sum()
            norms[planted] = []
            for step in range(2):
                x, y = global_batch(step)
                opt.zero_grad()
                opt.backward(model(x[4 * ctx.dp_rank: 4 * ctx.dp_rank + 4], y[4 * ctx.dp_rank:][:4]).sum() / y.numel())
                norms[planted].append(opt.step(lr_at(step)).grad_norm)
        out[(fast, poison)] = norms
    return out


def test_a_planted_read_of_what_a_reduce_scatter_does_not_own_fails() -> None:
    """The planted norm is wrong on gloo's fast path (a reduce per shard: the rest of the buffer is not the
    reduced sum) and with NCCL's semantics (the rest stays local), and is NaN, failing at once, with the poison
    the test suite turns on."""
    for r in run_world(_planted_read, 2):
        true = r[(True, False)][False]
        assert all(abs(a - b) > 1e-3 * b for a, b in zip(r[(True, False)][True], true))  # wrong on gloo too
        assert all(abs(a - b) > 1e-3 * b for a, b in zip(r[(False, False)][True], true))  # wrong under NCCL
        assert all(torch.isnan(torch.tensor(n)) for n in r[(True, True)][True])  # poisoned: fails here
        assert r[(True, True)][False] == true  # the optimizer itself reads only what it owns
