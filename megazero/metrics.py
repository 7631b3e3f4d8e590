"""Per-rank memory and communication records, throughput, and the sinks that write them (JSONL, W&B).

Every logged step produces one JSON object (DESIGN.md, metrics.jsonl) written by rank 0: the scalars
(``step``, ``loss``, ``lr``, ``grad_norm``, ``loss_scale``, ``tokens_per_s``, ``tflops_per_gpu``, ``mfu``,
``micro_batches``; also ``eval_loss``, ``hfu``, ``skipped``) and two lists with one object per rank,
``memory`` and ``comm``. Keys are always present; a value is ``null`` where it is not measured (yet), such as
``mfu``/``hfu`` on a device whose peak FLOP/s is unknown (set ``MEGAZERO_PEAK_TFLOPS``).

Throughput uses Megatron-LM's FLOPs count (:func:`megatron_model_flops`, :func:`megatron_hardware_flops`);
W&B receives the same records flattened into per-rank series (:func:`wandb_series`).
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

from megazero import host

__all__ = [
    "MEMORY_KEYS",
    "PEAK_FLOPS",
    "ActivationMemoryCounter",
    "MetricsWriter",
    "gather_rank_records",
    "host_rss_bytes",
    "megatron_hardware_flops",
    "megatron_model_flops",
    "peak_flops_per_device",
    "rank_memory_record",
    "throughput",
    "wandb_series",
]

MEMORY_KEYS = (
    "params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes", "activation_peak_bytes",
    "device_allocated_bytes", "device_peak_bytes", "device_reserved_bytes", "host_rss_bytes",
    "peak_bytes", "peak_by_category", "device_step_peak_bytes",
)


class ActivationMemoryCounter:
    """Measures activation memory as the bytes autograd saves for backward, through saved-tensor hooks.

    Saved tensors are de-duplicated by storage (a view counts its whole storage once, since that is what stays
    alive) and parameters and their views are left out (they are model states). ``last`` is what one tracked forward saved;
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
        params = {host.storage_key(p) for p in self.model.parameters()}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            # a parameter, or a view of one (``weight.t()`` inside linear); the view test also covers ZeRO-3,
            # whose parameters live in storages gathered during the forward, unknown when tracking starts
            if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
                storage = t.untyped_storage()
                ptr = host.storage_key(t)
                if ptr not in params and ptr not in seen:
                    seen[ptr] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.last = sum(seen.values())
        self.peak = max(self.peak, self.last)


def megatron_model_flops(batch: float, seq_len: int, num_layers: int, hidden: int, vocab: int) -> float:
    """Model FLOPs of one step (forward + backward) by Megatron-LM's count, no recomputation.

    ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))`` for ``batch`` = B sequences of ``seq_len`` = s tokens (the
    global batch), l layers, hidden size h and vocabulary V (Narayanan et al. 2021, appendix). MFU always
    uses this count.
    """
    s, h, n = seq_len, hidden, num_layers
    return 72.0 * batch * s * n * h * h * (1 + s / (6 * h) + vocab / (12 * n * h))


def megatron_hardware_flops(batch: float, seq_len: int, num_layers: int, hidden: int, vocab: int,
                            checkpointing: str = "none") -> float:
    """FLOPs the hardware executes in one step, recomputation included (the numerator of HFU).

    ``none``: the model FLOPs. ``full`` (every layer's forward run twice): Megatron-LM's
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``. ``selective`` (attention core recomputed): the model FLOPs plus
    one more forward of the ``QKᵀ`` and attention-over-V matmuls, ``4·B·s²·h`` per layer.
    """
    s, h, n = seq_len, hidden, num_layers
    if checkpointing == "full":
        return 96.0 * batch * s * n * h * h * (1 + s / (6 * h) + vocab / (16 * n * h))
    model = megatron_model_flops(batch, seq_len, num_layers, hidden, vocab)
    if checkpointing == "selective":
        return model + 4.0 * batch * s * s * h * n
    return model


# Dense (no sparsity) peak FLOP/s per device by compute dtype, from the vendors' datasheets. "tf32" is the
# tensor-core rate fp32 matmuls get when torch.backends.cuda.matmul.allow_tf32 is on, "fp32" the plain rate.
# Matched against torch.cuda.get_device_name() in order, first hit wins (so "H100 PCIe" before "H100").
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("H200 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("GH200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("B200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("A100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("A800", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.2e12, "fp32": 91.6e12}),
    ("L4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("A10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("V100", {"fp16": 125e12, "fp32": 15.7e12}),
]


def peak_flops_per_device(precision: str, device: torch.device | str | None = None,
                          peak_tflops: float | None = None, device_name: str | None = None) -> float | None:
    """Dense peak FLOP/s of one device for ``precision`` (fp32 | bf16 | fp16), or None where unknown (CPU).

    ``peak_tflops`` (``--peak-tflops``), else ``MEGAZERO_PEAK_TFLOPS`` (TFLOP/s, per device), overrides the
    table; otherwise the CUDA device's name (or ``device_name``) is looked up in :data:`PEAK_FLOPS`. fp32
    uses the TF32 rate when PyTorch allows TF32 matmuls.
    """
    if peak_tflops is not None:
        return peak_tflops * 1e12
    env = os.environ.get("MEGAZERO_PEAK_TFLOPS")
    if env:
        return float(env) * 1e12
    if device_name is None:
        dev = torch.device(device) if device is not None else None
        if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name(dev)
    key = precision
    if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        key = "tf32"
    for pattern, peaks in PEAK_FLOPS:
        if pattern.lower() in device_name.lower():
            return peaks.get(key)
    return None


def throughput(tokens: int, seq_len: int, seconds: float, world_size: int, num_layers: int, hidden: int,
               vocab: int, checkpointing: str = "none", peak_flops: float | None = None) -> dict[str, float | None]:
    """``tokens_per_s``, ``tflops_per_gpu`` (model FLOPs), ``mfu`` and ``hfu`` of one step over the whole job.

    ``tokens`` is the global batch's token count (so B = tokens / seq_len sequences), ``seconds`` the step's
    wall time, ``peak_flops`` one device's peak FLOP/s (``mfu``/``hfu`` are None without it). ``vocab`` is the
    (padded) vocabulary the LM head multiplies by.
    """
    batch = tokens / seq_len
    model = megatron_model_flops(batch, seq_len, num_layers, hidden, vocab)
    hardware = megatron_hardware_flops(batch, seq_len, num_layers, hidden, vocab, checkpointing)
    per_gpu = model / seconds / world_size
    return {
        "tokens_per_s": tokens / seconds,
        "tflops_per_gpu": per_gpu / 1e12,
        "mfu": per_gpu / peak_flops if peak_flops else None,
        "hfu": hardware / seconds / world_size / peak_flops if peak_flops else None,
    }


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
    (a :class:`megazero.memory.StepPeak`) adds the step's measured peak: ``peak_bytes``, ``peak_by_category``
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
    (:class:`megazero.dashboard.WandbDashboard`).
    """

    def __init__(self, log_dir: str | os.PathLike, enabled: bool, wandb_run: Any | None = None) -> None:
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.dashboard = None
        if wandb_run is not None:
            from megazero.dashboard import WandbDashboard

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
    peak of the step ``peak_gib`` with its parts ``peak/{category}_gib`` (:data:`megazero.memory.CATEGORIES`)
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
