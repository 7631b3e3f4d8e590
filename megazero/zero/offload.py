"""ZeRO-Offload's host side (``offload_optimizer: {device: cpu}``, stages 1-3): the optimizer's fp32 state in
host memory, the gradients copied there, and Adam run there.

The fp32 master partition and the Adam moments are allocated in host memory (pinned with ``pin_memory`` when a
GPU is present, so the copies below are asynchronous). Each step copies this rank's reduced gradient partition
into one fp32 host buffer, allocated once, and runs Adam there in chunks; each updated chunk is copied back to
the device parameters while the next chunk is computed. In fp32 the device parameters therefore need a separate
host master copy (:class:`~megazero.zero.state.OwnedState` keeps one whenever offload is on).
``offload_param: {device: cpu}`` (stage 3) is the store's part: :mod:`.stage3` keeps the parameter shards in
host memory and moves each to the device just before its all-gather. With both, Adam runs here and writes the
host shards. With ``offload_param`` alone, the optimizer's states stay on the device: the fp32 master (kept
apart from the host shards even in fp32), the moments and the gradients are all device tensors, Adam runs
there, and the updated master is then written into the host shards in the model dtype (one copy of Ψ/Nd per
step, where DeepSpeed would refuse the combination or mix devices in its optimizer call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megazero.distributed import device_io
from megazero.zero.adam import ADAM_CHUNK
from megazero.zero.flat import OwnedSegment
from megazero.zero.grads import OwnedGrads

__all__ = ["HostOffload"]


class HostOffload:
    """Host memory for the optimizer's fp32 state; ``pin``: page-locked (a GPU is present)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.grads: torch.Tensor | None = None  # the fp32 host copy of the owned gradients, allocated once

    def fp32(self, numel: int, zero: bool) -> torch.Tensor:
        """An fp32 host tensor of ``numel`` elements (zeroed when ``zero``)."""
        return (device_io.zeros if zero else device_io.empty)(numel, torch.float32, self.pin)

    def owned_grads(self, segments: Sequence[OwnedSegment], starts: Sequence[int]) -> OwnedGrads:
        """The reduced owned gradients copied into the fp32 host buffer, as Adam reads them; ``starts`` are the
        segments' offsets in owned coordinates followed by their total."""
        if self.grads is None:
            self.grads = device_io.empty(starts[-1], torch.float32, self.pin)
        g = self.grads
        for s, a in zip(segments, starts):
            g[a: a + s.grad.numel()].copy_(s.grad, non_blocking=True)
        if self.pin:
            torch.cuda.current_stream().synchronize()  # device-to-host copies done before Adam reads them
        return OwnedGrads([(0, g)])

    @torch.no_grad()
    def adam(self, master: torch.Tensor, segments: Sequence[OwnedSegment], starts: Sequence[int],
             update: Callable[[torch.Tensor, int, int], None]) -> None:
        """``update(master[lo:hi], lo, hi)`` (one Adam update of owned elements [lo, hi)) chunk by chunk on the
        host master; each updated chunk is copied to the device parameters (asynchronously from pinned memory)
        while the next chunk is computed."""
        numel = master.numel()
        for lo in range(0, numel, ADAM_CHUNK):
            hi = min(lo + ADAM_CHUNK, numel)
            update(master[lo:hi], lo, hi)
            for s, a in zip(segments, starts):
                a_lo, a_hi = max(a, lo), min(a + s.param.numel(), hi)
                if a_lo < a_hi:
                    s.param[a_lo - a: a_hi - a].copy_(master[a_lo:a_hi], non_blocking=True)
