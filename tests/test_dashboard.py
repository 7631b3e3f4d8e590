"""The memory dashboard builds itself: an offline W&B run holds one line-series chart per memory category (one
line per rank, the measured peak and its breakdown included) and a bar chart of each rank's peak, with the
values of metrics.jsonl; tools/plot_metrics.py draws the same from metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megazero.observe.dashboard import GIB, memory_series, rank_peaks

ROOT = Path(__file__).resolve().parents[1]


def _records() -> list[dict]:
    out = []
    for step in (1, 5, 10):
        mem = [{"rank": r, "tp_rank": r % 2, "pp_rank": 0, "dp_rank": r // 2, "params_bytes": 1000 * (r + 1) * step,
                "grads_bytes": 500 + r, "activation_peak_bytes": 70 * step, "host_rss_bytes": 2**20 + r,
                "device_allocated_bytes": None, "peak_bytes": 3000 + 10 * r + step,
                "peak_by_category": {"activations": 10 * r, "parameters": 20 + r}} for r in range(3)]
        out.append({"step": step, "loss": 2.0 / step, "memory": mem})
    out[-1]["samples"] = [{"prompt": "def ", "text": "f(x):", "ids": [1, 2]}]
    return out


def read_offline_run(log_dir: Path) -> tuple[dict[str, dict], bytes]:
    """The logged tables of the one offline run under ``log_dir`` by W&B key (from files/media/table) and the
    raw .wandb log (where the charts' Vega spec ids are recorded)."""
    [run] = list((log_dir / "wandb").glob("offline-run-*"))
    tables = {}
    for f in (run / "files" / "media" / "table").rglob("*.table.json"):
        rel = f.relative_to(run / "files" / "media" / "table").as_posix()
        tables[rel.rsplit("_", 2)[0]] = json.loads(f.read_text())  # "<key>_<step>_<hash>.table.json"
    [log] = list(run.glob("run-*.wandb"))
    return tables, log.read_bytes()


def check_dashboard(log_dir: Path, records: list[dict], n_ranks: int) -> dict[str, dict]:
    """Assert the run under ``log_dir`` holds the charts of ``records``; returns its tables."""
    tables, log = read_offline_run(log_dir)
    series = memory_series(records)
    assert series and len(series) >= 4
    for key, s in series.items():
        t = tables[f"dashboard/memory/{key.removesuffix('_bytes')}_table"]
        assert t["columns"] == ["step", "lineKey", "lineVal"]
        for rank in range(n_ranks):
            rows = [row for row in t["data"] if row[1] == f"rank {rank}"]
            assert [row[0] for row in rows] == s["steps"], (key, rank)
            assert [row[2] for row in rows] == pytest.approx([(v or 0) / GIB for v in s["ranks"][rank]]), (key, rank)
    peaks, _ = rank_peaks(records[-1])
    bar = tables["dashboard/peak_by_rank_table"]
    assert [row[0] for row in bar["data"]] == [f"rank {r}" for r, _ in peaks]
    assert [row[1] for row in bar["data"]] == pytest.approx([b / GIB for _, b in peaks])
    assert log.count(b"wandb/lineseries/v0") >= len(series) and b"wandb/bar/v0" in log
    return tables


def test_wandb_dashboard_and_plots_from_metrics(tmp_path, monkeypatch) -> None:
    import wandb

    from megazero.observe.metrics import MetricsWriter

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    records = _records()
    run = wandb.init(project="megazero-tests", mode="offline", dir=str(tmp_path))
    writer = MetricsWriter(tmp_path, True, run)
    for rec in records:
        writer.write(rec)
    writer.close()
    tables = check_dashboard(tmp_path, records, 3)
    assert {"dashboard/memory/peak_table", "dashboard/memory/peak/activations_table",
            "dashboard/memory/peak/parameters_table"} <= set(tables)  # the measured peak, when recorded
    assert tables["samples"]["data"] == [[10, "def ", "f(x):"]]
    assert rank_peaks(records[-1])[1] == "measured peak"
    # without measured peaks: the allocator's max, else model states + activations
    no_peak = [{**m, "peak_bytes": None} for m in records[-1]["memory"]]
    assert rank_peaks({"memory": no_peak})[0][1] == (1, 2000 * 10 + 501 + 700)

    spec = importlib.util.spec_from_file_location("_plot_metrics", ROOT / "tools" / "plot_metrics.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.main([str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    for name in ("memory_by_category.png", "peak_by_rank.png"):
        assert (tmp_path / "png" / name).read_bytes()[:4] == b"\x89PNG"


def _plot_tool():
    spec = importlib.util.spec_from_file_location("_plot_metrics", ROOT / "tools" / "plot_metrics.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    return plot


@pytest.mark.parametrize("n_steps", [3, 3000])
def test_memory_by_category_is_readable(n_steps) -> None:
    """Only categories with data get a panel; a flat series sits on an axis from zero (3.59 MiB was drawn on a
    3.40-3.75 axis); ranks with the same series are one line "ranks 0-3" (they hid each other), different ones
    stay apart; dots only where there are few points."""
    plot = _plot_tool()
    records = []
    for step in range(1, n_steps + 1):
        mem = [{"rank": r, "params_bytes": 3_764_000, "master_params_bytes": 0, "grads_bytes": None,
                "optimizer_states_bytes": 2**20 * (1 + (r == 5)), "host_rss_bytes": 2**28 + 2**20 * r + step}
               for r in range(6)]
        records.append({"step": step, "memory": mem})
    fig = plot.memory_by_category_figure(records)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.axison}
    assert set(panels) == {"parameters", "optimizer states", "host RSS"}  # no master copy, no gradients
    params = panels["parameters"]
    assert params.get_ylim()[0] == 0 and 3.59 < params.get_ylim()[1] < 4.2 and params.get_ylabel() == "MiB"
    assert [t.get_text() for t in params.get_legend().get_texts()] == ["ranks 0-5"]
    assert [t.get_text() for t in panels["optimizer states"].get_legend().get_texts()] == ["ranks 0-4", "rank 5"]
    assert len(panels["host RSS"].get_lines()) == 6  # every rank differs: one line each
    assert {line.get_marker() for line in params.get_lines()} == ({"."} if n_steps <= 60 else {"None"})
    assert plot._rank_label([0, 1, 4, 6, 7]) == "ranks 0-1, 4, 6-7"
    import matplotlib.pyplot as plt

    plt.close(fig)
