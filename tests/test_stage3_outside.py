"""ZeRO-3 outside the training step: evaluation, sample generation and export gather unit by unit, never the
whole model, so none peaks above the step itself; the order check stays off the traced paths. And inside it:
block-sized buffers come from the store's persistent slots, not from an allocation per use.

One gloo world, dp 4, a 6-layer GPT with every parameter sharded (persistence 0). Peaks are measured by the
tracker of metrics.jsonl (:class:`~megazero.observe.memory.PeakMemoryTracker`) on the tensors themselves; the
export's host copies are emulated host memory (:class:`~megazero.distributed.device_io.EmulatedHost`), which the
tracker leaves out as a GPU run's tracker leaves out CPU tensors.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.config.cli import parse_args
from megazero.distributed import device_io
from megazero.generate import generate_samples
from megazero.observe.memory import PeakMemoryTracker, zero_buffers
from megazero.train.engine import Engine
from tests.dist import run_world

FLAGS = ["--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512", "--num-layers", "6",
         "--zero-stage", "3", "--micro-batch-size", "1", "--global-batch-size", "8"]


class _Codec:
    """A tokenizer stand-in: characters to ids below the vocabulary."""

    eos_id = 0
    vocab_size = 512  # the session cache's tokenizer size (tests/conftest.py)

    def encode(self, text: str) -> list[int]:
        return [1 + ord(c) % 500 for c in text]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


class _BlockAllocations(TorchDispatchMode):
    """Counts the allocations of at least ``nbytes``: new tensors, and storages resized up (ZeRO-3's old way to
    gather and release, which the dispatcher does not see)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.count = nbytes, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
            self.count += out.untyped_storage().nbytes() >= self.nbytes
        return out

    def __enter__(self):
        self._resize, counter = torch.UntypedStorage.resize_, self

        def resize_(st, size):
            counter.count += size >= counter.nbytes
            return counter._resize(st, size)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)


def _batch(ctx, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 512, (8, 32), generator=g)[2 * ctx.dp_rank: 2 * ctx.dp_rank + 2]
    return list(zip(x.split(1), x.roll(-1, 1).split(1)))


def _outside_world(ctx, cache: str) -> dict:
    cfg = parse_args([*FLAGS, "--cache-dir", cache]).resolve(ctx.world_size)
    engine = Engine(replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0)), ctx)
    opt, checks = engine.optimizer, (ctx.dp_group.name, "all_gather", "check")
    for step in range(2):  # the forward and backward orders are traced
        engine.train_step(_batch(ctx, step))

    def tracked(fn) -> tuple[int, int, object]:
        """(peak bytes, order checks issued, result) of ``fn``."""
        tracker = PeakMemoryTracker("cpu", lambda: zero_buffers(opt), engine.chunks)
        before = ctx.ledger.calls[checks]
        with tracker:
            out = fn()
        return tracker.result()["peak_bytes"], ctx.ledger.calls[checks] - before, out

    out = {"step": tracked(lambda: engine.train_step(_batch(ctx, 2)))[:2]}
    block = max(u.full_bytes for u in opt.store.units if not u.is_root)
    with _BlockAllocations(block) as allocs:  # two micro-batches: 2 x 7 gathers, 2 x 6 stagings, 2 x 6 reductions
        engine.train_step(_batch(ctx, 3))
    out["block_allocations"], out["slot_bytes"], out["block"] = allocs.count, opt.store.slots.slot_bytes, block
    out["eval"] = tracked(lambda: engine.eval_loss(_batch(ctx, 3)))
    out["generate"] = tracked(lambda: generate_samples(engine, _Codec(), ["hello world"], 4))
    with device_io.use(device_io.EmulatedHost("cpu")):  # the export's copies are host memory
        out["export"] = tracked(engine.full_state_dict)
    # the same three through the whole gathered model, for their values
    with opt.gathered_parameters():
        whole = {n: p.detach().clone() for n, p in engine.chunks[0].named_parameters()}
        out["eval_whole"] = engine.eval_loss(_batch(ctx, 3))
        out["generate_whole"] = generate_samples(engine, _Codec(), ["hello world"], 4)
    out["whole"] = whole
    out["gathered_after"] = sum(u.gathered for u in opt.store.units)
    out["slots"] = opt.store.slots.count
    return out


@pytest.fixture(scope="module")
def world(data_cache) -> list[dict]:
    return run_world(_outside_world, 4, data_cache, timeout=300)


def test_evaluation_sampling_and_export_stay_below_the_step_at_dp4(world) -> None:
    """dp 4, every parameter sharded: ``eval_loss``, ``generate_samples`` and ``full_state_dict`` each peak no
    higher than a training step (before, each gathered the whole replica: twice the sharded states at this
    size), give the values the whole gathered model gives, leave nothing gathered, and check the gather order
    at most once (evaluation and sampling follow the traced forward; the export's walk is checked once)."""
    for r in world:
        step_peak, step_checks = r["step"]
        assert step_checks == 0
        for name in ("eval", "generate", "export"):
            peak, checks, _ = r[name]
            assert 0 < peak <= step_peak, (name, peak, step_peak)
            assert checks == (1 if name == "export" else 0), (name, checks)
        assert r["eval"][2] == r["eval_whole"] and r["generate"][2] == r["generate_whole"]
        export = r["export"][2]
        assert export.keys() == r["whole"].keys()
        assert all(torch.equal(export[k], r["whole"][k][: export[k].shape[0]]) for k in export)
        assert r["gathered_after"] == 0 and r["slots"] <= 4, (r["gathered_after"], r["slots"])


def test_block_buffers_come_from_the_slots(world) -> None:
    """A steady training step of 2 micro-batches at dp 4 (6 blocks, each gathered for its forward and backward
    and its gradients staged): the slots are exactly a block's buffer, and block-sized allocations are the
    pool's refills after each backward's drain (at most 4 per micro-batch: the forward's two gathers, the
    backward's staging, the last block's staging), not one per gather and per staging (about 24 before)."""
    for r in world:
        assert -(-r["block"] // 64) * 64 == r["slot_bytes"]
        assert 0 < r["block_allocations"] <= 8, r["block_allocations"]
