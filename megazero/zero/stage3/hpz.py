"""ZeRO++ for stage 3's weight gathers: hpZ's secondary partition and qwZ's quantized all-gather.

**hpZ** (``zero_hpz_partition_size`` N). Besides its primary shard (1/Nd of each unit, what the optimizer
updates), every rank keeps a *secondary* shard: 1/N of each unit's 16-bit gathered values, partitioned over a
group of N ranks inside its node (``<zero group>.hpz``). A forward all-gather over the whole ZeRO group leaves
this rank's secondary slice behind (copied out of the gathered buffer once the gather completes); a backward
gather of a unit whose secondary slice is current runs inside the node, over the hpZ group. Extra memory per
rank: the secondary shards of every gathered unit, 2Ψ/N bytes in 16-bit (measured by :attr:`SecondaryShards.nbytes`).

*Refresh and staleness.* A secondary slice is current while the primary shard it came from is unchanged: each
slice records the version counter of the unit's primary shard (``Tensor._version``, bumped by every in-place
write: the optimizer's update, a checkpoint load, an offloaded shard's copy-back) when it was stored, and the
optimizer's step also invalidates every slice (:meth:`invalidate`). A stale slice is never read: the backward
then gathers over the whole group and stores the slice afresh. So every optimizer step refreshes the secondary
partition through the next forward, under offload too (the case DeepSpeed breaks, its issue #6926). The
secondary partition is derived state: it is not in the optimizer's state and never checkpointed.

**qwZ** (``zero_quantized_weights``). The primary gathers quantize the rank's shard to INT8 in blocks of
:data:`~megazero.zero.quantize.WEIGHT_BLOCK` values (:mod:`megazero.zero.quantize`), all-gather values and fp32
scales, and dequantize into the unit's 16-bit gather buffer. The master weights, the optimizer and checkpoints
never see these values: the shard itself is untouched, and gathers for export, the tied-embedding check and
``gathered_parameters()`` are exact 16-bit gathers.

*The secondary shard holds the dequantized 16-bit values* (as in the paper): the forward's gathered buffer,
copied. So a unit's backward computes with exactly the weights its forward used; a secondary partition of exact
values would give the backward different weights from the forward, and gradients of neither. With qwZ and
without hpZ the backward gathers over the whole group quantized too, from the same shard: the same values again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.distributed.group import Group
from megazero.zero.qgz import QuantizedReduce
from megazero.zero.quantize import WEIGHT_BLOCK, dequantize, quantize
from megazero.zero.stage3.units import Unit

__all__ = ["SecondaryShards", "WeightComm", "zeropp_comm"]


@dataclass(frozen=True)
class WeightComm:
    """How stage 3 gathers weights: ``hpz`` the secondary partition's group (None: no hpZ), ``quantized`` qwZ."""

    hpz: Group | None = None
    quantized: bool = False
    block: int = WEIGHT_BLOCK


def weight_comm(cfg, dp_group: Group) -> WeightComm:
    """Stage 3's weight gathers for a :class:`~megazero.config.schema.ZeroConfig`: hpZ over the node groups that
    :meth:`ParallelContext.configure_nodes <megazero.distributed.context.ParallelContext.configure_nodes>` attached
    to ``dp_group`` (a partition size of 1, or of the whole group, is plain ZeRO-3), qwZ by its flag."""
    size = cfg.zero_hpz_partition_size
    hpz = None
    if size > 1 and size < dp_group.size:
        nodes = getattr(dp_group, "nodes", None)
        if nodes is None or nodes.hpz.size != size:
            raise ValueError(f"hpZ over {size} ranks needs the ZeRO group's node groups: call "
                             f"ctx.configure_nodes(ranks_per_node, {size}) before building the optimizer")
        hpz = nodes.hpz
    return WeightComm(hpz=hpz, quantized=cfg.zero_quantized_weights)


def zeropp_comm(cfg, dp_group: Group, reduce_group: Group) -> tuple[WeightComm, QuantizedReduce | None]:
    """Stage 3's ZeRO++ for a ZeroConfig: its weight gathers (:func:`weight_comm`) and qgZ's reduction over
    ``reduce_group`` (None: the group's own reduce-scatter)."""
    return weight_comm(cfg, dp_group), QuantizedReduce.from_config(cfg, reduce_group)


class SecondaryShards:
    """hpZ's secondary partition of ``units`` over ``group`` (module docstring): one flat 16-bit buffer holding this
    rank's slice of every unit."""

    def __init__(self, units: list[Unit], group: Group, dtype: torch.dtype, device: torch.device) -> None:
        self.group = group
        sizes = [u.layout.padded_numel // group.size for u in units]
        for u in units:
            if u.layout.padded_numel % group.size:  # padded_numel = Nd x shard and N divides Nd
                raise ValueError(f"unit {u.name}: {u.layout.padded_numel} elements do not split over hpZ's "
                                 f"{group.size} ranks")
        self.flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        self.slices: dict[int, torch.Tensor] = {}
        off = 0
        for u, n in zip(units, sizes):
            self.slices[u.uid] = self.flat[off: off + n]
            off += n
        self.versions: dict[int, int] = {}  # uid -> the primary shard's version its slice was stored from

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def fresh(self, unit: Unit) -> bool:
        """Whether ``unit``'s slice holds the values its primary shard has now."""
        return self.versions.get(unit.uid) == unit.shard._version

    def store(self, unit: Unit) -> None:
        """Copy this rank's slice out of ``unit``'s gathered buffer (after the forward's all-gather)."""
        piece = self.slices[unit.uid]
        n = piece.numel()
        piece.copy_(unit.full[self.group.rank * n: (self.group.rank + 1) * n])
        self.versions[unit.uid] = unit.shard._version

    def gather(self, unit: Unit):
        """Start the intra-node all-gather of ``unit``'s secondary slices into its gathered buffer."""
        return self.group.all_gather_into(unit.full, self.slices[unit.uid], tag="param", async_op=True)

    def invalidate(self) -> None:
        """Mark every slice stale (the optimizer stepped)."""
        self.versions.clear()


class QuantizedGather:
    """qwZ's all-gather of one unit: INT8 values and fp32 scales gathered over ``group``, dequantized into the
    unit's buffer when waited on (then ``after()``, e.g. hpZ's store)."""

    def __init__(self, group: Group, unit: Unit, shard: torch.Tensor, block: int, after=None) -> None:
        self.unit, self.block, self.after, self.size = unit, block, after, group.size
        s = shard.numel()
        values, scales = quantize(shard.view(1, s), 8, block)
        self.values = torch.empty(group.size, values.shape[1], dtype=values.dtype, device=values.device)
        self.scales = torch.empty(group.size, scales.shape[1], dtype=scales.dtype, device=scales.device)
        self.works = [group.all_gather_into(self.values.view(-1), values.view(-1), tag="param", async_op=True),
                      group.all_gather_into(self.scales.view(-1), scales.view(-1), tag="param", async_op=True)]
        self.inputs = (values, scales)  # alive until waited on, as NCCL keeps an asynchronous input

    def wait(self) -> None:
        if self.works is None:
            return
        for w in self.works:
            w.wait()
        self.works, self.inputs = None, None
        s = self.unit.layout.shard_numel
        dequantize(self.values, self.scales, 8, self.block, s, out=self.unit.full.view(self.size, s))
        self.values = self.scales = None
        if self.after is not None:
            self.after()


class Then:
    """A work handle that runs ``after()`` once its collective is waited on."""

    def __init__(self, work, after) -> None:
        self.work, self.after = work, after

    def wait(self) -> None:
        if self.work is None:
            return
        self.work.wait()
        self.work = None
        self.after()
