"""Activation checkpointing: parity with the run that keeps every activation, dropout masks reproduced by the
recomputation, and the measured activation bytes per rank against :mod:`megazero.plan.estimate`.

Memory is measured as :class:`~megazero.observe.memory.ActivationMemoryCounter` does (the bytes autograd saves for
backward during a forward, de-duplicated by storage, parameters excluded): that is the *device* stash. What
``cpu_checkpointing`` moved out of the graph into host buffers is counted by
:class:`~megazero.tensor_parallel.recompute.CheckpointStats` (``host_bytes``), and the transient that one
recomputation saves during backward by ``recompute_peak_bytes``. On these CPU ranks host and "device" are the
same RAM, so the split is a bookkeeping of where each byte lives, not a saving of physical memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megazero.config.cli import parse_args
from megazero.config.schema import ActivationCheckpointingConfig, ConfigError, ModelConfig
from megazero.model import GPT, init_parameters
from megazero.observe.memory import ActivationMemoryCounter
from megazero.plan.estimate import activation_bytes, checkpoint_host_bytes, recompute_bytes
from megazero.tensor_parallel import recompute
from megazero.tensor_parallel.random import RNGTracker
from tests.common import SMALL_FLAGS, assert_matches_reference, merge_runs, train_runs
from tests.dist import run_world

FULL = ["--activation-checkpointing", "full"]
SELECTIVE = ["--activation-checkpointing", "selective"]
DROPOUT = ["--dropout", "0.1"]


def _ds_file(tmp_path: Path, partition: bool, cpu: bool) -> list[str]:
    """``--deepspeed-config`` with DeepSpeed's activation_checkpointing block."""
    path = tmp_path / f"ds-{int(partition)}{int(cpu)}.json"
    path.write_text(json.dumps({"activation_checkpointing": {"partition_activations": partition,
                                                             "cpu_checkpointing": cpu}}))
    return ["--deepspeed-config", str(path)]


# -- one process: the RNG restore --------------------------------------------------------------------------
def _train_twice(mode: str, cpu: bool) -> tuple[list[float], torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two forward/backward passes of a dropout-0.1 GPT; the losses, the gradients and both RNG streams after."""
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512, dropout=0.1)
    torch.manual_seed(7)
    tracker = RNGTracker(7, 0)
    model = GPT(cfg, rng_tracker=tracker, activation_checkpointing=ActivationCheckpointingConfig(mode, False, cpu))
    init_parameters(model, 0)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(2):
        loss = model(ids, ids.roll(1, 1)).mean()
        loss.backward()
        losses.append(loss.item())
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    return losses, grads, torch.get_rng_state(), tracker.state


@pytest.fixture
def one_thread():
    """One intra-op thread, as in the gloo ranks (the 2 shared cores make more threads spin, not speed up)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_recomputation_reproduces_dropout_masks_and_rng_streams(monkeypatch, one_thread):
    """With dropout 0.1, recomputing (selective, full, full from host memory) gives bitwise the losses and
    gradients of the run that keeps its activations, and leaves both RNG streams where that run leaves them."""
    ref_losses, ref_grads, ref_rng, ref_tracker = _train_twice("none", False)
    for mode, cpu in (("selective", False), ("full", False), ("full", True), ("selective", True)):
        losses, grads, rng, tracker = _train_twice(mode, cpu)
        assert losses == ref_losses, (mode, cpu)
        assert torch.equal(grads, ref_grads), (mode, cpu)
        assert torch.equal(rng, ref_rng) and torch.equal(tracker, ref_tracker), (mode, cpu)
    # control: without restoring the RNG state the recomputation draws other masks and the gradients differ
    monkeypatch.setattr(recompute, "_set_rng_state", lambda *args: None)
    for mode in ("selective", "full"):
        _, grads, _, _ = _train_twice(mode, False)
        assert not torch.allclose(grads, ref_grads, rtol=1e-3, atol=0), mode


def test_checkpoint_refuses_inputs_without_grad():
    """Autograd would never call the recomputation, leaving the parameters inside without gradients."""
    layer = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="needs an input that requires grad"):
        recompute.checkpoint(layer, torch.ones(2, 4), options=recompute.CheckpointOptions())


def _partition_round_trip(ctx) -> bool:
    x = torch.arange(21.0).view(3, 7)  # 21 elements: the last rank's slice is zero-padded
    part = recompute.partition_tensor(x, ctx.tp_group)
    assert part.numel() == 11
    return torch.equal(recompute.gather_partition(part, ctx.tp_group, x.shape), x)


def test_partition_round_trip_with_padding():
    assert run_world(_partition_round_trip, 2, tp=2) == [True, True]


# -- parity with one process (fp32, 1e-5) and identical dropout masks in gloo worlds -----------------------
def _dropout_pairs_equal(merged, pairs: list[tuple[int, int]]) -> None:
    for a, b in pairs:
        (la, sa), (lb, sb) = merged[a], merged[b]
        assert max(abs(x - y) / abs(y) for x, y in zip(la, lb)) <= 1e-6, (a, b, la, lb)
        assert_matches_reference(la, sa, (lb, sb), tol=1e-6)


def test_parity_tp1(reference, data_cache, tmp_path):
    """One process: full, selective from host memory, and a DeepSpeed block; dropout masks with and without
    recomputation."""
    base = ["--micro-batch-size", "8"]
    runs = [[*base, *FULL], [*base, *SELECTIVE, *_ds_file(tmp_path, False, True)],
            [*base, *DROPOUT], [*base, *DROPOUT, *FULL, *_ds_file(tmp_path, True, True)]]
    merged = merge_runs(run_world(train_runs, 1, runs, data_cache, str(tmp_path)))
    for losses, state in merged[:2]:
        assert_matches_reference(losses, state, reference)
    _dropout_pairs_equal(merged, [(3, 2)])
    assert merged[2][0] != reference[0]  # dropout is really on


def test_parity_tp2_sequence_parallel_and_partitioned(reference, data_cache, tmp_path):
    """tp = 2: full with SP, full with partitioned inputs (in host memory too), selective with SP; dropout with
    the TP tracker's streams (attention heads, and the residual stream under SP) reproduced by recomputation."""
    base = ["--tp", "2", "--micro-batch-size", "8"]
    sp = [*base, "--sequence-parallel"]
    runs = [[*sp, *FULL], [*base, *FULL, *_ds_file(tmp_path, True, False)],
            [*base, *FULL, *_ds_file(tmp_path, True, True)], [*sp, *SELECTIVE],
            [*sp, *DROPOUT], [*sp, *DROPOUT, *FULL], [*base, *DROPOUT], [*base, *DROPOUT, *SELECTIVE]]
    merged = merge_runs(run_world(train_runs, 2, runs, data_cache, str(tmp_path), tp=2))
    for losses, state in merged[:4]:
        assert_matches_reference(losses, state, reference)
    _dropout_pairs_equal(merged, [(5, 4), (7, 6)])


def test_parity_pp2(reference, data_cache, tmp_path):
    """pp = 2 (1F1B, 2 micro-batches): full and selective from host memory; dropout with and without."""
    base = ["--pp", "2", "--micro-batch-size", "4", "--global-batch-size", "8"]
    runs = [[*base, *FULL], [*base, *SELECTIVE, *_ds_file(tmp_path, False, True)],
            [*base, *DROPOUT], [*base, *DROPOUT, *FULL, *_ds_file(tmp_path, False, True)]]
    merged = merge_runs(run_world(train_runs, 2, runs, data_cache, str(tmp_path), pp=2))
    for losses, state in merged[:2]:
        assert_matches_reference(losses, state, reference)
    _dropout_pairs_equal(merged, [(3, 2)])


def test_parity_zero3_dp2(reference, data_cache, tmp_path):
    """ZeRO-3 gathers a block's parameters again for its recomputation in backward."""
    runs = [["--zero-stage", "3", "--micro-batch-size", "4", *FULL]]
    for losses, state in merge_runs(run_world(train_runs, 2, runs, data_cache, str(tmp_path))):
        assert_matches_reference(losses, state, reference)


# -- measured activation bytes per rank --------------------------------------------------------------------
# (mode, partition_activations, cpu_checkpointing)
SETTINGS = [("none", False, False), ("selective", False, False), ("selective", False, True),
            ("full", False, False), ("full", True, False), ("full", False, True), ("full", True, True)]
MEM_MODEL = dict(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=512)


def measure_step(ctx, cfg: ModelConfig, micro: int, sp: bool, mode: str, part: bool, cpu: bool,
                 dtype: torch.dtype = torch.float32) -> tuple[int, int, int]:
    """(device stash, recompute transient, host bytes) of one forward/backward of ``cfg`` on this rank."""
    model = GPT(cfg, ctx.tp_group, sequence_parallel=sp, rng_tracker=RNGTracker(0, ctx.tp_rank),
                activation_checkpointing=ActivationCheckpointingConfig(mode, part, cpu))
    init_parameters(model, 0, ctx.tp_group)
    model.to(dtype)
    counter = ActivationMemoryCounter(model)
    ids = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with counter.track():
        loss = model(ids, ids.roll(1, 1)).mean()
    held = model.checkpoint_stats.host_bytes  # host copies alive between forward and backward
    loss.backward()
    stats = model.checkpoint_stats
    assert stats.host_bytes == 0  # every host copy is released once its recomputation consumed it
    return counter.last, stats.recompute_peak_bytes, held


def _measure(ctx, dropout: float, sp: bool, micro: int) -> dict[tuple[str, bool, bool], tuple[int, int, int]]:
    """Per setting: (device stash, recompute transient, host bytes) of one forward/backward on this rank."""
    cfg = ModelConfig(**MEM_MODEL, dropout=dropout)
    return {(mode, part, cpu): measure_step(ctx, cfg, micro, sp, mode, part, cpu)
            for mode, part, cpu in SETTINGS if not (part and sp)}


@pytest.mark.parametrize("tp, sp, micro", [(1, False, 1), (1, False, 2), (2, False, 2), (2, True, 1)])
def test_measured_activation_bytes_match_the_estimator(tp, sp, micro):
    """Every setting at dropout 0 (fused attention) and 0.1 (CPU: unfused attention, float masks): the device
    stash, the recompute transient and the host bytes equal the estimator's figures exactly; partitioning
    divides the kept layer inputs by tp; host memory takes exactly what leaves the device."""
    for dropout in (0.0, 0.1):
        ranks = run_world(_measure, tp, dropout, sp, micro, tp=tp)
        assert all(r == ranks[0] for r in ranks)  # every TP rank holds the same
        got = ranks[0]
        cfg = ModelConfig(**MEM_MODEL, dropout=dropout)
        cpu_kernels = dict(fused_attention=dropout == 0, mask_bytes=4)  # CPU SDPA with dropout is unfused
        for (mode, part, cpu), (stash, transient, host) in got.items():
            kw = dict(tp_size=tp, sequence_parallel=sp, precision="fp32", checkpointing=mode)
            assert stash == activation_bytes(cfg, micro, **kw, **cpu_kernels, partition_activations=part,
                                             cpu_checkpointing=cpu), (mode, part, cpu, dropout)
            assert transient == recompute_bytes(cfg, micro, **kw, **cpu_kernels), (mode, dropout)
            assert host == (checkpoint_host_bytes(cfg, micro, **kw, partition_activations=part) if cpu else 0)
        sbh = micro * cfg.seq_len * cfg.hidden_size * 4 // (tp if sp else 1)  # one layer input, fp32
        none, full = got[("none", False, False)][0], got[("full", False, False)][0]
        assert full < got[("selective", False, False)][0] <= none
        if dropout:  # selective drops the unfused core's s^2 tensors (3 per layer on CPU; at micro-batch 1
            # also the copies of q and k, since v's view keeps the qkv buffer that selective keeps anyway)
            core = 3 * 4 * cfg.num_heads // tp * cfg.seq_len**2 * micro
            core += 2 * 4 * micro * cfg.seq_len * cfg.hidden_size // tp if micro == 1 else 0
            assert none - got[("selective", False, False)][0] == cfg.num_layers * core
        # host memory takes exactly the kept inputs off the device
        assert full - got[("full", False, True)][0] == got[("full", False, True)][2] == cfg.num_layers * sbh
        if not sp:  # partitioned: each TP rank keeps 1/tp of every layer input
            assert full - got[("full", True, False)][0] == cfg.num_layers * sbh * (tp - 1) // tp
            assert got[("full", True, True)][2] == cfg.num_layers * sbh // tp


def test_engine_records_the_checkpointed_stash(data_cache, tmp_path):
    """metrics.jsonl's activation_peak_bytes (the executor's counter) shrinks to the estimator's figure."""
    base = ["--tp", "2", "--micro-batch-size", "8", "--train-steps", "2", "--log-interval", "1"]
    runs = [base, [*base, *FULL], [*base, *FULL, *_ds_file(tmp_path, True, False)]]
    run_world(train_runs, 2, runs, data_cache, str(tmp_path), tp=2)
    cfg = parse_args([*SMALL_FLAGS, *base])
    for i, (mode, part) in enumerate((("none", False), ("full", False), ("full", True))):
        rec = json.loads((tmp_path / f"2-{i}" / "metrics.jsonl").read_text().splitlines()[-1])
        measured = {m["activation_peak_bytes"] for m in rec["memory"]}
        est = activation_bytes(cfg.model, 8, tp_size=2, precision="fp32", checkpointing=mode,
                               partition_activations=part)
        assert measured == {est}, (mode, part, measured, est)


# -- configuration -----------------------------------------------------------------------------------------
def test_configuration(tmp_path):
    cfg = parse_args([*FULL, "--tp", "2", *_ds_file(tmp_path, True, True)]).resolve(2)
    ac = cfg.activation_checkpointing
    assert (ac.mode, ac.partition_activations, ac.cpu_checkpointing) == ("full", True, True)
    assert parse_args(SELECTIVE).resolve(1).activation_checkpointing.mode == "selective"
    with pytest.raises(ConfigError, match="need --activation-checkpointing full or selective"):
        parse_args(_ds_file(tmp_path, False, True)).resolve(1)
    with pytest.raises(ConfigError, match="selective recomputation keeps q, k, v"):
        parse_args([*SELECTIVE, *_ds_file(tmp_path, True, False)]).resolve(1)
    with pytest.raises(ConfigError, match="nothing to split with --sequence-parallel"):
        parse_args([*FULL, "--tp", "2", "--sequence-parallel", *_ds_file(tmp_path, True, False)]).resolve(2)
