"""ZeRO stage 3: parameters live only as shards, gathered one transformer block at a time.

The units of gathering (:mod:`.units`) are each model chunk's transformer blocks plus the chunk's own
parameters (embeddings, final LayerNorm, tied LM head). Each rank keeps only its slice of every unit; the
parameters are views into a full-size buffer whose storage is freed (resized to 0) while the unit is released,
so tensors autograd saved alias that storage and see the values again once it is re-gathered. While released,
a parameter's ``.data`` is a shared one-element NaN placeholder expanded to its shape (right
``shape``/``numel()``; a stray read sees NaN, not freed memory). Read real values inside
``ZeroOptimizer.gathered_parameters()`` (which holds through forwards run inside it) or from the optimizer's
fp32 master copy.

* **Forward**: a block's forward pre-hook gathers it (and prefetches the next unit of the traced order), its
  forward hook releases it; a chunk's own parameters stay gathered for the chunk's forward.
* **Backward**: the forward hook threads each output through an identity autograd function whose backward
  gathers the unit again before its backward runs. Hooks on the parameters' gradient accumulation copy the
  gradients into the unit's staging buffer; once all have arrived the unit is released and its staging buffer
  reduce-scattered to the owners at once (asynchronously with ``overlap_comm``, at most
  ``max_inflight_buckets`` reductions in flight, default 2, over ``reduce_group``: on NCCL a stream apart from
  the gathers'). Block-sized buffers (gathers, staging, converted chunks) are the persistent slots of :mod:`.slots`.
  The tied embedding's gradient arrives once, after both uses.
* **Gradient precision**: the reduction and the owned gradient are in ``grad_dtype`` (the optimizer's
  ``--grad-dtype``: fp32 when training in bf16 by default, the model dtype otherwise). Local gradients arrive
  in the model dtype and are staged in it (exactly); where ``grad_dtype`` is wider, a unit is converted and
  reduce-scattered in column chunks no larger than its staging buffer (two for bf16 -> fp32), so a block's
  staging costs the model dtype's bytes, not fp32's.
* **Full activation checkpointing**: a block recomputed inside backward stays gathered for its backward right
  after (``stage3_max_reuse_distance``), so it is gathered twice per micro-batch, not three times.
* **Ordering, prefetch, live budget, order check**: :mod:`.gather`.
* **Offload** (``offload_param``): the shards live in host memory (pinned when a GPU is present) and are
  copied to the device just before their all-gather; the optimizer writes updated values into the host shard.
* **Persistence**: parameters of at most ``stage3_param_persistence_threshold`` elements (DeepSpeed's rule)
  stay whole on every rank, handled like stage 2 by one :class:`~megazero.zero.bucketed.BucketedParams` per
  model chunk; their gradients mark the chunk touched, so a W pass reaching no unit still finishes the store.
* **Sharded initialisation**: a model built on the meta device is materialised one unit at a time by
  ``param_init``: a unit's parameters are drawn in full straight into a slot (fp32; a unit larger than a slot
  into ``device_io.mapped`` memory on the CPU), this rank's slice kept, so construction frees no heap block.
  In a 16-bit dtype the slice's fp32 values go to their place in one buffer of this rank's starting values
  (persistent parameters' first, then each unit's, the order of :attr:`segments`), which the optimizer takes
  as its fp32 master as it is (:class:`~megazero.zero.state.OwnedState`): nothing cloned, copied or freed.
* **Several chunks per rank** (the interleaved pipeline schedule): every chunk has its own hooks and passes;
  a backward reduces the units of the chunks it ran through only.

DP volume per optimizer step with m micro-batches: 3mΨ_g for gathered parameters (forward gather, backward
gather, gradient reduce-scatter in every micro-batch), full activation checkpointing included, less mΨ_own
where a rank runs one chunk (its own units, Ψ_own, are gathered once per micro-batch: :mod:`.gather`, "Carry"),
plus (m + 1)Ψ_p for persistent ones. With ``stage3_max_reuse_distance`` 0 nothing is reused: the own units are
gathered twice, and with full checkpointing each block once more, for its recomputation (4mΨ for the blocks).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from megazero.config.schema import ZeroConfig
from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.zero.bucketed import BucketedParams, FlatLayout, OwnedSegment
from megazero.zero.stage3.build import ParamInit, lent, persistent_numels, shard_unit, slot_bytes
from megazero.zero.stage3.gather import BWD, FWD, GatherOrderError, GatherScheduler
from megazero.zero.stage3.hpz import zeropp_comm
from megazero.zero.stage3.slots import SlotPool
from megazero.zero.stage3.units import PreBackward, Unit, collect_units, model_chunks, saves_storage

__all__ = ["GatherOrderError", "Stage3Params"]


class Stage3Params:
    """Sharded parameters with gather/release hooks on ``model`` (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, dp_group: Group, cfg: ZeroConfig, *,
                 align: int = 16, isolate: Sequence[nn.Parameter] = (), offload_param: bool = False,
                 param_init: ParamInit | None = None, device: torch.device | None = None,
                 grad_dtype: torch.dtype | None = None, reduce_group: Group | None = None) -> None:
        self.model, self.dtype, self.dp_group, self.rank, self.cfg = model, dtype, dp_group, dp_group.rank, cfg
        # gradient reductions go over their own communicator (on NCCL its own stream), apart from the gathers
        self.reduce_group = reduce_group or dp_group
        self.overlap_comm, self.reduce_scatter = cfg.overlap_comm, cfg.reduce_scatter
        self.comm, self.qgz = zeropp_comm(cfg, dp_group, self.reduce_group)  # ZeRO++: hpZ, qwZ; qgZ (None: off)
        self.grad_dtype = grad_dtype or dtype  # the optimizer's --grad-dtype (fp32 in bf16 by default)
        narrow = dtype.itemsize < self.grad_dtype.itemsize
        self.stage_dtype = dtype if narrow else self.grad_dtype  # local gradients are staged exactly
        self.reduce_chunks = self.grad_dtype.itemsize // dtype.itemsize if narrow else 1
        self.max_inflight = cfg.max_inflight_buckets
        self.device = device or next(p.device for p in model.parameters())
        if self.device.type == "meta" and param_init is None:  # the dry run gives both on meta
            raise ValueError("a model built on the meta device needs the ZeRO-3 store's device and param_init")
        self.chunks = [c for _, c in model_chunks(model)]
        threshold = cfg.stage3_param_persistence_threshold
        specs = collect_units(model, isolate)
        bucket = min(cfg.reduce_bucket_size, cfg.allgather_bucket_size)
        kept = [[p for s in specs if s.chunk == c for p in s.params if p.numel() <= threshold]
                for c in range(len(self.chunks))]  # each chunk's persistent parameters
        for s in specs:
            s.params = [p for p in s.params if p.numel() > threshold]
        specs = [s for s in specs if s.params]
        layouts = [FlatLayout([p.numel() for p in s.params], dp_group.size, align) for s in specs]
        total = sum(lay.shard_numel for lay in layouts)
        # mixed precision: this rank's fp32 starting values, persistent stores' then units', in one buffer (in the
        # order of self.segments) that OwnedState takes as the master as it is ("Sharded initialisation")
        kept_numel = persistent_numels(kept, bucket, dp_group.size, align, isolate)
        start = (torch.zeros(sum(kept_numel) + total, dtype=torch.float32, device=self.device)
                 if dtype != torch.float32 else None)
        self.persistent: list[BucketedParams] = []
        self.segments: list[OwnedSegment] = []
        at = 0
        for c, (ps, n) in enumerate(zip(kept, kept_numel)):
            store = BucketedParams(
                ps, dtype, dp_group, shard_optimizer=True, shard_gradients=True, bucket_numel=bucket, align=align,
                overlap_comm=cfg.overlap_comm, reduce_scatter=cfg.reduce_scatter, isolate=isolate,
                grad_dtype=self.grad_dtype, max_inflight=self.max_inflight, param_init=param_init,
                device=self.device, reduce_group=self.reduce_group,
                init_flat=None if start is None else start[at: at + n]) if ps else None
            for p in ps:  # after the store's hook: the chunk is touched, so finish_backward finishes the store
                p.register_post_accumulate_grad_hook(lambda _, c=c: self._touched.add(c))  # (docstring)
            self.persistent.append(store)
            self.segments += store.segments if store is not None else []
            assert sum(seg.param.numel() for seg in self.segments) == at + n, "persistent layout out of step"
            at += n
        self.offload_param = offload_param
        self.shard_flat = (device_io.empty(total, dtype, pin=torch.cuda.is_available()) if offload_param
                           else torch.empty(total, dtype=dtype, device=self.device))
        self._placeholder = torch.full((1,), float("nan"), dtype=dtype, device=self.device)
        self.slots = SlotPool(slot_bytes(specs, layouts, dp_group.size, dtype, self.stage_dtype, self.grad_dtype,
                                         self.reduce_chunks), self.device)
        self.units: list[Unit] = []
        off = 0
        for spec, layout in zip(specs, layouts):
            n = layout.shard_numel
            # released from the start (gathered when first used; the owned gradient allocated by the unit's
            # first reduction of a step): both made in a slot and left with an empty storage, no allocation
            full, grad = (lent(self.slots, layout.padded_numel, dtype, self.device),  # (if they fit)
                          lent(self.slots, n, self.grad_dtype, self.device))
            unit = Unit(len(self.units), spec, layout, self.shard_flat[off: off + n], grad, full)
            self.slots.empty(full.untyped_storage())  # after the parameters' views are made
            self.slots.empty(grad.untyped_storage())
            off += n
            self.segments.append(shard_unit(unit, param_init, self.slots, self._placeholder, self.rank,
                                            None if start is None else start[at: at + n]))
            at += n
            self.units.append(unit)
            for p in unit.params:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, unit))
        self.sched = GatherScheduler(
            self.units, dp_group, self.device, self._placeholder, self.slots,
            prefetch_numel=cfg.stage3_prefetch_bucket_size,
            max_live=cfg.stage3_max_live_parameters,
            reuse_distance=cfg.stage3_max_reuse_distance, comm=self.comm)
        self._install_hooks()
        self._in_backward = False
        self._input_only = False  # in a zero-bubble B pass (stage3/split.py)
        self._touched: set[int] = set()  # chunks this backward ran through
        self._probed = False  # this forward pass looked at what its part before the first block saved
        self._roots_free: dict[int, bool] = {}  # chunk -> its own units are not needed by the blocks' backward
        self._saved_names: dict[type, list[str]] = {}  # autograd node type -> its saved-value attributes
        self._inflight: list[tuple] = []  # (work, unit, buffer, this rank's part, start, first, its slot)

    # -- hooks ---------------------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        roots: dict[int, list[Unit]] = {c: [] for c in range(len(self.chunks))}
        for unit in self.units:
            if unit.is_root:
                roots[unit.chunk].append(unit)
                continue
            unit.module.register_forward_pre_hook(functools.partial(self._pre_forward, unit))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
        self._roots = roots
        for c, chunk in enumerate(self.chunks):
            chunk.register_forward_pre_hook(functools.partial(self._chunk_pre_forward, c, roots[c]))
            chunk.register_forward_hook(functools.partial(self._chunk_post_forward, c, roots[c]))

    def _attach(self, out, callback):
        """Route ``out`` through :class:`PreBackward` so that backward calls ``callback`` first."""
        if isinstance(out, torch.Tensor):
            return PreBackward.apply(callback, out) if out.requires_grad else out
        if isinstance(out, (tuple, list)):
            return type(out)(self._attach(o, callback) for o in out)
        return out

    def _chunk_pre_forward(self, c: int, roots: list[Unit], module, args) -> None:
        if self.sched.hold:
            return
        self._probed = False
        self.sched.begin(FWD, c)
        for u in roots:
            self.sched.use(u)

    def _chunk_post_forward(self, c: int, roots: list[Unit], module, args, out):
        if self.sched.hold:
            return out
        if torch.is_grad_enabled():
            out = self._attach(out, functools.partial(self._chunk_pre_backward, c, roots))
        for u in list(self.sched.gathered.values()):  # the chunk's own units and any unused prefetch
            self.sched.release(u)
        self.sched.end()
        return out

    def _chunk_pre_backward(self, c: int, roots: list[Unit]) -> None:
        self._touched.add(c)
        for u in roots:
            self.sched.use(u)

    def _pre_forward(self, unit: Unit, module, args) -> None:
        if self.sched.phase == FWD and not self.sched.hold and not self._probed:  # the chunk's first block
            self._probed = True
            roots = self._roots[unit.chunk]
            keys = {u.full.untyped_storage()._cdata for u in roots}
            free = bool(roots) and not saves_storage(args, keys, self._saved_names)
            self._roots_free[unit.chunk] = free and self._roots_free.get(unit.chunk, True)
        self._use_block(unit)

    def _use_block(self, unit: Unit) -> None:
        """Gather a block for its forward or backward; once backward reaches the blocks, release the chunk's
        own units if its forward saved none of them before its first block (module docstring)."""
        if self.sched.phase == BWD and self._roots_free.get(unit.chunk):
            for u in self._roots[unit.chunk]:
                self.sched.release(u)
        if self._input_only:  # a zero-bubble B pass (split.py): no gradient comes to release the block before
            for u in [u for u in self.sched.gathered.values() if u is not unit and not u.is_root]:
                self.sched.release(u)
        self.sched.use(unit)

    def _post_forward(self, unit: Unit, module, args, out):
        if self.sched.hold:
            return out
        grad = torch.is_grad_enabled()
        if grad:
            out = self._attach(out, functools.partial(self._use_block, unit))
        self.sched.done_with(unit, reused=grad and self._in_backward)  # a recomputation: its backward is next
        return out

    # -- gradients -----------------------------------------------------------------------------------------
    def _staging(self, unit: Unit) -> torch.Tensor:
        """A staging buffer for ``unit``'s local gradients: over its own gathered block where it can, else a slot of
        the pool (:meth:`GatherScheduler.staging <megazero.zero.stage3.gather.GatherScheduler.staging>`)."""
        return self.sched.staging(unit, self.stage_dtype)

    def _on_grad(self, unit: Unit, p: nn.Parameter) -> None:
        """File ``p``'s fresh gradient with its unit (a root unit's stays ``p.grad``, which later uses of the
        parameter in this backward add to); stage the filed ones once they reach the unit's largest parameter's
        size; reduce the unit once its last gradient has arrived."""
        if p.grad is None:
            return
        i = unit.index[p]
        self._touched.add(unit.chunk)
        if not unit.is_root:
            if unit.staging is None:  # the slot the unit's gradients are staged in: taken as they begin
                unit.staging = self._staging(unit)
            unit.filed.append((i, p.grad.reshape(-1)))
            unit.filed_numel, p.grad = unit.filed_numel + p.numel(), None
            if unit.filed_numel >= unit.flush_numel:
                self._stage(unit)
        if not unit.arrived[i]:
            unit.arrived[i] = True
            unit.remaining -= 1
        if unit.remaining == 0 and not unit.reduced:
            self._reduce(unit)

    def _stage(self, unit: Unit) -> None:
        """Move ``unit``'s filed gradients into its staging buffer: one ``torch._foreach_copy_`` (a parameter's
        first gradient of this backward) and one ``_foreach_add_`` (a second one), never a copy per parameter."""
        staging, layout = unit.staging, unit.layout
        if unit.is_root:
            filed = [(i, p.grad.reshape(-1)) for i, p in enumerate(unit.params) if p.grad is not None]
            for p in unit.params:
                p.grad = None
        else:
            filed, unit.filed, unit.filed_numel = unit.filed, [], 0
        copy: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        add: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, g in filed:
            o = layout.offsets[i]
            (add if i in unit.staged else copy)[0].append(staging[o: o + g.numel()])
            (add if i in unit.staged else copy)[1].append(g)
            unit.staged.add(i)
        if copy[0]:
            torch._foreach_copy_(*copy)
        filed = g = copy = None  # the fresh gradients are freed as soon as they are staged
        if add[0]:
            torch._foreach_add_(*add)

    def _flush(self, unit: Unit) -> None:
        """Stage what is filed, and zeros where no gradient arrived (and in the padding)."""
        self._stage(unit)
        layout, staging = unit.layout, unit.staging
        for i, (o, n) in enumerate(zip(layout.offsets, layout.numels)):
            if i not in unit.staged:
                staging[o: o + n].zero_()
        staging[layout.numel:].zero_()

    def _reduce(self, unit: Unit) -> None:
        """``unit``'s backward is done: release it and reduce-scatter its gradients (bounded in flight)."""
        unit.reduced = True
        self.sched.release(unit)
        g = unit.params[0].grad if unit.is_root and len(unit.params) == 1 and unit.arrived[0] else None
        direct = (g is not None and g.dtype == self.stage_dtype and g.numel() == unit.numel
                  and g.is_contiguous())  # one parameter, no padding: its own .grad is the reduction's input
        if direct:
            unit.staging, unit.staging_slot, unit.params[0].grad = g.view(-1), None, None
        else:
            if unit.staging is None:
                unit.staging = self._staging(unit)
            self._flush(unit)
        flat, slot, unit.staging, unit.staging_slot = unit.staging, unit.staging_slot, None, None
        first = not unit.grad_live  # the step's first reduction of this unit allocates its owned gradient
        if first:
            self._materialise(unit)
        s, size = unit.layout.shard_numel, self.dp_group.size
        if flat.dtype == self.grad_dtype:
            self._issue(unit, flat, 0, s, first, slot)
            return
        step = -(-s // self.reduce_chunks)
        for a in range(0, s, step):  # [a, b) of every rank's slice, converted to grad_dtype
            b = min(a + step, s)
            chunk_slot, chunk = self.slots.view(size * (b - a), self.grad_dtype, pooled=not unit.is_root)
            chunk.view(size, b - a).copy_(flat.view(size, s)[:, a:b])
            self._issue(unit, chunk, a, b, first, chunk_slot)
            del chunk  # a slot goes back when its reduction completes, a fresh tensor is freed (_complete_oldest)
        self.slots.give_back(slot)

    def _issue(self, unit: Unit, flat: torch.Tensor, a: int, b: int, first: bool, slot) -> None:
        """Reduce ``flat`` (every rank's [a, b) of ``unit``, rank-major) into this rank's owned [a, b)."""
        n = b - a
        mine = flat[self.rank * n: (self.rank + 1) * n]
        if self.reduce_scatter:
            work = (self.qgz or self.reduce_group).reduce_scatter(mine, flat, tag="grad", async_op=True)
        else:
            work = self.reduce_group.all_reduce(flat, tag="grad", async_op=True)
        self._inflight.append((work, unit, flat, mine, a, first, slot))
        limit = self.max_inflight if self.overlap_comm else 0
        while len(self._inflight) > limit:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        work, unit, buf, mine, a, first, slot = self._inflight.pop(0)
        work.wait()
        dest = unit.grad[a: a + mine.numel()]
        if first:
            dest.copy_(mine)
        else:  # a later micro-batch: accumulate
            dest.add_(mine)
        if slot is not None:
            self.slots.give_back(slot)
        elif buf.dtype != self.stage_dtype:  # a converted chunk too large for a slot: free it now (gloo's
            buf.untyped_storage().resize_(0)  # worker may keep a reference to the tensor a while)

    def _materialise(self, unit: Unit) -> torch.Tensor:
        unit.grad.untyped_storage().resize_(unit.grad.numel() * unit.grad.element_size())
        unit.grad_live = True
        return unit.grad

    def _held_staging(self) -> list[torch.Tensor]:
        filed = [g for u in self.units for _, g in u.filed]  # fresh gradients not yet staged
        return [u.staging for u in self.units if u.staging is not None] + [e[2] for e in self._inflight] + filed

    # -- the store interface the optimizer drives ----------------------------------------------------------
    def zero_grad(self) -> None:
        """Free the owned gradient partition: each unit's part is allocated by its first reduction of the next
        step (so a step's first backward holds only the parts reduced so far, like FSDP's sharded ``.grad``)."""
        for unit in self.units:
            unit.grad.untyped_storage().resize_(0)
            unit.grad_live = False
        for store in self.persistent:
            if store is not None:
                store.zero_grad()
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def start_backward(self) -> None:
        """Reset per-backward bookkeeping; called before each backward (one micro-batch of one chunk)."""
        for unit in self.units:
            unit.reset_backward()
        self._touched = set()
        self._in_backward = True
        self.sched.begin(BWD)
        for store in self.persistent:
            if store is not None:
                store.start_backward()

    def finish_backward(self) -> None:
        """Reduce the units of the chunks this backward ran through whose gradients did not all arrive, wait
        for every reduction, release everything."""
        for unit in self.units:
            if unit.chunk in self._touched and not unit.reduced:
                self._reduce(unit)
        while self._inflight:
            self._complete_oldest()
        for unit in list(self.sched.gathered.values()):
            self.sched.release(unit)
        for u in self.units:
            self.slots.give_back(u.staging_slot)
            u.staging, u.staging_slot = None, None
        self.sched.end()
        self._in_backward = False
        for c, store in enumerate(self.persistent):
            if store is not None and c in self._touched:
                store.finish_backward()

    def reduce_gradients(self) -> None:
        """Nothing left to reduce at the boundary (stage 3 reduces during every backward); owned gradients of
        units no backward reached this step become zeros."""
        for unit in self.units:
            if not unit.grad_live:
                self._materialise(unit).zero_()

    def after_step(self) -> None:
        """Gathered parameters need nothing (the next forward gathers them); persistent ones are all-gathered."""
        self.sched.invalidate()  # hpZ's secondary copy is stale until then; the carry ends (gather.py)
        for store in self.persistent:
            if store is not None:
                store.after_step()

    def gather_all(self) -> None:
        """Gather every unit (a collective over the DP group) and hold them; pair with :meth:`release_all`."""
        self.sched.gather_all()

    def release_all(self) -> None:
        """Release every gathered unit (the outermost of nested :meth:`gather_all` calls)."""
        self.sched.release_all()

    def walk(self, params: Sequence[nn.Parameter] | None = None) -> Iterator[list[nn.Parameter]]:
        """Lists of parameters holding their whole values, one gather unit at a time (:meth:`GatherScheduler.walk
        <megazero.zero.stage3.gather.GatherScheduler.walk>`): the persistent ones first (whole anyway), then each
        unit's, released once the caller moves on. ``params``: only those (and the units holding them). A
        collective over the DP group: every rank walks with the same ``params``."""
        wanted = None if params is None else {id(p) for p in params}
        whole = [p for store in self.persistent if store is not None for p in reversed(store.params)]
        whole = [p for p in whole if wanted is None or id(p) in wanted]
        if whole:
            yield whole
        units = [u for u in self.units if wanted is None or any(id(p) in wanted for p in u.params)]
        for unit in self.sched.walk(units):
            yield [p for p in unit.params if wanted is None or id(p) in wanted]

    def layouts(self) -> list[tuple[list[nn.Parameter], FlatLayout, int]]:
        """``(parameters, layout, rank)`` of each owned segment, in the order of :attr:`segments`."""
        out = [lay for s in self.persistent if s is not None for lay in s.layouts()]
        return out + [(u.params, u.layout, self.rank) for u in self.units]

    def consolidate(self, values: Sequence[torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Full fp32 tensors per parameter from every rank's per-segment ``values`` (a collective)."""
        out: dict[nn.Parameter, torch.Tensor] = {}
        k = 0
        for store in self.persistent:
            if store is not None:
                out.update(store.consolidate(values[k: k + len(store.segments)]))
                k += len(store.segments)
        for unit, v in zip(self.units, values[k:]):
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=v.device)
            self.dp_group.all_gather_into(full, v.detach().float().contiguous(), tag="other")
            shapes = [p.shape for p in unit.params]
            out.update(zip(unit.params, (t.clone() for t in unit.layout.views(full, shapes))))
        return out

    def padded_numel(self) -> dict[str, int]:
        """Elements laid out (with padding): ``whole`` (persistent parameters), ``gathered`` (sharded units) and
        ``own``, of them the chunks' own units (outside the blocks: gathered once per micro-batch where a rank
        runs one chunk, :mod:`.gather`'s "Carry")."""
        return {"whole": sum(s.numel for s in self.persistent if s is not None),
                "gathered": sum(u.numel for u in self.units),
                "own": sum(u.numel for u in self.units if u.is_root)}

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The buffers this store holds right now, by model-state category (released units hold 0 bytes)."""
        params = [self.shard_flat] + [u.full for u in self.units] + self.sched.held()  # + hpZ's secondary
        grads = [u.grad for u in self.units] + self._held_staging()
        comm: list[torch.Tensor] = self.slots.held()  # idle slots; the persistent parameters' staging pools
        for store in self.persistent:
            if store is not None:
                held = store.held_tensors()
                params += held["params"]
                grads += held["grads"]
                comm += held.get("comm", [])
        # what of the above lives in host memory (``offload_param``)
        return {"params": params, "grads": grads, "comm": comm,
                "offloaded_params": [self.shard_flat] if self.offload_param else []}
