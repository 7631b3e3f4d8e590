"""The communication ledger: the logical volume of every collective a rank joins, counted as the ZeRO paper
counts it (an all-reduce of n elements 2n, a reduce-scatter its full input n, an all-gather its full output n,
a broadcast or a send n), so measured traffic can be held to the paper's formulas."""

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
    _at_step_start: dict[tuple[str, str, str], int] = field(default_factory=dict)
    _last_step: dict[tuple[str, str, str], int] = field(default_factory=dict)
    steps: int = 0

    def record(self, group: str, op: str, tag: str, elements: int) -> None:
        key = (group, op, tag)
        self.totals[key] += int(elements)
        self.calls[key] += 1

    def mark_step(self) -> None:
        """Close one optimizer step: what was recorded since the previous mark becomes :meth:`last_step`."""
        self._last_step = {k: v - self._at_step_start.get(k, 0) for k, v in self.totals.items()}
        self._last_step = {k: v for k, v in self._last_step.items() if v}
        self._at_step_start = dict(self.totals)
        self.steps += 1

    def last_step(self) -> dict[tuple[str, str, str], int]:
        """Elements per (group, op, tag) moved during the last closed step."""
        return dict(self._last_step)

    def dp_volume_last_step(self) -> int:
        """Elements of gradients and parameters moved over the ZeRO group (:data:`ZERO_GROUPS`: DP, or DP x CP
        under context parallelism) in the last step: the figure ZeRO's formulas predict. Per rank and one
        micro-batch, with Ψ padded to a multiple of Nd = dp·cp: 2Ψ at stages 0-2 (reduce-scatter Ψ + all-gather
        Ψ, or an all-reduce), 3Ψ at stage 3 (gather in forward and in backward, reduce-scatter); with m
        micro-batches (m + 1)Ψ at stage 2 and 3mΨ at stage 3. The per-rank figure does not fall with Nd; what
        falls is each rank's shard, Ψ/Nd."""
        return sum(v for (g, _op, tag), v in self._last_step.items() if g in ZERO_GROUPS and tag in VOLUME_TAGS)

    def breakdown_last_step(self) -> dict[str, int]:
        """The last step as ``{"group/op/tag": elements}``, for metrics.jsonl."""
        return {f"{g}/{op}/{tag}": v for (g, op, tag), v in sorted(self._last_step.items())}
