"""ZeRO-3's construction (:class:`~megazero.zero.stage3.params.Stage3Params`, "Sharded initialisation"): the slot
size, the units' buffers shaped without allocating, each unit's shard filled from its initial values, and where
this rank's fp32 starting values go in a 16-bit dtype.

Construction must leave no freed heap behind the buffers that stay (glibc would keep it resident under them:
:func:`megazero.distributed.device_io.release_free_memory`). So a unit's full fp32 values are drawn straight into
a slot (or, larger than a slot, into ``device_io.mapped`` memory), and in a 16-bit dtype the owned slice's fp32
values are copied to their place in one buffer laid out in the order of the store's segments (the persistent
stores' owned slices first, each chunk's, then each unit's), which :class:`~megazero.zero.state.OwnedState`
takes as the fp32 master as it is: nothing is cloned and freed per unit, nothing copied into a master.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megazero.distributed import device_io
from megazero.zero.flat import FlatLayout, OwnedSegment, bucketed_shard_numel, initial_into, set_data
from megazero.zero.stage3.slots import SlotPool
from megazero.zero.stage3.units import Unit

__all__ = ["ParamInit", "lent", "persistent_numels", "shard_unit", "slot_bytes"]

ParamInit = Callable[[nn.Parameter], torch.Tensor]  # a parameter's full (local-shape) fp32 initial value


def slot_bytes(specs, layouts: Sequence[FlatLayout], dp_size: int, dtype: torch.dtype, stage_dtype: torch.dtype,
               grad_dtype: torch.dtype, reduce_chunks: int) -> int:
    """The pool's slot: the most bytes a block unit needs at once for one buffer (gathered, staged, or one
    converted reduction chunk); a chunk's own units are allocated at their own size (:mod:`.slots`)."""
    need = 0
    for spec, lay in zip(specs, layouts):
        if not spec.is_root:
            chunk = dp_size * -(-lay.shard_numel // reduce_chunks) * grad_dtype.itemsize
            need = max(need, lay.padded_numel * max(dtype.itemsize, stage_dtype.itemsize), chunk)
    return need


def lent(slots: SlotPool, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``numel`` elements on a storage of its own that holds a borrowed slot (or, larger than a slot,
    its own memory) until ``slots.empty`` is called on it: construction shapes the units' buffers and their views
    this way without allocating and freeing a block's bytes for each."""
    storage = torch.UntypedStorage(0, device=device)
    slots.fill(storage, numel * dtype.itemsize)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))


def persistent_numels(kept: Sequence[Sequence[nn.Parameter]], bucket_numel: int, dp_size: int, align: int,
                      isolate: Sequence[nn.Parameter]) -> list[int]:
    """The elements this rank owns of each chunk's persistent parameters ``kept``, laid out as their
    :class:`~megazero.zero.bucketed.BucketedParams` will lay them (reversed, ``isolate`` in buckets of their own):
    their place in the buffer of starting values is known before the stores are built."""
    return [bucketed_shard_numel([p.numel() for p in reversed(ps)], bucket_numel, dp_size, align,
                                 [any(p is q for q in isolate) for p in reversed(ps)]) for ps in kept]


def shard_unit(unit: Unit, param_init: ParamInit | None, slots: SlotPool, placeholder: torch.Tensor, rank: int,
               start: torch.Tensor | None) -> OwnedSegment:
    """Fill this rank's shard of ``unit`` from its full fp32 values (drawn here one unit at a time when the model
    is on the meta device), and ``start`` (16-bit dtypes: the shard's place in the buffer of fp32 starting values)
    with their slice; leave the parameters released (``placeholder``), and return the unit's owned segment."""
    layout, ps = unit.layout, unit.params
    lo, hi = layout.shard_range(rank)
    if placeholder.device.type == "cpu" and layout.padded_numel * 4 > slots.slot_bytes:  # larger than a slot:
        slot, flat32 = None, device_io.mapped(layout.padded_numel, torch.float32)  # off the heap (mapped's why)
    else:
        slot, flat32 = slots.view(layout.padded_numel, torch.float32)  # in a slot where it fits (fp32)
    flat32.zero_()
    for p, o, n in zip(ps, layout.offsets, layout.numels):
        initial_into(param_init, p, flat32[o: o + n].view(p.shape))  # built on meta: drawn in place
        set_data(p, placeholder.expand(p.shape))  # frees the parameter's own (full) storage
    unit.shard.copy_(flat32[lo:hi])  # rounded to the model dtype
    if start is not None:
        start.copy_(flat32[lo:hi])
    del flat32
    slots.give_back(slot)
    pieces = [(ps[pc.index], pc.offset, pc.offset + pc.numel) for pc in layout.pieces(lo, hi)]
    return OwnedSegment(unit.shard, unit.grad, pieces, start)
