"""ZeRO-3's constant buffers (ZeRO-R's C_B and M_D): equal byte *slots*, allocated once and reused.

A gathered unit's full buffer, a unit's gradient staging and a reduction's converted chunk are all at most one
block's bytes, and only a few exist at once. Instead of allocating and freeing one at every use (which glibc
keeps in its heap after the first free, and CUDA's caching allocator splits and caches), they borrow a slot:

* a unit's full buffer keeps its own storage object (autograd's saved tensors alias it and must see the values
  again when the unit is re-gathered), so the slot's memory is *swapped into* that storage
  (``UntypedStorage._swap_data_ptr_``, which FSDP and CUDA graph trees use the same way) and swapped back out on
  release: the storage is empty again, as after ``resize_(0)``, and the memory returns to the pool;
* staging and converted chunks are views of a slot.

Slots are ``slot_bytes`` each (the largest block unit's need, set by the store) and serve the block units only:
their buffers all have that size, so nothing is rounded up. A chunk's own units (embeddings, final norm) differ
in size from a block, larger or much smaller, and are used at both ends of a pass: they are not lent a slot
(that would hold a block's bytes for a LayerNorm, and the estimator's peak would no longer be the tracker's) but
allocated at their own size, once per micro-batch where they can be parked (below). Slots are created when none
is idle, so the pool grows to the most borrowed at once (the buffers a step held at that moment anyway). Once a
backward has made its last gather the pool is drained (:meth:`SlotPool.drain`): its idle slots would otherwise sit
beside the tied embedding's gradients at the end of backward and the optimizer step; the next pass fills it
again, a few allocations per pass instead of one per use. Without ``_swap_data_ptr_`` (older torch) gathers fall
back to ``resize_``.

Parking. Where a rank runs one model chunk, a chunk's own units released at the end of a forward that built a
graph are not freed: their memory is swapped into a holder (:meth:`SlotPool.park`) and swapped back by the next
gather of that unit (:meth:`SlotPool.fill` says so). The memory still holds the values gathered, so that gather
skips its all-gather while the parameters have not changed since (the scheduler's *carry*,
:mod:`.gather`): a chunk's own units are all-gathered once per micro-batch, not twice. The backward's release
frees the memory as before, so no peak grows; :meth:`SlotPool.held` includes parked memory. At GPT-2 124M this
maps the 154 MB tied embedding once per micro-batch instead of twice, and gathers it once.
"""

from __future__ import annotations

import torch

__all__ = ["SWAP", "SlotPool"]

SWAP = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
_ALIGN = 64  # bytes: every dtype's view of a slot starts aligned and ends on a whole element


class SlotPool:
    """Persistent byte slots of ``slot_bytes`` on ``device`` (see the module docstring)."""

    def __init__(self, slot_bytes: int, device: torch.device) -> None:
        self.slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        self.device = device
        self.idle: list[torch.Tensor] = []  # uint8 slots holding their memory, ready to lend
        self.count = 0  # slots ever created (none is freed)
        self._lent: dict[int, torch.Tensor] = {}  # storage key -> the slot whose memory it holds now
        self.keep = True  # idle slots are kept for the next borrower (False: freed, see :meth:`drain`)
        self.parking = True  # :meth:`park` keeps memory aside (False: it frees it; for A/B benchmarks)
        self._parked: dict[int, torch.Tensor] = {}  # storage key -> a uint8 holder of its memory while released

    def _take(self) -> torch.Tensor:
        if self.idle:
            return self.idle.pop()
        self.count += 1
        return torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device)

    def fill(self, storage: torch.UntypedStorage, nbytes: int, pooled: bool = True) -> bool:
        """Give the empty ``storage`` ``nbytes``: the memory it parked (returns True: its contents are those it
        parked), else a slot's where it fits (and ``pooled``), else its own (False)."""
        parked = self._parked.pop(storage._cdata, None)
        if parked is not None and parked.untyped_storage().nbytes() == nbytes:
            storage._swap_data_ptr_(parked.untyped_storage())
            return True
        if pooled and SWAP and 0 < nbytes <= self.slot_bytes:
            slot = self._take()
            storage._swap_data_ptr_(slot.untyped_storage())
            self._lent[storage._cdata] = slot
        else:
            storage.resize_(nbytes)
        return False

    def empty(self, storage: torch.UntypedStorage) -> None:
        """Take ``storage``'s memory back: into its slot (which becomes idle), or freed if it was its own."""
        slot = self.take_back(storage)
        if slot is None:
            storage.resize_(0)
            return
        self.give_back(slot)

    def park(self, storage: torch.UntypedStorage) -> None:
        """Empty ``storage`` (its own memory, not a slot's) but keep that memory aside for its next :meth:`fill`
        (module docstring, "Parking"); a slot's memory goes back to the pool as in :meth:`empty`."""
        if not (SWAP and self.parking) or self.lent(storage) or storage.nbytes() == 0:
            self.empty(storage)
            return
        holder = torch.empty(0, dtype=torch.uint8, device=self.device)
        holder.untyped_storage()._swap_data_ptr_(storage)  # the holder has the memory, ``storage`` is empty
        n = holder.untyped_storage().nbytes()
        self._parked[storage._cdata] = holder.set_(holder.untyped_storage(), 0, (n,), (1,))

    def parked(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage``'s memory is parked (:meth:`park`)."""
        return storage._cdata in self._parked

    def lent(self, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` holds a slot's memory now."""
        return storage._cdata in self._lent

    def take_back(self, storage: torch.UntypedStorage) -> torch.Tensor | None:
        """Move the slot's memory out of ``storage`` (left empty) back into the slot, and return the slot with
        its contents, still borrowed (:meth:`give_back` it); None if ``storage`` holds no slot."""
        slot = self._lent.pop(storage._cdata, None)
        if slot is not None:
            storage._swap_data_ptr_(slot.untyped_storage())
        return slot

    def view(self, numel: int, dtype: torch.dtype, pooled: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(slot, tensor)``: ``numel`` elements of ``dtype`` viewing a slot (give the slot back with
        :meth:`give_back`), or ``(None, a fresh tensor)`` when it does not fit one or not ``pooled``."""
        if not pooled or numel * dtype.itemsize > self.slot_bytes:
            return None, torch.empty(numel, dtype=dtype, device=self.device)
        slot = self._take()
        return slot, slot.view(dtype)[:numel]

    def give_back(self, slot: torch.Tensor | None) -> None:
        if slot is None:
            return
        if self.keep:
            self.idle.append(slot)
        else:
            self.count -= 1

    def drain(self) -> None:
        """Free the idle slots, and each slot given back, until :meth:`refill`: a backward past its last gather
        needs at most a staging buffer or two more, while the tied embedding's gradients (and the optimizer
        step after) would find the pool's idle slots added to their own peak."""
        self.keep = False
        self.count -= len(self.idle)
        self.idle.clear()

    def refill(self) -> None:
        """Keep idle slots again (a pass begins)."""
        self.keep = True

    def held(self) -> list[torch.Tensor]:
        """The idle slots (lent ones are held by their borrowers) and the parked memory."""
        return list(self.idle) + list(self._parked.values())
