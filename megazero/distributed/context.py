"""The (pp, dp, tp) rank grid and the process groups built on it.

Ranks are laid out with TP fastest-varying, then DP, then PP::

    rank = pp_rank * (dp_size * tp_size) + dp_rank * tp_size + tp_rank

so a TP group is a run of consecutive ranks (inside one node when ``tp_size`` divides the GPUs per node), and
each pipeline stage is a contiguous block of ``dp_size * tp_size`` ranks.

:class:`RankGrid` is pure arithmetic (no backend) and is unit-tested on its own. :class:`ParallelContext`
adds the live :class:`~megazero.distributed.group.Group` objects for this rank: ``tp``, ``dp``, ``pp``,
model-parallel ``mp`` (tp x pp) and ``embedding`` (first and last pipeline stage at the same tp/dp
coordinates, the two holders of the tied word embedding).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megazero.distributed.group import Group, backend_device
from megazero.distributed.ledger import CommLedger

__all__ = ["ParallelContext", "RankGrid", "TopologyError"]


class TopologyError(ValueError):
    """A world size and parallel sizes that do not fit together."""


@dataclass(frozen=True)
class RankGrid:
    """Rank arithmetic for a world of ``pp_size * dp_size * tp_size`` ranks."""

    world_size: int
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "dp_size", "world_size"):
            if getattr(self, name) < 1:
                raise TopologyError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tp_size * self.pp_size * self.dp_size != self.world_size:
            raise TopologyError(
                f"world size {self.world_size} != tp ({self.tp_size}) x pp ({self.pp_size}) x dp ({self.dp_size})"
                f" = {self.tp_size * self.pp_size * self.dp_size}; launch {self.tp_size * self.pp_size * self.dp_size}"
                " processes or change --tp/--pp/--dp (dp defaults to world_size / (tp x pp))"
            )

    @classmethod
    def from_world(cls, world_size: int, tp_size: int = 1, pp_size: int = 1, dp_size: int | None = None) -> RankGrid:
        """Build the grid, deriving ``dp_size = world_size / (tp * pp)`` when it is not given."""
        if dp_size is None:
            if tp_size < 1 or pp_size < 1 or world_size % (tp_size * pp_size):
                raise TopologyError(
                    f"world size {world_size} is not divisible by tp ({tp_size}) x pp ({pp_size});"
                    " launch a multiple of tp x pp processes or change --tp/--pp"
                )
            dp_size = world_size // (tp_size * pp_size)
        return cls(world_size=world_size, tp_size=tp_size, pp_size=pp_size, dp_size=dp_size)

    # -- coordinates -----------------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp_rank, dp_rank, tp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} outside world of {self.world_size}")
        tp_rank = rank % self.tp_size
        dp_rank = (rank // self.tp_size) % self.dp_size
        pp_rank = rank // (self.tp_size * self.dp_size)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.dp_size * self.tp_size + dp_rank * self.tp_size + tp_rank

    # -- groups (every group of a kind, each a sorted list of global ranks) -----------------------------
    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for t in range(self.tp_size)]
                for p in range(self.pp_size) for d in range(self.dp_size)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for d in range(self.dp_size)]
                for p in range(self.pp_size) for t in range(self.tp_size)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(p, d, t) for p in range(self.pp_size)]
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: all tp x pp ranks holding one model replica."""
        return [sorted(self.rank_of(p, d, t) for p in range(self.pp_size) for t in range(self.tp_size))
                for d in range(self.dp_size)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage at equal (dp, tp): the two copies of the tied embedding (middle stages
        are in no embedding group)."""
        last = self.pp_size - 1
        return [sorted({self.rank_of(0, d, t), self.rank_of(last, d, t)})
                for d in range(self.dp_size) for t in range(self.tp_size)]

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The ranks of the ``kind`` group ("tp", "dp", "pp", "mp", "embedding") that contains ``rank``."""
        for ranks in getattr(self, f"{kind}_groups")():
            if rank in ranks:
                return ranks
        raise TopologyError(f"rank {rank} is in no {kind} group")  # pragma: no cover - grid covers all


GROUP_KINDS = ("tp", "dp", "pp", "mp", "embedding")


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
        self.pp_rank, self.dp_rank, self.tp_rank = grid.coords(rank)
        self.tp_group = groups["tp"]
        self.dp_group = groups["dp"]
        self.pp_group = groups["pp"]
        self.mp_group = groups["mp"]
        self.embedding_group: Group | None = groups.get("embedding")  # None on middle pipeline stages
        self.world_group = groups["world"]

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
                f"launched {dist.get_world_size()} processes but tp x pp x dp = {grid.world_size}; "
                "set --tp/--pp/--dp so that their product equals the number of processes"
            )
        rank = dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
        ledger = CommLedger()
        device = torch.device(device) if device is not None else backend_device()
        groups: dict[str, Group] = {}
        for kind in GROUP_KINDS:
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
        groups["world"] = group_cls("world", list(range(grid.world_size)), dist.group.WORLD, ledger, device)
        return cls(grid, rank, groups, ledger)

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
        return {"rank": self.rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "dp_rank": self.dp_rank}

    def __repr__(self) -> str:
        g = self.grid
        return (f"ParallelContext(rank={self.rank}/{g.world_size}, tp={self.tp_rank}/{g.tp_size}, "
                f"pp={self.pp_rank}/{g.pp_size}, dp={self.dp_rank}/{g.dp_size})")
