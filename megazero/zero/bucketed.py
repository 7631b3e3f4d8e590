"""Which state each ZeRO stage shards, and :class:`BucketedParams`: the flat parameter and gradient buffers of
stages 0-2 (and of stage 3's persistent parameters), reduced over the DP group bucket by bucket.

The flat layouts, owned segments and bucket cuts it builds on live in :mod:`megazero.zero.flat` (re-exported
here).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.zero import flat
from megazero.zero.flat import FlatLayout, OwnedSegment, Piece, build_buckets, set_data, storage_bytes

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


class BucketedParams:
    """Parameters in flat buckets whose gradients are reduced over the DP group bucket by bucket.

    The parameters, laid end to end in reverse registration order (roughly the order backward produces their
    gradients), are cut into buckets of ``bucket_numel`` elements (:func:`build_buckets`: a parameter may
    continue in the next bucket); each bucket is a :class:`FlatLayout` over the DP group (``shard_optimizer``)
    or over this rank alone, and every parameter becomes a view into one flat model-dtype buffer. Gradients
    are accumulated and reduced in ``grad_dtype`` (default: the model dtype; fp32 for bf16 training).
    ``groups`` are the model chunks of an interleaved pipeline (default: one): no bucket spans two groups, and
    a backward touches only the buckets of the chunk that ran. Policy:

    * Gradients move into the flat buffers a bucket at a time, never a parameter at a time: a parameter's hook
      only files its fresh gradient under its bucket; once the bucket's last gradient of the backward has
      arrived (or the gradients it keeps alive reach :attr:`flush_numel` elements, the largest parameter's
      size, so filing holds about one more parameter's gradient than copying each at once would; in the
      buckets holding a piece of the largest, the second largest's: there the largest's gradient, a GPT's tied
      embedding whose three copies autograd makes at the end of backward, would find a pile of gradients as
      large as itself waiting beside it at the step's peak) one
      ``torch._foreach_copy_`` (the step's first gradient; it casts bf16 to fp32) or ``_foreach_add_`` (later
      micro-batches) moves them all, so a step makes a few launches per bucket, not per parameter.
    * ``shard_gradients`` False (stages 0-1): one flat gradient buffer of Ψ elements, allocated once and never
      zeroed (the first flush of a step copies over the last step's values). With ``grad_dtype`` equal to the
      model dtype ``p.grad`` points into it after each backward, otherwise ``p.grad`` is dropped (Megatron-LM's
      ``main_grad``); each backward starts with ``p.grad`` None, so autograd hands over its fresh gradient
      without accumulating into the view a parameter at a time. During the last micro-batch's
      backward of each group (known from :meth:`zero_grad`'s ``micro_batches``), a bucket is all-reduced
      (stage 0) or reduced-scattered in place (stage 1) as soon as its last gradient arrives, overlapped with
      the rest of backward (DDP-style; waited on in :meth:`reduce_gradients`). 2Ψ resp. Ψ per step, whatever
      the number of micro-batches m.
    * ``shard_gradients`` True (stage 2): a bucket's gradients are flushed into its staging buffer, taken
      from a pool of ``max_inflight`` buffers of one bucket's size allocated once; a full bucket is
      reduce-scattered at once (asynchronously with ``overlap_comm``) and its shard copied or added into this
      rank's owned gradient buffer (one contiguous buffer of ~Ψ/Nd) when its buffer is needed again or at the
      end of the backward. At most ``max_inflight`` buckets are being filled or reduced at any time, so the
      unreduced gradient never exists whole. When every buffer holds a bucket still being filled, the oldest
      is reduced as it is and its late gradients reopen it (more traffic, never more memory). Ψ per micro-batch.

    Every rank issues its reductions in the order its gradients arrive, which is the same on every rank of the
    DP group (same graph, same code). With ``shard_optimizer``, :meth:`after_step` all-gathers the updated
    slices into every rank's buffer (Ψ). With ``reduce_scatter`` False, gradients are all-reduced instead (2Ψ
    per reduction) and the slice kept. Parameters in ``isolate`` get buckets of their own, so this rank owns
    the same elements of them whatever else the store holds (the tied embedding's two pipeline copies must be
    partitioned alike, given the same ``bucket_numel``). ``init_flat``: where the owned fp32 starting values go
    in mixed precision (default: a new buffer; ZeRO-3's holds its gathered parameters' too).
    """

    def __init__(self, params: Sequence[nn.Parameter], dtype: torch.dtype, dp_group: Group, *,
                 shard_optimizer: bool, shard_gradients: bool, bucket_numel: int, align: int = 16,
                 overlap_comm: bool = False, reduce_scatter: bool = True,
                 isolate: Sequence[nn.Parameter] = (), grad_dtype: torch.dtype | None = None,
                 max_inflight: int = 2, groups: Sequence[Sequence[nn.Parameter]] | None = None,
                 param_init: Callable[[nn.Parameter], torch.Tensor] | None = None,
                 device: torch.device | None = None, reduce_group: Group | None = None, qgz=None,
                 init_flat: torch.Tensor | None = None) -> None:
        if shard_gradients and not shard_optimizer:
            raise ValueError("sharded gradients need sharded optimizer states (ZeRO stage 2 includes stage 1)")
        if max_inflight < 1:
            raise ValueError(f"max_inflight (--max-inflight-buckets) must be >= 1, got {max_inflight}")
        self.dp_group = dp_group
        self.reduce_group = reduce_group or dp_group  # the gradient reductions' group (ZeRO-3: its own)
        self.qgz = qgz  # stage 2's reduce-scatter as ZeRO++ qgZ (megazero.zero.qgz.QuantizedReduce), or None
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
        # (start, the parameter of each piece, layout whose bases say where each piece starts in its parameter)
        self.buckets: list[tuple[int, list[nn.Parameter], FlatLayout]] = []
        self._bucket_group: list[int] = []
        # parameter -> its pieces (bucket, offset in the bucket, offset in the parameter, numel, piece index)
        self._pieces: dict[nn.Parameter, list[tuple[int, int, int, int, int]]] = {p: [] for p in order}
        self._start: dict[nn.Parameter, int] = {}  # where the parameter starts in the flat buffers
        start = 0
        isolated = [any(p is q for q in isolate) for p in order]
        for cut in build_buckets([p.numel() for p in order], bucket_numel, isolated,
                                 [group_of.get(p, 0) for p in order], multiple=n_ranks * align):
            b = len(self.buckets)
            ps = [order[i] for i, _, _ in cut]
            layout = FlatLayout([n for _, _, n in cut], n_ranks, align, [base for _, base, _ in cut])
            for j, ((i, base, n), off) in enumerate(zip(cut, layout.offsets)):
                p = order[i]
                self._start.setdefault(p, start + off)
                if self._start[p] + base != start + off:  # a cut parameter continues without padding
                    raise AssertionError(f"parameter {tuple(p.shape)} laid out with a gap at bucket {b}")
                self._pieces[p].append((b, off, base, n, j))
            self.buckets.append((start, ps, layout))
            self._bucket_group.append(group_of.get(ps[0], 0))
            start += layout.padded_numel
        self.numel = start
        device = device or (order[0].device if order else None)
        self.param_flat = torch.empty(start, dtype=dtype, device=device)
        gdt = self.grad_dtype
        if shard_gradients:
            self.grad_flat = None
            self.owned_grad = torch.zeros(sum(lay.shard_numel for _, _, lay in self.buckets), dtype=gdt,
                                          device=device)
        else:  # zero once: hooks copy into it, and the padding is only ever written by the reductions (zeros)
            self.grad_flat = torch.zeros(start, dtype=gdt, device=device)
            self.owned_grad = None
        ranges = [(s, *lay.shard_range(self.rank)) for s, _, lay in self.buckets]
        # the owned slices' fp32 starting values for a mixed-precision master copy (zeros in the padding)
        owned = [hi - lo for _, lo, hi in ranges]  # mixed precision: one fp32 buffer, the master-to-be (state.py)
        mixed = dtype != torch.float32 and bool(owned)
        start = (torch.zeros(sum(owned), dtype=torch.float32, device=device) if init_flat is None
                 else init_flat.zero_()) if mixed else None  # (split checks init_flat's size)
        inits = list(start.split(owned)) if start is not None else [None] * len(owned)
        for s, _, layout in self.buckets:
            self.param_flat[s + layout.numel: s + layout.padded_numel].zero_()
        for p in order:  # one parameter's value at a time (built on the meta device: drawn in place where fp32)
            pv = self.param_flat[self._start[p]: self._start[p] + p.numel()].view(p.shape)
            value = flat.initial_into(param_init, p, pv)  # its fp32 value (pv itself, or a temporary)
            for b, off, base, n, _ in self._pieces[p]:
                _, lo, hi = ranges[b]
                a, z = max(off, lo), min(off + n, hi)
                if inits[b] is not None and a < z:
                    inits[b][a - lo: z - lo].copy_(value.reshape(-1)[base + a - off: base + z - off])
            del value
            set_data(p, pv)
        self.segments: list[OwnedSegment] = []
        owned_off = 0
        for (s, ps, layout), (_, lo, hi), init in zip(self.buckets, ranges, inits):
            if shard_gradients:
                grad = self.owned_grad[owned_off: owned_off + layout.shard_numel]
                owned_off += layout.shard_numel
            else:
                grad = self.grad_flat[s + lo: s + hi]
            pieces = [(ps[pc.index], pc.offset, pc.offset + pc.numel) for pc in layout.pieces(lo, hi)]
            self.segments.append(OwnedSegment(self.param_flat[s + lo: s + hi], grad, pieces, init))
        # stages 0-1 in the model dtype: ``p.grad`` is left pointing into grad_flat after each backward
        self._grad_views = not shard_gradients and gdt == dtype
        self._exposed = False  # ``p.grad`` views grad_flat now (from the end of a backward to the next start)
        # fresh gradients filed per bucket until flushed: (bucket) -> [(piece index, 1-D source)], their elements
        self._filed: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.buckets]
        self._filed_numel = [0] * len(self.buckets)
        # a bucket's filed gradients flush here (class docstring): the largest parameter's size, the second
        # largest's in the buckets holding a piece of the largest
        sizes = sorted(p.numel() for p in order)
        self.flush_numel = [sizes[-2] if len(sizes) > 1 and any(q.numel() == sizes[-1] for q in ps) else sizes[-1]
                            for _, ps, _ in self.buckets]
        # stage 2: the staging pool (allocated on first use, never again) and the buckets using it
        self._pool_numel = max((lay.padded_numel for _, _, lay in self.buckets), default=0)
        self._pool: list[torch.Tensor] = []
        self._free: list[int] = []
        self._open: dict[int, int] = {}  # bucket -> pool buffer, in the order they were opened
        self._filled: dict[int, set[int]] = {}  # open bucket -> pieces copied into its buffer
        self._inflight: deque[tuple[object, int, int]] = deque()  # (work, bucket, pool buffer)
        # stages 0-1: this step's reductions, started in the last micro-batch's backward of each group
        self._pending: list[object] = []
        self._launched = [False] * len(self.buckets)
        self._written: list[set[int]] = [set() for _ in self.buckets]  # pieces this step has in grad_flat
        self._owned_written = [False] * len(self.buckets)  # stage 2: owned slices holding this step's sums
        # per backward: pieces still to arrive per bucket, groups touched; per step: passes per group
        self._remaining = [len(ps) for _, ps, _ in self.buckets]
        self._touched: set[int] = set()
        self._passes: dict[int, int] = {}
        self.micro_batches: int | None = None
        for p in order:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.zero_grad()

    # -- gradients -----------------------------------------------------------------------------------------
    def _grad_view(self, p: nn.Parameter) -> torch.Tensor:
        a = self._start[p]
        return self.grad_flat[a: a + p.numel()].view(p.shape)

    def zero_grad(self, micro_batches: int | None = None) -> None:
        """Start a new step of ``micro_batches`` backward passes per model chunk.

        Knowing ``micro_batches`` lets stages 0-1 reduce each bucket during the last pass (None: all at
        :meth:`reduce_gradients`). Nothing is zeroed: each gradient buffer is overwritten by the step's first
        gradient (and slices no gradient reached are zeroed before their reduction).
        """
        if micro_batches is not None and micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.micro_batches = micro_batches
        self._passes = {}
        self._launched = [False] * len(self.buckets)
        self._written = [set() for _ in self.buckets]
        self._owned_written = [False] * len(self.buckets)
        self._drop_filed()
        self._exposed = False
        for p in self.params:
            p.grad = None

    def _drop_filed(self) -> None:
        self._filed = [[] for _ in self.buckets]
        self._filed_numel = [0] * len(self.buckets)

    def start_backward(self) -> None:
        """Reset the per-backward bookkeeping; call before each backward pass. ``p.grad`` becomes None, so
        autograd hands each fresh gradient to the hooks instead of adding it into the buffer's view."""
        self._remaining = [len(ps) for _, ps, _ in self.buckets]
        self._touched = set()
        if self._exposed:
            self._exposed = False
            for p in self.params:
                p.grad = None

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
        """File ``p``'s fresh gradient under its buckets (no copy); flush and reduce the buckets it completes."""
        if p.grad is None:
            return
        pieces = self._pieces[p]
        last = self._last_pass(pieces[0][0])
        if self.grad_flat is not None and any(self._launched[b] for b, *_ in pieces):
            raise RuntimeError("a gradient arrived for a bucket already reduced in this step: zero_grad("
                               "micro_batches=m) must state the number of backward passes per step")
        g = p.grad
        in_place = self._exposed and device_io.same_data(g, self._grad_view(p))
        if in_place:  # autograd added into the view (a backward without start_backward): already there
            for b, _, _, _, j in pieces:
                self._written[b].add(j)
        else:
            flat = g.reshape(-1)
            for b, _, base, n, j in pieces:  # a piece keeps its whole gradient alive: counted in full
                self._filed[b].append((j, flat[base: base + n]))
                self._filed_numel[b] += flat.numel()
        p.grad = None
        for b, *_ in pieces:
            self._remaining[b] -= 1
            if self._remaining[b] == 0 or self._filed_numel[b] >= self.flush_numel[b]:
                self._flush(b)
            if self._remaining[b] == 0:
                if self.grad_flat is None:
                    self._launch_staged(b)
                elif last:
                    self._launch_flat(b)

    def _flush(self, b: int) -> None:
        """Move bucket ``b``'s filed gradients into its buffer: one foreach copy (their first gradient of the
        step, or of this staging) and one foreach add (later ones), each casting to ``grad_dtype``."""
        filed = self._filed[b]
        if not filed:
            return
        self._filed[b], self._filed_numel[b] = [], 0
        layout = self.buckets[b][2]
        if self.grad_flat is None:  # stage 2: into the bucket's staging buffer
            if b not in self._open:
                self._open[b] = self._acquire()
                self._filled[b] = set()
                self._pool[self._open[b]][layout.numel: layout.padded_numel].zero_()
            dest, seen = self._pool[self._open[b]], self._filled[b]
        else:
            dest, seen = self.grad_flat[self.buckets[b][0]:], self._written[b]
        copy: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        add: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for j, src in filed:
            off = layout.offsets[j]
            (add if j in seen else copy)[0].append(dest[off: off + src.numel()])
            (add if j in seen else copy)[1].append(src)
            seen.add(j)
        if copy[0]:
            torch._foreach_copy_(*copy)
        if add[0]:
            torch._foreach_add_(*add)

    def _flush_all(self) -> None:
        for b in range(len(self.buckets)):
            self._flush(b)

    def _expose(self) -> None:
        """Stages 0-1 in the model dtype: ``p.grad`` views the buffer where this step's gradient is."""
        if not self._grad_views:
            return
        self._exposed = True
        for p in self.params:
            if all(j in self._written[b] for b, _, _, _, j in self._pieces[p]):
                p.grad = self._grad_view(p)

    # stage 2 -------------------------------------------------------------------------------------------
    def _acquire(self) -> int:
        """A free staging buffer: a new one while the pool is not full, else wait for the oldest reduction,
        else reduce the bucket opened first (every buffer holds a bucket still being filled)."""
        if self._free:
            return self._free.pop()
        if len(self._pool) < min(self.max_inflight, len(self.buckets)):
            self._pool.append(torch.empty(self._pool_numel, dtype=self.grad_dtype, device=self.param_flat.device))
            return len(self._pool) - 1
        if not self._inflight:
            self._launch_staged(next(iter(self._open)))
        self._wait_oldest()
        return self._free.pop()

    def _launch_staged(self, b: int) -> None:
        self._flush(b)
        buf = self._open.pop(b)
        _, ps, layout = self.buckets[b]
        staging = self._pool[buf][: layout.padded_numel]
        filled = self._filled.pop(b)
        if len(filled) < len(ps):  # reduced before all its gradients arrived: the missing ones count zero
            for j, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
                if j not in filled:
                    staging[off: off + n].zero_()
        lo, hi = layout.shard_range(self.rank)
        if self.reduce_scatter:
            work = (self.qgz or self.reduce_group).reduce_scatter(staging[lo:hi], staging, tag="grad", async_op=True)
        else:
            work = self.reduce_group.all_reduce(staging, tag="grad", async_op=True)
        self._inflight.append((work, b, buf))
        if not self.overlap_comm:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        work, b, buf = self._inflight.popleft()
        work.wait()
        lo, hi = self.buckets[b][2].shard_range(self.rank)
        if self._owned_written[b]:
            self.segments[b].grad.add_(self._pool[buf][lo:hi])
        else:
            self.segments[b].grad.copy_(self._pool[buf][lo:hi])
            self._owned_written[b] = True
        self._free.append(buf)

    # stages 0-1 ----------------------------------------------------------------------------------------
    def _launch_flat(self, b: int) -> None:
        self._flush(b)
        s, ps, layout = self.buckets[b]
        for j, (off, n) in enumerate(zip(layout.offsets, layout.numels)):  # no gradient this step: zeros
            if j not in self._written[b]:
                self.grad_flat[s + off: s + off + n].zero_()
        g = self.grad_flat[s: s + layout.padded_numel]
        if self.shard_optimizer and self.reduce_scatter:
            lo, hi = layout.shard_range(self.rank)
            work = self.reduce_group.reduce_scatter(g[lo:hi], g, tag="grad", async_op=True)
        else:
            work = self.reduce_group.all_reduce(g, tag="grad", async_op=True)
        self._launched[b] = True
        if self.overlap_comm:
            self._pending.append(work)
        else:
            work.wait()

    def _drain_staged(self) -> None:
        """Stage 2: flush the filed gradients, reduce the buckets filled only partly, wait for every reduction."""
        self._flush_all()
        for b in sorted(self._open):
            self._launch_staged(b)
        while self._inflight:
            self._wait_oldest()

    def finish_backward(self) -> None:
        """End of one backward pass: flush every bucket's filed gradients. Stage 2: reduce the buckets this
        pass filled only partly, wait for every reduction. Stages 0-1, last pass of a group: start the
        reductions of that group's remaining buckets."""
        if self.grad_flat is None:
            self._drain_staged()
        else:
            self._flush_all()
            if self.micro_batches is not None:
                last = {g for g in self._touched if self._passes[g] == self.micro_batches}
                for b, g in enumerate(self._bucket_group):
                    if g in last and not self._launched[b]:
                        self._launch_flat(b)
            self._expose()
        self.start_backward()

    def reduce_gradients(self) -> None:
        """At the accumulation boundary. Stages 0-1: reduce the buckets not reduced yet, wait for all. Stage 2:
        zero the owned slices no gradient reached this step."""
        if self.grad_flat is None:
            self._drain_staged()  # also the gradients of a backward run without finish_backward
            for b, written in enumerate(self._owned_written):
                if not written:
                    self.segments[b].grad.zero_()
                    self._owned_written[b] = True
            return
        self._flush_all()
        for b in range(len(self.buckets)):
            if self._launched[b]:
                continue
            for p in self.buckets[b][1] if self._grad_views else ():  # gradients that bypassed the buffer
                view = self._grad_view(p)
                if p.grad is not None and not device_io.same_data(p.grad, view):
                    view.copy_(p.grad)
                    for c, _, _, _, j in self._pieces[p]:
                        self._written[c].add(j)
            self._launch_flat(b)
        for work in self._pending:
            work.wait()
        self._pending.clear()
        self._expose()

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
        fulls = []
        for (_, _, layout), v in zip(self.buckets, values):
            v = v.detach().float().contiguous()
            full = torch.empty(layout.padded_numel, dtype=torch.float32, device=v.device)
            if self.shard_optimizer:
                self.dp_group.all_gather_into(full, v, tag="other")
            else:
                full.copy_(v)
            fulls.append(full)
        out = {}
        for p, pieces in self._pieces.items():
            t = torch.empty(p.numel(), dtype=torch.float32, device=fulls[0].device if fulls else None)
            for b, off, base, n, _ in pieces:
                t[base: base + n].copy_(fulls[b][off: off + n])
            out[p] = t.view(p.shape)
        return out

    def layouts(self) -> list[tuple[list[nn.Parameter], FlatLayout, int]]:
        """``(parameters, layout, rank)`` of each owned segment, in the order of :attr:`segments`."""
        return [(ps, lay, self.rank) for _, ps, lay in self.buckets]

    def padded_numel(self) -> dict[str, int]:
        """Elements laid out: ``whole`` (parameters kept whole, all buckets with padding), ``gathered`` and
        ``own`` (0: stage 3's)."""
        return {"whole": self.numel, "gathered": 0, "own": 0}

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The buffers this store holds right now, by category: ``params``, ``grads`` (the accumulated or
        owned gradient, and fresh gradients filed but not flushed yet) and ``comm`` (stage 2's staging pool: communication buffers, allocated once)."""
        grads = [self.grad_flat if self.grad_flat is not None else self.owned_grad]
        grads += [t for filed in self._filed for _, t in filed]  # fresh gradients not flushed yet
        return {"params": [self.param_flat], "grads": grads, "comm": list(self._pool)}
