"""The canonical form of the training state, independent of the topology, and what a checkpoint reads from
the engine to produce it.

The training state of a parameter is three fp32 tensors of its *local TP shard* shape (vocab padding
included): the ``master`` weight (the parameter itself in fp32 runs; the 16-bit model copy is master rounded,
so it is not stored), ``exp_avg`` and ``exp_avg_sq`` (:data:`KINDS`). Each rank owns runs of elements of these
flattened shards (:meth:`~megazero.zero.optimizer.ZeroOptimizer.owned_state`: all of them at stage 0, a DP
slice at stages 1-3). Parameters are named independently of the topology (``blocks.5.mlp.fc.weight``), so a
checkpoint saved at one (tp, pp, dp, ZeRO stage, precision) loads at any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from megazero.distributed.context import ParallelContext

__all__ = ["FORMAT", "KINDS", "VERSION", "TrainState", "named_params"]

FORMAT, VERSION = "megazero-checkpoint", 1
KINDS = ("master", "exp_avg", "exp_avg_sq")


class TrainState(Protocol):
    """What a checkpoint saves and restores: the engine's model chunks, optimizer, RNG tracker and step, as
    :class:`megazero.train.engine.Engine` provides them (declared here so checkpointing does not import the
    training package above it)."""

    cfg: Any
    ctx: ParallelContext
    chunks: list[torch.nn.Module]
    optimizer: Any
    rng_tracker: Any
    device: torch.device
    step: int
    schedule: str
    virtual_stages: int


def named_params(engine: TrainState) -> list[tuple[str, torch.nn.Parameter, Any]]:
    """``(name, parameter, model chunk)`` for every parameter this rank holds, in chunk order."""
    return [(n, p, chunk) for chunk in engine.chunks for n, p in chunk.named_parameters()]
