"""K/V heads shared by TP ranks when tp exceeds them (issue 30 item 5): Llama with 4 query heads on 2 K/V heads at
tp 4, each K/V head held by 2 consecutive TP ranks (Megatron-LM's replication of query groups).

Without processes: every rank's qkv shard is its query head's rows and its K/V head's rows of the full tensor
(sliced here by head, independently of the sharding code), initialised identically for any TP size, merged back
once; the gradient norm counts the shared rows on one rank of each pair; the estimator's per-rank parameters are
the model's. One 4-rank world then trains, against one process and the independent reference (Hugging Face
``LlamaForCausalLM``, torch AdamW, ``clip_grad_norm_``): tp 4 with and without SP, a checkpoint saved at tp 4
resumed at tp2·dp2 and one saved at tp2·dp2 resumed at tp 4, ``--init-from`` a Hugging Face Llama directory, and
one K/V head on both ranks of tp 2 under zero-bubble's split backward (tp2·pp2, zb-h1); the ledger shows one
all-reduce of the K/V rows' gradient per layer and micro-batch over the pairs; the saved-tensor counter at tp 4
equals the estimate, and the logits equal one process's. Negative controls: without the sum over the pair (tp 4
and zb-h1), or with the shared rows counted twice in the gradient norm (clipping is active), the weights miss.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.config.schema import ModelConfig
from megazero.distributed.context import ParallelContext, RankGrid
from megazero.model import GPT, init_parameters
from megazero.model.gpt import initial_value
from megazero.plan.estimate import rank_parameter_numels
from megazero.tensor_parallel.layers import unshard_tensor
from megazero.zero.norm import grad_norm_weights
from tests.common import SMALL_FLAGS, assert_matches_reference, merge_runs
from tests.dist import run_world
from tests.reference import LLAMA as SPEC
from tests.reference import run_reference

transformers = pytest.importorskip("transformers")

TOL = 1e-5
LLAMA = ["--arch", "llama", "--num-layers", str(SPEC.num_layers), "--num-kv-heads", str(SPEC.num_kv_heads),
         "--ffn-hidden-size", str(SPEC.ffn_size), "--global-batch-size", "8"]
FOUR = ["--train-steps", str(SPEC.train_steps)]
THREE, SIX = ["--train-steps", "3", "--lr-decay-steps", "6"], ["--train-steps", "6", "--lr-decay-steps", "6"]
ONE = ["--micro-batch-size", "8"]
CFG = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512, arch="llama",
                  num_kv_heads=2, ffn_size=96, rope_theta=500000.0)


class _TPRank:
    """What the layers ask of a TP group at construction: its size and this rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank


# -- without processes --------------------------------------------------------------------------------------
def test_each_rank_holds_its_query_head_and_the_shared_kv_head_and_counts_it_once():
    full = GPT(CFG)
    init_parameters(full, seed=3)
    hd, name = CFG.head_dim, "blocks.1.attn.qkv.weight"
    w = full.get_parameter(name).detach()
    q, k, v = w.split([4 * hd, 2 * hd, 2 * hd])
    shards, counted = [], []
    for r in range(4):
        model = GPT(CFG, _TPRank(4, r))
        p = model.get_parameter(name)
        kv = r // 2  # query head r uses K/V head r // (4 / 2), as Hugging Face Llama
        want = torch.cat([q[r * hd:(r + 1) * hd], k[kv * hd:(kv + 1) * hd], v[kv * hd:(kv + 1) * hd]])
        got = initial_value(p, name, 3, _TPRank(4, r))  # drawn in full from (seed, name), this rank's rows kept
        assert torch.equal(got, want), r
        shards.append(got)
        counted.append(grad_norm_weights(model, r)[p])
        # the estimator's parameters per rank are the model's (K/V rows included where shared)
        numels = {n: t.numel() for n, t in model.named_parameters()}
        assert rank_parameter_numels(CFG, 4, 1, 0) == numels, r
        assert model.blocks["0"].attn.local_kv_heads == 1 and p.shape == (3 * hd, CFG.hidden_size)
    assert torch.equal(unshard_tensor(shards, p.shard_spec), w)  # merged once: the full tensor back
    # the norm counts the shared K/V rows on the first rank of each pair, only the query rows on the other
    assert counted == [True, hd * CFG.hidden_size, True, hd * CFG.hidden_size]


# -- one world: tp 4, resharding to and from tp2·dp2, Hugging Face weights ----------------------------------
def _no_sum(t, start, group):  # the K/V rows' gradient left per rank (each rank's own query heads' share)
    return t


def _twice(model, tp_rank):  # every TP shard counted whole: the shared K/V rows enter the norm twice
    return {p: p.shard_spec.partition_dim is not None or tp_rank == 0 for p in model.parameters()}


MUTATIONS = {"no K/V gradient sum": ("megazero.tensor_parallel.layers.sum_shared_rows_grad", _no_sum),
             "K/V rows counted twice in the norm": ("megazero.train.recipe.grad_norm_weights", _twice)}


def _config(flags: list[str], cache: str, log_dir: str):
    from megazero.checkpoint.hf_import import configure_from_inputs

    cfg = parse_args([*SMALL_FLAGS, *flags, "--cache-dir", cache, "--log-dir", log_dir])
    return configure_from_inputs(cfg) if "--init-from" in flags else cfg


def _kv_summed(ctx) -> int:
    """Elements the ledger counted for the K/V rows' gradient sums (over tp_kv, or the TP group when it is one)."""
    return sum(n for (group, op, tag), n in ctx.ledger.totals.items()
               if group in ("tp_kv", "tp") and op == "all_reduce" and tag == "kv_grad")


def _runs(ctx, plan: list, cache: str, log_dir: str) -> list:
    """Train each ``(grid, mutation, flags)``: ``grid`` None is this world's, else RankGrid.from_world arguments;
    returns per run (losses, full state on tp_rank = dp_rank = 0, K/V gradient elements this rank summed)."""
    from megazero.train.loop import run_training

    out = []
    for i, (grid, mutation, flags) in enumerate(plan):
        sub = ctx if grid is None else ParallelContext.from_grid(RankGrid.from_world(ctx.world_size, **grid))
        before = _kv_summed(sub)
        with mock.patch(*MUTATIONS[mutation]) if mutation else contextlib.nullcontext():
            s = run_training(_config(flags, cache, f"{log_dir}/{i}").resolve(ctx.world_size), sub,
                             keep_final_state=True)
        kv = _kv_summed(sub) - before
        out.append((s.losses, s.final_state if sub.tp_rank == 0 and sub.dp_rank == 0 else None, kv))
    return out


def _activations(ctx) -> dict[str, int]:
    """Bytes autograd saves in one forward of llama-tiny's layers at this rank (fp32, micro-batch 1), by
    recomputation mode: the saved-tensor counter of metrics.jsonl."""
    from dataclasses import replace

    from megazero.config.schema import ActivationCheckpointingConfig, model_preset
    from megazero.observe.memory import ActivationMemoryCounter
    from megazero.tensor_parallel.random import RNGTracker

    cfg, out = replace(model_preset("llama-tiny"), num_layers=2), {}
    for mode in ("none", "selective"):
        model = GPT(cfg, ctx.tp_group, rng_tracker=RNGTracker(0, ctx.tp_rank), kv_group=ctx.kv_group(2),
                    activation_checkpointing=ActivationCheckpointingConfig(mode))
        init_parameters(model, 0, ctx.tp_group)
        counter = ActivationMemoryCounter(model)
        ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        with counter.track():
            loss = model(ids, ids.roll(1, 1)).mean()
        loss.backward()
        out[mode] = counter.last
    # decoding runs forward only (no K/V group needed): the logits of the whole model
    model.eval()
    with torch.no_grad():
        out["logits"] = model.full_logits(ids)
    return out


def _tp4_world(ctx, plan: list, cache: str, log_dir: str) -> tuple[list, dict[str, int]]:
    return _runs(ctx, plan, cache, log_dir), _activations(ctx)


@pytest.fixture(scope="module")
def hf_dir(data_cache, tmp_path_factory):
    """A tiny Hugging Face Llama (4 heads on 2 K/V heads, every tensor random) saved locally, and the data
    cache's tokenizer to train it with."""
    from megazero.data import resolve_tokenizer

    root = tmp_path_factory.mktemp("hf-kv")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_((1.0 if "norm" in n else 0.0) + 0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(root)
    return ["--init-from", str(root), "--tokenizer", str(resolve_tokenizer([], 512, data_cache).model_path)]


@pytest.fixture(scope="module")
def single(data_cache, hf_dir, tmp_path_factory) -> dict:
    """One process: the Llama run (4 steps), the first 3 and all 6 steps of a 6-step schedule, and 3 steps from
    the Hugging Face directory."""
    plan = {"four": [*LLAMA, *FOUR], "three": [*LLAMA, *THREE], "six": [*LLAMA, *SIX], "hf": [*hf_dir, *THREE],
            "mqa": [*LLAMA, *FOUR, "--num-kv-heads", "1"]}
    out = run_world(_runs, 1, [(None, None, [*ONE, *f]) for f in plan.values()], data_cache,
                    str(tmp_path_factory.mktemp("kv-single")))
    return dict(zip(plan, [(losses, state) for losses, state, _ in out[0]]))


@pytest.fixture(scope="module")
def tp4(data_cache, hf_dir, tmp_path_factory) -> dict:
    ck = tmp_path_factory.mktemp("kv-ck")
    tp2dp2 = {"tp_size": 2}
    plan = {"tp4": (None, None, [*LLAMA, *FOUR, *ONE, "--tp", "4"]),
            "tp4 SP, 2 micro-batches": (None, None, [*LLAMA, *FOUR, "--micro-batch-size", "4", "--tp", "4",
                                                     "--sequence-parallel"]),
            "saved at tp4": (None, None, [*LLAMA, *THREE, *ONE, "--tp", "4", "--save", f"{ck}/a"]),
            "resumed at tp2·dp2": (tp2dp2, None, [*LLAMA, *SIX, "--micro-batch-size", "4", "--tp", "2",
                                                  "--zero-stage", "3", "--load", f"{ck}/a"]),
            "saved at tp2·dp2": (tp2dp2, None, [*LLAMA, *THREE, "--micro-batch-size", "4", "--tp", "2",
                                                "--zero-stage", "1", "--save", f"{ck}/b"]),
            "resumed at tp4": (None, None, [*LLAMA, *SIX, *ONE, "--tp", "4", "--load", f"{ck}/b"]),
            "from Hugging Face at tp4": (None, None, [*hf_dir, *THREE, *ONE, "--tp", "4"]),
            # one K/V head shared by both TP ranks (the TP group is the K/V group), zero-bubble's split backward
            "MQA at tp2·pp2, zb-h1": ({"tp_size": 2, "pp_size": 2}, None, [
                *LLAMA, *FOUR, "--num-kv-heads", "1", "--micro-batch-size", "2", "--tp", "2", "--pp", "2",
                "--pp-schedule", "zb-h1"])}
    plan.update({m: (None, m, [*LLAMA, *FOUR, *ONE, "--tp", "4"]) for m in MUTATIONS})
    plan["MQA zb-h1 without the sum"] = (plan["MQA at tp2·pp2, zb-h1"][0], "no K/V gradient sum",
                                         plan["MQA at tp2·pp2, zb-h1"][2])
    ranks = run_world(_tp4_world, 4, list(plan.values()), data_cache, str(ck / "logs"), tp=4)
    results = [runs for runs, _ in ranks]
    merged = merge_runs([[(losses, state) for losses, state, _ in rank] for rank in results])
    kv = [[n for _, _, n in rank] for rank in results]
    return {"runs": dict(zip(plan, merged)), "kv": dict(zip(plan, zip(*kv))), "ck": ck,
            "activations": [acts for _, acts in ranks]}


@pytest.fixture(scope="module")
def llama_reference(data_cache):
    ref = run_reference(data_cache, SPEC)
    return ref.losses, ref.final


def test_tp4_on_2_kv_heads_matches_one_process_and_the_independent_reference(tp4, single, llama_reference):
    for label in ("tp4", "tp4 SP, 2 micro-batches"):
        for expected in (single["four"], llama_reference):
            try:
                assert_matches_reference(*tp4["runs"][label], expected, TOL)
            except AssertionError as e:
                raise AssertionError(f"{label}: {e}") from None
    # each rank sums its 2 x hd x H K/V rows' gradient over its pair once per layer and micro-batch (2n counted)
    per_call = 2 * (2 * CFG.head_dim * CFG.hidden_size)
    assert tp4["kv"]["tp4"] == (per_call * SPEC.num_layers * SPEC.train_steps,) * 4
    assert tp4["kv"]["tp4 SP, 2 micro-batches"] == (2 * per_call * SPEC.num_layers * SPEC.train_steps,) * 4
    assert tp4["kv"]["resumed at tp4"] == (per_call * SPEC.num_layers * 3,) * 4
    assert tp4["kv"]["from Hugging Face at tp4"] == (per_call * CFG.num_layers * 3,) * 4
    assert tp4["kv"]["resumed at tp2·dp2"] == (0,) * 4  # tp 2 holds whole K/V heads: nothing shared


def test_checkpoints_reshard_between_tp4_and_tp2(tp4, single):
    """Saved after 3 steps of a 6-step schedule at tp 4 and resumed at tp2·dp2 (ZeRO 3), and the reverse: both
    continue the uninterrupted one-process run; the checkpoint's merged K/V weights are the full tensors."""
    from megazero.checkpoint import CheckpointReader, find_checkpoint

    runs, six_losses = tp4["runs"], single["six"][0]
    for saved, resumed in (("saved at tp4", "resumed at tp2·dp2"), ("saved at tp2·dp2", "resumed at tp4")):
        assert_matches_reference(*runs[saved], (six_losses[:3], single["three"][1]), TOL)
        assert_matches_reference(*runs[resumed], (six_losses[3:], single["six"][1]), TOL)
    reader = CheckpointReader(find_checkpoint(tp4["ck"] / "a"))
    rec = reader.tensors["blocks.0.attn.qkv.weight"]
    assert rec["replicas"] == [1, 2, 2] and rec["local_shape"][0] == 3 * CFG.head_dim
    for name, value in runs["saved at tp4"][1].items():
        assert torch.equal(reader.full_tensor(name), value), name


def test_hugging_face_weights_at_tp4_match_one_process(tp4, single):
    assert_matches_reference(*tp4["runs"]["from Hugging Face at tp4"], single["hf"], TOL)


def test_one_kv_head_on_two_tp_ranks_under_the_zero_bubble_schedule(tp4, single):
    """Multi-query attention at tp 2 (its one K/V head on both ranks, summed over the TP group itself) with the
    split backward of zb-h1 at pp 2, 4 micro-batches: the one-process run."""
    assert_matches_reference(*tp4["runs"]["MQA at tp2·pp2, zb-h1"], single["mqa"], TOL)
    per_call = 2 * (2 * CFG.head_dim * CFG.hidden_size)  # each stage holds 2 of the 4 layers
    assert tp4["kv"]["MQA at tp2·pp2, zb-h1"] == (per_call * 2 * 4 * SPEC.train_steps,) * 4


def test_activations_at_tp4_equal_the_estimate(tp4):
    """A rank's qkv output holds its query head and the shared K/V head (not 2 x kv / tp of one); its attention
    is then multi-head (one query head on one K/V head, nothing repeated): the estimate counts exactly that.
    The trained-from-seed model's logits at tp 4 (forward only, as generation runs it) equal one process's."""
    from dataclasses import replace

    from megazero.config.schema import model_preset
    from megazero.plan.estimate import activation_bytes

    cfg = replace(model_preset("llama-tiny"), num_layers=2)
    single = GPT(cfg).eval()
    init_parameters(single, 0)
    ids = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    want = single.full_logits(ids)
    for acts in tp4["activations"]:
        torch.testing.assert_close(acts.pop("logits"), want, rtol=1e-5, atol=1e-5)  # tp 4 equals one process
        for mode, measured in acts.items():
            est = activation_bytes(cfg, 1, tp_size=4, precision="fp32", checkpointing=mode, fused_attention=True,
                                   mask_bytes=4, fused_norm=False)
            assert measured == est, (mode, measured, est)


def test_negative_controls_miss(tp4, single):
    for m, expected in [*((m, "four") for m in MUTATIONS), ("MQA zb-h1 without the sum", "mqa")]:
        with pytest.raises(AssertionError, match="relative error|normwise error"):
            assert_matches_reference(*tp4["runs"][m], single[expected], TOL)
