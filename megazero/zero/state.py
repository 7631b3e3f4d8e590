"""This rank's optimizer state, and its canonical form for checkpoints.

The elements a rank updates are its store's owned segments laid end to end ("owned coordinates"). Over them it
keeps the two fp32 Adam moments and, where the parameters are not fp32 themselves, an fp32 master copy:

* ``fp32`` trains the parameters directly: a parameter is its own master copy (no ``master``; 8 bytes of Adam
  moments per owned element);
* ``bf16`` and ``fp16`` keep the model's parameters in 16 bits and an fp32 master of this rank's partition only
  (K = 12 bytes per owned element; stage 0 owns everything);
* under optimizer offload (:mod:`.offload`) the master and moments live in host memory, so fp32 needs a
  separate master there too.

A checkpoint does not store these flat buffers: :meth:`OwnedState.owned` names every run of elements by its
parameter and offset, so a writer can save each run and a reader reload it at any topology
(``megazero/checkpoint/canonical.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from megazero.distributed import device_io
from megazero.zero.bucketed import BucketedParams
from megazero.zero.offload import HostOffload
from megazero.zero.stage3.params import Stage3Params

__all__ = ["OwnedState"]

OwnedRun = tuple[nn.Parameter, int, dict[str, torch.Tensor]]


class OwnedState:
    """The fp32 state over ``store``'s owned segments: ``master`` (None when the parameters are their own
    master: ``separate_master`` False), ``exp_avg`` and ``exp_avg_sq``; in host memory when ``host`` is given.

    A separate master starts from each segment's fp32 ``init`` values (a mixed-precision model's fp32 start,
    dropped once taken), else from the parameters. ``starts`` are the segments' offsets in owned coordinates,
    ``numel`` their total, ``pieces`` the ``(start, end, tensor)`` runs Adam updates in place. Without ``host``
    the states live on ``device`` (default: the first segment's).
    """

    def __init__(self, store: BucketedParams | Stage3Params, separate_master: bool,
                 host: HostOffload | None = None, device: torch.device | None = None) -> None:
        self.store = store
        segs = store.segments
        self.starts = [0]
        for s in segs:
            self.starts.append(self.starts[-1] + s.param.numel())
        self.numel = self.starts[-1]
        device = device or segs[0].param.device  # the compute device (not a host shard's, under offload_param)

        def fp32(zero: bool) -> torch.Tensor:  # an owned-size fp32 state, in host memory under offload
            if host is not None:
                return host.fp32(self.numel, zero)
            return (torch.zeros if zero else torch.empty)(self.numel, dtype=torch.float32, device=device)

        inits = [s.init for s in segs]
        if separate_master and host is None and _one_buffer(inits, self.numel):  # the store's fp32 start, in order
            self.master = inits[0].as_strided((self.numel,), (1,), 0)  # becomes the master: nothing copied or freed
            for s in segs:
                s.init = None
            self.pieces = [(0, self.numel, self.master)]
        elif separate_master:  # an fp32 master copy of the owned partition (from the fp32 model)
            self.master = fp32(zero=False)
            for s, a in zip(segs, self.starts):
                self.master[a: a + s.param.numel()].copy_(s.init if s.init is not None else s.param)
                s.init = None
            self.pieces = [(0, self.numel, self.master)]
        else:  # the parameters are their own master; merge segments that are adjacent in memory
            self.master = None
            self.pieces = []
            for s, a in zip(segs, self.starts):
                prev = self.pieces[-1] if self.pieces else None
                if prev is not None and prev[1] == a and device_io.adjacent(prev[2], s.param):
                    self.pieces[-1] = (prev[0], a + s.param.numel(), _extend(prev[2], s.param.numel()))
                else:
                    self.pieces.append((a, a + s.param.numel(), s.param))
        self.exp_avg = fp32(zero=True)
        self.exp_avg_sq = fp32(zero=True)

    def runs(self, keep: Callable[[nn.Parameter], bool | int]) -> list[tuple[int, int]]:
        """Merged ``[start, end)`` runs (owned coordinates) of the parameter elements ``keep`` selects: all of a
        parameter's (True), none (False) or its first ``n`` flattened elements (an int ``n``: a TP shard whose
        tail another rank holds too, K/V heads shared by TP ranks); a run never spans two segments."""
        runs: list[list[int]] = []
        for base, (ps, layout, rank) in zip(self.starts, self.store.layouts()):
            for pc in layout.pieces(*layout.shard_range(rank)):
                k, a, b = keep(ps[pc.index]), pc.offset, pc.offset + pc.numel
                if not isinstance(k, bool):  # the first k elements of the parameter
                    b = min(b, a + max(k - pc.param_offset, 0))
                if not k or a >= b:
                    continue
                if runs and runs[-1][1] == base + a and a > 0:  # within one segment
                    runs[-1][1] = base + b
                else:
                    runs.append([base + a, base + b])
        return [(a, b) for a, b in runs]

    def write_params(self) -> None:
        """Copy the separate fp32 master into the model's parameters (rounded to the model dtype): one
        ``torch._foreach_copy_`` over every owned segment (one launch where they share a device), not a copy
        per segment."""
        segs = self.store.segments
        if segs:
            torch._foreach_copy_([s.param for s in segs],
                                 [self.master[a: a + s.param.numel()] for s, a in zip(segs, self.starts)])

    def master_params(self, model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
        """The full fp32 master value of every trainable parameter of ``model``, by name: a collective over the
        store's DP group, run on ``device`` (a host master is moved there first)."""
        if self.master is not None:
            values = [self.master[a: a + s.param.numel()] for s, a in zip(self.store.segments, self.starts)]
        else:
            values = [s.param for s in self.store.segments]
        full = self.store.consolidate([v.to(device) for v in values])
        return {n: full[p] for n, p in model.named_parameters() if p in full}

    # -- checkpointing (canonical, topology-independent form; see megazero/checkpoint/canonical.py) -------------
    def owned(self) -> list[OwnedRun]:
        """The runs of parameter elements this rank updates, in owned order: ``(param, offset, views)``.

        ``offset`` is where the run starts in the flattened parameter as this rank holds it (its TP shard,
        vocab padding included); ``views`` are live 1-D views of the run's fp32 ``master`` value (the
        parameter itself in fp32 runs), ``exp_avg`` and ``exp_avg_sq``. A parameter has one run per bucket it
        spans (buckets may cut parameters). Stage 0 owns every element on every DP rank.
        """
        store = self.store
        layouts = store.layouts()
        assert len(layouts) == len(store.segments), "owned segments and flat layouts out of step"
        out = []
        for seg, base, (ps, layout, rank) in zip(store.segments, self.starts, layouts):
            lo, hi = layout.shard_range(rank)
            for pc in layout.pieces(lo, hi):
                a, b = base + pc.offset, base + pc.offset + pc.numel
                master = self.master[a:b] if self.master is not None else seg.param[pc.offset: pc.offset + pc.numel]
                out.append((ps[pc.index], pc.param_offset,
                            {"master": master, "exp_avg": self.exp_avg[a:b], "exp_avg_sq": self.exp_avg_sq[a:b]}))
        return out

    @torch.no_grad()
    def load(self, values: Sequence[dict[str, torch.Tensor] | OwnedRun]) -> None:
        """Copy ``values`` into the runs of :meth:`owned`, one per run in the same order: a dict of
        ``master``/``exp_avg``/``exp_avg_sq`` values, or the triples :meth:`owned` returns."""
        owned = self.owned()
        if len(values) != len(owned):
            raise ValueError(f"optimizer state has {len(values)} owned runs, this rank owns {len(owned)}")
        for (p, offset, views), item in zip(owned, values):
            item = item[2] if isinstance(item, tuple) else item
            for kind, view in views.items():
                src = item[kind].reshape(-1)
                if src.numel() != view.numel():
                    raise ValueError(f"optimizer state {kind} at offset {offset} of a {tuple(p.shape)} parameter has "
                                     f"{src.numel()} elements, expected {view.numel()}")
                view.copy_(src)


def _one_buffer(inits: list[torch.Tensor | None], numel: int) -> bool:
    """Whether ``inits`` lie end to end over one whole buffer of ``numel`` fp32 elements from its start (every stage
    in 16 bits lays the owned slices' starting values out so, stage 3 its persistent stores' and units' in one
    buffer: that buffer can be the master as it is)."""
    if not inits or any(t is None for t in inits) or inits[0].storage_offset() != 0:
        return False
    if inits[0].untyped_storage().nbytes() != numel * 4 or inits[0].dtype != torch.float32:
        return False
    return all(device_io.adjacent(a, b) for a, b in zip(inits, inits[1:]))


def _extend(a: torch.Tensor, n: int) -> torch.Tensor:
    """``a`` grown by ``n`` elements in place over its storage (the next segment, adjacent in memory)."""
    return a.as_strided((a.numel() + n,), (1,), a.storage_offset())
