"""Per-rank memory and communication records, throughput, and the sinks that write them (JSONL, W&B).

Every logged step produces one JSON object (DESIGN.md, metrics.jsonl) written by rank 0: the scalars
(``step``, ``loss``, ``lr``, ``grad_norm``, ``loss_scale``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``,
``micro_batches``; also ``eval_loss``, ``hfu``, ``skipped``) and two lists with one object per rank,
``memory`` and ``comm``. Keys are always present; a value is ``null`` where it is not measured (yet), such as
``mfu``/``hfu`` on a device whose peak FLOP/s is unknown (set ``MEGAZERO_PEAK_TFLOPS``).

Throughput uses Megatron-LM's FLOPs count (:mod:`megazero.observe.flops`); W&B receives the same records flattened into per-rank series (:func:`wandb_series`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "MEMORY_KEYS",
    "MetricsWriter",
    "gather_rank_records",
    "host_rss_bytes",
    "rank_memory_record",
    "wandb_series",
]

MEMORY_KEYS = (
    "params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes", "activation_peak_bytes",
    "device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes", "host_rss_bytes",
    "peak_bytes", "peak_by_category", "device_step_peak_bytes",
)


def host_rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def rank_memory_record(coords: dict[str, int], model_state: dict[str, int],
                       activation_peak_bytes: int | None = None,
                       device: torch.device | str | None = None,
                       peak: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's memory record: coordinates, model-state breakdown, device and host figures.

    On CUDA (``device``, else the current CUDA device once CUDA is in use): ``memory_allocated``,
    ``max_memory_allocated`` and ``memory_reserved``; everywhere: the process's resident set size. ``peak``
    (a :class:`megazero.observe.memory.StepPeak`) adds the step's measured peak: ``peak_bytes``, ``peak_by_category``
    and, on CUDA, ``device_step_peak_bytes`` (``max_memory_allocated`` over that step).
    """
    rec: dict[str, Any] = dict(coords)
    rec.update({k: None for k in MEMORY_KEYS})
    rec.update(model_state)
    rec["activation_peak_bytes"] = activation_peak_bytes
    dev = torch.device(device) if device is not None else None
    if (dev is None or dev.type == "cuda") and torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["device_allocated_bytes"] = torch.cuda.memory_allocated(dev)
        rec["device_peak_bytes"] = max(torch.cuda.max_memory_allocated(dev),
                                       (peak or {}).get("device_run_peak_bytes") or 0)
        rec["device_reserved_bytes"] = torch.cuda.memory_reserved(dev)
    rec["host_rss_bytes"] = host_rss_bytes()
    if peak is not None:
        rec["peak_bytes"] = peak["peak_bytes"]
        rec["peak_by_category"] = dict(peak["peak_by_category"])
        rec["device_step_peak_bytes"] = peak.get("device_step_peak_bytes")
    return rec


def gather_rank_records(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Gather one small record per rank to global rank 0 (None elsewhere). Not on the hot path."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [record]
    out: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, out, dst=0)
    return out


class MetricsWriter:
    """Writes metrics.jsonl (and W&B when enabled) on rank 0; a no-op elsewhere.

    With W&B the run also gets the self-building memory dashboard and the samples table
    (:class:`megazero.observe.dashboard.WandbDashboard`).
    """

    def __init__(self, log_dir: str | os.PathLike, enabled: bool, wandb_run: Any | None = None) -> None:
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.dashboard = None
        if wandb_run is not None:
            from megazero.observe.dashboard import WandbDashboard

            self.dashboard = WandbDashboard(wandb_run)
        self.path = Path(log_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(wandb_series(record), step=record["step"])
            self.dashboard.update(record)

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self.wandb_run is not None:
                self.dashboard.finish()
                self.wandb_run.finish()


# metrics.jsonl memory key -> W&B series name under memory/rank{r}/ (GiB)
_WANDB_MEMORY = {
    "params_bytes": "params_gib", "grads_bytes": "grads_gib", "master_params_bytes": "master_params_gib",
    "optimizer_states_bytes": "optimizer_states_gib", "activation_peak_bytes": "activations_gib",
    "device_allocated_bytes": "allocated_gib", "device_peak_bytes": "max_allocated_gib",
    "device_reserved_bytes": "reserved_gib", "host_rss_bytes": "host_rss_gib", "peak_bytes": "peak_gib",
    "device_step_peak_bytes": "step_max_allocated_gib",
}
_MODEL_STATE_KEYS = ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes")


def wandb_series(record: dict[str, Any]) -> dict[str, float]:
    """One metrics.jsonl record as flat W&B series, so that a panel shows one line per GPU.

    Scalars keep their names (``loss``, ``tokens_per_s``, ``mfu``...; nulls are left out). Per rank r:
    ``memory/rank{r}/{params,grads,master_params,optimizer_states,model_states,activations}_gib``, the
    device's ``allocated_gib``, ``max_allocated_gib`` and ``reserved_gib`` (on a CPU rank, where there is no
    device allocator, ``allocated_gib`` is the process's resident memory), ``host_rss_gib``, the measured
    peak of the step ``peak_gib`` with its parts ``peak/{category}_gib`` (:data:`megazero.observe.memory.CATEGORIES`)
    and, on CUDA, ``step_max_allocated_gib`` beside it; and ``comm/rank{r}/volume_elements_per_step``.
    """
    out: dict[str, float] = {k: int(v) if isinstance(v, bool) else v for k, v in record.items()
                             if isinstance(v, (int, float)) and k != "step"}
    for rec in record.get("memory") or []:
        prefix = f"memory/rank{rec['rank']}/"
        for key, name in _WANDB_MEMORY.items():
            if rec.get(key) is not None:
                out[prefix + name] = rec[key] / 2**30
        for cat, nbytes in (rec.get("peak_by_category") or {}).items():
            out[f"{prefix}peak/{cat}_gib"] = nbytes / 2**30
        if all(rec.get(k) is not None for k in _MODEL_STATE_KEYS):
            out[prefix + "model_states_gib"] = sum(rec[k] for k in _MODEL_STATE_KEYS) / 2**30
        if rec.get("device_allocated_bytes") is None and rec.get("host_rss_bytes") is not None:
            out[prefix + "allocated_gib"] = rec["host_rss_bytes"] / 2**30
    for rec in record.get("comm") or []:
        if rec.get("volume_elements_per_step") is not None:
            out[f"comm/rank{rec['rank']}/volume_elements_per_step"] = rec["volume_elements_per_step"]
    return out
