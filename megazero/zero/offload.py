"""ZeRO-Offload's host side (``offload_optimizer: {device: cpu}``, stages 1-3): the optimizer's fp32 state in
host memory, the gradients copied there, and Adam run there, pipelined with the copies.

The fp32 master partition and the Adam moments are allocated in host memory (pinned with ``pin_memory`` when a
GPU is present, so the copies below are asynchronous). A step runs over sub-groups of the owned partition
(``chunk`` elements, DeepSpeed's ``sub_group_size``), as DeepSpeed's CPU-Adam pipelines them:

1. the gradient norm, the sequence-parallel sum and the clipping scale run on the device over the reduced
   gradients in place (:class:`~megazero.zero.host_adam.StagedGrads`), as without offload;
2. the device-to-host copy of sub-group k+1's gradients into one fp32 host buffer (allocated once) is issued
   (on a side stream on CUDA) before Adam of sub-group k starts, so PCIe and the host cores work at once;
3. Adam of sub-group k runs on the host, one fused call per run of decayed / undecayed elements of the flat
   chunk (not per parameter), on this rank's share of the cores (:func:`~megazero.zero.host_adam.host_threads`);
4. the updated sub-group is copied back to the device parameters (on the compute stream, so the next forward
   waits for it) while the next sub-group is computed. From the pinned fp32 master into 16-bit parameters,
   torch's non-blocking copy moves 4 bytes per element and casts on the GPU (into a temporary there);
   ``stage_out`` casts on the host into one of two pinned 16-bit staging chunks first (DeepSpeed's
   ``adam_update_copy``), moving 2 bytes per element for one more pass over host memory. Off by default until
   a GPU run says which costs less.

The arithmetic is the non-overlapped step's, so the result is the same bit for bit (tests/test_offload.py);
DeepSpeed's one-step delayed parameter update, which changes it, is not implemented. In fp32 the device
parameters need a separate host master copy (:class:`~megazero.zero.state.OwnedState` keeps one whenever
offload is on). ``offload_param: {device: cpu}`` (stage 3) is the store's part: :mod:`.stage3` keeps the
parameter shards in host memory and moves each to the device just before its all-gather. With both, Adam runs
here and writes the host shards. With ``offload_param`` alone, the optimizer's states stay on the device: the
fp32 master (kept apart from the host shards even in fp32), the moments and the gradients are all device
tensors, Adam runs there, and the updated master is then written into the host shards in the model dtype (one
copy of Ψ/Nd per step, where DeepSpeed would refuse the combination or mix devices in its optimizer call).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megazero.distributed import device_io
from megazero.zero.adam import ADAM_CHUNK
from megazero.zero.flat import OwnedSegment
from megazero.zero.grads import OwnedGrads
from megazero.zero.host_adam import StagedGrads, host_threads, using_threads

__all__ = ["HostOffload"]

SUB_GROUP = ADAM_CHUNK  # elements per pipelined sub-group (read when a HostOffload is made; tests shrink it)


class HostOffload:
    """Host memory for the optimizer's fp32 state and the pipelined host step (see the module docstring).

    ``pin``: page-locked host memory and asynchronous copies (a GPU is present); ``chunk``: elements per
    sub-group (default :data:`SUB_GROUP`); ``threads``: intra-op threads of the host Adam (None:
    :func:`~megazero.zero.host_adam.host_threads` at each step)."""

    def __init__(self, pin: bool, chunk: int | None = None, threads: int | None = None,
                 stage_out: bool = False) -> None:
        self.pin = pin
        self.chunk = chunk or SUB_GROUP
        self.threads = threads
        # cast the copy-back on the host through two pinned model-dtype chunks (False: copy from the master)
        self.stage_out = stage_out
        self._out: list[torch.Tensor] = []  # the two staging chunks, allocated once
        self._out_done: list[torch.cuda.Event | None] = [None, None]  # each chunk's last copy (pinned)
        self.grads: torch.Tensor | None = None  # the fp32 host copy of the owned gradients, allocated once
        self._staged: StagedGrads | None = None  # this step's gradients, owned_grads -> adam
        self._stream: torch.cuda.Stream | None = None  # the device-to-host copies' side stream (pinned)

    def fp32(self, numel: int, zero: bool) -> torch.Tensor:
        """An fp32 host tensor of ``numel`` elements (zeroed when ``zero``)."""
        return (device_io.zeros if zero else device_io.empty)(numel, torch.float32, self.pin)

    def owned_grads(self, segments: Sequence[OwnedSegment], starts: Sequence[int]) -> OwnedGrads:
        """The reduced owned gradients, still on the device (the norm and clipping run there); :meth:`adam`
        stages them into the fp32 host buffer sub-group by sub-group. ``starts`` are the segments' offsets in
        owned coordinates followed by their total."""
        if self.grads is None:
            self.grads = device_io.empty(starts[-1], torch.float32, self.pin)
        self._staged = StagedGrads(segments, starts, self.grads)
        return self._staged

    def _issue(self, g: StagedGrads, lo: int, hi: int, first: bool) -> torch.cuda.Event | None:
        """Issue the device-to-host copy of gradients ``[lo, hi)``: on the side stream behind the compute
        stream's work so far (pinned; an event to wait on), else synchronously (None)."""
        if not self.pin:
            g.to_host(lo, hi, non_blocking=False)
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        if first:  # the reduced gradients are ready once the compute stream's work so far is done
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            g.to_host(lo, hi, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event

    @torch.no_grad()
    def adam(self, master: torch.Tensor, segments: Sequence[OwnedSegment], starts: Sequence[int],
             update: Callable[[torch.Tensor, int, int], None]) -> None:
        """``update(master[lo:hi], lo, hi)`` (one Adam update of owned elements [lo, hi), reading the gradients
        :meth:`owned_grads` returned) sub-group by sub-group on the host master, pipelined with the copies:
        sub-group k+1's gradients are on their way to the host before sub-group k's update starts, and each
        updated sub-group is copied to the device parameters while the next one is computed."""
        g, self._staged = self._staged, None  # None: the gradients are host tensors already (benchmarks)
        numel = master.numel()
        chunks = [(lo, min(lo + self.chunk, numel)) for lo in range(0, numel, self.chunk)]
        landed: list[torch.cuda.Event | None] = []
        if g is not None:
            g.read_host()  # the update reads the host buffer, chunk k once it has landed
            landed.append(self._issue(g, *chunks[0], first=True))
        with using_threads(self.threads or host_threads()):
            for k, (lo, hi) in enumerate(chunks):
                if g is not None:
                    if k + 1 < len(chunks):
                        landed.append(self._issue(g, *chunks[k + 1], first=False))
                    if landed[k] is not None:
                        landed[k].synchronize()
                    g.finish_chunk(lo, hi)
                update(master[lo:hi], lo, hi)
                self._copy_back(master, segments, starts, k, lo, hi)

    def _staged_out(self, master: torch.Tensor, segments: Sequence[OwnedSegment]) -> bool:
        """Whether the copy-back goes through the pinned staging chunks (allocating them the first time)."""
        dtypes = {s.param.dtype for s in segments}
        if not self.stage_out or len(dtypes) != 1:
            return False
        if not self._out:
            dtype = next(iter(dtypes))
            self._out = [device_io.empty(min(self.chunk, master.numel()), dtype, self.pin) for _ in range(2)]
        return True

    def _copy_back(self, master: torch.Tensor, segments: Sequence[OwnedSegment], starts: Sequence[int], k: int,
                   lo: int, hi: int) -> None:
        """Copy the updated owned elements ``[lo, hi)`` of sub-group ``k`` to the parameters: straight from the
        master, or cast into staging chunk k % 2 (once its copy of sub-group k - 2 is done) and copied from
        there (asynchronously when pinned)."""
        staged = self._staged_out(master, segments)
        src, base = master, 0
        if staged:
            slot = k % 2
            done = self._out_done[slot]
            if done is not None:
                done.synchronize()
            src, base = self._out[slot][: hi - lo], lo
            src.copy_(master[lo:hi])  # the cast to the model dtype, on the host, into the staging chunk
        for s, a in zip(segments, starts):
            a_lo, a_hi = max(a, lo), min(a + s.param.numel(), hi)
            if a_lo < a_hi:
                s.param[a_lo - a: a_hi - a].copy_(src[a_lo - base: a_hi - base], non_blocking=True)
        if staged and self.pin:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream())
            self._out_done[k % 2] = event
