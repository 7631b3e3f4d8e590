"""Context parallelism in training (issue 23, items 1-5): ``--cp N`` trains the same model as one process.

Each topology is one world that runs several flag sets (tests/common.py's small GPT on the built-in corpus,
global batch 8), and every run is held to the single-process megazero run of the same flags within 1e-5 (fp32,
losses per step and whole-model weights). The single-process runs are computed once, in one 1-rank world
(:func:`single`); the 10-step GPT-2 runs at cp 2 and cp 4, the Llama run at cp 2 and the tp2·cp2·pp2 world are
also held to the independent reference (tests/reference.py: Hugging Face model, torch AdamW), which shares no
code with megazero's sharding, positions, loss or optimizer.

What each world covers: cp 2 (ring and all-gather attention, Llama, full and selective recompute, ZeRO 2 with
offload, ZeRO 3) and two negative controls; cp 4 and the checkpoint saved at cp 2 resumed at cp 4 (ZeRO 3) and
at cp 1 (one process); tp2·cp2 with and without SP; cp2·dp2 at ZeRO 1 and 3 plus the ledger's volume per ZeRO
stage over the DP x CP group; pp2·cp2 under 1F1B, GPipe and interleaved; tp2·cp2·pp2 at ZeRO 3 with SP and
64-token sequences (each CP rank holds two chunks of 16 tokens, each TP rank one of them under SP).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from megazero.checkpoint import CheckpointReader
from megazero.config.cli import parse_args
from megazero.config.errors import ConfigError
from megazero.config.resolve import CP_ATTENTION_MODES as CONFIG_CP_MODES
from megazero.context_parallel import CP_ATTENTION_MODES
from megazero.distributed.context import ParallelContext, RankGrid
from megazero.distributed.ledger import VOLUME_TAGS
from megazero.train.engine import Engine
from megazero.zero.stage3.slots import SWAP
from tests.common import (
    SMALL_FLAGS,
    assert_matches_reference,
    dp_volumes,
    merge_runs,
    outside_blocks,
    train_runs,
)
from tests.dist import run_world
from tests.reference import LLAMA as LLAMA_SPEC
from tests.reference import RefSpec, run_reference

ROOT = Path(__file__).resolve().parents[1]
THREE = ["--train-steps", "3", "--lr-decay-steps", "6"]  # the first 3 steps of a 6-step schedule
SIX = ["--train-steps", "6", "--lr-decay-steps", "6"]
L4 = ["--num-layers", "4"]  # interleaved pp2 needs 4 chunks
LLAMA = ["--arch", "llama", "--num-layers", str(LLAMA_SPEC.num_layers), "--num-kv-heads",
         str(LLAMA_SPEC.num_kv_heads), "--ffn-hidden-size", str(LLAMA_SPEC.ffn_size), "--train-steps",
         str(LLAMA_SPEC.train_steps)]
SEQ64 = ["--seq-len", "64"]
ONE = ["--micro-batch-size", "8"]  # one process: the global batch of 8 as one micro-batch
# the single-process runs every CP run is held to, by name
EVAL = ["--eval-interval", "10", "--eval-iters", "2"]  # evaluation at the last of 10 steps
SINGLE = {"ten": EVAL, "three": THREE, "six": SIX, "three_l4": [*THREE, *L4], "llama": LLAMA,
          "three_seq64": [*THREE, *SEQ64]}
TOL = 1e-5


@pytest.fixture(scope="module")
def single(data_cache, tmp_path_factory) -> dict[str, tuple[list[float], dict]]:
    """The single-process megazero run of each of :data:`SINGLE`'s flag sets (one 1-rank world)."""
    runs = [[*ONE, *flags] for flags in SINGLE.values()]
    log_dir = tmp_path_factory.mktemp("cp-single")
    merged = merge_runs(run_world(train_runs, 1, runs, data_cache, str(log_dir)))
    return {**dict(zip(SINGLE, merged)), "eval": _eval_loss(log_dir / "1-0")}


def _eval_loss(log_dir: Path) -> float:
    """The last evaluation loss rank 0 wrote to metrics.jsonl."""
    return [r["eval_loss"] for r in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("eval_loss") is not None][-1]


def _contiguous(x: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    return x.chunk(cp_size, dim=seq_dim)[cp_rank]


def _loss_summed_over_dp_only(self, loss_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    total = loss_sum.reshape(1).clone()
    self.ctx.dp_group.all_reduce(total, tag="loss")
    self.ctx.pp_group.broadcast(total, src=self.ctx.pp_size - 1, tag="loss")
    return total[0] / tokens


MUTATIONS = {  # negative controls: each must break parity
    "contiguous chunks": ("megazero.train.engine.shard_sequence", _contiguous),
    "loss not summed over CP": ("megazero.train.engine.Engine._global_loss", _loss_summed_over_dp_only),
}


def _runs(ctx, plan: list, cache: str, log_dir: str) -> list:
    """Train each ``(grid, mutation, flags)`` of ``plan`` in turn, at a global batch of 8: ``grid`` None is this
    world's own grid, else RankGrid.from_world keyword arguments for a second grid over the same ranks;
    ``mutation`` a key of :data:`MUTATIONS` or None."""
    out = []
    for i, (grid, mutation, flags) in enumerate(plan):
        sub = ctx if grid is None else ParallelContext.from_grid(RankGrid.from_world(ctx.world_size, **grid))
        with mock.patch(*MUTATIONS[mutation]) if mutation else contextlib.nullcontext():
            out += train_runs(sub, [["--global-batch-size", "8", *flags]], cache, f"{log_dir}/{i}")
    return out


def _world(world_size: int, plan: list, cache: str, log_dir: Path, **grid) -> list:
    return merge_runs(run_world(_runs, world_size, plan, cache, str(log_dir), **grid))


def _check(results: list, expected: list, labels: list[str]) -> None:
    for (losses, state), ref, label in zip(results, expected, labels):
        try:
            assert_matches_reference(losses, state, ref, TOL)
        except AssertionError as e:
            raise AssertionError(f"{label}: {e}") from None


# -- cp 2 alone: both attention modes, Llama, recomputation, offload, ZeRO 3; negative controls --------------
CP2 = [("ring, 2 micro-batches, 10 steps", ["--cp", "2", "--micro-batch-size", "4", *EVAL], "ten"),
       ("all-gather attention", ["--cp", "2", "--cp-attention", "allgather", *ONE, *THREE], "three"),
       ("llama", ["--cp", "2", "--micro-batch-size", "4", *LLAMA], "llama"),
       ("full recompute, ZeRO 2 + offload", ["--cp", "2", *ONE, *THREE, "--activation-checkpointing", "full",
                                             "--zero-stage", "2", "--offload-optimizer"], "three"),
       ("selective recompute, ZeRO 3", ["--cp", "2", "--micro-batch-size", "4", *THREE, "--activation-checkpointing",
                                        "selective", "--zero-stage", "3"], "three")]


@pytest.fixture(scope="module")
def cp2(data_cache, tmp_path_factory) -> dict:
    plan = [(None, None, flags) for _, flags, _ in CP2]
    plan += [(None, m, ["--cp", "2", *ONE, *THREE]) for m in MUTATIONS]
    log_dir = tmp_path_factory.mktemp("cp2")
    return {"runs": _world(2, plan, data_cache, log_dir, cp=2), "eval": _eval_loss(log_dir / "0" / "2-0")}


def test_cp2_matches_one_process_and_the_independent_reference(cp2, single, reference, data_cache):
    """Also the evaluation loss (the eval batches split over CP like training's) equals one process's."""
    runs = cp2["runs"]
    _check(runs, [single[key] for *_, key in CP2], [label for label, *_ in CP2])
    assert cp2["eval"] == pytest.approx(single["eval"], rel=TOL)
    assert_matches_reference(*runs[0], reference, TOL)  # Hugging Face GPT-2 + torch AdamW
    llama = run_reference(data_cache, LLAMA_SPEC)
    assert_matches_reference(*runs[2], (llama.losses, llama.final), TOL)  # Hugging Face Llama (rotary, GQA)


def test_negative_controls_break_cp_parity(cp2, single):
    """Contiguous halves instead of chunks i and 2cp-1-i (the model's positions and the ring's mask then disagree
    with the tokens), and a loss summed over DP only (each CP rank's half of the tokens): both fail."""
    ref_losses, ref_state = single["three"]
    for (losses, state), name in zip(cp2["runs"][len(CP2):], MUTATIONS):
        with pytest.raises(AssertionError):
            assert_matches_reference(losses, state, single["three"], TOL)
        worst = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
        assert worst > 10 * TOL, (name, worst)  # far outside the tolerance, not at its edge


# -- cp 4 alone, and a checkpoint saved at cp 2 resumed at cp 4 and at cp 1 ----------------------------------
@pytest.fixture(scope="module")
def cp4(data_cache, tmp_path_factory) -> dict:
    ck = tmp_path_factory.mktemp("cp-ckpt")
    plan = [(None, None, ["--cp", "4", *ONE]),
            ({"cp_size": 2}, None, ["--cp", "2", "--zero-stage", "1", "--micro-batch-size", "2", *THREE, "--save",
                                    f"{ck}/a"]),
            (None, None, ["--cp", "4", "--zero-stage", "3", "--micro-batch-size", "4", *SIX, "--load", f"{ck}/a"])]
    ten, saved, at_cp4 = _world(4, plan, data_cache, ck / "logs", cp=4)
    [at_cp1] = merge_runs(run_world(train_runs, 1, [[*ONE, *SIX, "--load", f"{ck}/a"]], data_cache, str(ck / "l1")))
    return {"ten": ten, "saved": saved, "cp4": at_cp4, "cp1": at_cp1, "ck": ck}


def test_cp4_matches_one_process_and_the_independent_reference(cp4, single, reference):
    assert_matches_reference(*cp4["ten"], single["ten"], TOL)
    assert_matches_reference(*cp4["ten"], reference, TOL)


def test_checkpoint_saved_at_cp2_resumes_at_cp4_and_cp1(cp4, single):
    """Saved at cp2·dp2 ZeRO 1 after 3 steps of a 6-step schedule; resumed at cp 4 (ZeRO 3) and in one process,
    both continue the uninterrupted single-process run. The manifest records cp, every file's cp_rank, and ZeRO's
    runs from all four DP x CP ranks; loading reads parameter runs by name and offset, never cp."""
    six_losses, six_state = single["six"]
    assert_matches_reference(*cp4["saved"], (six_losses[:3], single["three"][1]), TOL)
    assert_matches_reference(*cp4["cp4"], (six_losses[3:], six_state), TOL)
    assert_matches_reference(*cp4["cp1"], (six_losses[3:], six_state), TOL)
    manifest = CheckpointReader(cp4["ck"] / "a" / "step_00000003").manifest
    assert manifest["topology"]["cp"] == 2 and manifest["topology"]["dp"] == 2
    files = manifest["files"]
    assert sorted((f["dp_rank"], f["cp_rank"]) for f in files.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    owners = {p["file"] for t in manifest["tensors"].values() for p in t["pieces"]}
    assert owners == set(files)  # ZeRO 1 over DP x CP: every rank owns (and saved) a run of the optimizer state


# -- tp2·cp2 (±SP) -------------------------------------------------------------------------------------------
TP2_CP2 = [("tp2·cp2", ["--tp", "2", "--cp", "2", *ONE, *THREE]),
           ("tp2·cp2 SP, 2 micro-batches", ["--tp", "2", "--cp", "2", "--sequence-parallel", "--micro-batch-size",
                                            "4", *THREE])]


def test_tp2_cp2_with_and_without_sp(data_cache, single, tmp_path):
    plan = [(None, None, flags) for _, flags in TP2_CP2]
    results = _world(4, plan, data_cache, tmp_path, tp=2, cp=2)
    _check(results, [single["three"]] * len(results), [label for label, _ in TP2_CP2])


# -- cp2·dp2 at ZeRO 1 and 3, and the ledger over DP x CP ----------------------------------------------------
def _cp2_dp2(ctx, cache: str, log_dir: str) -> dict:
    plan = [(None, None, ["--cp", "2", "--zero-stage", str(z), "--micro-batch-size", "2", *THREE]) for z in (1, 3)]
    out = {"runs": _runs(ctx, plan, cache, log_dir), "ledger": {}}
    m = 2  # micro-batches per step
    for stage in (0, 1, 2, 3):
        cfg = parse_args([*SMALL_FLAGS, "--cp", "2", "--zero-stage", str(stage), "--micro-batch-size", "2",
                          "--global-batch-size", str(2 * m * ctx.dp_size), "--cache-dir", cache])
        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0)).resolve(ctx.world_size)
        engine = Engine(cfg, ctx)
        volumes = dp_volumes(ctx, engine, m)
        groups = {g for (g, _op, tag) in ctx.ledger.last_step() if tag in VOLUME_TAGS}
        owned = sum(v["master"].numel() for _, _, v in engine.optimizer.owned_state())
        psi = sum(p.numel() for c in engine.chunks for p in c.parameters())
        out["ledger"][stage] = (volumes, engine.optimizer.padded_numel(), psi, groups, owned,
                                outside_blocks(engine.chunks))
    return out


def test_cp2_dp2_zero_1_and_3_and_the_ledger_over_dp_x_cp(data_cache, single, tmp_path):
    """ZeRO 1 and 3 over DP x CP match one process. The ledger counts ZeRO's traffic on the "dp_cp" group (none
    on "dp"), per rank and step with m = 2 micro-batches: 2Ψ at stages 0-1, (m + 1)Ψ at stage 2, 3mΨ - mΨ_own at
    stage 3 (the embeddings and final norm, outside the blocks, are gathered once per micro-batch), Ψ padded to
    a multiple of Nd = dp·cp = 4; and at stages 1-3 the four ranks own disjoint runs that add up to Ψ, at most
    Ψ/Nd each (stage 0: each owns all of Ψ)."""
    results = run_world(_cp2_dp2, 4, data_cache, str(tmp_path), cp=2)
    _check(merge_runs([r["runs"] for r in results]), [single["three"]] * 2, ["ZeRO 1", "ZeRO 3"])
    m, nd = 2, 4
    for stage in (0, 1, 2, 3):
        per_rank = [r["ledger"][stage] for r in results]
        volumes, padded, psi, groups, _, psi_own = per_rank[0]
        w, g = padded["whole"], padded["gathered"]
        want = {0: 2 * w, 1: 2 * w, 2: (m + 1) * w, 3: 3 * m * g - SWAP * m * padded["own"]}[stage]
        assert volumes == [want, want], (stage, volumes, want)
        paper = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[stage] * psi - (SWAP * m * psi_own if stage == 3 else 0)
        assert abs(want - paper) / paper < 0.01, (stage, want, paper)  # only padding separates them
        assert groups == {"dp_cp"}, (stage, groups)
        owned = [r[4] for r in per_rank]
        if stage == 0:
            assert owned == [psi] * nd
        else:
            flat = g if stage == 3 else w  # what ZeRO partitions: the gathered units at stage 3
            assert flat % nd == 0 and sum(owned) == psi and max(owned) <= flat // nd, (stage, owned, flat)


# -- pp2·cp2 under each schedule -----------------------------------------------------------------------------
PP2_CP2 = [("1f1b", ["--pp", "2", "--cp", "2", "--micro-batch-size", "2", *THREE], "three"),
           ("gpipe", ["--pp", "2", "--cp", "2", "--pp-schedule", "gpipe", "--micro-batch-size", "4", *THREE],
            "three"),
           ("interleaved", ["--pp", "2", "--cp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                            "--micro-batch-size", "2", *THREE, *L4], "three_l4")]


def test_pp2_cp2_under_each_schedule(data_cache, single, tmp_path):
    plan = [(None, None, flags) for _, flags, _ in PP2_CP2]
    results = _world(4, plan, data_cache, tmp_path, pp=2, cp=2)
    _check(results, [single[key] for *_, key in PP2_CP2], [label for label, *_ in PP2_CP2])


# -- tp2·cp2·pp2 at ZeRO 3 with SP, 64-token sequences -------------------------------------------------------
def test_tp2_cp2_pp2_zero3_long_sequences(data_cache, single, tmp_path):
    """8 ranks, 4 micro-batches per step under 1F1B; each CP rank holds chunks of 16 tokens (i and 3 - i), SP
    gives each TP rank 16 of its 32; against one process and the independent reference at 64 tokens."""
    flags = ["--tp", "2", "--cp", "2", "--pp", "2", "--zero-stage", "3", "--sequence-parallel", "--micro-batch-size",
             "2", *THREE, *SEQ64]
    [result] = _world(8, [(None, None, flags)], data_cache, tmp_path, tp=2, pp=2, cp=2)
    assert_matches_reference(*result, single["three_seq64"], TOL)
    ref = run_reference(data_cache, RefSpec(seq_len=64, train_steps=3, decay_steps=6))
    assert_matches_reference(*result, (ref.losses, ref.final), TOL)


# -- settings, dry run, generation ---------------------------------------------------------------------------
@pytest.mark.parametrize("flags, world, message", [
    (["--cp", "2", "--tp", "2"], 6, "world size 6 is not divisible by --tp 2 x --cp 2 x --pp 1 = 4"),
    (["--cp", "2", "--dp", "2"], 8, "world size 8 != --tp 1 x --cp 2 x --pp 1 x --dp 2 = 4"),
    (["--cp", "3", "--seq-len", "32"], 3, "--cp 3 needs --seq-len 32 divisible by 2 x cp = 6"),
    (["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36", "--num-heads", "4"], 8,
     "--sequence-parallel with --cp 2 splits each rank's 18 tokens"),
    (["--cp", "2", "--dropout", "0.1"], 2, "context-parallel attention has no attention dropout"),
    (["--cp", "0"], 1, "--cp must be a positive integer"),
    (["--cp", "2", "--sample-prompts", "prompts.txt"], 2, "--sample-prompts with --cp 2: generation runs at cp 1"),
])
def test_cp_settings_are_refused_with_the_fix(flags, world, message):
    with pytest.raises(ConfigError) as e:
        parse_args([*SMALL_FLAGS, *flags]).resolve(world)
    assert message in str(e.value), str(e.value)


def test_cp_settings_resolve_and_name_the_same_modes():
    cfg = parse_args([*SMALL_FLAGS, "--cp", "2", "--tp", "2", "--cp-attention", "allgather"]).resolve(8)
    assert (cfg.parallel.cp_size, cfg.parallel.dp_size, cfg.parallel.cp_attention) == (2, 2, "allgather")
    assert CONFIG_CP_MODES == CP_ATTENTION_MODES


def test_dry_run_builds_the_grid_with_cp(tmp_path):
    """The dry run's world is tp·cp·pp·dp; the ring's traffic shows under "cp" and ZeRO's under "dp_cp"."""
    from megazero.plan.dryrun import dry_run, format_report
    from megazero.plan.roofline import cluster

    cfg = parse_args(["--tp", "2", "--cp", "2", "--pp", "2", "--zero-stage", "1", "--global-batch-size", "4",
                      "--micro-batch-size", "2", "--log-dir", str(tmp_path)]).resolve(8)
    report = dry_run(cfg, cluster("h100", 8), str(tmp_path))
    assert report.fits and report.topology["cp"] == 2 and report.topology["world_size"] == 8
    for role in report.roles:
        assert role.volumes.get("cp", 0) > 0 and role.volumes.get("dp_cp", 0) > 0 and "dp" not in role.volumes
    assert "tp 2 x cp 2 x pp 2 x dp 1 = 8 ranks" in format_report(report)


def test_generation_refuses_cp(capsys):
    from megazero.config.schema import ModelConfig
    from megazero.generate import SamplingConfig, generate_ids
    from megazero.model.gpt import GPT

    with torch.device("meta"):
        model = GPT(ModelConfig(num_layers=1, hidden_size=16, num_heads=2, seq_len=8, vocab_size=32),
                    cp_group=SimpleNamespace(size=2, rank=0))
    with pytest.raises(ValueError, match="generation runs at cp 1, got cp 2"):
        generate_ids(model, [1, 2], SamplingConfig(2))
    spec = importlib.util.spec_from_file_location("_tools_generate", ROOT / "tools" / "generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["no-checkpoint", "--prompt", "x", "--cp", "2"]) == 2
    assert "generation runs at cp 1, got cp 2" in capsys.readouterr().err
