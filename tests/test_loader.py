"""The prefetching loader: the same batches in the same order as the synchronous path, the sampler's
position only counts handed-out batches, the next batch is ready before it is asked for, errors surface."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from megazero.data import DistributedBatchSampler, TokenDataset, collate
from megazero.data.loader import PrefetchLoader


def _dataset() -> TokenDataset:
    return TokenDataset(np.arange(5000, dtype=np.int64) % 997, seq_len=16)


@pytest.mark.parametrize("dp_rank, depth", [(0, 1), (1, 3)])
def test_same_batches_in_the_same_order_as_collate(dp_rank, depth):
    ds = _dataset()  # 312 samples: 20 steps of 24 cross an epoch boundary
    ref = DistributedBatchSampler(len(ds), 24, 4, dp_rank, 2, seed=3)
    want = [[collate(ds, idx) for idx in ref.next_global_batch()] for _ in range(20)]
    sampler = DistributedBatchSampler(len(ds), 24, 4, dp_rank, 2, seed=3)
    with PrefetchLoader(ds, sampler, depth=depth, pin_memory=False) as loader:
        for step, batches in enumerate(want):
            got = loader.next_global_batch()
            assert len(got) == len(batches) == 3
            for (x, y), (wx, wy) in zip(got, batches):
                assert torch.equal(x, wx) and torch.equal(y, wy)
            assert sampler.consumed_samples == (step + 1) * 24  # handed out, not prepared
        time.sleep(0.2)
        assert loader.ready == depth  # the thread ran ahead, as far as allowed
        assert sampler.consumed_samples == 20 * 24  # ... without moving the checkpointed position
    assert sampler.state_dict()["consumed_samples"] == ref.consumed_samples


def test_next_batch_is_prepared_while_the_step_runs():
    ds = _dataset()
    sampler = DistributedBatchSampler(len(ds), 8, 8, seed=0)
    with PrefetchLoader(ds, sampler, pin_memory=False) as loader:
        loader.next_global_batch()
        deadline = time.monotonic() + 5
        while loader.ready == 0 and time.monotonic() < deadline:  # "the step" runs here
            time.sleep(0.01)
        assert loader.ready == 1


def test_resume_position_and_errors():
    ds = _dataset()
    sampler = DistributedBatchSampler(len(ds), 8, 8, seed=0, consumed_samples=40)
    with PrefetchLoader(ds, sampler, pin_memory=False) as loader:
        (x, _), = loader.next_global_batch()
    ref = DistributedBatchSampler(len(ds), 8, 8, seed=0, consumed_samples=40)
    assert torch.equal(x, collate(ds, ref.next_global_batch()[0])[0])
    sampler.consumed_samples = 0  # moved behind the loader's back
    with PrefetchLoader(ds, sampler, pin_memory=False) as loader:
        sampler.consumed_samples = 8
        with pytest.raises(RuntimeError, match="out of step"):
            loader.next_global_batch()

    class Broken:
        def __getitem__(self, i):
            raise KeyError("bad sample")

    with PrefetchLoader(Broken(), DistributedBatchSampler(10, 2, 2), pin_memory=False) as loader:
        with pytest.raises(KeyError, match="bad sample"):
            loader.next_global_batch()
