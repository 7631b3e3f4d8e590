"""The communication ledger: the logical volume of every collective a rank joins, counted as the ZeRO paper
counts it (an all-reduce of n elements 2n, a reduce-scatter its full input n, an all-gather its full output n,
an all-to-all its input n, a broadcast or a send n), so measured traffic can be held to the paper's formulas.

**Bytes by link.** Beside elements, every call is counted in bytes (elements times the element size of what
was sent: an INT8 gather moves half the bytes of a bf16 one) under the link it uses, as the ZeRO++ paper counts
it: the per-rank volume of a collective whose group spans nodes is *inter-node*, one whose group lies inside a
node *intra-node*. Nodes are blocks of ``ranks_per_node`` consecutive global ranks (torchrun's
``LOCAL_WORLD_SIZE`` or ``--ranks-per-node``; :meth:`ParallelContext.configure_nodes
<megazero.distributed.context.ParallelContext.configure_nodes>` sets it; None: one node).

**Per node.** A flat collective over a group with k members on this rank's node crosses the node's boundary
once with its per-rank volume (a ring enters and leaves each node once), so each member's *share* of the node's
inter-node volume is volume/k; summing the shares of a node's ranks gives the node's inter-node bytes, the
figure the paper's 3Ψ -> 0.75Ψ refers to. For a flat DP group the node figure equals the per-rank one; for
qgZ's inter-node all-to-all (one member per node, ``ranks_per_node`` such groups side by side) it is
``ranks_per_node`` times the per-rank one (derivation in :mod:`megazero.zero.qgz`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["VOLUME_TAGS", "ZERO_GROUPS", "CommLedger"]

# Tags say what a collective moves; the DP volume of the ZeRO formulas counts "grad" and "param" only.
VOLUME_TAGS = ("grad", "param")
# The group ZeRO reduces and partitions over: "dp", or "dp_cp" (DP x CP) under context parallelism, where CP ranks
# hold the same weights; the formulas' Nd is that group's size, dp x cp.
ZERO_GROUPS = ("dp", "dp_cp")


@dataclass
class CommLedger:
    """Counts the logical volume (in elements) of every collective this rank joins.

    Entries are keyed by (group name, op, tag). :meth:`mark_step` closes an optimizer step so that per-step
    figures can be read with :meth:`last_step`.
    """

    totals: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    # bytes by (group, op, tag, link) and this rank's share of its node's inter-node bytes (module docstring)
    byte_totals: dict[tuple[str, str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    share_totals: dict[tuple[str, str, str, str], float] = field(default_factory=lambda: defaultdict(float))
    ranks_per_node: int | None = None  # None: every rank on one node
    rank: int = 0  # this rank's global rank (set by ParallelContext; places it on its node)
    _at_step_start: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _last_step: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _bytes_start: dict = field(default_factory=dict)
    _bytes_last: dict = field(default_factory=dict)
    _share_start: dict = field(default_factory=dict)
    _share_last: dict = field(default_factory=dict)
    steps: int = 0

    def record(self, group: str, op: str, tag: str, elements: int, nbytes: int | None = None,
               ranks: list[int] | None = None) -> None:
        """Count one call: ``elements`` (logical volume), ``nbytes`` (the same volume in bytes; default one
        byte per element) over the group of global ``ranks`` (default: one node)."""
        key = (group, op, tag)
        self.totals[key] += int(elements)
        self.calls[key] += 1
        nbytes = int(elements) if nbytes is None else int(nbytes)
        link, members_here = self.link_of(ranks)
        self.byte_totals[(*key, link)] += nbytes
        if link == "inter":
            self.share_totals[(*key, link)] += nbytes / members_here

    def node_of(self, rank: int) -> int:
        """The node a global rank sits on (blocks of ``ranks_per_node`` consecutive ranks)."""
        return 0 if self.ranks_per_node is None else rank // self.ranks_per_node

    def link_of(self, ranks: list[int] | None) -> tuple[str, int]:
        """("intra" | "inter", members of the group on this rank's node) for a group of global ``ranks``."""
        if ranks is None or self.ranks_per_node is None:
            return "intra", len(ranks or [0])
        nodes = [self.node_of(r) for r in ranks]
        here = self.node_of(self.rank)
        return ("inter" if len(set(nodes)) > 1 else "intra"), max(1, nodes.count(here))

    def mark_step(self) -> None:
        """Close one optimizer step: what was recorded since the previous mark becomes :meth:`last_step`."""
        self._last_step = {k: v - self._at_step_start.get(k, 0) for k, v in self.totals.items()}
        self._last_step = {k: v for k, v in self._last_step.items() if v}
        self._at_step_start = dict(self.totals)
        self._bytes_last = {k: v - self._bytes_start.get(k, 0) for k, v in self.byte_totals.items()}
        self._bytes_last = {k: v for k, v in self._bytes_last.items() if v}
        self._bytes_start = dict(self.byte_totals)
        self._share_last = {k: v - self._share_start.get(k, 0.0) for k, v in self.share_totals.items()}
        self._share_last = {k: v for k, v in self._share_last.items() if v}
        self._share_start = dict(self.share_totals)
        self.steps += 1

    def bytes_last_step(self) -> dict[tuple[str, str, str, str], int]:
        """Bytes per (group, op, tag, link) moved during the last closed step."""
        return dict(self._bytes_last)

    def link_bytes_last_step(self, tags: tuple[str, ...] | None = None) -> dict[str, int]:
        """Bytes per link ("intra", "inter") in the last step, per rank; ``tags``: only these (e.g.
        :data:`VOLUME_TAGS`, the gradients and parameters ZeRO moves)."""
        out = {"intra": 0, "inter": 0}
        for (_g, _op, tag, link), v in self._bytes_last.items():
            if tags is None or tag in tags:
                out[link] += v
        return out

    def node_share_last_step(self, tags: tuple[str, ...] | None = None) -> float:
        """This rank's share of its node's inter-node bytes in the last step (module docstring): the sum over a
        node's ranks is the node's inter-node volume."""
        return sum(v for (_g, _op, tag, _l), v in self._share_last.items() if tags is None or tag in tags)

    def link_breakdown_last_step(self) -> dict[str, int]:
        """The last step's bytes as ``{"group/op/tag/link": bytes}``, for metrics.jsonl and the dry run."""
        return {"/".join(k): v for k, v in sorted(self._bytes_last.items())}

    def last_step(self) -> dict[tuple[str, str, str], int]:
        """Elements per (group, op, tag) moved during the last closed step."""
        return dict(self._last_step)

    def dp_volume_last_step(self) -> int:
        """Elements of gradients and parameters moved over the ZeRO group (:data:`ZERO_GROUPS`: DP, or DP x CP
        under context parallelism) in the last step: the figure ZeRO's formulas predict. Per rank and one
        micro-batch, with Ψ padded to a multiple of Nd = dp·cp (the ZeRO group's node subgroups, "dp.intra",
        "dp.inter", "dp.hpz", count as the group): 2Ψ at stages 0-2 (reduce-scatter Ψ + all-gather
        Ψ, or an all-reduce), 3Ψ at stage 3 (gather in forward and in backward, reduce-scatter); with m
        micro-batches (m + 1)Ψ at stage 2 and 3mΨ at stage 3, less mΨ_own where a rank runs one chunk (its
        embeddings, final norm and output layer are gathered once per micro-batch: ``zero/stage3/gather.py``,
        "Carry"). The per-rank figure does not fall with Nd; what falls is each rank's shard, Ψ/Nd."""
        return sum(v for (g, _op, tag), v in self._last_step.items()
                   if g.split(".")[0] in ZERO_GROUPS and tag in VOLUME_TAGS)

    def breakdown_last_step(self) -> dict[str, int]:
        """The last step as ``{"group/op/tag": elements}``, for metrics.jsonl."""
        return {f"{g}/{op}/{tag}": v for (g, op, tag), v in sorted(self._last_step.items())}
