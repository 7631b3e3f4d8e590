"""Deterministic, resumable data order for data-parallel training with gradient accumulation.

The data order is an infinite stream: the concatenation of one permutation of all sample indices per
epoch (epoch ``e`` shuffled with the seed sequence ``(seed, e)``). The sampler's position is
``consumed_samples``, the number of global samples taken from that stream. Global batch ``k`` is stream
positions ``k*G .. k*G + G - 1``, whatever the data-parallel size or micro-batch size; DP rank ``r`` takes
the contiguous share ``[r*G/dp, (r+1)*G/dp)`` and splits it into micro-batches of ``micro_batch_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from megazero.data.corpus import DataError

__all__ = ["DistributedBatchSampler", "collate"]


class DistributedBatchSampler:
    """This DP rank's micro-batches of sample indices, one global batch per optimizer step.

    Args:
        num_samples: dataset length (samples per epoch).
        global_batch_size: samples per optimizer step over all DP ranks (``G``).
        micro_batch_size: samples per forward/backward on one rank.
        dp_rank: this rank's index in the data-parallel group.
        dp_size: data-parallel group size.
        seed: shuffling seed (non-negative).
        consumed_samples: stream position to start from (from a checkpoint).
        shuffle: permute each epoch; ``False`` gives the identity order (e.g. for evaluation).

    Raises:
        ValueError: for non-positive sizes, a bad ``dp_rank`` or ``global_batch_size`` not divisible by
            ``micro_batch_size * dp_size``.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        consumed_samples: int = 0,
        shuffle: bool = True,
    ) -> None:
        for name, value in (
            ("num_samples", num_samples),
            ("global_batch_size", global_batch_size),
            ("micro_batch_size", micro_batch_size),
            ("dp_size", dp_size),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if global_batch_size % (micro_batch_size * dp_size) != 0:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size "
                f"({micro_batch_size}) x dp_size ({dp_size}) = {micro_batch_size * dp_size}; "
                "change --global-batch-size, --micro-batch-size or the data-parallel size"
            )
        if seed < 0 or consumed_samples < 0:
            raise ValueError(f"seed and consumed_samples must be non-negative, got {seed} and {consumed_samples}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.consumed_samples = consumed_samples
        self._permutations: dict[int, np.ndarray] = {}

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank per optimizer step (the gradient-accumulation count)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp_size)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be consumed."""
        return self.consumed_samples // self.num_samples

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """Order of the sample indices in ``epoch`` (int64 array of length ``num_samples``)."""
        if epoch not in self._permutations:
            if self.shuffle:
                perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            if len(self._permutations) >= 2:  # a global batch spans at most a few epochs; keep memory flat
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = perm.astype(np.int64)
        return self._permutations[epoch]

    def global_batch_indices(self, consumed_samples: int | None = None) -> list[int]:
        """The ``G`` sample indices of the global batch starting at stream position ``consumed_samples``.

        Defaults to the current position; does not advance the sampler.
        """
        start = self.consumed_samples if consumed_samples is None else consumed_samples
        out: list[int] = []
        pos = start
        end = start + self.global_batch_size
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out.extend(self.epoch_permutation(epoch)[offset : offset + take].tolist())
            pos += take
        return out

    def rank_micro_batches(self, global_indices: Sequence[int]) -> list[list[int]]:
        """Split a global batch into this rank's contiguous share, cut into micro-batches."""
        share = len(global_indices) // self.dp_size
        mine = list(global_indices[self.dp_rank * share : (self.dp_rank + 1) * share])
        mbs = self.micro_batch_size
        return [mine[i : i + mbs] for i in range(0, len(mine), mbs)]

    def next_global_batch(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step; advances ``consumed_samples`` by ``G``."""
        batch = self.rank_micro_batches(self.global_batch_indices())
        self.consumed_samples += self.global_batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Training state: the stream position plus what defines the stream (checked on load)."""
        return {
            "consumed_samples": self.consumed_samples,
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["consumed_samples"]``; dp size, micro- and global batch size may differ.

        Raises:
            ValueError: if the saved dataset length, seed or shuffle setting differs from this sampler's.
        """
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state was saved with {key}={state[key]!r} but this run has {key}="
                    f"{getattr(self, key)!r}; resuming would change the data order (use the same data and seed)"
                )
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise ValueError(f"consumed_samples must be non-negative, got {consumed}")
        self.consumed_samples = consumed

    def __repr__(self) -> str:
        return (
            f"DistributedBatchSampler(num_samples={self.num_samples}, global_batch_size={self.global_batch_size}, "
            f"micro_batch_size={self.micro_batch_size}, dp_rank={self.dp_rank}, dp_size={self.dp_size}, "
            f"seed={self.seed}, consumed_samples={self.consumed_samples})"
        )


def collate(dataset: Any, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples ``dataset[i]`` (each ``[S + 1]`` tokens) into ``(input_ids[B, S], targets[B, S])`` longs."""
    if len(indices) == 0:
        raise ValueError("collate needs at least one sample index")
    batch = torch.stack([torch.as_tensor(dataset[int(i)], dtype=torch.long) for i in indices])
    return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
