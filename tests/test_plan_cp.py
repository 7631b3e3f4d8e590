"""The planner with context parallelism (megazero.plan.search, megazero.plan.roofline): pure arithmetic, no ranks,
except one tiny dry run of a CP layout."""

from __future__ import annotations

import pytest

from megazero.config.cli import parse_args
from megazero.config.schema import model_preset
from megazero.distributed.context import RankGrid
from megazero.plan.dryrun import dry_run
from megazero.plan.estimate import model_state_bytes, rank_parameter_numels
from megazero.plan.roofline import cluster, ring_kv_bytes, step_time
from megazero.plan.search import CP_MIN_SEQ_LEN, Layout, evaluate, layouts, search

# one layout family per parallel shape: search only over (tp, cp, pp, dp) and sequence parallelism
NARROW = dict(micro_batch_sizes=(1,), stages=(1,), checkpointing=("none",), offload=(False,), virtual_stages=(1,))


def test_a_long_sequence_plans_cp_and_a_short_one_does_not():
    c = cluster("h100", 8)
    long = model_preset("llama-3-8b", seq_len=32768)
    plans, tried = search(long, 64, 64, c, **NARROW)
    assert plans and plans[0].layout.cp > 1, [(p.layout, p.time.total) for p in plans[:5]]
    lay = plans[0].layout
    assert lay.tp * lay.cp <= 8 and long.seq_len % (2 * lay.cp) == 0  # the CP group within a node
    assert plans[0].cp_bytes > 0 and "--cp" in lay.flags()
    short = model_preset("llama-3-8b", seq_len=4096)
    assert short.seq_len < CP_MIN_SEQ_LEN
    plans, _ = search(short, 64, 64, c, **NARROW)
    assert plans and {p.layout.cp for p in plans} == {1}


def test_cp_candidates_divide_the_sequence_in_two_chunks_per_rank():
    model = model_preset("llama-3-8b", seq_len=8200)  # 8200 = 8 x 1025: cp 4 splits it in 8 chunks, cp 8 not
    assert {lay.cp for lay in layouts(model, 64, 64, 8, **NARROW)} == {1, 2, 4}
    model = model_preset("llama-3-8b", seq_len=16384)
    assert {lay.cp for lay in layouts(model, 64, 64, 8, **NARROW)} == {1, 2, 4, 8}  # tp·cp within a node
    assert {lay.cp for lay in layouts(model, 64, 64, 8, cp_across_nodes=True, **NARROW)} == {1, 2, 4, 8, 16, 32, 64}
    assert all(lay.tp * lay.cp <= 8 for lay in layouts(model, 64, 64, 8, **NARROW))
    for lay in layouts(model, 16, 16, 8, **NARROW)[::5]:  # every layout is a valid configuration
        cfg = parse_args(["--model", "llama-3-8b", "--seq-len", str(model.seq_len), *lay.flags(),
                          "--global-batch-size", "16"]).resolve(16)
        assert (cfg.parallel.tp_size, cfg.parallel.cp_size, cfg.parallel.dp_size) == (lay.tp, lay.cp, lay.dp)


def test_cp_divides_activations_and_zero_shards_over_dp_cp():
    model = model_preset("gpt2-350m", seq_len=16384)  # learned positions: the table stays whole under CP
    c = cluster("h100", 8)
    one = evaluate(model, Layout(tp=1, pp=1, dp=2, zero_stage=1, micro_batch_size=1), 4, c)
    for cp in (2, 4):
        lay = Layout(tp=1, pp=1, dp=2, zero_stage=1, micro_batch_size=1, cp=cp)
        plan = evaluate(model, lay, 4, c)
        numels = list(rank_parameter_numels(model, 1, 1, 0).values())
        assert plan.states_bytes == pytest.approx(model_state_bytes(numels, 1, 2 * cp).device)
        # the stash of seq_len / cp tokens and backward's transients, but for the fresh gradient of the largest
        # parameter (the tied embedding, bf16), which does not depend on the sequence
        fixed = 2 * max(numels)
        assert plan.activation_bytes - fixed == pytest.approx((one.activation_bytes - fixed) / cp, rel=1e-9)
        kv = 2 * (model.seq_len // cp) * model.hidden_size  # K and V of this rank's tokens, one layer
        assert plan.cp_bytes == pytest.approx(2 * model.num_layers * ring_kv_bytes(kv, cp, 2))  # 2 micro-batches


def test_ring_bytes_follow_the_ledger_and_hide_behind_attention():
    n, kv = 4, 1000  # the ledger (tests/test_context_parallel.py): kv 2(cp-1)·2N, kv_grad cp·2N in fp32
    assert ring_kv_bytes(kv, n, 2) == 2 * (n - 1) * kv * 2 + n * kv * 4
    assert ring_kv_bytes(kv, n, 2, recomputed=True) == 3 * (n - 1) * kv * 2 + n * kv * 4
    assert ring_kv_bytes(kv, 1, 2) == 0
    c = cluster("h100", 8, efficiency=0.5)
    common = dict(c=c, precision="bf16", global_batch=8, seq_len=32768, num_layers=32, hidden=4096, vocab=128256,
                  checkpointing="none", tp=1, pp=1, dp=8, micro_batches=1, virtual_stages=1, tp_elements=0,
                  pp_elements=0, dp_grad_elements=0, dp_param_elements=0, grad_bytes=4, owned_params=0,
                  offload=False, tp_crosses=False, pp_crosses=False, dp_crosses=False, cp=4)
    tail = 1e9
    hidden = step_time(**common, cp_send_bytes=1e10, cp_tail_bytes=tail)
    assert hidden.cp_comm == pytest.approx(tail / 450e9)  # the attention matmuls cover all but the last hops
    assert hidden.total == pytest.approx(hidden.compute + hidden.cp_comm + hidden.optimizer)
    exposed = step_time(**common, cp_send_bytes=1e14, cp_tail_bytes=tail, cp_crosses=True)
    attention = 6.0 * 8 * 32768**2 * 4096 * 32 / 8 / (c.gpu.peak_flops["bf16"] * 0.5)
    assert exposed.cp_comm == pytest.approx(1e14 / 50e9 - attention)


def test_a_cp_layout_dry_runs_as_one_role():
    """tiny, cp 2 x dp 2: the dry run builds the CP grid, runs one role for all four ranks and counts the ring."""
    lay = Layout(tp=1, pp=1, dp=2, zero_stage=1, micro_batch_size=1, cp=2)
    cfg = parse_args(["--model", "tiny", "--seq-len", "256", *lay.flags(), "--global-batch-size", "2"]).resolve(
        lay.world, device_type="cuda")
    rep = dry_run(cfg, cluster("h100", 8), device_type="cuda")
    assert rep.topology["cp"] == 2 and len(rep.roles) == 1 and rep.fits
    role = rep.roles[0]
    assert role.volumes.get("cp", 0) > 0 and role.step_seconds["cp_comm_s"] > 0  # the ring on its link
    assert RankGrid(4, cp_size=2, dp_size=2).group_of("cp", 0) == [0, 1]
