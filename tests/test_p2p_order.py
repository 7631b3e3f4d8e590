"""NCCL's rules, checked on the CPU: device discipline of every Group call, and pipeline transfers replayed
under NCCL's point-to-point matching (k-th send A->B meets the k-th receive at B from A, tags ignored, a rank's
batched calls one after another) so that an order that would deadlock on GPUs fails here."""

from __future__ import annotations

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.distributed.group import Group
from megazero.pipeline.p2p import forward_actions, transfer_plan
from megazero.pipeline.p2p_replay import P2PCall, plan_calls, record_p2p, replay
from megazero.pipeline.schedules import ScheduleError, build_schedule, transfer_ticks, transfer_units
from megazero.train.engine import Engine
from tests.dist import run_world


# -- device discipline ------------------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["all_reduce", "all_gather_into", "reduce_scatter", "all_gather_list",
                                  "broadcast", "send", "recv"])
def test_group_refuses_a_tensor_off_its_device_even_at_size_one(call):
    group = Group("dp", [0], None, device="meta")  # a group whose backend works on another device
    t = torch.zeros(4)
    calls = {
        "all_reduce": lambda: group.all_reduce(t, tag="loss"),
        "all_gather_into": lambda: group.all_gather_into(torch.zeros(4), t, tag="loss"),
        "reduce_scatter": lambda: group.reduce_scatter(torch.zeros(4), t, tag="loss"),
        "all_gather_list": lambda: group.all_gather_list(t, tag="loss"),
        "broadcast": lambda: group.broadcast(t, tag="loss"),
        "send": lambda: group.batch_p2p([("send", t, 0, 0)], tag="loss"),
        "recv": lambda: group.batch_p2p([("recv", t, 0, 0)], tag="loss"),
    }
    with pytest.raises(RuntimeError, match=rf"{call}.*'dp' group \(tag 'loss'\).*tensor on cpu.*works on meta"):
        calls[call]()
    ok = Group("dp", [0], None, device="cpu")  # the right device: a group of one just returns
    ok.all_reduce(t, tag="loss")


# -- replay of the executor's plan, every schedule --------------------------------------------------------
def _plan(schedule: str, pp: int, m: int, v: int, evaluate: bool, paired: bool, ticks: bool = True
          ) -> dict[int, list]:
    calls = {}
    for r in range(pp):
        actions, units = build_schedule(schedule, pp, r, m, v), transfer_units(schedule, pp, r, m, v)
        if evaluate:
            actions, units = forward_actions(actions), None
        calls[r] = plan_calls(transfer_plan(actions, r, pp, v, units=units, paired=paired, schedule=schedule,
                                            ticks=transfer_ticks(schedule, pp, m) if ticks else None),
                              list(range(pp)))
    return calls


CASES = [(s, pp, v, m) for pp in (2, 4) for s, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                                                       ("zbv", 2))
         for m in range(1, 2 * pp + 2) if s != "interleaved" or m % pp == 0]


def test_every_schedule_replays_under_nccl_rules_and_the_old_order_deadlocks():
    old_deadlocks = []
    for schedule, pp, v, m in CASES:
        for evaluate in (False, True):
            result = replay(_plan(schedule, pp, m, v, evaluate, paired=True))
            assert result.ok, f"{schedule} pp={pp} v={v} m={m} evaluate={evaluate}: {result}"
            old = replay(_plan(schedule, pp, m, v, evaluate, paired=False))
            assert not old.mismatches or schedule == "zbv"  # zbv's old order also misdelivers (next test)
            if not old.completed:
                old_deadlocks.append((schedule, pp, m, evaluate))
            if schedule != "gpipe" and m >= 2 and not evaluate:  # the negative case
                assert not old.completed, f"old order of {schedule} pp={pp} m={m} should deadlock"
    assert ("1f1b", 2, 2, False) in old_deadlocks and ("interleaved", 4, 8, True) in old_deadlocks


def test_interleaved_needs_its_steady_state_units():
    """Per-action pairing (each forward/backward its own unit) deadlocks around the interleaved ring."""
    pp, v, m = 2, 2, 4
    calls = {r: plan_calls(transfer_plan(build_schedule("interleaved", pp, r, m, v), r, pp, v), [0, 1])
             for r in range(pp)}
    assert not replay(calls).completed


def test_zbv_needs_its_tick_grouping_and_keeps_the_turn_local():
    """zbv's V: a link carries chunk 0's forwards and chunk 1's gradients both ways, consumed in another order
    than produced, so per-action pairing misdelivers and deadlocks (pp 2, m 3 on); grouped by the list
    scheduler's ticks it replays. The turn at rank p - 1 (chunk 0 -> chunk 1, and its gradient back) and the
    loss on rank 0 need no transfer: rank p - 1 never receives from itself, and the 2 (p - 1) links carry
    exactly 2 m messages each way (F and B per micro-batch and link, two links per adjacent pair)."""
    for pp, m in ((2, 3), (4, 5), (4, 8)):
        per_action = replay(_plan("zbv", pp, m, 2, False, True, ticks=False))
        assert not per_action.ok, (pp, m)
        calls = _plan("zbv", pp, m, 2, False, True)
        assert replay(calls).ok
        ops = [(r, c.kind, c.peer, c.tag) for r, groups in calls.items() for g in groups for c in g]
        assert all(peer != r for r, _, peer, _ in ops)
        for r in range(pp - 1):  # link r <-> r + 1: chunk 0's F and B, chunk 1's F and B
            sends = [t for q, k, peer, t in ops if (q, k, peer) == (r, "send", r + 1)]
            assert sorted(sends) == sorted([("F", i, 0) for i in range(m)] + [("B", i, 1) for i in range(m)])


def test_replay_rules_on_hand_made_cases():
    s, r = (lambda p, t=None: P2PCall("send", p, 8, t)), (lambda p, t=None: P2PCall("recv", p, 8, t))
    assert replay({0: [[s(1)], [r(1)]], 1: [[r(0)], [s(0)]]}).ok
    assert replay({0: [[s(1), r(1)]], 1: [[s(0), r(0)]]}).ok  # a batched exchange
    dead = replay({0: [[s(1)], [r(1)]], 1: [[s(0)], [r(0)]]})  # both send first, one op per call
    assert not dead.completed and set(dead.stuck) == {0, 1}
    swapped = replay({0: [[s(1, "a"), s(1, "b")]], 1: [[r(0, "b"), r(0, "a")]]})  # tags ignored: misdelivery
    assert swapped.completed and len(swapped.mismatches) == 2
    assert "2 sends but 1 receives" in replay({0: [[s(1)], [s(1)]], 1: [[r(0)]]}).mismatches[0]
    with pytest.raises(ScheduleError):
        build_schedule("interleaved", 4, 0, 6, 2)


def test_replay_is_linear_enough_for_large_pipelines():
    """64 pipeline ranks, interleaved, 128 micro-batches (about 65,000 operations) replay in well under a
    second; the replay is linear in the operations."""
    import time

    start = time.perf_counter()
    result = replay(_plan("interleaved", 64, 128, 2, evaluate=False, paired=True))
    assert result.ok and time.perf_counter() - start < 60


# -- one real recorded run over gloo ----------------------------------------------------------------------
RECORDED = {"interleaved": (["--virtual-stages", "2"], 4), "zbv": ([], 5)}  # flags, m (zbv: 2p + 1)


def _recorded(ctx, cache: str):
    logs = {}
    for schedule, (flags, m) in RECORDED.items():
        cfg = parse_args(["--num-layers", "4", "--pp", "2", "--pp-schedule", schedule, *flags, "--micro-batch-size",
                          "1", "--global-batch-size", str(m), "--vocab-size", "512", "--seq-len", "32",
                          "--hidden-size", "64", "--num-heads", "4", "--cache-dir", cache]).resolve(ctx.world_size)
        engine = Engine(cfg, ctx)
        gen = torch.Generator().manual_seed(0)
        batch = [(torch.randint(0, 512, (1, 32), generator=gen), torch.randint(0, 512, (1, 32), generator=gen))
                 for _ in range(m)]
        logs[schedule] = record_p2p(ctx.pp_group)
        engine.train_step(batch)
        engine.eval_loss(batch)
    return logs


def test_recorded_gloo_run_follows_the_plan_and_replays(data_cache):
    """gloo waits for a send's receive too, so the run itself would hang on a bad order; the recording shows
    what the executor issued: exactly the plan the pure replay checks, one batched call per group. Interleaved
    (m 4) and zbv (m 5: its calls grouped by tick, the turn at rank 1 local) in one world."""
    pp, v = 2, 2
    worlds = run_world(_recorded, 2, data_cache, pp=2)
    nbytes = 1 * 32 * 64 * 4  # [micro-batch, seq, hidden] fp32 activations and gradients
    for schedule, (_, m) in RECORDED.items():
        recorded = {r: w[schedule] for r, w in enumerate(worlds)}
        assert replay(recorded).ok, str(replay(recorded))
        for r, calls in recorded.items():
            want = _plan(schedule, pp, m, v, False, True)[r] + _plan(schedule, pp, m, v, True, True)[r]
            assert [[(c.kind, c.peer, c.nbytes) for c in g] for g in calls] == \
                [[(c.kind, c.peer, nbytes) for c in g] for g in want], schedule
    assert max(len(g) for g in worlds[0]["interleaved"]) == 4  # steady state: 2 sends + 2 receives in one call
