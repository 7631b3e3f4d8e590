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

The arithmetic is the non-overlapped step's, so the result is the same bit for bit (tests/test_offload.py). In
fp32 the device parameters need a separate host master copy (:class:`~megazero.zero.state.OwnedState` keeps one
whenever offload is on). ``offload_param: {device: cpu}`` (stage 3) is the store's part: :mod:`.stage3` keeps the
parameter shards in host memory and moves each to the device just before its all-gather. With both, Adam runs
here and writes the host shards. With ``offload_param`` alone, the optimizer's states stay on the device: the
fp32 master (kept apart from the host shards even in fp32), the moments and the gradients are all device
tensors, Adam runs there, and the updated master is then written into the host shards in the model dtype (one
copy of Ψ/Nd per step, where DeepSpeed would refuse the combination or mix devices in its optimizer call).

**The one-step delayed parameter update** (``--offload-delayed-update``, ZeRO-Offload's DPU; off by default). The
pipelined step above still leaves the device idle while the host Adam runs. With DPU the host Adam of step t runs
in a background thread (torch's ops release the GIL) while the device computes step t + 1, and its result lands
at the end of step t + 1. The exact semantics, with θ_t the master after step t's update:

* Step t's forward and backward see θ_{t-2} (θ_{t-1} when step t - 1 was not delayed). Step t's update is still
  Adam(θ_{t-1}, g_t) on the host master: only the gradient is one step stale, as in DeepSpeed.
* At the end of step t (:meth:`begin_step`, then :meth:`adam`: :meth:`stage_delayed`, :meth:`land`,
  :meth:`launch`):
  1. step t - 1's thread is joined: it is done with the one fp32 host gradient buffer and the master;
  2. g_t's device-to-host copy into that buffer is issued (on the side stream when pinned);
  3. θ_{t-1} is copied from the master into the device parameters (on the compute stream, beside 2.; the store
     then all-gathers them: a collective, so on the main thread), so step t + 1's forward sees θ_{t-1};
  4. the compute stream waits for 2., so step t + 1's backward cannot overwrite the device gradients before they
     left, and a new thread runs step t's Adam over the host master in sub-groups, once the copy-back of
     θ_{t-1} (pinned: an event) and g_t's copy have completed.
  With one host gradient buffer, g_t's copy waits for step t - 1's Adam to end (a second buffer, 4Ψ/Nd more host
  memory, would let it run during that Adam).
* The first ``offload_delayed_update_after`` steps run without the delay (DeepSpeed starts DPU after a few
  warm-up steps); a skipped step (non-finite norm, an fp16 overflow: the norm is known before the update is
  launched) launches nothing, and the pending update still lands at its end (the optimizer flushes).
* The update a thread runs is the optimizer's own closure (``update``), the same arithmetic as the synchronous
  step, with the step count bound when it was made; the step tensor it reads is filled again only after
  :meth:`begin_step` joined it.
* :meth:`land` without a launch is the flush (``ZeroOptimizer.flush``): the loop calls it before an evaluation,
  samples, a checkpoint and at the end, and the optimizer's state reads (``owned_state``, ``master_params``,
  the gathered walks) call it too, so a checkpoint holds the parameters and moments of one step. After a flush the
  next forward sees the newest parameters (a resumed run starts the same way). A run that raises joins the thread
  (:meth:`join`) and leaves the host state at a step boundary; a killed run resumes from its last checkpoint.
* **A failed update stops every rank, at the same place.** The thread's error (a ``MemoryError``, a failed check)
  happens on one rank, while its peers would go on into the collective that follows the landing (the parameters'
  all-gather) and wait there until the collective timeout. So the ranks agree first. Before its gradient norm is
  summed, a step joins the pending update (:meth:`settle`; it used to be joined after the step's host read: the
  device keeps computing either way) and appends a failure flag, one fp64 slot per rank (:meth:`with_flags`), to
  the norm's all-reduce over DP (stages 1-3 make it: :func:`host_offload` refuses stage 0) and the model-parallel
  group: no new collective and no new host read, as the norm the step reads is -1 when a flag is set
  (:meth:`fold_flags`). Every rank then raises the same :class:`DelayedUpdateError` naming the failing ranks (the
  failing rank chains its own error) and drops the update: nothing lands, nothing is all-gathered. A skipped step
  lands the pending update on that agreement too. A flush agrees through one all-reduce of the flags alone and a
  read (:meth:`agree`; it is off the step's path). The run resumes from its last checkpoint: a failed rank's
  master may hold part of an update.
* **Cores.** The thread runs Adam on :func:`~megazero.zero.host_adam.host_threads` intra-op threads on the CPU
  device; where a GPU is the device, on one fewer (at least 1), so the main thread keeps a core to launch the
  device's work (DeepSpeed's CPU Adam does likewise); the synchronous host Adam, with nothing beside it, keeps all.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Sequence

import torch

from megazero.config.schema import ZeroConfig
from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.zero.adam import ADAM_CHUNK
from megazero.zero.bucketed import sharded_state
from megazero.zero.flat import OwnedSegment
from megazero.zero.grads import OwnedGrads
from megazero.zero.host_adam import StagedGrads, host_threads, using_threads

__all__ = ["DelayedUpdateError", "HostOffload", "host_offload"]

SUB_GROUP = ADAM_CHUNK  # elements per pipelined sub-group (read when a HostOffload is made; tests shrink it)


class HostOffload:
    """Host memory for the optimizer's fp32 state and the pipelined host step (see the module docstring).

    ``pin``: page-locked host memory and asynchronous copies (a GPU is present); ``chunk``: elements per
    sub-group (default :data:`SUB_GROUP`); ``threads``: intra-op threads of the host Adam (None:
    :func:`~megazero.zero.host_adam.host_threads` at each step, one fewer on the delayed update's thread where
    ``gpu``: the device is a GPU). ``rank`` (this process's global rank), ``slot`` and ``slots``: where this rank
    writes its failure flag among the ``slots`` the flags are summed over (:meth:`failure_flags`)."""

    def __init__(self, pin: bool, chunk: int | None = None, threads: int | None = None,
                 stage_out: bool = False, delayed_after: int | None = None, gpu: bool = False,
                 rank: int = 0, slot: int = 0, slots: int = 1) -> None:
        self.pin = pin
        self.gpu = gpu
        self.rank, self.slot, self.slots = rank, slot, slots
        self.chunk = chunk or SUB_GROUP
        self.threads = threads
        # cast the copy-back on the host through two pinned model-dtype chunks (False: copy from the master)
        self.stage_out = stage_out
        self._out: list[torch.Tensor] = []  # the two staging chunks, allocated once
        self._out_done: list[torch.cuda.Event | None] = [None, None]  # each chunk's last copy (pinned)
        self.grads: torch.Tensor | None = None  # the fp32 host copy of the owned gradients, allocated once
        self._staged: StagedGrads | None = None  # this step's gradients, owned_grads -> adam
        self._stream: torch.cuda.Stream | None = None  # the device-to-host copies' side stream (pinned)
        # the delayed update: None off, else the optimizer steps run synchronously before the delay starts
        self.delayed_after = delayed_after
        self._delayed: tuple[StagedGrads, torch.cuda.Event | None] | None = None  # stage_delayed -> launch
        self._worker: _Worker | None = None  # the running (or finished, not yet landed) delayed Adam
        self._copied_back: torch.cuda.Event | None = None  # the last copy-back out of the pinned master
        self._delay_now = False  # this step's adam() is delayed (begin_step)
        self._flags: torch.Tensor | None = None  # the summed failure flags of the last fold_flags

    # -- the one-step delayed update (module docstring) -------------------------------------------------------
    def delays(self, steps_done: int) -> bool:
        """Whether the step after ``steps_done`` optimizer steps runs its Adam delayed."""
        return self.delayed_after is not None and steps_done >= self.delayed_after

    @property
    def pending(self) -> bool:
        """Whether a delayed update was launched and has not landed yet."""
        return self._worker is not None

    def begin_step(self, steps_done: int) -> None:
        """Before the step after ``steps_done`` optimizer steps calls :meth:`adam`: wait for the pending update,
        which is then done with the host gradient buffer and Adam's step tensor, and decide whether this step's
        update is delayed."""
        self.wait()
        self._delay_now = self.delays(steps_done)

    def _adam_delayed(self, master: torch.Tensor, segments: Sequence[OwnedSegment], starts: Sequence[int],
                      update: Callable[[torch.Tensor, int, int], None]) -> None:
        """:meth:`adam` of a delayed step: this step's gradients leave for the host, the previous update lands in
        the parameters, and this step's update starts on a host thread (the module docstring's 2.-4.)."""
        self.stage_delayed()
        self.land(master, segments, starts)
        self.launch(master, update)

    def stage_delayed(self) -> StagedGrads:
        """Issue the copy of this step's (scaled) gradients from the device into the fp32 host buffer, whole
        (pinned: on the side stream; else at once), for :meth:`launch`; returns them, reading the host buffer from
        now on. The buffer is single: the previous update must have finished reading it (:meth:`wait`)."""
        g, self._staged = self._staged, None
        if g is None:
            raise RuntimeError("HostOffload.stage_delayed needs owned_grads first")
        event = self._issue(g, 0, self.grads.numel(), first=True)
        g.read_host()
        self._delayed = (g, event)
        return g

    def land(self, master: torch.Tensor, segments: Sequence[OwnedSegment], starts: Sequence[int]) -> bool:
        """Join the pending delayed update (re-raising its error) and copy the master into the device parameters,
        sub-group by sub-group; False when none was pending. The caller all-gathers the parameters after."""
        if self._worker is None:
            return False
        self.wait()
        self._worker = None
        for k, lo in enumerate(range(0, master.numel(), self.chunk)):
            self._copy_back(master, segments, starts, k, lo, min(lo + self.chunk, master.numel()))
        if self.pin:  # the next update writes the master only once these copies have read it
            self._copied_back = torch.cuda.Event()
            self._copied_back.record(torch.cuda.current_stream())
        return True

    def launch(self, master: torch.Tensor, update: Callable[[torch.Tensor, int, int], None]) -> None:
        """Start ``update(master[lo:hi], lo, hi)`` over the sub-groups on a background thread, reading the gradients
        :meth:`stage_delayed` copied (after their copy and the last copy-back out of the master completed); the
        thread sees the caller's context (the emulated host of a test) and runs on :meth:`worker_threads` cores."""
        if self._delayed is None or self._worker is not None:
            raise RuntimeError("HostOffload.launch needs stage_delayed first and no update pending (land it)")
        (g, copied), self._delayed = self._delayed, None
        if self.pin:  # the next backward writes the device gradients only after they left
            torch.cuda.current_stream().wait_stream(self._stream)
        read_back, numel, chunk = self._copied_back, master.numel(), self.chunk
        threads = self.worker_threads()

        @torch.no_grad()
        def run() -> None:
            for event in (read_back, copied):
                if event is not None:
                    event.synchronize()
            with using_threads(threads):
                for lo in range(0, numel, chunk):
                    hi = min(lo + chunk, numel)
                    g.finish_chunk(lo, hi)
                    update(master[lo:hi], lo, hi)

        self._worker = _Worker(contextvars.copy_context(), run)
        self._worker.start()

    def wait(self) -> None:
        """Wait for the pending delayed update to finish (it stays pending until :meth:`land`); re-raise its error."""
        worker = self._worker
        if worker is not None:
            worker.join()
            if worker.error is not None:
                self._worker = None
                raise RuntimeError("the delayed host Adam step failed") from worker.error

    def join(self) -> None:
        """Wait for a pending delayed update without landing it or raising (a run unwinding from an error)."""
        if self._worker is not None:
            self._worker.join()

    def worker_threads(self) -> int:
        """Intra-op threads of the delayed update's thread: ``threads``, else :func:`host_threads`, less one where
        the device is a GPU (at least 1): the main thread keeps a core to launch the device's work meanwhile."""
        if self.threads:
            return self.threads
        n = host_threads()
        return max(1, n - 1) if self.gpu else n

    def settle(self) -> BaseException | None:
        """Join the pending delayed update without landing it or raising; return its error (None: it succeeded, or
        none is pending). The ranks then agree on it (:meth:`failure_flags`) before anything lands."""
        self.join()
        return self._worker.error if self._worker is not None else None

    def failure_flags(self, device: torch.device) -> torch.Tensor:
        """Join the pending delayed update and return this rank's failure flags: ``slots`` fp64 zeros on ``device``,
        one per rank the flags are summed over, holding this rank's global rank + 1 at its ``slot`` when its update
        raised. Summed over DP and the model-parallel group (beside the gradient norm), they say on every rank which
        ranks failed (:func:`failed_ranks`)."""
        failed = self.settle() is not None
        flags = torch.zeros(self.slots, dtype=torch.float64, device=device)
        if failed:
            flags[self.slot] = float(self.rank + 1)
        return flags

    def with_flags(self, sq: torch.Tensor) -> torch.Tensor:
        """``sq`` (the step's local squared gradient norm, shape (1,)) followed by :meth:`failure_flags`: summed with
        it over DP and the model-parallel group, then :meth:`fold_flags`."""
        return torch.cat([sq, self.failure_flags(sq.device)])

    def fold_flags(self, summed: torch.Tensor) -> torch.Tensor:
        """The global squared norm from :meth:`with_flags`' summed vector, -1 when a flag is set (the step's one
        host read carries the agreement; :meth:`raise_failure` then reads the flags to name the ranks)."""
        self._flags = summed[1:]
        return summed[0].masked_fill(self._flags.any(), -1.0)

    def raise_failure(self, step: int) -> None:
        """After :meth:`fold_flags` gave -1: raise :class:`DelayedUpdateError` (on every rank alike)."""
        self._raise_if_failed(device_io.read(self._flags), step)

    def agree(self, device: torch.device, groups: Sequence[Group | None], step: int) -> None:
        """Before a flush lands the pending update: sum the failure flags over ``groups`` (DP, the model-parallel
        group) and raise on every rank alike if any is set (one all-reduce per group and a read, off the step's
        path)."""
        flags = self.failure_flags(device)
        for group in groups:
            if group is not None:
                group.all_reduce(flags, tag="other")
        self._raise_if_failed(device_io.read(flags), step)

    def _raise_if_failed(self, flags: Sequence[float], step: int) -> None:
        """Given the failure flags summed over all ranks: when any is set, drop the pending update (nothing lands)
        and raise the same error as every other rank; the failing rank chains its own error."""
        ranks = failed_ranks(flags)
        if ranks:
            own = self.settle()
            self._worker, self._delayed = None, None
            raise delayed_update_error(ranks, step, own) from own

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
        if self._delay_now:
            self._adam_delayed(master, segments, starts, update)
            return
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


class DelayedUpdateError(RuntimeError):
    """A delayed host Adam update failed on some rank; every rank raises it at the same point (module docstring)."""


def failed_ranks(flags: Sequence[float]) -> list[int]:
    """The global ranks set in the summed failure flags (:meth:`HostOffload.failure_flags`: rank + 1 per slot)."""
    return sorted(int(f) - 1 for f in flags if f > 0)


def host_offload(cfg: ZeroConfig, dp_group: Group, norm_group: Group | None) -> HostOffload | None:
    """The optimizer's host side as ``cfg`` asks (None without ``offload_optimizer: cpu``): pinned where a GPU is
    present and asked; the delayed update after ``offload_delayed_update_after`` steps, its thread leaving the main
    thread a core where the device (``dp_group``'s) is a GPU, its failure flags one slot per rank of DP x the
    model-parallel group (``norm_group``), placed by the groups' ranks (no torch.distributed here).

    The delayed update needs partitioned optimizer states (stages 1-3): the flags are summed over DP inside the
    gradient norm's all-reduce, which stage 0 does not make over DP (config/resolve.py refuses it too)."""
    if cfg.offload_optimizer != "cpu":
        return None
    delayed = cfg.offload_delayed_update_after if cfg.offload_delayed_update else None
    if delayed is not None and not sharded_state(cfg.stage).optimizer_states:
        raise ValueError(f"the delayed update (offload_delayed_update, --offload-delayed-update) needs ZeRO stage 1-3, "
                         f"got stage {cfg.stage}: its failure flags ride on the gradient norm's all-reduce over DP, "
                         f"which stage 0 does not make; raise the stage or turn the delayed update off")
    mp_rank, mp = (norm_group.rank, norm_group.size) if norm_group is not None else (0, 1)
    return HostOffload(cfg.offload_optimizer_pin_memory and torch.cuda.is_available(), delayed_after=delayed,
                       gpu=dp_group.device.type == "cuda", rank=dp_group.global_rank(dp_group.rank),
                       slot=mp_rank * dp_group.size + dp_group.rank, slots=mp * dp_group.size)


def delayed_update_error(ranks: Sequence[int], step: int, own: BaseException | None) -> DelayedUpdateError:
    """The error every rank raises when the delayed update of optimizer step ``step`` failed on ``ranks``; ``own``
    is this rank's error (None on a rank whose update succeeded)."""
    which = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    here = (f"this rank's error: {type(own).__name__}: {own}" if own is not None
            else f"see the log of {which} for its error")
    return DelayedUpdateError(
        f"the delayed host Adam update of optimizer step {step} (--offload-delayed-update) failed on {which} ({here}); "
        f"every rank stops here and none lands it. Resume from the last checkpoint (a failed rank's master may hold "
        f"part of the update); without --offload-delayed-update the host Adam runs on the main thread")


class _Worker(threading.Thread):
    """A daemon thread running ``fn`` inside ``context``, keeping the exception it raised (for :meth:`HostOffload.land`)."""

    def __init__(self, context: contextvars.Context, fn: Callable[[], None]) -> None:
        super().__init__(name="megazero-host-adam", daemon=True)
        self.context, self.fn = context, fn
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.context.run(self.fn)
        except BaseException as e:  # re-raised on the main thread by land()
            self.error = e
