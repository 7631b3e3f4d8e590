"""The (pp, dp, cp, tp) rank grid and the process groups built on it.

Ranks are laid out as Megatron-Core orders them: TP fastest-varying, then CP (context parallel), then DP, then
PP::

    rank = ((pp_rank * dp_size + dp_rank) * cp_size + cp_rank) * tp_size + tp_rank

so a TP group is a run of consecutive ranks (inside one node when ``tp_size`` divides the GPUs per node), a
TP x CP block is contiguous too (the ring traffic of context parallelism stays in a node where it fits), and
each pipeline stage is a contiguous block of ``dp_size * cp_size * tp_size`` ranks. With ``cp_size = 1`` (the
default) every rank, group and coordinate is the one of the three-dimensional grid.

:class:`RankGrid` is pure arithmetic (no backend) and is unit-tested on its own. :class:`ParallelContext`
adds the live :class:`~megazero.distributed.group.Group` objects for this rank: ``tp``, ``cp`` (same tp, dp and
pp coordinates: the ranks that split one sample's sequence), ``dp``, ``dp_cp`` (same tp and pp: the ranks that
hold the same weights, over which ZeRO shards when CP is on), ``pp``, model-parallel ``mp`` (tp x pp, one per
dp and cp coordinate) and ``embedding`` (first and last pipeline stage at the same tp/cp/dp coordinates, the
two holders of the tied word embedding). With ``cp_size = 1`` the ``dp_cp`` group is the ``dp`` group itself
(the same object, so no second communicator and the ledger keeps naming it "dp"). ``zero_reduce`` holds the
``dp_cp`` ranks again over a communicator of its own, for ZeRO-3's gradient reductions: on NCCL they run on their
own stream beside the prefetch gathers; the ledger names it like its twin, so the DP volume counts both.

**Nodes.** Nodes are blocks of ``ranks_per_node`` consecutive global ranks: torchrun's ``LOCAL_WORLD_SIZE`` by
default (one node without it), or ``--ranks-per-node N`` to simulate nodes on one machine.
:meth:`ParallelContext.configure_nodes` splits the ZeRO (dp x cp) group into ``<name>.intra`` (its members on
this rank's node), ``<name>.inter`` (the members with this rank's position on every node) and, for hpZ,
``<name>.hpz`` (blocks of ``hpz_size`` consecutive intra-node members); a subgroup with the ranks of one already
made is that group (one node: intra is the ZeRO group; hpz of the node's size: intra), so no communicator is
built twice, and repeated calls with the same sizes return the same groups. The ledger learns the node size and
counts bytes per link (:mod:`megazero.distributed.ledger`).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from megazero.distributed.group import Group, backend_device
from megazero.distributed.ledger import CommLedger

__all__ = ["GridPosition", "NodeGroups", "ParallelContext", "RankGrid", "TopologyError", "node_split"]


class TopologyError(ValueError):
    """A world size and parallel sizes that do not fit together."""


class GridPosition(NamedTuple):
    """All four coordinates of a rank (:meth:`RankGrid.position`)."""

    pp_rank: int
    dp_rank: int
    cp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class RankGrid:
    """Rank arithmetic for a world of ``pp_size * dp_size * cp_size * tp_size`` ranks.

    ``cp_size`` comes last among the fields so that the positional form ``RankGrid(world, tp, pp, dp)`` of the
    three-dimensional grid keeps its meaning.
    """

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    cp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "cp_size", "world_size"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} must be >= 1, got {getattr(self, name)}")
        product = self.tp_size * self.cp_size * self.pp_size * self.dp_size
        if product != self.world_size:
            cp = f" x cp ({self.cp_size})" if self.cp_size > 1 else ""
            raise TopologyError(
                f"world size {self.world_size} != tp ({self.tp_size}){cp} x pp ({self.pp_size}) x dp ({self.dp_size})"
                f" = {product}; launch {product} processes or change --tp/--cp/--pp/--dp"
                " (dp defaults to world_size / (tp x cp x pp))"
            )

    @classmethod
    def from_world(cls, world_size: int, tp_size: int = 1, pp_size: int = 1, dp_size: int | None = None,
                   cp_size: int = 1) -> RankGrid:
        """Build the grid, deriving ``dp_size = world_size / (tp * cp * pp)`` when it is not given."""
        if dp_size is None:
            model = tp_size * cp_size * pp_size
            if min(tp_size, cp_size, pp_size) < 1 or world_size % model:
                cp = f" x cp ({cp_size})" if cp_size != 1 else ""
                raise TopologyError(
                    f"world size {world_size} is not divisible by tp ({tp_size}){cp} x pp ({pp_size});"
                    " launch a multiple of tp x cp x pp processes or change --tp/--cp/--pp"
                )
            dp_size = world_size // model
        return cls(world_size=world_size, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size, cp_size=cp_size)

    # -- coordinates -----------------------------------------------------------------------------------
    def position(self, rank: int) -> GridPosition:
        """``(pp_rank, dp_rank, cp_rank, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of {self.world_size}")
        rest, tp_rank = divmod(rank, self.tp_size)
        rest, cp_rank = divmod(rest, self.cp_size)
        pp_rank, dp_rank = divmod(rest, self.dp_size)
        return GridPosition(pp_rank, dp_rank, cp_rank, tp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank: :meth:`position` without the CP coordinate, the
        triple that callers written for the three-dimensional grid (and checkpoints) read."""
        pp_rank, dp_rank, _cp_rank, tp_rank = self.position(rank)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    def _ranks(self, keep: str, vary: str) -> list[list[int]]:
        """Every group whose members share the coordinates not in ``vary`` (letters p, d, c, t), each a sorted
        list of global ranks; groups listed in rank order of their fixed coordinates (``keep`` order)."""
        sizes = {"p": self.pp_size, "d": self.dp_size, "c": self.cp_size, "t": self.tp_size}
        groups = []
        for fixed in _product([sizes[a] for a in keep]):
            at = dict(zip(keep, fixed))
            members = []
            for varied in _product([sizes[a] for a in vary]):
                at.update(zip(vary, varied))
                members.append(self.rank_of(at["p"], at["d"], at["t"], at["c"]))
            groups.append(sorted(members))
        return groups

    # -- groups (every group of a kind, each a sorted list of global ranks) -----------------------------
    def tp_groups(self) -> list[list[int]]:
        return self._ranks("pdc", "t")

    def cp_groups(self) -> list[list[int]]:
        """The ranks that split one sample's sequence: equal tp, dp and pp coordinates."""
        return self._ranks("pdt", "c")

    def dp_groups(self) -> list[list[int]]:
        return self._ranks("pct", "d")

    def dp_cp_groups(self) -> list[list[int]]:
        """Equal tp and pp coordinates: the dp x cp ranks that hold the same weights (ZeRO's group under CP)."""
        return self._ranks("pt", "dc")

    def pp_groups(self) -> list[list[int]]:
        return self._ranks("dct", "p")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: all tp x pp ranks holding one model replica (one per dp and cp coordinate)."""
        return self._ranks("dc", "pt")

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage at equal (dp, cp, tp): the two copies of the tied embedding (middle
        stages are in no embedding group)."""
        last = self.pp_size - 1
        return [sorted({self.rank_of(0, d, t, c), self.rank_of(last, d, t, c)})
                for d, c, t in _product([self.dp_size, self.cp_size, self.tp_size])]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ranks of the ``kind`` group (one of :data:`GROUP_KINDS`) that contains ``rank``."""
        for ranks in getattr(self, f"{kind}_groups")():
            if rank in ranks:
                return ranks
        raise TopologyError(f"rank {rank} is in no {kind} group")  # pragma: no cover - grid covers all


def node_split(ranks: list[int], ranks_per_node: int, hpz_size: int = 1
               ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Split one group's sorted global ``ranks`` by node (blocks of ``ranks_per_node`` consecutive ranks):
    ``(intra, inter, hpz)`` groups, each a list of sorted rank lists. ``intra``: the members on each node;
    ``inter``: the members at the same position on every node; ``hpz``: each intra group cut into blocks of
    ``hpz_size``. Every node must hold the same number of members, and ``hpz_size`` must divide it."""
    by_node: dict[int, list[int]] = {}
    for r in sorted(ranks):
        by_node.setdefault(r // ranks_per_node, []).append(r)
    intra = list(by_node.values())
    local = len(intra[0])
    if any(len(g) != local for g in intra):
        raise TopologyError(
            f"the ZeRO group {sorted(ranks)} holds {[len(g) for g in intra]} ranks on its nodes of "
            f"--ranks-per-node {ranks_per_node}; choose a node size whose nodes hold equal parts of every group "
            "(a multiple of tp x cp, or a divisor of it)")
    if hpz_size < 1 or local % hpz_size:
        raise TopologyError(
            f"--zero-hpz-partition-size {hpz_size} does not divide the {local} ZeRO (dp x cp) ranks per node "
            f"(--ranks-per-node {ranks_per_node} / (tp x cp)); use a divisor of {local}")
    inter = [[g[i] for g in intra] for i in range(local)]
    hpz = [g[i: i + hpz_size] for g in intra for i in range(0, local, hpz_size)]
    return intra, inter, hpz


@dataclass(frozen=True)
class NodeGroups:
    """This rank's node subgroups of the ZeRO group (:meth:`ParallelContext.configure_nodes`)."""

    ranks_per_node: int
    intra: Group  # the ZeRO group's members on this node
    inter: Group  # the members at this rank's position on every node (one per node)
    hpz: Group  # hpZ's secondary partition group: ``hpz_size`` members of this node (intra itself when equal)

    @property
    def nodes(self) -> int:
        """Nodes the ZeRO group spans."""
        return self.inter.size


def _product(sizes: list[int]) -> list[tuple[int, ...]]:
    """Every index tuple of a grid with these sizes, the last index fastest."""
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [t + (i,) for t in out for i in range(n)]
    return out


GROUP_KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "mp", "embedding")


class ParallelContext:
    """This rank's place in the grid and its process groups; the only object that sees all of them.

    Build it with :meth:`from_grid` after ``torch.distributed`` is initialised (every rank must call it, in the
    same order, because group creation is collective). Leaf code receives single groups
    (``ctx.tp_group``, ``ctx.dp_group``...), never the context.
    """

    def __init__(self, grid: RankGrid, rank: int, groups: dict[str, Group], ledger: CommLedger) -> None:
        self.grid = grid
        self.rank = rank
        self.ledger = ledger
        self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = grid.position(rank)
        self.tp_group = groups["tp"]
        self.cp_group = groups["cp"]
        self.dp_group = groups["dp"]
        self.dp_cp_group = groups["dp_cp"]
        self.pp_group = groups["pp"]
        self.mp_group = groups["mp"]
        self.embedding_group: Group | None = groups.get("embedding")  # None on middle pipeline stages
        self.world_group = groups["world"]
        self.zero_reduce_group = groups.get("zero_reduce", self.dp_cp_group)
        self._timeout: datetime.timedelta | None = None
        self._group_cls: type[Group] = Group
        self._node_groups: dict[tuple[int, int], NodeGroups] = {}
        self._built: set[tuple[int, ...]] = set()
        self._kv_groups: dict[int, Group] = {}  # kv_group's, by ranks per K/V head
        self.ranks_per_node = ledger.ranks_per_node or grid.world_size
        ledger.rank = rank

    @classmethod
    def from_grid(cls, grid: RankGrid, timeout_s: float | None = None, device: torch.device | str | None = None,
                  group_cls: type[Group] = Group) -> ParallelContext:
        """Create every group of the grid (a collective call) and keep this rank's.

        ``device`` is where every group's collectives work (:class:`~megazero.distributed.group.Group` checks each
        tensor against it): by default the current CUDA device under NCCL and the CPU under gloo. ``group_cls``
        lets a test harness substitute a :class:`Group` subclass.

        ``timeout_s`` bounds every collective of every group (``--dist-timeout``); without it the subgroups
        would fall back to the backend's default (30 minutes for gloo), whatever the world group was given.
        """
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised; call megazero.distributed.init_distributed()")
        if dist.get_world_size() != grid.world_size:
            raise TopologyError(
                f"launched {dist.get_world_size()} processes but tp x cp x pp x dp = {grid.world_size}; "
                "set --tp/--cp/--pp/--dp so that their product equals the number of processes"
            )
        rank = dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        ledger = CommLedger(rank=rank)
        local = os.environ.get("LOCAL_WORLD_SIZE")  # torchrun's ranks on this node
        if local and int(local) < grid.world_size and grid.world_size % int(local) == 0:
            ledger.ranks_per_node = int(local)
        device = torch.device(device) if device is not None else backend_device()
        groups: dict[str, Group] = {}
        for kind in GROUP_KINDS:
            if kind == "dp_cp" and grid.cp_size == 1:
                groups[kind] = groups["dp"]  # the same ranks: one communicator, one ledger name
                continue
            seen: set[tuple[int, ...]] = set()
            for ranks in getattr(grid, f"{kind}_groups")():
                key = tuple(ranks)
                if key in seen:
                    continue
                seen.add(key)
                # new_group is collective over the whole world: every rank creates every group.
                pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    groups[kind] = group_cls(kind, ranks, pg, ledger, device)
        for ranks in sorted({tuple(r) for r in grid.dp_cp_groups()}):  # a second communicator (module docstring)
            pg = dist.new_group(list(ranks), timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                groups["zero_reduce"] = group_cls(groups["dp_cp"].name, list(ranks), pg, ledger, device)
        groups["world"] = group_cls("world", list(range(grid.world_size)), dist.group.WORLD, ledger, device)
        ctx = cls(grid, rank, groups, ledger)
        ctx._timeout, ctx._group_cls = timeout, group_cls
        return ctx

    def configure_nodes(self, ranks_per_node: int | None = None, hpz_size: int = 1) -> NodeGroups:
        """Set the node size (None: torchrun's ``LOCAL_WORLD_SIZE``, else the one this context has) and return
        this rank's node subgroups of the ZeRO (dp x cp) group (module docstring). A collective call: every
        rank calls it with the same sizes; the groups of a pair of sizes are made once."""
        rpn = ranks_per_node or self.ranks_per_node
        if rpn < 1 or self.grid.world_size % rpn:
            raise TopologyError(f"--ranks-per-node {rpn} does not divide the world size {self.grid.world_size}; "
                                "launch whole nodes or change --ranks-per-node")
        self.ranks_per_node = rpn
        self.ledger.ranks_per_node = rpn if rpn < self.grid.world_size else None
        key = (rpn, hpz_size)
        if key in self._node_groups:
            self.dp_cp_group.nodes = self.zero_reduce_group.nodes = self._node_groups[key]
            return self._node_groups[key]
        zero = self.dp_cp_group
        made: dict[tuple[int, ...], Group] = {tuple(zero.ranks): zero}  # this rank's groups by their ranks
        for old in self._node_groups.values():
            made.update({tuple(g.ranks): g for g in (old.intra, old.inter, old.hpz)})
        built = self._built  # every rank tuple with a communicator: the same set on every rank
        built.update(tuple(r) for r in self.grid.dp_cp_groups())
        mine: dict[str, Group] = {}
        split = [node_split(r, rpn, hpz_size) for r in sorted({tuple(r) for r in self.grid.dp_cp_groups()})]
        for i, kind in enumerate(("intra", "inter", "hpz")):
            for ranks in (tuple(r) for parts in split for r in parts[i]):
                here = self.rank in ranks
                if ranks not in built and len(ranks) > 1:  # new_group is collective over the whole world
                    pg = dist.new_group(list(ranks), timeout=self._timeout)
                    built.add(ranks)
                    if here:
                        made[ranks] = self._group_cls(f"{zero.name}.{kind}", list(ranks), pg, self.ledger,
                                                      zero.device)
                elif here and ranks not in made:  # a group of one: no communicator
                    made[ranks] = self._group_cls(f"{zero.name}.{kind}", list(ranks), None, self.ledger,
                                                  zero.device)
                if here:
                    mine[kind] = made[ranks]
        groups = NodeGroups(rpn, mine["intra"], mine["inter"], mine["hpz"])
        self._node_groups[key] = groups
        for zero_group in {id(g): g for g in (zero, self.zero_reduce_group)}.values():
            zero_group.nodes = groups  # what stage 3 and qgZ read (megazero.zero.stage3.hpz, megazero.zero.qgz)
        return groups

    def kv_group(self, replicas: int) -> Group:
        """This rank's ``replicas`` consecutive TP ranks: those that hold the same key/value heads when the TP size
        exceeds the model's K/V heads, over which those heads' gradients are summed (``tp_kv`` in the ledger; the
        TP group itself when it is one such set). A collective call the first time for a size (every rank calls
        it, with the same size); later calls return the same group."""
        if replicas < 1 or self.tp_size % replicas:
            raise TopologyError(f"{replicas} ranks per key/value head do not divide --tp {self.tp_size}")
        if replicas not in self._kv_groups:
            mine = self.tp_group
            if replicas < self.tp_size:
                for ranks in sorted({tuple(r) for r in self.grid.tp_groups()}):
                    for i in range(0, len(ranks), replicas):  # new_group is collective over the whole world
                        block = list(ranks[i: i + replicas])
                        pg = dist.new_group(block, timeout=self._timeout) if replicas > 1 else None
                        if self.rank in block:
                            mine = self._group_cls("tp_kv", block, pg, self.ledger, self.tp_group.device)
            self._kv_groups[replicas] = mine
        return self._kv_groups[replicas]

    # -- convenience ------------------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.grid.tp_size

    @property
    def pp_size(self) -> int:
        return self.grid.pp_size

    @property
    def dp_size(self) -> int:
        return self.grid.dp_size

    @property
    def cp_size(self) -> int:
        return self.grid.cp_size

    @property
    def world_size(self) -> int:
        return self.grid.world_size

    @property
    def tp_enabled(self) -> bool:
        """Whether layers are split over a TP group (tp > 1)."""
        return self.grid.tp_size > 1

    @property
    def pp_enabled(self) -> bool:
        """Whether the layers are split over pipeline stages (pp > 1)."""
        return self.grid.pp_size > 1

    @property
    def cp_enabled(self) -> bool:
        """Whether each sample's sequence is split over a CP group (cp > 1)."""
        return self.grid.cp_size > 1

    @property
    def dp_enabled(self) -> bool:
        """Whether gradients are reduced over a DP group (dp > 1)."""
        return self.grid.dp_size > 1

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.grid.pp_size - 1

    def coords(self) -> dict[str, int]:
        return {"rank": self.rank, "tp_rank": self.tp_rank, "cp_rank": self.cp_rank, "pp_rank": self.pp_rank,
                "dp_rank": self.dp_rank}

    def __repr__(self) -> str:
        g = self.grid
        return (f"ParallelContext(rank={self.rank}/{g.world_size}, tp={self.tp_rank}/{g.tp_size}, "
                f"cp={self.cp_rank}/{g.cp_size}, pp={self.pp_rank}/{g.pp_size}, dp={self.dp_rank}/{g.dp_size})")
