"""The host side of an offloaded Adam step: how many cores it runs on, and the gradients it reads.

**Cores.** torch's fused CPU Adam(W) kernel (``torch._fused_adamw_``, what :func:`~megazero.zero.adam.adam_update`
calls) already splits each tensor over ATen's intra-op pool (``at::parallel_for`` in cache-line units), so one
call per flat chunk uses every thread torch is allowed (bench/offload.py --host-adam measures it: CPU time over
wall time at 1 and 2 threads). What can leave cores idle is the pool's size: torchrun sets ``OMP_NUM_THREADS=1``
for every rank it starts on a node, so a rank's host Adam would run on one core while the others idle.
:func:`host_threads` gives each rank its share of the machine (the cores it may run on over torchrun's
``LOCAL_WORLD_SIZE``) and :func:`using_threads` applies it around the update only; without torchrun (tests, one
process) the pool is left as the caller set it.

**Gradients.** :class:`StagedGrads` are the owned gradients of an offloaded step: they stay on the device for
the norm, the sequence-parallel all-reduce and the clipping (all device work, as without offload), and are read
from the fp32 host buffer once :class:`~megazero.zero.offload.HostOffload` has staged them there chunk by chunk,
so each chunk's device-to-host copy overlaps the Adam update of the chunk before it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from megazero.zero.flat import OwnedSegment
from megazero.zero.grads import OwnedGrads

__all__ = ["StagedGrads", "host_threads", "using_threads"]


def host_threads() -> int:
    """Intra-op threads for this rank's host Adam: its share of the cores it may run on under torchrun
    (``LOCAL_WORLD_SIZE`` ranks per node), else torch's current setting (a test rank's, a single process's)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not local:
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(local)))


@contextmanager
def using_threads(n: int) -> Iterator[None]:
    """ATen's intra-op pool at ``n`` threads inside the block, restored after it."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


class StagedGrads(OwnedGrads):
    """Owned gradients that start on the device (the store's reduced segments, used in place) and move to the
    fp32 host buffer ``host`` chunk by chunk: :meth:`to_host` issues the copy of owned elements ``[lo, hi)``,
    :meth:`read_host` switches reads to ``host`` (whose chunks the caller has waited for, and passed to
    :meth:`finish_chunk`, before Adam reads them).

    :meth:`scale_` (unscaling and clipping) runs on the device before the copies: fp32 parts are multiplied in
    place, the factor of 16-bit parts is applied to their fp32 host copy by :meth:`finish_chunk`, the same
    arithmetic as scaling the host copy (fp32(g) * factor)."""

    def __init__(self, segments: Sequence[OwnedSegment], starts: Sequence[int], host: torch.Tensor) -> None:
        super().__init__([(a, s.grad) for s, a in zip(segments, starts)])
        self.host = host
        self._device_parts = list(zip(self.bounds, self.parts))
        self._host_factor = 1.0  # the factor still owed by 16-bit parts' host copies (set by read_host)

    def to_host(self, lo: int, hi: int, non_blocking: bool) -> None:
        """Copy owned elements ``[lo, hi)`` from the device segments into ``host`` (cast to fp32)."""
        for a, t in self._device_parts:
            x, y = max(a, lo), min(a + t.numel(), hi)
            if x < y:
                self.host[x:y].copy_(t[x - a: y - a], non_blocking=non_blocking)

    def finish_chunk(self, lo: int, hi: int) -> None:
        """After ``[lo, hi)`` landed in ``host``: apply the pending scale factor to its 16-bit parts' copies."""
        if self._host_factor == 1.0:
            return
        for a, t in self._device_parts:
            x, y = max(a, lo), min(a + t.numel(), hi)
            if x < y and t.dtype != torch.float32:
                self.host[x:y].mul_(self._host_factor)

    def read_host(self) -> None:
        """From now on reads (:meth:`slice`, :meth:`fp32_runs`) see ``host``: one fp32 part, already scaled."""
        self._host_factor = self._factor
        self.parts, self.bounds, self._factor = [self.host], [0], 1.0
