"""The planning side of ZB-V (issue 29): the estimator, the planner and the dry run know ``--pp-schedule zbv``.

Under zbv pipeline rank r holds virtual stages r and 2p - 1 - r, so rank 0 holds the embeddings and the final
norm, the LM head and the loss (both copies of GPT-2's tied embedding), and rank p - 1 no vocabulary at all.
Without processes: each rank's parameters as the estimator counts them equal the model chunks the V layout
builds; the planner enumerates zbv where it is valid, prices its bubble from the timeline and its memory with
the W stashes of both chunks.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from megazero.config.schema import ModelConfig
from megazero.distributed.context import RankGrid
from megazero.model.gpt import GPT
from megazero.pipeline.partition import stage_specs
from megazero.pipeline.schedules import simulate
from megazero.plan.estimate import peak_bytes, rank_parameter_numels
from megazero.plan.role import rank_roles
from megazero.plan.roofline import bubble_fraction, cluster
from megazero.plan.search import Layout, evaluate, layouts

GPT2 = ModelConfig(num_layers=8, hidden_size=64, num_heads=4, seq_len=32, vocab_size=500)
LLAMA = replace(GPT2, arch="llama", num_kv_heads=2, ffn_size=96)
XL = ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, seq_len=1024, vocab_size=50257)  # GPT-2 1.3B


def _built(model: ModelConfig, pp: int, rank: int) -> dict[str, int]:
    """The parameters of the chunks rank ``rank`` builds under zbv (on meta), named as in a ModuleList."""
    with torch.device("meta"):
        return {f"{c}.{n}": p.numel()
                for c, s in enumerate(stage_specs(model.num_layers, pp, rank, 2, schedule="zbv"))
                for n, p in GPT(model, layers=s.layers, pre_process=s.pre_process,
                                post_process=s.post_process).named_parameters()}


def test_estimator_counts_the_v_layout():
    """Per rank, the estimator's parameters are the V layout's chunks: rank 0 holds the embeddings, the final
    norm and the head (GPT-2: both tied copies; Llama: the untied ``lm_head``); rank p - 1 holds blocks only.
    The dry run's roles follow: the vocabulary's padding splits rank 0's TP ranks only."""
    for model in (GPT2, LLAMA):
        for r in range(4):
            counted = rank_parameter_numels(model, 1, 4, r, virtual_stages=2, schedule="zbv")
            assert counted == _built(model, 4, r), (model.arch, r)
        zero = rank_parameter_numels(model, 1, 4, 0, virtual_stages=2, schedule="zbv")
        head = "1.wte.weight" if model.tied else "1.lm_head.weight"
        assert {"0.wte.weight", head, "1.ln_f.weight"} <= set(zero)
        assert not any("wte" in k or "ln_f" in k for k in rank_parameter_numels(model, 1, 4, 3, virtual_stages=2,
                                                                                schedule="zbv"))
    grid = RankGrid(8, 2, 4, 1)  # tp 2: vocab 500 pads to 512, the second TP rank's slice holds the padding
    assert [grid.coords(r)[0] for r, _ in rank_roles(grid, 500, "zbv")] == [0, 0, 1, 2, 3]
    assert [grid.coords(r)[0] for r, _ in rank_roles(grid, 500, "1f1b")] == [0, 0, 1, 2, 3, 3]


def test_estimator_holds_rank_0s_ends_and_the_v_in_flight():
    """Model states follow the V: rank 0 holds both ends (the tied embedding twice, the final norm), rank p - 1
    blocks only, the middle ranks as many blocks as under 1F1B. Activations: every rank holds up to 2p chunk
    micro-batches between F and W (1F1B's first stage), so the later ranks hold more than under 1F1B."""
    from megazero.plan.estimate import model_state_bytes

    common = dict(stage=1, dp_size=1, pp_size=4, precision="bf16", micro_batches=8)
    zbv = [peak_bytes(XL, 1, pp_rank=r, schedule="zbv", **common) for r in range(4)]
    one = [peak_bytes(XL, 1, pp_rank=r, schedule="1f1b", **common) for r in range(4)]
    h = XL.hidden_size
    ends = model_state_bytes(50304 * h + 2 * h, 1, 1, "bf16").total  # the tied copy and ln_f move to rank 0
    assert zbv[0].model_states == one[0].model_states + ends
    assert zbv[3].model_states == one[3].model_states - ends
    assert [z.model_states for z in zbv[1:3]] == [o.model_states for o in one[1:3]]
    assert all(z.activations > o.activations for z, o in zip(zbv[1:], one[1:]))
    # pp 1: zbv is no pipeline; the estimate is the one-stage run's
    assert peak_bytes(XL, 1, pp_size=1, schedule="zbv", stage=1, dp_size=1).total == peak_bytes(
        XL, 1, pp_size=1, stage=1, dp_size=1).total


def test_planner_lists_and_prices_zbv():
    """The planner offers zbv for pipelines of at least two layers per rank (never with interleaving or zb-h1),
    prints its flag, prices its bubble from the zbv timeline (below zb-h1's, below 1F1B's) and counts its
    point-to-point traffic without the V's turn: rank p - 1 sends no activation to itself."""
    cands = layouts(XL, 32, 64, 8, micro_batch_sizes=(1,), stages=(1,), checkpointing=("none",), offload=(False,))
    vee = [lay for lay in cands if lay.zbv]
    assert {lay.pp for lay in vee} == {2, 4, 8}  # pp 16 and 32 leave fewer than two layers per rank
    assert all(not lay.zero_bubble and lay.virtual_stages == 1 and lay.schedule == "zbv" for lay in vee)
    h100 = cluster("h100", 8)
    one, zb, zv = (evaluate(XL, Layout(2, 4, 4, 1, 1, zero_bubble=z, zbv=v), 64, h100)
                   for z, v in ((False, False), (True, False), (False, True)))
    assert "--pp-schedule zbv" in " ".join(zv.layout.flags())
    assert bubble_fraction(4, 16, 2, "zbv") == simulate("zbv", 4, 16, 2).bubble_fraction
    assert zv.time.bubble < zb.time.bubble < one.time.bubble
    assert zv.time.bubble / one.time.bubble < 0.3
    assert zv.activation_bytes > one.activation_bytes  # the W stashes
    # per micro-batch: rank 1 sends 2 activations and 2 gradients (zbv) against 1 and 1 (1F1B)
    assert zv.pp_bytes == 2 * one.pp_bytes


# -- against the runtime: the measured peak of a zbv step, on CPU ranks and on meta ----------------------------
TINY = ["--num-layers", "8", "--vocab-size", "512", "--seq-len", "32", "--hidden-size", "64", "--num-heads", "4"]


def _activation_peak(ctx, cache: str, m: int) -> int:
    """The most activation bytes this rank held in one zbv step (saved for B, or stashed for W), counted from the
    tensors by the executor (fp32, micro-batch 1)."""
    from megazero.config.cli import parse_args
    from megazero.train.engine import Engine

    batch = [(torch.randint(0, 512, (1, 32)), torch.randint(0, 512, (1, 32))) for _ in range(m)]
    cfg = parse_args([*TINY, "--pp", str(ctx.pp_size), "--pp-schedule", "zbv", "--micro-batch-size", "1",
                      "--global-batch-size", str(m), "--cache-dir", cache])
    engine = Engine(cfg.resolve(ctx.world_size), ctx)
    engine.train_step(batch, measure=True)
    return engine.activation_peak_bytes


def test_estimated_activations_match_a_zbv_run(data_cache):
    """pp 2, m = 4: each rank's live activation bytes at the peak of a real zbv step (both chunks' saved tensors
    and W stashes) within 1% of the estimate's timeline replay (it leaves out the O(h) norm gradients kept for
    W); one chunk's figures doubled (the layout of zb-h1) miss rank 0's by more than 5%: its chunks differ."""
    from tests.dist import run_world

    model = ModelConfig(num_layers=8, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512)
    measured = run_world(_activation_peak, 2, data_cache, 4, pp=2)
    for r, got in enumerate(measured):
        est = peak_bytes(model, 1, stage=0, dp_size=1, pp_size=2, pp_rank=r, precision="fp32", micro_batches=4,
                         schedule="zbv").activations
        assert abs(est - got) / got < 0.01, (r, est, got)
    flat = peak_bytes(model, 1, stage=0, dp_size=1, pp_size=2, pp_rank=0, precision="fp32", micro_batches=4,
                      schedule="zb-h1").activations  # rank 0 as one stage of 4 layers with only the embedding
    assert abs(flat - measured[0]) / measured[0] > 0.05, (flat, measured[0])


def test_dry_run_of_zbv_agrees_with_the_estimate(tmp_path):
    """The dry run (meta, every rank role, the real executor) runs zbv at pp 4: the recorded point-to-point calls
    replay under NCCL's rules, the bubble is the zbv timeline's, the report names the schedule, rank 0 alone
    holds the vocabulary, and each role's peak is within 2% of the estimate (bf16, ZeRO 1, CUDA's kernels; measured
    -1.0, +0.6, +0.3, +0.0% with the received tensors waiting in the inbox counted, up to 2 beyond the one held
    on ranks 1-3; -1.0, +0.0, -0.3, -0.5% without; -2.3..-3.0% without the output gradients a B holds beside the
    activations it has not freed yet), where the zb-h1 layout's estimate (rank 0 without the head, rank 3 with it) misses by > 10%."""
    from megazero.config.cli import parse_args
    from megazero.plan.dryrun import dry_run, format_report

    m = 8
    cfg = parse_args(["--num-layers", "8", "--hidden-size", "128", "--num-heads", "4", "--seq-len", "128",
                      "--vocab-size", "2000", "--pp", "4", "--pp-schedule", "zbv", "--zero-stage", "1",
                      "--precision", "bf16", "--micro-batch-size", "1", "--global-batch-size", str(m),
                      "--log-dir", str(tmp_path)]).resolve(4, device_type="cuda")
    report = dry_run(cfg, cluster("h100", 8))
    assert report.fits and report.p2p_ok and report.p2p_replay.startswith("replay completed"), report.p2p_replay
    assert report.bubble_fraction == simulate("zbv", 4, m, 2).bubble_fraction
    assert report.topology["schedule"] == "zbv" and report.topology["virtual_stages"] == 2
    assert "(zbv)" in format_report(report).splitlines()[0]
    assert [r.pp_rank for r in report.roles] == [0, 1, 2, 3]
    for r in report.roles:
        est = peak_bytes(cfg.model, 1, stage=1, dp_size=1, pp_size=4, pp_rank=r.pp_rank, precision="bf16",
                         micro_batches=m, schedule="zbv").total
        assert abs(est - r.peak_bytes) / r.peak_bytes < 0.02, (r.pp_rank, est, r.peak_bytes)
        assert r.step_seconds["total_s"] > 0
        if r.pp_rank in (0, 3):
            h1 = peak_bytes(cfg.model, 1, stage=1, dp_size=1, pp_size=4, pp_rank=r.pp_rank, precision="bf16",
                            micro_batches=m, schedule="zb-h1").total
            assert abs(h1 - r.peak_bytes) / r.peak_bytes > 0.1, (r.pp_rank, h1, r.peak_bytes)
