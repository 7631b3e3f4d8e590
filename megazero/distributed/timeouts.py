"""Collective timeouts that a real run survives: a long one until the first step is done, then the configured one.

``--dist-timeout`` bounds every collective, so that a rank whose peer died or hung fails instead of waiting
forever. The first step is slower than any later one: ``torch.compile`` compiles every block (and a deep
pipeline's last stage waits in its first receive for every earlier stage's compile), and NCCL sets up each
communicator lazily at its first collective. torchtitan's answer, followed here: start with a long timeout
(``init_timeout_seconds``) and shorten it to the configured one once the first step has run
(``train_timeout_seconds``); the first evaluation (which compiles the blocks again, in eval mode) gets the long
one too.

The long timeout is :data:`FIRST_STEP_TIMEOUT_S` (30 minutes, NCCL's own default) or ``--dist-timeout`` if that
is longer, on CUDA or with ``--compile``; elsewhere (gloo on the CPU without compile) the first step is not
special and the configured timeout holds throughout. The cost: a peer that dies during the first step is
noticed after the long timeout.

torch changes a process group's timeout through a private function, ``distributed_c10d._set_pg_timeout`` (what
torchtitan calls too). Where it or the group registry it walks is missing, :func:`set_collective_timeout` changes
nothing and says so (the run keeps ``--dist-timeout`` throughout, as before).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable

import torch.distributed as dist

__all__ = ["FIRST_STEP_TIMEOUT_S", "first_step_timeout_s", "process_groups", "set_collective_timeout"]

FIRST_STEP_TIMEOUT_S = 1800.0


def first_step_timeout_s(dist_timeout_s: float, compile: bool, device_type: str) -> float:
    """The timeout of the first step (and first evaluation): long where compile or NCCL's lazy set-up runs."""
    if compile or device_type == "cuda":
        return max(dist_timeout_s, FIRST_STEP_TIMEOUT_S)
    return dist_timeout_s


def process_groups(extra: Iterable[dist.ProcessGroup | None] = ()) -> list[dist.ProcessGroup]:
    """Every process group this process belongs to: torch's registry of them (it also holds groups made outside
    :class:`~megazero.distributed.context.ParallelContext`, e.g. ZeRO-3's second DP group), plus ``extra``."""
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None) or {}
    groups = list(registry)
    for pg in extra:
        if pg is not None and all(pg is not g for g in groups):
            groups.append(pg)
    return groups


def set_collective_timeout(seconds: float, groups: Iterable[dist.ProcessGroup]) -> bool:
    """Set the timeout of every collective issued from now on in ``groups``; False where torch offers no way
    (then nothing changed)."""
    setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if setter is None or not dist.is_initialized():
        return False
    timeout = datetime.timedelta(seconds=seconds)
    try:
        for pg in groups:
            setter(timeout, pg)
    except (AttributeError, TypeError, ValueError, RuntimeError):  # a torch whose private API moved
        return False
    return True
