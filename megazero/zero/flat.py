"""Flat, padded buffers split into equal per-rank shards, and the buckets gradients are reduced in.

A :class:`FlatLayout` lays a list of tensors end to end in one flat buffer and pads it so that each of the
``dp_size`` ranks owns an equal slice whose length is a multiple of ``align`` elements::

    | p0 ......... | p1 ....... | p2 .. | pad |
    |  rank 0 slice   |  rank 1 slice   |  ...      (a parameter may straddle two slices)

The optimizer sees its share of a buffer as an :class:`OwnedSegment` (which parameter, which elements), so
that it can apply weight decay and count the gradient norm per parameter without any per-element mask.
:func:`build_buckets` cuts tensors laid end to end into buckets of a given size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from megazero.distributed import device_io

__all__ = ["FlatLayout", "OwnedSegment", "Piece", "build_buckets", "bucketed_shard_numel", "initial_into", "set_data",
           "storage_bytes"]


@dataclass(frozen=True)
class Piece:
    """Part of tensor ``index`` inside a flat range: ``numel`` elements from ``param_offset`` within its
    parameter (the tensor may itself be a piece of one, see :class:`FlatLayout`'s ``bases``), at ``offset``
    within the range."""

    index: int
    param_offset: int
    offset: int
    numel: int


class FlatLayout:
    """Tensors of sizes ``numels`` laid end to end, padded to ``dp_size`` equal slices of ``shard_numel``.

    ``shard_numel`` is a multiple of ``align`` so every rank's slice starts aligned; the padding (at most
    ``dp_size * align - 1`` elements, plus one aligned slice per rank for an empty layout) sits at the end.
    """

    def __init__(self, numels: Sequence[int], dp_size: int, align: int = 16, bases: Sequence[int] | None = None) -> None:
        if dp_size < 1 or align < 1:
            raise ValueError(f"dp_size and align must be >= 1, got {dp_size} and {align}")
        self.numels = [int(n) for n in numels]
        self.bases = [int(b) for b in bases] if bases is not None else [0] * len(self.numels)
        self.offsets = [0, *accumulate(self.numels)][:-1] if self.numels else []
        self.numel = sum(self.numels)
        self.dp_size = dp_size
        self.align = align
        chunk = dp_size * align
        self.padded_numel = max(1, math.ceil(self.numel / chunk)) * chunk
        self.shard_numel = self.padded_numel // dp_size

    def __repr__(self) -> str:
        return (f"FlatLayout({len(self.numels)} tensors, {self.numel} elements, padded {self.padded_numel}, "
                f"{self.dp_size} x {self.shard_numel})")

    def shard_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s slice in the flat buffer."""
        if not 0 <= rank < self.dp_size:
            raise ValueError(f"rank {rank} outside a layout of {self.dp_size} shards")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, start: int, end: int) -> list[Piece]:
        """The tensors overlapping ``[start, end)``, with offsets relative to ``start`` (padding omitted);
        ``param_offset`` counts from ``bases[i]``, where tensor ``i`` starts in its parameter (a cut one)."""
        out = []
        for i, (off, n, base) in enumerate(zip(self.offsets, self.numels, self.bases)):
            lo, hi = max(off, start), min(off + n, end)
            if lo < hi:
                out.append(Piece(index=i, param_offset=base + lo - off, offset=lo - start, numel=hi - lo))
        return out

    def views(self, flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
        """Views of ``flat`` (one layout's worth of elements) shaped like the laid-out tensors."""
        return [flat[o: o + n].view(s) for o, n, s in zip(self.offsets, self.numels, shapes)]

    def flatten(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new padded flat buffer holding ``tensors`` (zeros in the padding)."""
        dtype = dtype or tensors[0].dtype
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=tensors[0].device if tensors else None)
        for t, o, n in zip(tensors, self.offsets, self.numels):
            flat[o: o + n].copy_(t.detach().reshape(-1))
        return flat


def build_buckets(numels: Sequence[int], bucket_numel: int, isolate: Sequence[bool] | None = None,
                  keys: Sequence[int] | None = None, multiple: int = 1) -> list[list[tuple[int, int, int]]]:
    """Cut tensors laid end to end into buckets: each a list of ``(index, offset, numel)`` pieces (``numel``
    elements of tensor ``index`` from element ``offset``).

    A bucket is full at ``bucket_numel`` rounded down to a multiple of ``multiple`` (at least ``multiple``); a
    tensor that does not fit is cut there and goes on in the next bucket, so a full bucket needs no padding
    and a tensor's elements stay contiguous across buckets. A bucket ends early only where ``keys`` changes
    (e.g. two model chunks) and around indices marked in ``isolate``, whose buckets hold nothing else (so
    their cuts depend on nothing else). ``bucket_numel`` <= 0 means no limit.
    """
    cap = max(multiple, bucket_numel // multiple * multiple) if bucket_numel > 0 else 0
    groups: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    size = 0
    current_isolated, current_key = False, None
    for i, n in enumerate(numels):
        isolated = bool(isolate is not None and isolate[i])
        key = keys[i] if keys is not None else None
        if current and (isolated or current_isolated or key != current_key):
            groups.append(current)
            current, size = [], 0
        current_isolated, current_key = isolated, key
        offset = 0
        while True:
            take = n - offset if not cap else min(n - offset, cap - size)
            current.append((i, offset, take))
            size += take
            offset += take
            if cap and size == cap:
                groups.append(current)
                current, size = [], 0
            if offset >= n:
                break
    if current:
        groups.append(current)
    return groups


def bucketed_shard_numel(numels: Sequence[int], bucket_numel: int, dp_size: int, align: int,
                         isolate: Sequence[bool] | None = None) -> int:
    """The elements one of ``dp_size`` ranks owns of tensors of sizes ``numels`` (in layout order) cut into buckets
    as :class:`~megazero.zero.bucketed.BucketedParams` cuts them (one group): known before the store is built, so
    ZeRO-3 can lay its persistent parameters' fp32 starting values out in the buffer that holds the rest."""
    return sum(FlatLayout([n for _, _, n in cut], dp_size, align).shard_numel
               for cut in build_buckets(numels, bucket_numel, isolate, multiple=dp_size * align))


def set_data(p: nn.Parameter, value: torch.Tensor) -> None:
    """``p.data = value``, also for a parameter built on the meta device (which ``.data`` cannot leave): its
    tensor is swapped in place, keeping the Parameter object, its hooks and its attributes."""
    if not p.is_meta:
        p.data = value
        return
    attrs = dict(p.__dict__)
    hooks = list((p._backward_hooks or {}).values())
    post = list((p._post_accumulate_grad_hooks or {}).values())
    torch.utils.swap_tensors(p, nn.Parameter(value, requires_grad=p.requires_grad))
    p.__dict__.update(attrs)
    p._backward_hooks = None  # the hooks stayed with the swapped-out tensor: register them again
    for hook in hooks:
        p.register_hook(hook)
    p._post_accumulate_grad_hooks = None
    for hook in post:
        p.register_post_accumulate_grad_hook(hook)


def initial_into(param_init: Callable[[nn.Parameter], torch.Tensor] | None, p: nn.Parameter,
                 out: torch.Tensor) -> torch.Tensor:
    """Write ``p``'s initial value into ``out`` (``p``'s shape: the memory that keeps it) and return the value:
    ``p``'s own when it has storage; for a parameter built on the meta device, drawn straight into an fp32
    ``out`` through ``param_init.into`` where the initializer has one (:class:`megazero.model.init.ParameterInit`:
    no temporary of the parameter's size, so construction leaves no freed heap behind; its module docstring),
    else its fp32 value on the host (drawn in place through ``into`` into ``device_io.mapped`` memory beside an
    ``out`` of a narrower dtype, on any device; without ``into`` ``param_init(p)``'s fresh tensor), copied
    (rounded) into ``out``."""
    if not p.is_meta:
        value = p.detach()
    elif out.dtype == torch.float32 and hasattr(param_init, "into"):
        param_init.into(p, out)
        return out
    elif hasattr(param_init, "into"):  # the fp32 value on the host beside a narrower ``out``
        value = device_io.mapped(out.numel(), torch.float32).view(out.shape)  # off the heap (mapped's why)
        param_init.into(p, value)
    else:
        value = param_init(p)
    out.copy_(value)
    return value


def storage_bytes(tensors: Sequence[torch.Tensor], seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views share one), skipping storages in ``seen``.

    ``seen`` is updated, so calling this per category with one set counts every storage once overall.
    Storages that have been freed (resized to 0, a released ZeRO-3 buffer) count 0.
    """
    seen = set() if seen is None else seen
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        key = device_io.storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


@dataclass
class OwnedSegment:
    """This rank's contiguous share of one flat buffer: what the optimizer updates.

    ``param`` holds the model-dtype values (a view into a live buffer, written back after each step), ``grad``
    the reduced gradient in the store's ``grad_dtype`` (valid after the reduction), ``pieces`` the
    ``(parameter, start, end)`` runs of each parameter's elements inside the segment, ``init`` the fp32
    starting values for a mixed-precision master copy (dropped once :class:`~megazero.zero.state.OwnedState`
    has taken them).
    """

    param: torch.Tensor
    grad: torch.Tensor
    pieces: list[tuple[nn.Parameter, int, int]]
    init: torch.Tensor | None = None
