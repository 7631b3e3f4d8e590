"""Per-rank memory and communication records, throughput, and the sinks that write them (JSONL, W&B).

Every logged step produces one JSON object (DESIGN.md, metrics.jsonl) written by rank 0: the scalars
(``step``, ``loss``, ``lr``, ``grad_norm``, ``loss_scale``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``,
``micro_batches``) and two lists with one object per rank, ``memory`` and ``comm``. Keys are always
present; a value is ``null`` where it is not measured (yet).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "MEMORY_KEYS",
    "ActivationMemoryCounter",
    "MetricsWriter",
    "gather_rank_records",
    "host_rss_bytes",
    "megatron_model_flops",
    "rank_memory_record",
]

MEMORY_KEYS = (
    "params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes", "activation_peak_bytes",
    "device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes", "host_rss_bytes",
)


class ActivationMemoryCounter:
    """Measures activation memory as the bytes autograd saves for backward, through saved-tensor hooks.

    Saved tensors are de-duplicated by storage (a view counts its whole storage once, since that is what stays
    alive) and parameters are left out (they are model states). ``last`` is what one tracked forward saved;
    ``peak`` the largest of all tracked forwards since :meth:`reset_peak`.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.last = 0
        self.peak = 0

    def reset_peak(self) -> None:
        self.peak = 0

    @contextmanager
    def track(self) -> Iterator[None]:
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in params and ptr not in seen:
                    seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.last = sum(seen.values())
        self.peak = max(self.peak, self.last)


def megatron_model_flops(batch: int, seq_len: int, num_layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one step (forward + backward) by Megatron-LM's count, no recomputation."""
    s, h, n = seq_len, hidden, num_layers
    return 72.0 * batch * s * n * h * h * (1 + s / (6 * h) + vocab / (12 * n * h))


def host_rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def rank_memory_record(coords: dict[str, int], model_state: dict[str, int],
                       activation_peak_bytes: int | None = None) -> dict[str, Any]:
    """This rank's memory record: coordinates, model-state breakdown, device and host figures."""
    rec: dict[str, Any] = dict(coords)
    rec.update({k: None for k in MEMORY_KEYS})
    rec.update(model_state)
    rec["activation_peak_bytes"] = activation_peak_bytes
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["device_allocated_bytes"] = torch.cuda.memory_allocated()
        rec["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        rec["device_reserved_bytes"] = torch.cuda.memory_reserved()
    rec["host_rss_bytes"] = host_rss_bytes()
    return rec


def gather_rank_records(record: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Gather one small record per rank to global rank 0 (None elsewhere). Not on the hot path."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [record]
    out: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(record, out, dst=0)
    return out


class MetricsWriter:
    """Writes metrics.jsonl (and W&B when enabled) on rank 0; a no-op elsewhere."""

    def __init__(self, log_dir: str | os.PathLike, enabled: bool, wandb_run: Any | None = None) -> None:
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.path = Path(log_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(_flatten_for_wandb(record), step=record["step"])

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self.wandb_run is not None:
                self.wandb_run.finish()


def _flatten_for_wandb(record: dict[str, Any]) -> dict[str, float]:
    """Scalars as they are; per-rank memory as ``memory/rank{r}/{key}_gib`` so a panel shows one line per GPU."""
    out: dict[str, float] = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
    for rec in record.get("memory") or []:
        r = rec["rank"]
        for key in MEMORY_KEYS:
            if rec.get(key) is not None:
                out[f"memory/rank{r}/{key.removesuffix('_bytes')}_gib"] = rec[key] / 2**30
    for rec in record.get("comm") or []:
        if rec.get("volume_elements_per_step") is not None:
            out[f"comm/rank{rec['rank']}/volume_elements_per_step"] = rec["volume_elements_per_step"]
    return out
