"""Flat, padded buffers split into equal per-rank shards, and which state each ZeRO stage shards.

A :class:`FlatLayout` lays a list of tensors end to end in one flat buffer and pads it so that each of the
``dp_size`` ranks owns an equal slice whose length is a multiple of ``align`` elements::

    | p0 ......... | p1 ....... | p2 .. | pad |
    |  rank 0 slice   |  rank 1 slice   |  ...      (a parameter may straddle two slices)

The optimizer sees its share of a buffer as an :class:`OwnedSegment` made of :class:`Piece` runs (which parameter, which elements), so that it
can apply weight decay and count the gradient norm per parameter without any per-element mask.
:func:`build_buckets` groups consecutive tensors into buckets of bounded size, and :class:`BucketedParams`
keeps whole parameters in such buckets and reduces their gradients over the DP group (stages 0-2, and the
persistent parameters of stage 3).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from megazero import host
from megazero.distributed import Group

__all__ = [
    "BucketedParams",
    "FlatLayout",
    "OwnedSegment",
    "Piece",
    "ShardedState",
    "build_buckets",
    "set_data",
    "sharded_state",
    "storage_bytes",
]


@dataclass(frozen=True)
class ShardedState:
    """Which model states a ZeRO stage partitions across the data-parallel group."""

    optimizer_states: bool
    gradients: bool
    parameters: bool


def sharded_state(stage: int) -> ShardedState:
    """What is sharded at ``stage``: 0 nothing, 1 optimizer states (P_os), 2 + gradients (P_os+g), 3 + params."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage} (--zero-stage / zero_optimization.stage)")
    return ShardedState(optimizer_states=stage >= 1, gradients=stage >= 2, parameters=stage >= 3)


@dataclass(frozen=True)
class Piece:
    """Part of tensor ``index`` inside a flat range: ``numel`` elements from ``param_offset`` within the tensor,
    at ``offset`` within the range."""

    index: int
    param_offset: int
    offset: int
    numel: int


class FlatLayout:
    """Tensors of sizes ``numels`` laid end to end, padded to ``dp_size`` equal slices of ``shard_numel``.

    ``shard_numel`` is a multiple of ``align`` so every rank's slice starts aligned; the padding (at most
    ``dp_size * align - 1`` elements, plus one aligned slice per rank for an empty layout) sits at the end.
    """

    def __init__(self, numels: Sequence[int], dp_size: int, align: int = 16) -> None:
        if dp_size < 1 or align < 1:
            raise ValueError(f"dp_size and align must be >= 1, got {dp_size} and {align}")
        self.numels = [int(n) for n in numels]
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
        """The tensors overlapping ``[start, end)``, with offsets relative to ``start`` (padding omitted)."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            lo, hi = max(off, start), min(off + n, end)
            if lo < hi:
                out.append(Piece(index=i, param_offset=lo - off, offset=lo - start, numel=hi - lo))
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
                  keys: Sequence[int] | None = None) -> list[list[int]]:
    """Group consecutive indices so each group holds at most ``bucket_numel`` elements.

    A tensor larger than the bucket gets a group of its own; ``bucket_numel`` <= 0 means one group. Indices
    marked in ``isolate`` always get a group of their own (so their partition depends on nothing else); a
    group never holds two different ``keys`` (e.g. two model chunks).
    """
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and keys is not None and keys[i] != keys[current[-1]]:
            groups.append(current)
            current, size = [], 0
        if isolate is not None and isolate[i]:
            if current:
                groups.append(current)
            groups.append([i])
            current, size = [], 0
            continue
        if current and bucket_numel > 0 and size + n > bucket_numel:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        groups.append(current)
    return groups


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
        key = host.storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        total += st.nbytes()
    return total


@dataclass
class OwnedSegment:
    """This rank's contiguous share of one flat buffer: what the optimizer updates.

    ``param`` holds the model-dtype values (a view into a live buffer, written back after each step), ``grad``
    the reduced gradient in the model dtype (valid after the reduction), ``pieces`` the ``(parameter, start,
    end)`` runs of each parameter's elements inside the segment, ``init`` the fp32 starting values for a
    mixed-precision master copy (dropped once the optimizer has taken them).
    """

    param: torch.Tensor
    grad: torch.Tensor
    pieces: list[tuple[nn.Parameter, int, int]]
    init: torch.Tensor | None = None


class BucketedParams:
    """Whole parameters in flat buckets whose gradients are reduced over the DP group bucket by bucket.

    The parameters (in reverse registration order, roughly the order backward produces their gradients)
    are grouped into buckets of at most ``bucket_numel`` elements; each bucket is a :class:`FlatLayout` over
    the DP group (``shard_optimizer``) or over this rank alone, and every parameter becomes a view into one
    flat model-dtype buffer. Gradients are accumulated and reduced in ``grad_dtype`` (default: the model
    dtype; fp32 for bf16 training). ``groups`` are the model chunks of an interleaved pipeline (default: one):
    no bucket spans two groups, and a backward touches only the buckets of the chunk that ran. Policy:

    * ``shard_gradients`` False (stages 0-1): one flat gradient buffer of Ψ elements, allocated once. With
      ``grad_dtype`` equal to the model dtype, ``p.grad`` are views into it, so backward accumulates
      micro-batches in place; otherwise a hook adds each fresh ``p.grad`` into it and drops ``p.grad``
      (Megatron-LM's ``main_grad``). During the last micro-batch's backward of each group (known from
      :meth:`zero_grad`'s ``micro_batches``), a bucket is all-reduced (stage 0) or reduced-scattered in place
      (stage 1) as soon as its last gradient arrives, overlapped with the rest of backward (DDP-style; waited
      on in :meth:`reduce_gradients`). 2Ψ resp. Ψ per step, whatever the number of micro-batches m.
    * ``shard_gradients`` True (stage 2): a hook copies each gradient into its bucket's staging buffer, taken
      from a pool of ``max_inflight`` buffers of the largest bucket's size allocated once; a full bucket is
      reduce-scattered at once (asynchronously with ``overlap_comm``) and added to this rank's owned gradient
      buffer (one contiguous buffer of ~Ψ/Nd) when its buffer is needed again or at the end of the backward.
      At most ``max_inflight`` buckets are being filled or reduced at any time, so the unreduced gradient
      never exists whole. When every buffer holds a bucket still being filled, the oldest is reduced as it
      is and its late gradients reopen it (more traffic, never more memory). Ψ per micro-batch.

    Every rank issues its reductions in the order its gradients arrive, which is the same on every rank of the
    DP group (same graph, same code). With ``shard_optimizer``, :meth:`after_step` all-gathers the updated
    slices into every rank's buffer (Ψ). With ``reduce_scatter`` False, gradients are all-reduced instead (2Ψ
    per reduction) and the slice kept. Parameters in ``isolate`` get a bucket of their own, so this rank owns
    the same elements of them whatever else the store holds (the tied embedding's two pipeline copies must be
    partitioned alike).
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype, dp_group: Group, *,
                 shard_optimizer: bool, shard_gradients: bool, bucket_numel: int, align: int = 16,
                 overlap_comm: bool = False, reduce_scatter: bool = True,
                 isolate: Sequence[nn.Parameter] = (), grad_dtype: torch.dtype | None = None,
                 max_inflight: int = 2, groups: Sequence[Sequence[nn.Parameter]] | None = None,
                 param_init: Callable[[nn.Parameter], torch.Tensor] | None = None,
                 device: torch.device | None = None) -> None:
        if shard_gradients and not shard_optimizer:
            raise ValueError("sharded gradients need sharded optimizer states (ZeRO stage 2 includes stage 1)")
        if max_inflight < 1:
            raise ValueError(f"max_inflight (--max-inflight-buckets) must be >= 1, got {max_inflight}")
        self.dp_group = dp_group
        self.dtype = dtype
        self.grad_dtype = grad_dtype or dtype
        self.shard_optimizer = shard_optimizer
        self.shard_gradients = shard_gradients
        self.overlap_comm = overlap_comm
        self.reduce_scatter = reduce_scatter
        self.max_inflight = max_inflight
        self.rank = dp_group.rank if shard_optimizer else 0
        order = list(reversed(list(params)))
        self.params = order
        group_of = {p: i for i, g in enumerate(groups or ()) for p in g}
        n_ranks = dp_group.size if shard_optimizer else 1
        self.buckets: list[tuple[int, list[nn.Parameter], FlatLayout]] = []  # (start, params, layout)
        self._bucket_group: list[int] = []
        start = 0
        isolated = [any(p is q for q in isolate) for p in order]
        for idx in build_buckets([p.numel() for p in order], bucket_numel, isolated,
                                 [group_of.get(p, 0) for p in order]):
            ps = [order[i] for i in idx]
            layout = FlatLayout([p.numel() for p in ps], n_ranks, align)
            self.buckets.append((start, ps, layout))
            self._bucket_group.append(group_of.get(ps[0], 0))
            start += layout.padded_numel
        self.numel = start
        device = device or (order[0].device if order else None)
        self.param_flat = torch.empty(start, dtype=dtype, device=device)
        self._where: dict[nn.Parameter, tuple[int, int]] = {}
        self.segments: list[OwnedSegment] = []
        gdt = self.grad_dtype
        if shard_gradients:
            self.grad_flat = None
            self.owned_grad = torch.zeros(sum(lay.shard_numel for _, _, lay in self.buckets), dtype=gdt,
                                          device=device)
        else:
            self.grad_flat = torch.zeros(start, dtype=gdt, device=device)
            self.owned_grad = None
        owned_off = 0
        for b, (s, ps, layout) in enumerate(self.buckets):
            view = self.param_flat[s: s + layout.padded_numel]
            view[layout.numel:].zero_()
            lo, hi = layout.shard_range(self.rank)
            # the owned slice's fp32 starting values for a mixed-precision master copy (zeros in the padding)
            init = torch.zeros(hi - lo, dtype=torch.float32, device=device) if dtype != torch.float32 else None
            for p, pv, off in zip(ps, layout.views(view, [p.shape for p in ps]), layout.offsets):
                # one parameter's full fp32 value at a time (from param_init when built on the meta device)
                value = param_init(p) if p.is_meta else p.detach()
                pv.copy_(value)
                a, z = max(off, lo), min(off + p.numel(), hi)
                if init is not None and a < z:
                    init[a - lo: z - lo].copy_(value.reshape(-1)[a - off: z - off])
                del value
                set_data(p, pv)
                self._where[p] = (b, off)
            if shard_gradients:
                grad = self.owned_grad[owned_off: owned_off + layout.shard_numel]
                owned_off += layout.shard_numel
            else:
                grad = self.grad_flat[s + lo: s + hi]
            pieces = [(ps[pc.index], pc.offset, pc.offset + pc.numel) for pc in layout.pieces(lo, hi)]
            self.segments.append(OwnedSegment(view[lo:hi], grad, pieces, init))
        # gradients land in ``p.grad`` views of grad_flat (stages 0-1 in the model dtype) or pass through hooks
        self._grad_views = not shard_gradients and gdt == dtype
        # stage 2: the staging pool (allocated on first use, never again) and the buckets using it
        self._pool_numel = max((lay.padded_numel for _, _, lay in self.buckets), default=0)
        self._pool_size = min(max_inflight, len(self.buckets))
        self._pool: list[torch.Tensor] = []
        self._free: list[int] = []
        self._open: dict[int, int] = {}  # bucket -> pool buffer, in the order they were opened
        self._inflight: deque[tuple[object, int, int]] = deque()  # (work, bucket, pool buffer)
        # stages 0-1: this step's reductions, started in the last micro-batch's backward of each group
        self._pending: list[object] = []
        self._launched = [False] * len(self.buckets)
        # per backward: parameters still to arrive per bucket, groups touched; per step: passes per group
        self._remaining = [len(ps) for _, ps, _ in self.buckets]
        self._touched: set[int] = set()
        self._passes: dict[int, int] = {}
        self.micro_batches: int | None = None
        for p in order:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.zero_grad()

    # -- gradients -----------------------------------------------------------------------------------------
    def _grad_view(self, p: nn.Parameter) -> torch.Tensor:
        b, off = self._where[p]
        s = self.buckets[b][0]
        return self.grad_flat[s + off: s + off + p.numel()].view(p.shape)

    def zero_grad(self, micro_batches: int | None = None) -> None:
        """Zero the gradient buffers for a new step of ``micro_batches`` backward passes per model chunk.

        Knowing ``micro_batches`` lets stages 0-1 reduce each bucket during the last pass (None: all at
        :meth:`reduce_gradients`). Stages 0-1 in the model dtype point ``p.grad`` at the flat buffer.
        """
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self._passes = {}
        self._launched = [False] * len(self.buckets)
        if self.grad_flat is not None:
            self.grad_flat.zero_()
        else:
            self.owned_grad.zero_()
        for p in self.params:
            p.grad = self._grad_view(p) if self._grad_views else None

    def start_backward(self) -> None:
        """Reset the per-backward bookkeeping; call before each backward pass."""
        self._remaining = [len(ps) for _, ps, _ in self.buckets]
        self._touched = set()

    def _last_pass(self, b: int) -> bool:
        """Count this backward for bucket ``b``'s group; whether it is the group's last of the step."""
        g = self._bucket_group[b]
        if g not in self._touched:
            self._touched.add(g)
            self._passes[g] = self._passes.get(g, 0) + 1
            if self.micro_batches is not None and self._passes[g] > self.micro_batches:
                raise RuntimeError(
                    f"backward pass {self._passes[g]} of a step declared with micro_batches="
                    f"{self.micro_batches} (zero_grad): pass the number of backward passes per model chunk")
        return self.micro_batches is not None and self._passes[g] == self.micro_batches

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:
            return
        b, off = self._where[p]
        last = self._last_pass(b)
        if self.grad_flat is None:  # stage 2: into a staging buffer, reduced when the bucket is complete
            if b not in self._open:
                self._open[b] = buf = self._acquire()
                self._pool[buf][: self.buckets[b][2].padded_numel].zero_()
            self._pool[self._open[b]][off: off + p.numel()].add_(p.grad.reshape(-1))
            p.grad = None
            self._remaining[b] -= 1
            if self._remaining[b] == 0:
                self._launch_staged(b)
            return
        if self._launched[b]:
            raise RuntimeError("a gradient arrived for a bucket already reduced in this step: zero_grad("
                               "micro_batches=m) must state the number of backward passes per step")
        view = self._grad_view(p)
        if not self._grad_views:  # accumulate in grad_dtype (fp32): the model-dtype gradient is dropped
            view.add_(p.grad)
            p.grad = None
        elif not host.same_data(p.grad, view):  # bypassed the buffer (e.g. after model.zero_grad())
            view.copy_(p.grad)
            p.grad = view
        if last:
            self._remaining[b] -= 1
            if self._remaining[b] == 0:
                self._launch_flat(b)

    # stage 2 -------------------------------------------------------------------------------------------
    def _acquire(self) -> int:
        """A free staging buffer: a new one while the pool is not full, else wait for the oldest reduction,
        else reduce the bucket opened first (every buffer holds a bucket still being filled)."""
        if self._free:
            return self._free.pop()
        if len(self._pool) < self._pool_size:
            self._pool.append(torch.empty(self._pool_numel, dtype=self.grad_dtype, device=self.param_flat.device))
            return len(self._pool) - 1
        if not self._inflight:
            self._launch_staged(next(iter(self._open)))
        self._wait_oldest()
        return self._free.pop()

    def _launch_staged(self, b: int) -> None:
        buf = self._open.pop(b)
        layout = self.buckets[b][2]
        staging = self._pool[buf][: layout.padded_numel]
        lo, hi = layout.shard_range(self.rank)
        if self.reduce_scatter:
            work = self.dp_group.reduce_scatter(staging[lo:hi], staging, tag="grad", async_op=True)
        else:
            work = self.dp_group.all_reduce(staging, tag="grad", async_op=True)
        self._inflight.append((work, b, buf))
        if not self.overlap_comm:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, b, buf = self._inflight.popleft()
        work.wait()
        lo, hi = self.buckets[b][2].shard_range(self.rank)
        self.segments[b].grad.add_(self._pool[buf][lo:hi])
        self._free.append(buf)

    # stages 0-1 ----------------------------------------------------------------------------------------
    def _launch_flat(self, b: int) -> None:
        s, _, layout = self.buckets[b]
        g = self.grad_flat[s: s + layout.padded_numel]
        if self.shard_optimizer and self.reduce_scatter:
            lo, hi = layout.shard_range(self.rank)
            work = self.dp_group.reduce_scatter(g[lo:hi], g, tag="grad", async_op=True)
        else:
            work = self.dp_group.all_reduce(g, tag="grad", async_op=True)
        self._launched[b] = True
        if self.overlap_comm:
            self._pending.append(work)
        else:
            work.wait()

    def finish_backward(self) -> None:
        """End of one backward pass. Stage 2: reduce the buckets this pass filled only partly, wait for every
        reduction. Stages 0-1, last pass of a group: start the reductions of that group's remaining buckets."""
        if self.grad_flat is None:
            for b in sorted(self._open):
                self._launch_staged(b)
            while self._inflight:
                self._wait_oldest()
        elif self.micro_batches is not None:
            last = {g for g in self._touched if self._passes[g] == self.micro_batches}
            for b, g in enumerate(self._bucket_group):
                if g in last and not self._launched[b]:
                    self._launch_flat(b)
        self.start_backward()

    def reduce_gradients(self) -> None:
        """At the accumulation boundary (stages 0-1): reduce the buckets not reduced yet, wait for all."""
        if self.grad_flat is None:
            return
        for b in range(len(self.buckets)):
            if self._launched[b]:
                continue
            for p in self.buckets[b][1] if self._grad_views else ():  # gradients that bypassed the buffer
                view = self._grad_view(p)
                if p.grad is not None and not host.same_data(p.grad, view):
                    view.copy_(p.grad)
                p.grad = view
            self._launch_flat(b)
        for work in self._pending:
            work.wait()
        self._pending.clear()

    # -- parameters ----------------------------------------------------------------------------------------
    def after_step(self) -> None:
        """All-gather the updated slices into every rank's parameter buffer (sharded optimizer only)."""
        if not self.shard_optimizer:
            return
        works = []
        for s, _, layout in self.buckets:
            full = self.param_flat[s: s + layout.padded_numel]
            lo, hi = layout.shard_range(self.rank)
            works.append(self.dp_group.all_gather_into(full, full[lo:hi], tag="param", async_op=True))
        for w in works:
            w.wait()

    def consolidate(self, values: Sequence[torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Full fp32 tensors per parameter from every rank's per-segment ``values`` (a collective)."""
        out = {}
        for (_, ps, layout), v in zip(self.buckets, values):
            v = v.detach().float().contiguous()
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=v.device)
            if self.shard_optimizer:
                self.dp_group.all_gather_into(full, v, tag="other")
            else:
                full.copy_(v)
            out.update(zip(ps, (t.clone() for t in layout.views(full, [p.shape for p in ps]))))
        return out

    def padded_numel(self) -> dict[str, int]:
        """Elements laid out: ``whole`` (parameters kept whole, all buckets with padding) and ``gathered`` (0)."""
        return {"whole": self.numel, "gathered": 0}

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The buffers this store holds right now, by category: ``params``, ``grads`` (the accumulated or
        owned gradient) and ``comm`` (stage 2's staging pool: communication buffers, allocated once)."""
        grads = [self.grad_flat if self.grad_flat is not None else self.owned_grad]
        return {"params": [self.param_flat], "grads": grads, "comm": list(self._pool)}
