"""Pipeline parallelism: partitioning, schedule timelines (bubbles, in-flight micro-batches), parity."""

from __future__ import annotations

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.config.schema import ConfigError
from megazero.pipeline.partition import PipelineLayoutError, partition_layers, stage_specs
from megazero.pipeline.schedules import ScheduleError, build_schedule, simulate
from megazero.train.engine import Engine
from megazero.zero.stage3.slots import SWAP
from tests.common import assert_matches_reference, dp_volumes, merge_runs, outside_blocks, train_eval_runs
from tests.dist import run_world
from tests.reference import RefSpec, run_reference

PP_MODEL = ["--num-layers", "8"]



# -- pure: partitioning and timelines ---------------------------------------------------------------------
def test_partition_balanced_and_user_layout():
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [len(r) for r in partition_layers(10, 4)] == [2, 2, 3, 3]
    assert partition_layers(6, 3, [1, 2, 3]) == [range(0, 1), range(1, 3), range(3, 6)]
    specs = stage_specs(8, pp_size=2, pp_rank=1, virtual_stages=2)
    assert [(s.virtual_stage, s.layers, s.pre_process, s.post_process) for s in specs] == [
        (1, range(2, 4), False, False), (3, range(6, 8), False, True)]
    with pytest.raises(PipelineLayoutError, match="--num-layers 3 is fewer than the 4"):
        partition_layers(3, 4)
    with pytest.raises(PipelineLayoutError, match="sum to --num-layers 8"):
        partition_layers(8, 2, [3, 4])


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)])
@pytest.mark.parametrize("pp", [2, 4])
def test_timelines_are_complete_and_have_the_textbook_bubble(name, v, pp):
    for m in (pp, 2 * pp, 4 * pp):
        for r in range(pp):
            actions = build_schedule(name, pp, r, m, v)
            fwd = [(a.micro_batch, a.chunk) for a in actions if a.kind == "F"]
            bwd = [(a.micro_batch, a.chunk) for a in actions if a.kind == "B"]
            assert sorted(fwd) == sorted(bwd) == sorted((i, c) for i in range(m) for c in range(v))
            assert all(actions.index(next(a for a in actions if a.kind == "F"
                       and (a.micro_batch, a.chunk) == x)) < actions.index(next(a for a in actions if a.kind == "B"
                       and (a.micro_batch, a.chunk) == x)) for x in fwd)
        sim = simulate(name, pp, m, v)
        assert sim.bubble_fraction == pytest.approx((pp - 1) / m / v)  # idle slots, counted from the timeline
        if name == "gpipe":
            assert sim.peak_in_flight == [m] * pp
        if name == "1f1b":
            assert sim.peak_in_flight == [pp - r for r in range(pp)]


def test_schedule_errors():
    with pytest.raises(ScheduleError, match="multiple of --pp"):
        build_schedule("interleaved", 4, 0, 6, 2)
    with pytest.raises(ScheduleError, match="unknown --pp-schedule"):
        build_schedule("zigzag", 2, 0, 2)


@pytest.mark.parametrize("argv, world, message", [
    (["--pp", "4", "--num-layers", "3"], 4, "--num-layers 3 is fewer than the 4 pipeline chunks"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--num-layers", "8",
      "--micro-batch-size", "1", "--global-batch-size", "3"], 2, "divisible by --pp 2"),
    (["--pp", "2", "--pp-layout", "1,2"], 2, "--pp-layout 1,2 needs 2 entries"),
])
def test_configuration_errors(argv, world, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv).resolve(world)


# -- parity with one process ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(data_cache):
    """The independent reference (tests/reference.py: HF GPT-2, torch AdamW, LambdaLR) of the 8-layer model for
    each global batch and step count the tests use."""
    keys = [("8", "10"), ("5", "10"), ("9", "10"), ("8", "4")]
    runs = {k: run_reference(data_cache, RefSpec(num_layers=8, global_batch=int(k[0]), train_steps=int(k[1])))
            for k in keys}
    return {k: (r.losses + [r.eval_loss], r.final) for k, r in runs.items()}  # + the evaluation after the last step


def _pp_runs(pp: int) -> list[tuple[tuple[str, str], list[str]]]:
    """(reference key, flags): m = 1, pp and 2pp + 1 micro-batches for 1F1B and GPipe; interleaved at pp, 2pp."""
    mb = {1: ("8", "8"), pp: (str(8 // pp), "8"), 2 * pp + 1: ("1", str(2 * pp + 1))}
    out = []
    for sched in ("1f1b", "gpipe"):
        for m, (micro, glob) in mb.items():
            if sched == "gpipe" and m == 1:
                continue  # identical to 1F1B with one micro-batch
            out.append(((glob, "10"), ["--pp-schedule", sched, "--micro-batch-size", micro,
                                       "--global-batch-size", glob]))
    for micro in (str(8 // pp), str(4 // pp) if pp == 2 else "1"):  # m = pp and 2pp (interleaved needs m % pp == 0)
        out.append((("8", "10"), ["--pp-schedule", "interleaved", "--virtual-stages", "2",
                                  "--micro-batch-size", micro, "--global-batch-size", "8"]))
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(pp, references, data_cache, tmp_path):
    """Training losses, final weights and the final evaluation loss (the last entry of ``losses``) match one
    process for 1F1B, GPipe and interleaved at pp 2 and 4."""
    runs = _pp_runs(pp)
    flags = [[*PP_MODEL, "--pp", str(pp), *f] for _, f in runs]
    results = merge_runs(run_world(train_eval_runs, pp, flags, data_cache, str(tmp_path), pp=pp))
    for (key, f), (losses, state) in zip(runs, results):
        try:
            assert_matches_reference(losses, state, references[key])
        except AssertionError as e:
            raise AssertionError(f"pp={pp} {f}: {e}") from None


def test_pipeline_with_tensor_and_data_parallel_and_zero(references, data_cache, tmp_path):
    """8 ranks: pp 2 x tp 2 x dp 2 at every ZeRO stage, four steps (frugal: DESIGN.md, Testing). Stages 2 and 3
    partition the tied embedding's two copies alike, so summing their gradients is exact. The evaluation
    loss after the last step matches too."""
    base = [*PP_MODEL, "--pp", "2", "--tp", "2", "--dp", "2", "--train-steps", "4", "--micro-batch-size", "2",
            "--global-batch-size", "8"]
    runs = [[*base, "--zero-stage", "0", "--sequence-parallel"], [*base, "--zero-stage", "1"],
            [*base, "--zero-stage", "2", "--sequence-parallel"], [*base, "--zero-stage", "3"]]
    for losses, state in merge_runs(run_world(train_eval_runs, 8, runs, data_cache, str(tmp_path), pp=2, tp=2)):
        assert_matches_reference(losses, state, references[("8", "4")])


# -- the tied-embedding guard ---------------------------------------------------------------------------------
def _drift(ctx, cache: str):
    """Per schedule (1F1B at ZeRO 0; zbv at ZeRO 1, where rank 0 holds both copies): the check after building,
    the error after one copy drifts, and the groups a zbv step used."""
    out = {}
    for schedule, stage in (("1f1b", "0"), ("zbv", "1")):
        cfg = parse_args([*PP_MODEL, "--pp", "2", "--pp-schedule", schedule, "--zero-stage", stage, "--vocab-size",
                          "512", "--seq-len", "32", "--hidden-size", "64", "--num-heads", "4", "--micro-batch-size",
                          "1", "--global-batch-size", "3", "--cache-dir", cache]).resolve(ctx.world_size)
        engine = Engine(cfg, ctx)
        assert engine.check_tied_embeddings() == 0.0  # both copies initialised from the same (seed, name)
        groups = set()
        if schedule == "zbv":  # a step sums the two copies on rank 0: no traffic over the embedding group
            before = dict(ctx.ledger.totals)
            batch = [(torch.randint(0, 512, (1, 32)), torch.randint(0, 512, (1, 32))) for _ in range(3)]
            engine.train_step(batch)
            groups = {k[0].split(".")[0] for k, v in ctx.ledger.totals.items() if v != before.get(k, 0)}
            assert engine.check_tied_embeddings() == 0.0
        holder = engine.chunks[-1] if schedule == "zbv" else engine.chunks[0]  # the head's copy
        if ctx.pp_rank == engine.loss_rank:
            with torch.no_grad():
                holder.wte.weight.add_(1e-3)
        try:
            engine.check_tied_embeddings()
            out[schedule] = ("no error", groups)
        except RuntimeError as e:
            out[schedule] = (str(e), groups)
    return out


def test_drifting_tied_embeddings_are_an_error_on_every_rank(data_cache):
    """1F1B (the copies on pp ranks 0 and 1) and zbv (both on pp rank 0, compared shard by shard): one copy
    drifting is an error on every rank; a zbv step moves nothing over the embedding group."""
    for out in run_world(_drift, 2, data_cache, pp=2):
        for schedule, (msg, _) in out.items():
            assert "tied word embedding differs between the first and last pipeline stage" in msg, schedule
        assert "embedding" not in out["zbv"][1] and "pp" in out["zbv"][1], out["zbv"][1]


def _dp_volume(ctx, cache: str):
    """Per ZeRO stage and micro-batch count m: (ledger DP volume per step, the padded buffer sizes)."""
    from dataclasses import replace

    out = {}
    for stage in (0, 1, 2, 3):
        for m in (1, 3):
            cfg = parse_args([*PP_MODEL, "--pp", "2", "--zero-stage", str(stage), "--micro-batch-size", "2",
                              "--global-batch-size", str(2 * m * ctx.dp_size), "--vocab-size", "512", "--seq-len",
                              "32", "--hidden-size", "64", "--num-heads", "4", "--cache-dir", cache])
            cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0)).resolve(ctx.world_size)
            engine = Engine(cfg, ctx)
            volumes = dp_volumes(ctx, engine, m)
            psi = sum(p.numel() for c in engine.chunks for p in c.parameters())
            out[(stage, m)] = (volumes, engine.optimizer.padded_numel(), psi, outside_blocks(engine.chunks))
    for stage in (1, 2):  # interleaved, 2 chunks per rank, m = 2: each backward reduces only its own chunk
        cfg = parse_args([*PP_MODEL, "--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                          "--zero-stage", str(stage), "--micro-batch-size", "2", "--global-batch-size",
                          str(4 * ctx.dp_size), "--vocab-size", "512", "--seq-len", "32", "--hidden-size", "64",
                          "--num-heads", "4", "--cache-dir", cache]).resolve(ctx.world_size)
        engine = Engine(cfg, ctx)
        volumes = dp_volumes(ctx, engine, 2)
        psi = sum(p.numel() for c in engine.chunks for p in c.parameters())
        out[("interleaved", stage, 2)] = (volumes, engine.optimizer.padded_numel(), psi, 0)
    return out


def test_dp_volume_per_stage_with_micro_batches_matches_the_formula(data_cache):
    """With pipelining each stage's DP traffic follows its ZeRO formula in m on that stage's own Ψ_r:
    stages 0-1 2Ψ, stage 2 (m + 1)Ψ (reduce-scatter every micro-batch), stage 3 3mΨ (gather in forward and
    backward, reduce-scatter gradients, every micro-batch) less mΨ_own: under 1F1B a rank runs one chunk, whose
    own units (embeddings on the first stage, final norm and tied embedding on the last) are gathered once per
    micro-batch. Under the interleaved schedule (2 chunks per rank)
    stages 1-2 too: a chunk's backward reduces only that chunk's buckets."""
    for rank_result in run_world(_dp_volume, 4, data_cache, pp=2):
        for key, (volumes, padded, psi, psi_own) in rank_result.items():
            stage, m = key[-2:]  # ("interleaved", stage, m): v = 2 chunks per rank, still (m + 1)Ψ, not (mv + 1)Ψ
            w, g = padded["whole"], padded["gathered"]
            want = {0: 2 * w, 1: 2 * w, 2: (m + 1) * w, 3: 3 * m * g - SWAP * m * padded["own"]}[stage]
            assert volumes == [want, want], (stage, m, volumes, want)
            paper = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage] * psi - (SWAP * m * psi_own if stage == 3 else 0)
            assert abs(want - paper) / paper < 0.01, (stage, m, want, paper)  # only padding separates them
