"""When ZeRO stage 3 gathers and releases its units: traced order, prefetch, reuse, the live budget, order check.

A *pass* is one chunk's forward (its forward pre-hook to its forward hook) or one backward (from
``start_backward`` to ``finish_backward``, recomputations included). The first pass of each kind records the
order in which it uses the units; later passes of the same kind (keyed by the chunk for a forward, by the
first unit used for a backward) follow that *trace* and gather the next unit one step ahead of its use
(``stage3_prefetch_bucket_size`` > 0, and only within ``stage3_max_live_parameters``).

**Order check.** While a pass is being traced, every gather is preceded by an all-gather of a small
fingerprint (pass kind, gather number, unit id) over the DP group, as a device tensor; if the ranks disagree,
every rank raises :class:`GatherOrderError` naming the modules instead of exchanging mismatched buffers. A
pass that follows its trace needs no check: every rank traced the same order under the check. On a deviation
from the trace, checking resumes (and the pass is traced afresh). So once the traced orders are agreed the
check costs no collective and no host synchronisation.

**Live budget.** ``stage3_max_live_parameters`` bounds the elements of every gathered unit at once (each
all-gather writes straight into the unit's full buffer, so these are the receive buffers too): a prefetch that
would exceed it is skipped, and units kept for reuse are released first when a needed unit would exceed it.

**Reuse.** A unit whose forward runs inside a backward (a recomputation under full activation checkpointing)
is used again by its own backward right after. It stays gathered until then unless more than
``stage3_max_reuse_distance`` elements of other units are gathered in between (0: release at once, and gather
it again for its backward).

**Carry.** Where a chunk's own units are parked from a forward (**Buffers** below), their next gather finds the
values it would all-gather already there, unless an optimizer step (:meth:`GatherScheduler.invalidate`) came in
between (or any other write to the unit's shard: its version is kept), and runs no collective. Each
micro-batch's forward parks them and its backward, or the forward after it, takes them back, while every backward
frees them: a chunk's own units cost one all-gather per micro-batch, not two, whatever the schedule of one chunk
per rank (GPipe, 1F1B, ZB-H1 or none; which passes gather depends on the schedule: ``plan/zeropp.py``). Any
positive ``stage3_max_reuse_distance`` (DeepSpeed's default is 1e9) allows it, however many elements are gathered
in between (the memory is held anyway); 0 carries nothing. So the DP volume is 3mΨ for the blocks and 2mΨ for the
chunk's own units (embeddings, final norm, an untied head; 3mΨ where a rank runs several chunks).
``gathered_parameters()`` releases what it gathered without parking it (its caller may write the values).

**Buffers.** A block unit is gathered into a slot of the store's :class:`~megazero.zero.stage3.slots.SlotPool`
(a chunk's own units into memory of their own, per use, parked from the end of a forward with a graph to the
pass that takes them back, where the rank runs one chunk: **Carry** above); a backward that has used every unit of its
chunk drains the pool. :meth:`GatherScheduler.gather_all` (``gathered_parameters()``) allocates instead, so
holding the whole model once never leaves the pool that large.

**ZeRO++** (:mod:`.hpz`): with hpZ a forward gather also stores this rank's secondary slice and a backward
gather of a unit whose slice is current runs over the node's hpZ group; with qwZ the gathers over the whole group
are INT8-quantized. Gathers outside the step's passes (``gathered_parameters()``, :meth:`GatherScheduler.walk`
for export) are always exact 16-bit gathers over the whole group and leave the secondary partition alone.

**Outside the step.** Evaluation and sampling run the model's forward with the same hooks (no graph: nothing is
kept for a backward) and follow the traced forward. :meth:`GatherScheduler.walk` serves export and the
tied-embedding check: one unit at a time, the next prefetched, checked once per walk.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.zero.stage3.hpz import QuantizedGather, SecondaryShards, Then, WeightComm
from megazero.zero.stage3.slots import SlotPool
from megazero.zero.stage3.units import Unit

__all__ = ["FWD", "BWD", "HOLD", "GatherOrderError", "GatherScheduler"]

FWD, BWD, HOLD = 0, 1, 2
_PHASES = ("forward", "backward", "gathered_parameters()")


class GatherOrderError(RuntimeError):
    """Data-parallel ranks tried to gather different ZeRO-3 parameters at the same point."""


class _Holding:
    """A collective's work handle that keeps its input alive until the handle is dropped (after ``wait``), as
    NCCL keeps an asynchronous collective's input; gloo's all-gather road copies it at once and lets it go."""

    def __init__(self, work: object, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()


class GatherScheduler:
    """Gathers and releases :class:`Unit` buffers over ``dp_group`` (see the module docstring)."""

    def __init__(self, units: list[Unit], dp_group: Group, device: torch.device, placeholder: torch.Tensor,
                 slots: SlotPool, *, prefetch_numel: int, max_live: int, reuse_distance: int,
                 comm: WeightComm | None = None) -> None:
        self.units, self.dp_group, self.device, self.placeholder = units, dp_group, device, placeholder
        self.comm = comm or WeightComm()  # ZeRO++: hpZ's group, qwZ (:mod:`.hpz`)
        self.secondary = (SecondaryShards(units, self.comm.hpz, placeholder.dtype, device)
                          if self.comm.hpz is not None and units else None)
        self.slots = slots  # the persistent buffers gathered units borrow (:mod:`.slots`)
        self.prefetch_numel, self.max_live, self.reuse_distance = prefetch_numel, max_live, reuse_distance
        self.live = 0  # elements gathered (or being gathered) right now
        self.gathered: dict[int, Unit] = {}  # uid -> unit, gathered (or being gathered) right now
        self.kept: dict[int, Unit] = {}  # uid -> unit, of them kept for reuse (``Unit.kept`` is not None)
        self.peak_live = 0
        self.hold = 0  # gathered_parameters() depth: nothing is released while > 0
        self.traces: dict[tuple[int, int], list[int]] = {}
        self.phase = FWD
        self.key: tuple[int, int] | None = None
        self.recorded: list[int] = []
        self.follow: list[int] | None = None
        self.cursor = 0
        self.seq = 0  # gathers in this pass (the check's sequence number)
        self.chunk_units: dict[int, set[int]] = {}  # chunk -> its units' ids
        for u in units:
            self.chunk_units.setdefault(u.chunk, set()).add(u.uid)
        # uid -> its shard's version when parked from a gather of the current parameters ("Carry", module docstring)
        self.carry: dict[int, int] = {}
        self.unused: set[int] | None = None  # a backward: its chunk's units it has not used yet
        # a chunk's own units are parked from its forward to its backward only where the rank runs one chunk: with
        # several (interleaved, zbv) another chunk's backward may run in between, which would hold them too
        self.park_roots = len(self.chunk_units) == 1

    # -- passes ----------------------------------------------------------------------------------------------
    def begin(self, phase: int, chunk: int | None = None) -> None:
        """Start a pass; a backward's key is set by its first use."""
        self.phase, self.seq, self.recorded, self.cursor = phase, 0, [], 0
        self.unused = None
        self.slots.refill()
        self.key = (phase, chunk) if chunk is not None else None
        self.follow = self.traces.get(self.key) if self.key is not None else None

    def end(self) -> None:
        """End the pass: its order becomes the trace to follow (and to stop checking against) next time."""
        if self.key is not None and self.recorded and self.traces.get(self.key) != self.recorded:
            self.traces[self.key] = self.recorded
        self.key, self.follow, self.recorded = None, None, []

    # -- use, prefetch, release ------------------------------------------------------------------------------
    def use(self, unit: Unit) -> None:
        """Make ``unit`` available now, gathering the next unit of the trace one step ahead."""
        if self.hold:
            return
        if self.key is None:  # a backward is keyed by its first unit
            self.key = (self.phase, unit.uid)
            self.follow = self.traces.get(self.key)
            self.unused = set(self.chunk_units[unit.chunk])
        self.recorded.append(unit.uid)
        unit.kept = None
        self.kept.pop(unit.uid, None)
        if self.follow is not None:
            if self.cursor < len(self.follow) and self.follow[self.cursor] == unit.uid:
                self.cursor += 1
            else:  # the order changed: check every gather again until this pass is traced afresh
                self.follow = None
        if not unit.gathered:
            self._make_room(unit.numel)
            self.fetch(unit)
        nxt = self._next(unit)
        if nxt is not None:
            self.fetch(nxt)
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        if self.unused is not None:
            self.unused.discard(unit.uid)
            if not self.unused:  # the backward's last gather: the pool has little left to serve
                self.slots.drain()

    def _next(self, current: Unit) -> Unit | None:
        """The unit the trace uses next (one unit ahead), if it should be prefetched now."""
        if self.follow is None or self.prefetch_numel <= 0:
            return None
        for uid in self.follow[self.cursor:]:
            if uid == current.uid:
                continue
            u = self.units[uid]
            if u.gathered or u.numel > self.prefetch_numel or self.live + u.numel > self.max_live:
                return None
            return u
        return None

    def _make_room(self, numel: int) -> None:
        """Release units kept for reuse while a needed gather would exceed the live budget."""
        for u in list(self.kept.values()):
            if self.live + numel <= self.max_live:
                return
            self.release(u)

    def fetch(self, unit: Unit, pooled: bool = True, check: bool = True) -> None:
        """Start the all-gather of ``unit`` into its full buffer (checked while tracing); the buffer is a slot
        of the pool when ``pooled`` (else allocated for this use)."""
        if self.follow is None and check:
            self.check(unit)
        self.seq += 1
        for u in list(self.kept.values()):  # units kept for reuse age by what is gathered after them
            u.kept += unit.numel
            if u.kept > self.reuse_distance:
                self.release(u)
        restored = self.slots.fill(unit.full.untyped_storage(), unit.full_bytes, pooled and not unit.is_root)
        for p, view in zip(unit.params, unit.views):
            p.data = view
        unit.gathered = True
        self.gathered[unit.uid] = unit
        self.live += unit.numel
        self.peak_live = max(self.peak_live, self.live)
        carried = self.carry.pop(unit.uid, None) == unit.shard._version  # (an unseen write to the shard: gather)
        if restored and carried and self.phase != HOLD:  # its parked memory holds the current values: no gather
            return
        sec = self.secondary if self.phase != HOLD else None
        if sec is not None and self.phase == BWD and sec.fresh(unit):  # hpZ: inside the node
            unit.work = sec.gather(unit)
            return
        shard = device_io.to_device(unit.shard, self.device)  # from host memory with offload_param
        after = (lambda: sec.store(unit)) if sec is not None else None
        if self.comm.quantized and self.phase != HOLD:  # qwZ
            unit.work = QuantizedGather(self.dp_group, unit, shard, self.comm.block, after)
            return
        # the device copy of an offloaded shard lives until the gather is waited on, as under NCCL
        work = _Holding(self.dp_group.all_gather_into(unit.full, shard, tag="param", async_op=True), shard)
        unit.work = Then(work, after) if after is not None else work

    def held(self) -> list[torch.Tensor]:
        """Buffers held beyond the units' own: hpZ's secondary partition."""
        return [self.secondary.flat] if self.secondary is not None else []

    def invalidate(self) -> None:
        """The primary shards changed (an optimizer step): hpZ's secondary slices are stale until re-stored, and
        nothing parked is carried any more."""
        if self.secondary is not None:
            self.secondary.invalidate()
        self.carry.clear()

    def done_with(self, unit: Unit, reused: bool) -> None:
        """A forward of ``unit`` finished: keep it for its imminent ``reused`` backward, or release it."""
        if reused and self.reuse_distance > 0:
            unit.kept = 0
            self.kept[unit.uid] = unit
        else:
            self.release(unit)

    def release(self, unit: Unit) -> None:
        """Free ``unit``'s full buffer (not while ``gathered_parameters()`` holds everything)."""
        if self.hold or not unit.gathered:
            return
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        if unit.staged_in_full:  # its gradients are staged over it (:meth:`staging`): the slot becomes the staging
            unit.staged_in_full = False
            unit.staging_slot = self.slots.take_back(unit.full.untyped_storage())
            unit.staging = unit.staging_slot.view(unit.full.dtype)[: unit.numel]
        elif unit.is_root and self.phase == FWD and self.park_roots and torch.is_grad_enabled():
            self.slots.park(unit.full.untyped_storage())  # its backward gathers it next (:mod:`.slots`, "Parking")
            if self.reuse_distance > 0 and self.slots.parked(unit.full.untyped_storage()):
                self.carry[unit.uid] = unit.shard._version  # gathered in this forward from the current shards
        else:
            self.slots.empty(unit.full.untyped_storage())
        for p in unit.params:
            p.data = self.placeholder.expand(p.shape)
        unit.gathered, unit.kept = False, None
        del self.gathered[unit.uid]
        self.kept.pop(unit.uid, None)
        self.live -= unit.numel

    def staging(self, unit: Unit, dtype: torch.dtype) -> torch.Tensor:
        """A buffer for ``unit``'s local gradients in ``dtype`` (its full buffer's layout). A block gathered in a slot
        of its own dtype stages them over its own parameters: a parameter's gradient reaches its hook once every use
        of it in this backward is done, so it may overwrite the parameter's elements, and :meth:`release` hands the
        slot to ``unit.staging`` instead of the pool (one slot fewer at each block's backward). Otherwise a slot of
        the pool (``unit.staging_slot``), or memory of its own for a chunk's own unit."""
        if (not unit.is_root and unit.gathered and dtype == unit.full.dtype
                and self.slots.lent(unit.full.untyped_storage())):
            unit.staged_in_full = True
            return unit.full
        unit.staging_slot, buf = self.slots.view(unit.numel, dtype, pooled=not unit.is_root)
        return buf

    def gather_all(self) -> None:
        """Gather every unit and hold them (nested calls count); pair with :meth:`release_all`."""
        if self.hold == 0:
            saved = self.phase, self.seq, self.follow
            self.phase, self.seq, self.follow = HOLD, 0, None
            for u in self.units:  # not in slots: the pool would grow to the whole model and stay
                if not u.gathered:
                    self.fetch(u, pooled=False)
            for u in self.units:
                if u.work is not None:
                    u.work.wait()
                    u.work = None
            self.phase, self.seq, self.follow = saved
        self.hold += 1

    def walk(self, units: list[Unit]) -> Iterator[Unit]:
        """Yield ``units`` one at a time, each gathered and released once the caller is done with it, the next
        prefetched meanwhile (within the prefetch size and the live budget): export and the tied-embedding check
        hold one or two units, never the model. One order check covers the whole walk (its length and first
        unit), since a walk has no control flow of its own; units already gathered are left as they are."""
        if not units:
            return
        saved = self.phase, self.seq, self.follow
        self.phase, self.seq, self.follow = HOLD, len(units), None
        ours: list[Unit] = []
        try:
            self.check(units[0])
            for i, unit in enumerate(units):
                if not unit.gathered:
                    self._make_room(unit.numel)
                    self.fetch(unit, check=False)
                    ours.append(unit)
                nxt = units[i + 1] if i + 1 < len(units) else None
                if (nxt is not None and not nxt.gathered and nxt.numel <= self.prefetch_numel
                        and self.live + nxt.numel <= self.max_live):
                    self.fetch(nxt, check=False)
                    ours.append(nxt)
                if unit.work is not None:
                    unit.work.wait()
                    unit.work = None
                yield unit
                if unit in ours:
                    ours.remove(unit)
                    self.release(unit)
        finally:
            for unit in ours:
                self.release(unit)
            self.phase, self.seq, self.follow = saved

    def release_all(self) -> None:
        """Undo one :meth:`gather_all`; the outermost releases every unit."""
        self.hold = max(0, self.hold - 1)
        if self.hold == 0:
            saved, self.phase = self.phase, HOLD  # released, not parked: the caller may have written the values
            for u in self.units:
                self.release(u)
            self.phase = saved

    # -- the order check -------------------------------------------------------------------------------------
    def check(self, unit: Unit) -> None:
        """All-gather (phase, gather number, unit id) over DP; raise on every rank if they differ."""
        group = self.dp_group
        if group.size == 1:
            return
        mine = torch.tensor([self.phase, self.seq, unit.uid], dtype=torch.int64, device=self.device)
        every = torch.empty(group.size * 3, dtype=torch.int64, device=self.device)
        group.all_gather_into(every, mine, tag="check")
        every = every.view(group.size, 3)
        if device_io.read((every == mine).all())[0]:
            return
        lines = []
        values = [int(v) for v in device_io.read(every)]
        for r, (ph, seq, uid) in enumerate(zip(values[::3], values[1::3], values[2::3])):
            name = self.units[uid].name if 0 <= uid < len(self.units) else f"unit #{uid}"
            lines.append(f"rank {r}: {_PHASES[ph] if 0 <= ph < 3 else ph} gather #{seq} of {name}")
        raise GatherOrderError(
            "ZeRO-3: data-parallel ranks disagree on which parameters to gather next (" + "; ".join(lines)
            + "). Every DP rank must run the model's submodules in the same order (same control flow).")
