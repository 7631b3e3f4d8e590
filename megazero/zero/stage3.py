"""ZeRO stage 3: parameters live only as shards, gathered per submodule just before they are used.

Every module with its own ``forward`` is a *unit*: its trainable parameters (plus those of children without
a forward, such as GPT's ``wpe`` holder, read by the parent's forward) form one
:class:`~megazero.zero.partition.FlatLayout` over the DP group. Each rank keeps only its slice; the
parameters are views into a full-size buffer whose storage is freed (resized to 0) while the unit is
released, so tensors autograd saved alias that storage and see the values again once it is re-gathered.
While released, a parameter's ``.data`` is a shared one-element NaN placeholder expanded to its shape (right
``shape``/``numel()``; a stray read sees NaN, not freed memory). Read real values inside
``ZeroOptimizer.gathered_parameters()`` or from the optimizer's fp32 master copy.

* **Forward**: a forward pre-hook gathers the unit, a forward hook releases it. Units with several entry
  points (the tied embedding: ``wte.forward`` at the input, ``wte.logits`` at the output) stay gathered
  until the model's forward ends, so they are gathered once per forward.
* **Backward**: the forward hook threads the unit's outputs through an identity autograd function whose
  backward gathers the unit again before its backward runs; hooks on the parameters' gradient accumulation
  collect the gradients into a unit buffer; once all have arrived the unit is released and its gradients are
  reduce-scattered to the owners, coalesced with other ready units up to ``reduce_bucket_size`` elements
  (asynchronously with ``overlap_comm``, waited on at the end of backward). The tied embedding's gradient
  arrives once, after both uses.
* **Prefetch**: the first forward and backward record the order of use; later passes gather the next units
  of that order ahead of use in one coalesced all-gather, up to ``stage3_prefetch_bucket_size`` elements and
  never beyond ``stage3_max_live_parameters`` gathered elements.
* **Offload** (``offload_param``): the shards live in host memory (pinned when a GPU is present) and are
  copied to the device just before their all-gather; the optimizer writes updated values into the host shard.
* **Persistence**: parameters of at most ``stage3_param_persistence_threshold`` elements (DeepSpeed's rule)
  stay whole on every rank, handled like stage 2 by a :class:`~megazero.zero.partition.BucketedParams`.
* **Order check**: every gather first all-gathers a small fingerprint (phase, sequence number, unit ids) over
  the DP group; if ranks disagree, all raise :class:`GatherOrderError` naming the modules instead of
  exchanging mismatched buffers (gloo aborts on those). The collective timeout remains the last resort.

DP volume per optimizer step with m micro-batches: 3mΨ_g for gathered parameters (forward gather, backward
gather, gradient reduce-scatter in every micro-batch) plus (m + 1)Ψ_p for persistent ones. With full
activation checkpointing each block is gathered once more, for its recomputation in backward (4mΨ_g for the
blocks), as in DeepSpeed without ``stage3_max_reuse_distance``; keeping a recomputed unit gathered until its
backward would bring it back to 3mΨ_g.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from megazero.config import ZeroConfig
from megazero.distributed import Group
from megazero.zero.partition import BucketedParams, FlatLayout, OwnedSegment

__all__ = ["GatherOrderError", "Stage3Params", "collect_units"]

FWD, BWD = 0, 1
_PHASES = ("forward", "backward")
_FINGERPRINT = 5  # int64s per rank in the order check


class GatherOrderError(RuntimeError):
    """Data-parallel ranks tried to gather different ZeRO-3 parameters at the same point."""


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def collect_units(model: nn.Module) -> list[tuple[str, nn.Module, list[nn.Parameter]]]:
    """``(name, module, parameters)`` for every module with a forward, in registration order.

    A module's parameters are its own trainable ones plus those of descendants without a forward (which
    only hold weights the nearest ancestor with a forward reads). The root is always listed, as ``""``.
    """
    units: dict[nn.Module, tuple[str, list[nn.Parameter]]] = {}
    seen: set[nn.Parameter] = set()

    def walk(module: nn.Module, name: str, owner: nn.Module) -> None:
        if module is model or _has_forward(module):
            owner = module
            units[module] = (name, [])
        for p in module.parameters(recurse=False):
            if p.requires_grad and p not in seen:
                seen.add(p)
                units[owner][1].append(p)
        for child_name, child in module.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, owner)

    walk(model, "", model)
    return [(name, m, ps) for m, (name, ps) in units.items()]


class _PreBackward(torch.autograd.Function):
    """Identity whose backward first calls ``callback`` (gathers a unit before its backward runs)."""

    @staticmethod
    def forward(ctx, callback, x):
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return None, grad


class _GatherBatch:
    """One coalesced all-gather of several units' shards; the first ``wait`` copies every unit out."""

    def __init__(self, units: list[_Unit], group: Group, device: torch.device) -> None:
        self.units = units
        self.n = group.size
        send = torch.cat([u.shard for u in units]).to(device, non_blocking=True)
        self.recv = torch.empty(self.n * send.numel(), dtype=send.dtype, device=send.device)
        self.work = group.all_gather_into(self.recv, send, tag="param", async_op=True)

    def wait(self) -> None:
        if self.recv is None:
            return
        self.work.wait()
        rows = self.recv.view(self.n, -1)
        off = 0
        for u in self.units:
            k = u.layout.shard_numel
            u.full.view(self.n, k).copy_(rows[:, off: off + k])
            off += k
        self.recv = None


class _Unit:
    """One gather unit: a module's parameters as a flat buffer sharded over the DP group."""

    def __init__(self, uid: int, name: str, module: nn.Module, params: list[nn.Parameter], layout: FlatLayout,
                 shard: torch.Tensor, grad: torch.Tensor, full: torch.Tensor) -> None:
        self.uid, self.name, self.module, self.params, self.layout = uid, name or "(model)", module, params, layout
        self.shard, self.grad, self.full = shard, grad, full
        self.views = layout.views(full, [p.shape for p in params])
        self.full_bytes = full.numel() * full.element_size()
        self.offsets = dict(zip(params, layout.offsets))
        self.entries, self.gathered, self.work, self.remaining, self.reduced = 1, False, None, len(params), False
        self.staging: torch.Tensor | None = None


class Stage3Params:
    """Sharded parameters with gather/release hooks on ``model`` (see the module docstring).

    ``extra_entry_points`` maps module types to methods (besides ``forward``) that read the module's
    parameters; the default covers the tied LM head, ``VocabParallelEmbedding.logits``.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype, dp_group: Group, cfg: ZeroConfig, *,
                 align: int = 16, extra_entry_points: dict[type, Sequence[str]] | None = None,
                 isolate: Sequence[nn.Parameter] = (), offload_param: bool = False) -> None:
        if extra_entry_points is None:
            from megazero.tensor_parallel import VocabParallelEmbedding

            extra_entry_points = {VocabParallelEmbedding: ("logits",)}
        self.model = model
        self.dtype = dtype
        self.dp_group = dp_group
        self.rank = dp_group.rank
        self.cfg = cfg
        self.overlap_comm = cfg.overlap_comm
        self.reduce_scatter = cfg.reduce_scatter
        threshold = cfg.stage3_param_persistence_threshold
        spec = collect_units(model)
        persistent = [p for _, _, ps in spec for p in ps if p.numel() <= threshold]
        spec = [(n, m, [p for p in ps if p.numel() > threshold]) for n, m, ps in spec]
        self.persistent = BucketedParams(
            persistent, dtype, dp_group, shard_optimizer=True, shard_gradients=True,
            bucket_numel=min(cfg.reduce_bucket_size, cfg.allgather_bucket_size), align=align,
            overlap_comm=cfg.overlap_comm, reduce_scatter=cfg.reduce_scatter, isolate=isolate) if persistent else None
        layouts = [FlatLayout([p.numel() for p in ps], dp_group.size, align) for _, _, ps in spec if ps]
        device = self.device = next(model.parameters()).device
        total = sum(lay.shard_numel for lay in layouts)
        self.offload_param = offload_param
        host = torch.device("cpu") if offload_param else device
        pin = offload_param and torch.cuda.is_available()
        self.shard_flat = torch.empty(total, dtype=dtype, device=host, pin_memory=pin)
        self.owned_grad = torch.zeros(total, dtype=dtype, device=device)
        self.units: list[_Unit] = []
        self._placeholder = torch.full((1,), float("nan"), dtype=dtype, device=device)
        self.segments: list[OwnedSegment] = list(self.persistent.segments) if self.persistent else []
        self._unit_of: dict[nn.Module, _Unit] = {}
        off = 0
        for (name, module, ps), layout in zip([s for s in spec if s[2]], layouts):
            lo, hi = layout.shard_range(self.rank)
            flat32 = layout.flatten(ps, torch.float32)
            shard = self.shard_flat[off: off + layout.shard_numel]
            shard.copy_(flat32[lo:hi])
            full = torch.empty(layout.padded_numel, dtype=dtype, device=device)
            unit = _Unit(len(self.units), name, module, ps, layout, shard,
                         self.owned_grad[off: off + layout.shard_numel], full)
            off += layout.shard_numel
            self._free(unit)
            self.units.append(unit)
            self._unit_of[module] = unit
            pieces = [(ps[pc.index], pc.offset, pc.offset + pc.numel) for pc in layout.pieces(lo, hi)]
            init = flat32[lo:hi].clone() if dtype != torch.float32 else None
            self.segments.append(OwnedSegment(shard, unit.grad, pieces, init))
            for p in ps:
                p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, unit))
        self._root_unit = self._unit_of.get(model)
        self._install_hooks(extra_entry_points)
        self._trace: list[list[int] | None] = [None, None]
        self._recording: list[list[int] | None] = [None, None]
        self._cursor = [0, 0]
        self._seq = 0
        self._inflight: list[tuple[object, list[_Unit], torch.Tensor]] = []
        self._pending: list[_Unit] = []
        self._pending_numel = 0
        self._bucket_numel = cfg.reduce_bucket_size

    # -- hooks ---------------------------------------------------------------------------------------------
    def _install_hooks(self, extra_entry_points: dict[type, Sequence[str]]) -> None:
        self.model.register_forward_pre_hook(self._root_pre_forward)
        self.model.register_forward_hook(self._root_post_forward)
        for unit in self.units:
            if unit.module is self.model:
                continue
            unit.module.register_forward_pre_hook(lambda *_, u=unit: self._use(u, FWD))
            unit.module.register_forward_hook(functools.partial(self._post_forward, unit))
            for kind, methods in extra_entry_points.items():
                if isinstance(unit.module, kind):
                    for method in methods:
                        setattr(unit.module, method, self._wrap_entry(unit, getattr(unit.module, method)))
                        unit.entries += 1

    def _wrap_entry(self, unit: _Unit, method):
        @functools.wraps(method)
        def entry(*args, **kwargs):
            self._use(unit, FWD)
            return self._attach(method(*args, **kwargs), unit)  # released at the end of the forward

        return entry

    def _attach(self, out, unit: _Unit):
        """Route ``out`` through :class:`_PreBackward` so backward gathers ``unit`` first."""
        if not torch.is_grad_enabled():
            return out
        if isinstance(out, torch.Tensor):
            return _PreBackward.apply(functools.partial(self._use, unit, BWD), out) if out.requires_grad else out
        if isinstance(out, (tuple, list)):
            return type(out)(self._attach(o, unit) for o in out)
        return out

    def _root_pre_forward(self, module, args) -> None:
        self._begin_pass(FWD)
        if self._root_unit is not None:
            self._use(self._root_unit, FWD)

    def _root_post_forward(self, module, args, out):
        if self._root_unit is not None:
            out = self._attach(out, self._root_unit)
        for unit in self.units:  # multi-entry units, the root's own parameters, unused prefetches
            if unit.gathered:
                self._free(unit)
        self._end_pass(FWD)
        return out

    def _post_forward(self, unit: _Unit, module, args, out):
        out = self._attach(out, unit)
        if unit.entries == 1:
            self._free(unit)
        return out

    # -- passes and prefetching ----------------------------------------------------------------------------
    def _begin_pass(self, phase: int) -> None:
        self._cursor[phase] = 0
        self._seq = 0
        self._recording[phase] = [] if self._trace[phase] is None else None

    def _end_pass(self, phase: int) -> None:
        if self._recording[phase] is not None:
            self._trace[phase] = self._recording[phase]
            self._recording[phase] = None

    def _use(self, unit: _Unit, phase: int) -> None:
        """Make ``unit`` available now (fetching it and the next ones in the recorded order)."""
        if self._recording[phase] is not None:
            self._recording[phase].append(unit.uid)
        trace = self._trace[phase]
        if trace is not None:
            c = self._cursor[phase]
            if c < len(trace) and trace[c] == unit.uid:
                self._cursor[phase] = c + 1
            else:  # the order changed: stop prefetching and record it afresh in the next pass
                self._trace[phase] = None
        batch = [] if unit.gathered else [unit]
        batch += self._prefetch(phase, unit)
        if batch:
            self._fetch(batch, phase)
        if unit.work is not None:
            unit.work.wait()
            unit.work = None

    def _prefetch(self, phase: int, current: _Unit) -> list[_Unit]:
        trace, budget = self._trace[phase], self.cfg.stage3_prefetch_bucket_size
        if trace is None or budget <= 0:
            return []
        live = sum(u.layout.padded_numel for u in self.units if u.gathered) + (
            0 if current.gathered else current.layout.padded_numel)
        upcoming = []
        for uid in trace[self._cursor[phase]:]:
            u = self.units[uid]
            if u is not current and u not in upcoming:
                upcoming.append(u)
        ahead = 0
        for u in upcoming:  # refill only when less than half the bucket is already on its way
            if not u.gathered:
                break
            ahead += u.layout.padded_numel
        if ahead >= budget // 2:
            return []
        out = []
        for u in upcoming:
            if u.gathered:
                continue
            n = u.layout.padded_numel
            if ahead + n > budget or live + n > self.cfg.stage3_max_live_parameters:
                break
            out.append(u)
            ahead += n
            live += n
        return out

    def _fetch(self, units: list[_Unit], phase: int) -> None:
        """Gather ``units`` in one all-gather (several units: through one coalesced buffer)."""
        self._check_order(units, phase)
        for u in units:
            u.full.untyped_storage().resize_(u.full_bytes)
            for p, view in zip(u.params, u.views):
                p.data = view
            u.gathered = True
        if len(units) == 1:
            shard = units[0].shard.to(self.device, non_blocking=True)  # from host memory when offloaded
            units[0].work = self.dp_group.all_gather_into(units[0].full, shard, tag="param", async_op=True)
            return
        batch = _GatherBatch(units, self.dp_group, self.device)
        for u in units:
            u.work = batch

    def _free(self, unit: _Unit) -> None:
        if unit.work is not None:
            unit.work.wait()
            unit.work = None
        unit.full.untyped_storage().resize_(0)
        for p in unit.params:
            p.data = self._placeholder.expand(p.shape)
        unit.gathered = False

    def gather_all(self) -> None:
        """Gather every unit (a collective over the DP group); pair with :meth:`release_all`."""
        missing = [u for u in self.units if not u.gathered]
        if missing:
            self._seq = 0
            self._fetch(missing, FWD)
        for u in self.units:
            if u.work is not None:
                u.work.wait()
                u.work = None

    def release_all(self) -> None:
        """Release every gathered unit."""
        for u in self.units:
            if u.gathered:
                self._free(u)

    def _check_order(self, units: list[_Unit], phase: int) -> None:
        self._seq += 1
        if self.dp_group.size == 1:
            return
        digest = 0  # order-sensitive hash of the unit ids
        for u in units:
            digest = (digest * 1_000_003 + u.uid + 1) % (2**61 - 1)
        mine = torch.tensor([phase, self._seq, len(units), units[0].uid, digest], dtype=torch.int64)
        every = torch.empty(self.dp_group.size * _FINGERPRINT, dtype=torch.int64)
        self.dp_group.all_gather_into(every, mine, tag="check")
        every = every.view(self.dp_group.size, _FINGERPRINT)
        if bool((every == mine).all()):
            return
        lines = []
        for r, (ph, seq, n, first, _) in enumerate(every.tolist()):
            name = self.units[first].name if 0 <= first < len(self.units) else f"unit #{first}"
            more = f" and {n - 1} more" if n > 1 else ""
            lines.append(f"rank {r}: {_PHASES[ph] if ph in (0, 1) else ph} gather #{seq} of {name}{more}")
        raise GatherOrderError(
            "ZeRO-3: data-parallel ranks disagree on which parameters to gather next (" + "; ".join(lines)
            + "). Every DP rank must run the model's submodules in the same order (same control flow).")

    # -- gradients -----------------------------------------------------------------------------------------
    def _on_grad(self, unit: _Unit, p: nn.Parameter) -> None:
        if p.grad is None:
            return
        if unit.staging is None:
            unit.staging = torch.zeros(unit.layout.padded_numel, dtype=self.dtype, device=p.device)
        off = unit.offsets[p]
        unit.staging[off: off + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None
        unit.remaining -= 1
        if unit.remaining == 0 and not unit.reduced:
            self._ready(unit)

    def _ready(self, unit: _Unit) -> None:
        """All of ``unit``'s gradients are in: release it and queue its gradients for reduction."""
        unit.reduced = True
        self._free(unit)  # its backward is done: every use of its parameters fed these gradients
        if unit.staging is None:  # no gradient arrived in this backward: reduce zeros, as every rank does
            unit.staging = torch.zeros(unit.layout.padded_numel, dtype=self.dtype, device=unit.grad.device)
        self._pending.append(unit)
        self._pending_numel += unit.layout.padded_numel
        if self._pending_numel >= self._bucket_numel:
            self._reduce_pending()

    def _reduce_pending(self) -> None:
        """Reduce-scatter the queued units' gradients in one collective (rank-major coalesced buffer)."""
        units, self._pending, self._pending_numel = self._pending, [], 0
        if not units:
            return
        n = self.dp_group.size
        if len(units) == 1:
            flat = units[0].staging
        else:
            flat = torch.cat([u.staging.view(n, -1) for u in units], dim=1).view(-1)
        for u in units:
            u.staging = None
        shard = flat.numel() // n
        out = flat[self.rank * shard: (self.rank + 1) * shard]
        if self.reduce_scatter:
            work = self.dp_group.reduce_scatter(out, flat, tag="grad", async_op=True)
        else:
            work = self.dp_group.all_reduce(flat, tag="grad", async_op=True)
        self._inflight.append((work, units, flat))
        if not self.overlap_comm:
            self._drain()

    def _drain(self) -> None:
        for work, units, flat in self._inflight:
            work.wait()
            shard = flat.numel() // self.dp_group.size
            off = self.rank * shard
            for u in units:
                u.grad.add_(flat[off: off + u.layout.shard_numel])
                off += u.layout.shard_numel
        self._inflight.clear()

    # -- the store interface the optimizer drives ----------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero the owned gradient partition."""
        self.owned_grad.zero_()
        if self.persistent is not None:
            self.persistent.zero_grad()
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def start_backward(self) -> None:
        """Reset per-backward bookkeeping; called before each micro-batch's backward."""
        for unit in self.units:
            unit.remaining, unit.reduced, unit.staging = len(unit.params), False, None
        self._begin_pass(BWD)
        if self.persistent is not None:
            self.persistent.start_backward()

    def finish_backward(self) -> None:
        """Reduce units whose gradients did not all arrive, wait for every reduction, release everything."""
        for unit in self.units:
            if not unit.reduced:
                self._ready(unit)
        self._reduce_pending()
        self._drain()
        for unit in self.units:
            if unit.gathered:
                self._free(unit)
        self._end_pass(BWD)
        if self.persistent is not None:
            self.persistent.finish_backward()

    def reduce_gradients(self) -> None:
        """Nothing left to reduce at the boundary: stage 3 reduces during every backward."""

    def after_step(self) -> None:
        """Gathered parameters need nothing (the next forward gathers them); persistent ones are all-gathered."""
        if self.persistent is not None:
            self.persistent.after_step()

    def consolidate(self, values: Sequence[torch.Tensor]) -> dict[nn.Parameter, torch.Tensor]:
        """Full fp32 tensors per parameter from every rank's per-segment ``values`` (a collective)."""
        k = len(self.persistent.segments) if self.persistent else 0
        out = self.persistent.consolidate(values[:k]) if self.persistent else {}
        for unit, v in zip(self.units, values[k:]):
            full = torch.empty(unit.layout.padded_numel, dtype=torch.float32, device=v.device)
            self.dp_group.all_gather_into(full, v.detach().float().contiguous(), tag="other")
            shapes = [p.shape for p in unit.params]
            out.update(zip(unit.params, (t.clone() for t in unit.layout.views(full, shapes))))
        return out

    def padded_numel(self) -> dict[str, int]:
        """Elements laid out (with padding): ``whole`` (persistent parameters), ``gathered`` (sharded units)."""
        return {"whole": self.persistent.numel if self.persistent else 0,
                "gathered": sum(u.layout.padded_numel for u in self.units)}

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The buffers this store holds right now, by model-state category (released units hold 0 bytes)."""
        params = [self.shard_flat] + [u.full for u in self.units]
        grads = [self.owned_grad] + [u.staging for u in self.units if u.staging is not None]
        grads += [flat for _, _, flat in self._inflight]
        if self.persistent is not None:
            held = self.persistent.held_tensors()
            params += held["params"]
            grads += held["grads"]
        # what of the above lives in host memory (``offload_param``)
        return {"params": params, "grads": grads, "offloaded_params": [self.shard_flat] if self.offload_param else []}
