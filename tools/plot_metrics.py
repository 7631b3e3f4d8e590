"""Plot a run's metrics.jsonl: loss, per-rank memory, throughput and MFU, as PNG files.

    python tools/plot_metrics.py runs/latest                 # writes runs/latest/plots/*.png
    python tools/plot_metrics.py runs/latest --out figs --step 200

Writes ``loss.png`` (training loss, and evaluation loss where logged), ``memory.png`` (per rank: the
model-state breakdown -- params, grads, master params, optimizer states -- stacked with the activation peak,
and beside it what the device allocator, or on CPU the process's resident memory, measured) and
``throughput.png`` (tokens/s, TFLOP/s per GPU, MFU and HFU where the peak FLOP/s is known), and the memory
dashboard the W&B run builds (:mod:`megazero.observe.dashboard`): ``memory_by_category.png`` (one panel per memory
category that holds data, measured peak and its breakdown included where recorded, one line per group of ranks
with the same series -- "ranks 0-3" -- over the steps, each axis from zero) and
``peak_by_rank.png`` (each rank's peak at the plotted step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

try:
    import megazero  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from megazero.observe.dashboard import memory_series, rank_peaks  # noqa: E402

__all__ = ["build_parser", "load_records", "main", "memory_by_category_figure", "plot_loss", "plot_memory",
           "plot_memory_by_category", "plot_peak_by_rank", "plot_throughput"]

BREAKDOWN = (("params_bytes", "params"), ("grads_bytes", "grads"), ("master_params_bytes", "master params"),
             ("optimizer_states_bytes", "optimizer states"), ("activation_peak_bytes", "activations (peak)"))
MEASURED = (("device_allocated_bytes", "allocated"), ("device_peak_bytes", "max allocated"),
            ("device_reserved_bytes", "reserved"), ("host_rss_bytes", "host RSS"))


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``path`` (a metrics.jsonl file, or the log directory holding one), in step order."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise ValueError(f"{path} holds no records")
    return sorted(records, key=lambda r: r["step"])


def _unit(max_bytes: float) -> tuple[float, str]:
    for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= div:
            return div, name
    return 1.0, "bytes"


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def _marker(n_points: int) -> str | None:
    """Dots on a line of a few points (3 points read as a line otherwise); none on a long one (3,000 points)."""
    return "." if n_points <= 60 else None


def _steps_axis(ax: Any) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers: no 2.5


def _rank_label(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-3``, ``ranks 0-1, 4, 6-7``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _same_series(ranks: dict[int, list[float | None]]) -> list[tuple[list[int], list[float | None]]]:
    """Ranks whose series are identical, as one group each (by first rank), so that none hides another."""
    groups: dict[tuple, list[int]] = {}
    for rank, vals in sorted(ranks.items()):
        groups.setdefault(tuple(vals), []).append(rank)
    return [(members, list(vals)) for vals, members in groups.items()]


def plot_loss(records: list[dict[str, Any]], out: Path) -> Path:
    """Training loss per logged step, with the evaluation loss as markers."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*_series(records, "loss"), label="train loss", marker=_marker(len(records)))
    steps, evals = _series(records, "eval_loss")
    if steps:
        ax.plot(steps, evals, label="eval loss", marker="o", linestyle="--")
    ax.set(xlabel="step", ylabel="loss (token-weighted, global batch)", title="Loss")
    _steps_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend()
    path = out / "loss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory(record: dict[str, Any], out: Path) -> Path:
    """Per-rank stacked model-state + activation breakdown, and the measured allocator/RSS figures."""
    ranks = record.get("memory") or []
    if not ranks:
        raise ValueError(f"record of step {record['step']} has no per-rank memory")
    labels = [f"{m['rank']}\n(t{m.get('tp_rank', 0)} p{m.get('pp_rank', 0)} d{m.get('dp_rank', 0)})" for m in ranks]
    x = range(len(ranks))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(ranks) + 4), 4.5))

    totals = [sum(m.get(k) or 0 for k, _ in BREAKDOWN) for m in ranks]
    div, unit = _unit(max(totals))
    bottom = [0.0] * len(ranks)
    for key, name in BREAKDOWN:
        vals = [(m.get(key) or 0) / div for m in ranks]
        if not any(vals):  # e.g. no master copy in fp32: nothing to stack or to name
            continue
        ax1.bar(x, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set(xticks=list(x), xlabel="rank (tp, pp, dp)", ylabel=unit, ylim=(0, 1.4 * max(bottom) or 1),
            title=f"Model states + activations, step {record['step']}")  # headroom for the legend
    ax1.set_xticklabels(labels, fontsize=8)
    ax1.legend(fontsize=8)
    ax1.grid(axis="y", alpha=0.3)

    present = [(k, n) for k, n in MEASURED if any(m.get(k) is not None for m in ranks)]
    if present:
        div2, unit2 = _unit(max((m.get(k) or 0) for m in ranks for k, _ in present))
        width = 0.8 / len(present)
        for i, (key, name) in enumerate(present):
            ax2.bar([j + (i - (len(present) - 1) / 2) * width for j in x],
                    [(m.get(key) or 0) / div2 for m in ranks], width, label=name)
        top = max((m.get(k) or 0) for m in ranks for k, _ in present) / div2
        ax2.set(ylabel=unit2, ylim=(0, 1.25 * top or 1))
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax2.transAxes)
    ax2.set(xticks=list(x), xlabel="rank (tp, pp, dp)", title="Measured (device allocator / process)")
    ax2.set_xticklabels(labels, fontsize=8)
    ax2.grid(axis="y", alpha=0.3)
    path = out / "memory.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory_by_category(records: list[dict[str, Any]], out: Path) -> Path:
    """One panel per memory category that holds data, one line per group of ranks with the same series over the
    logged steps (the W&B dashboard's charts); each axis starts at zero, so a flat series reads as flat."""
    fig = memory_by_category_figure(records)
    path = out / "memory_by_category.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def memory_by_category_figure(records: list[dict[str, Any]]) -> Any:
    """The figure of :func:`plot_memory_by_category`."""
    series = memory_series(records)
    if not series:
        raise ValueError("no record holds per-rank memory")
    cols = min(3, len(series))
    rows = -(-len(series) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.3 * rows), squeeze=False)
    for ax, s in zip(axes.flat, series.values()):
        top = max((v or 0) for vals in s["ranks"].values() for v in vals)
        div, unit = _unit(top)
        groups = _same_series(s["ranks"])
        for members, vals in groups:
            pts = [(x, v / div) for x, v in zip(s["steps"], vals) if v is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=_marker(len(pts)), label=_rank_label(members),
                    linewidth=1.5 if len(groups) <= 8 else 0.7)
        ax.set(title=s["title"], xlabel="step", ylabel=unit, ylim=(0, 1.15 * top / div))
        _steps_axis(ax)
        ax.grid(alpha=0.3)
        if len(groups) <= 8:
            ax.legend(fontsize=7, loc="lower right")
        else:
            ax.text(0.99, 0.02, f"{len(s['ranks'])} ranks, {len(groups)} different series", fontsize=7,
                    ha="right", va="bottom", transform=ax.transAxes)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


def plot_peak_by_rank(record: dict[str, Any], out: Path) -> Path:
    """Bar chart of each rank's peak memory in one record."""
    peaks, source = rank_peaks(record)
    div, unit = _unit(max((b for _, b in peaks), default=1))
    fig, ax = plt.subplots(figsize=(max(5.0, 0.8 * len(peaks) + 2), 3.5))
    ax.bar([str(r) for r, _ in peaks], [b / div for _, b in peaks])
    ax.set(xlabel="rank", ylabel=unit, title=f"Peak per rank, step {record['step']} ({source})")
    ax.grid(axis="y", alpha=0.3)
    path = out / "peak_by_rank.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput(records: list[dict[str, Any]], out: Path) -> Path:
    """Tokens/s, TFLOP/s per GPU, and MFU/HFU (in %) per logged step."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    marker = _marker(len(records))
    axes[0].plot(*_series(records, "tokens_per_s"), marker=marker)
    axes[0].set(title="Throughput", ylabel="tokens/s")
    axes[1].plot(*_series(records, "tflops_per_gpu"), marker=marker)
    axes[1].set(title="Model TFLOP/s per GPU", ylabel="TFLOP/s")
    drawn = False
    for key in ("mfu", "hfu"):
        steps, vals = _series(records, key)
        if steps:
            axes[2].plot(steps, [100 * v for v in vals], marker=marker, label=key.upper())
            drawn = True
    axes[2].set(title="MFU / HFU", ylabel="% of peak")
    for ax in axes:
        ax.set(xlabel="step")
        ax.set_ylim(bottom=0)
        _steps_axis(ax)
        ax.grid(alpha=0.3)
    if drawn:
        axes[2].legend()
    else:  # no empty axes to read: just why
        axes[2].axis("off")
        axes[2].text(0.5, 0.5, "MFU / HFU n/a: this device's peak FLOP/s\nis unknown (pass --peak-tflops)",
                     ha="center", va="center", transform=axes[2].transAxes)
    path = out / "throughput.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/plot_metrics.py", description=__doc__.split("\n\n")[0])
    p.add_argument("log_dir", help="a run's --log-dir (or its metrics.jsonl)")
    p.add_argument("--out", help="output directory (default: LOG_DIR/plots)")
    p.add_argument("--step", type=int, help="step whose per-rank memory to plot (default: the last logged)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Read LOG_DIR's metrics.jsonl and write the PNGs; prints their paths."""
    p = build_parser()
    args = p.parse_args(argv)
    try:
        records = load_records(args.log_dir)
    except (OSError, ValueError) as e:
        p.error(str(e))
    src = Path(args.log_dir)
    out = Path(args.out) if args.out else (src if src.is_dir() else src.parent) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    mem = [r for r in records if r.get("memory") and (args.step is None or r["step"] == args.step)]
    if not mem:
        p.error(f"no record with per-rank memory{f' at step {args.step}' if args.step is not None else ''}")
    for path in (plot_loss(records, out), plot_memory(mem[-1], out), plot_throughput(records, out),
                 plot_memory_by_category(records, out), plot_peak_by_rank(mem[-1], out)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
