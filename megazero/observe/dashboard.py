"""A per-GPU memory dashboard that builds itself, from metrics.jsonl records: W&B custom charts and PNGs.

One chart per memory category (model states, activations, the allocator's figures, the measured peak and its
breakdown by category where recorded) with one line per rank over the logged steps, and a bar chart of each
rank's peak. :func:`memory_series` and :func:`rank_peaks` extract the data from the records;
:class:`WandbDashboard` logs them as ``wandb.plot.line_series`` / ``wandb.plot.bar`` charts (keys
``dashboard/memory/<category>`` and ``dashboard/peak_by_rank``, refreshed every ``refresh_every`` records and
at the end) and the ``--sample-prompts`` samples as a table (``samples``); ``tools/plot_metrics.py`` draws
the same series without an account.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CATEGORIES", "WandbDashboard", "memory_series", "rank_peaks"]

# metrics.jsonl memory key -> chart title
CATEGORIES: dict[str, str] = {
    "params_bytes": "parameters", "grads_bytes": "gradients", "master_params_bytes": "master parameters",
    "optimizer_states_bytes": "optimizer states", "activation_peak_bytes": "activations (peak)",
    "device_allocated_bytes": "device allocated", "device_peak_bytes": "device max allocated",
    "device_reserved_bytes": "device reserved", "host_rss_bytes": "host RSS", "peak_bytes": "measured peak",
}
GIB = 2**30


def _values(rec: dict[str, Any]) -> dict[str, float]:
    """A rank's memory record as {category key: bytes}, ``peak_by_category`` flattened to ``peak/<cat>``."""
    out = {k: rec[k] for k in CATEGORIES if isinstance(rec.get(k), (int, float))}
    for cat, v in (rec.get("peak_by_category") or {}).items():
        if isinstance(v, (int, float)):
            out[f"peak/{cat}"] = v
    return out


def memory_series(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per category measured in any record and not zero throughout (no master copy in fp32, say):
    ``{"title", "steps": [...], "ranks": {rank: [bytes or None]}}``."""
    steps = [r["step"] for r in records if r.get("memory")]
    out: dict[str, dict[str, Any]] = {}
    for i, r in enumerate([r for r in records if r.get("memory")]):
        for m in r["memory"]:
            for key, v in _values(m).items():
                title = CATEGORIES.get(key) or f"peak: {key.split('/', 1)[1]}"
                s = out.setdefault(key, {"title": title, "steps": steps, "ranks": {}})
                s["ranks"].setdefault(m["rank"], [None] * len(steps))[i] = v
    return {k: s for k, s in out.items() if any(v for vals in s["ranks"].values() for v in vals)}


def rank_peaks(record: dict[str, Any]) -> tuple[list[tuple[int, float]], str]:
    """Each rank's peak bytes in one record and what was measured: ``peak_bytes`` where recorded, else the
    device allocator's max, else (CPU) the model states plus the activation peak."""
    ranks = record.get("memory") or []
    for key, source in (("peak_bytes", "measured peak"), ("device_peak_bytes", "device max allocated")):
        if ranks and all(isinstance(m.get(key), (int, float)) for m in ranks):
            return [(m["rank"], m[key]) for m in ranks], source
    parts = ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes", "activation_peak_bytes")
    return [(m["rank"], sum(m.get(k) or 0 for k in parts)) for m in ranks], "model states + activation peak"


class WandbDashboard:
    """Keeps the logged records and (re)draws the memory charts and the samples table into a W&B run."""

    def __init__(self, run: Any, refresh_every: int = 10) -> None:
        self.run = run
        self.refresh_every = refresh_every
        self.records: list[dict[str, Any]] = []
        self.samples: list[list[Any]] = []
        self._since_refresh = 0

    def update(self, record: dict[str, Any]) -> None:
        """Take one metrics.jsonl record; log its samples; redraw the charts every ``refresh_every`` records."""
        import wandb

        if record.get("samples"):
            self.samples += [[record["step"], s["prompt"], s["text"]] for s in record["samples"]]
            self.run.log({"samples": wandb.Table(columns=["step", "prompt", "text"], data=self.samples)},
                         step=record["step"])
        if record.get("memory"):
            self.records.append({"step": record["step"], "memory": record["memory"]})
            self._since_refresh += 1
            if self._since_refresh >= self.refresh_every:
                self.refresh()

    def refresh(self) -> None:
        """Log every category's line chart (one line per rank, GiB) and the bar chart of the latest peaks."""
        import wandb

        if not self.records:
            return
        self._since_refresh = 0
        charts: dict[str, Any] = {}
        for key, s in memory_series(self.records).items():
            ranks = sorted(s["ranks"])
            ys = [[(v or 0) / GIB for v in s["ranks"][r]] for r in ranks]
            charts[f"dashboard/memory/{key.removesuffix('_bytes')}"] = wandb.plot.line_series(
                xs=s["steps"], ys=ys, keys=[f"rank {r}" for r in ranks], title=f"{s['title']} (GiB) per rank",
                xname="step")
        peaks, source = rank_peaks(self.records[-1])
        table = wandb.Table(columns=["rank", "peak_gib"], data=[[f"rank {r}", b / GIB] for r, b in peaks])
        charts["dashboard/peak_by_rank"] = wandb.plot.bar(
            table, "rank", "peak_gib", title=f"peak per rank, step {self.records[-1]['step']} ({source}, GiB)")
        self.run.log(charts, step=self.records[-1]["step"])

    def finish(self) -> None:
        if self._since_refresh:
            self.refresh()
