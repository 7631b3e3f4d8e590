"""An RNG tracker so dropout masks differ across TP ranks where activations are sharded and agree elsewhere.

The default torch generator is seeded identically on every TP rank, so dropout on replicated activations
(the residual stream without sequence parallelism) draws the same mask everywhere, as the unsharded model
would. Dropout on sharded activations (attention probabilities of this rank's heads; the residual stream's
sequence shard under sequence parallelism) runs inside :meth:`RNGTracker.fork`, which swaps in a second
generator state seeded per TP rank, so each shard gets its own mask. Both streams are deterministic, so a
rerun with the same seed reproduces every mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["RNGTracker"]

_TP_SEED_OFFSET = 2718


class RNGTracker:
    """A tensor-parallel RNG stream on ``device``, swapped in for the default one inside :meth:`fork`."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        # meta tensors (the dry run) draw no random numbers: keep a host generator's state
        gen = torch.Generator(device="cpu" if self.device.type == "meta" else self.device)
        gen.manual_seed(seed + _TP_SEED_OFFSET + tp_rank)
        self.state = gen.get_state()

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def fork(self) -> Iterator[None]:
        """Run the body with the tracker's RNG state; the default state is untouched afterwards."""
        default = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(default)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"state": self.state.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state["state"].clone()
