"""A roofline model of one training step: compute at a stated fraction of peak, each collective over its link.

The estimate of a step on ``world`` GPUs laid out by :class:`~megazero.distributed.context.RankGrid` (TP fastest,
then CP, then DP, then PP; ``gpus_per_node`` consecutive ranks share a node) is the sum of

* **compute**: the FLOPs the hardware executes (Megatron-LM's count, recomputation included:
  :func:`megazero.observe.flops.megatron_hardware_flops`) split evenly over the ranks, at ``efficiency`` x the GPU's
  dense peak for the compute dtype;
* **pipeline bubble**: compute x ``(p - 1) / m`` (1F1B, GPipe) or ``(1/v)(p - 1) / m`` (interleaved), or the
  zero-bubble timeline's idle fraction (zb-h1; zbv over its two chunks per rank);
* **communication**: each collective's logical volume as the ledger counts it (all-reduce 2n, reduce-scatter
  and all-gather n, send n) x ``(g - 1) / g`` for a ring of g ranks, over the bandwidth of the slowest link the
  group crosses: NVLink (per GPU, one direction) inside a node, the GPU's share of the node's network across
  nodes. Nothing is assumed to overlap with compute except the fraction ``dp_overlap`` of DP traffic;
* **context parallelism** (:mod:`megazero.context_parallel`): the ring's K/V (and dK/dV) sends cross one link
  each, in bytes (the ring sends dK/dV in fp32), at NVLink speed when the CP group sits inside a node (TP is
  fastest in the grid, then CP) and at the network's when it spans nodes; the all-gather mode's collectives as
  the others. The ring posts each hop before computing the block in hand, so its sends hide behind the
  attention blocks' compute (the causal half of the ``QKᵀ`` and attention-over-V matmuls, forward and
  backward); only what exceeds that compute is counted, and never less than each layer's last dK/dV hop, which
  waits with nothing left to compute;
* **optimizer step**: reading and writing the owned fp32 state at HBM bandwidth, or with optimizer offload
  the PCIe transfer of gradients and parameters plus a host Adam at ``host_adam_params_per_s``.

Figures are per rank and per optimizer step, in seconds; every hardware figure comes from :data:`GPUS` and
can be overridden (``dataclasses.replace`` or the flags of ``tools/plan.py``). The table holds vendor
datasheet figures, checked against NVIDIA's datasheets (dense tensor-core peaks, i.e. half the "with
sparsity" figures: H100/H200 SXM 989 TFLOP/s bf16, H100 PCIe 756, B200 2,250, A100 312, L40S 362; HBM
3.35 / 2.0 / 4.8 / 8 / 2.04 (40 GB: 1.56) / 0.864 TB/s) and link rates per GPU and direction (NVLink 4 on
H100/H200 SXM: 900 GB/s bidirectional = 450 per direction; NVLink 5 on B200: 1.8 TB/s = 900; NVLink 3 on A100:
600 GB/s = 300; PCIe Gen5 x16 64 GB/s, Gen4 32 GB/s), with the usual node networks (one 400 Gb/s NDR
InfiniBand port per GPU = 50 GB/s for H100/H200/B200, 200 Gb/s HDR = 25 GB/s for A100, 100 Gb/s for L40S).

Nothing here is measured. The largest assumption is ``efficiency``, the fraction of the dense peak a step
achieves on the hardware FLOPs (default 0.5: Megatron-LM's published GPT runs on A100 reach 44-52% of the
peak, Narayanan et al. 2021, arXiv 2104.04473; a small model or micro-batch reaches less). Links are assumed to run at
their full datasheet rate. :func:`describe` states the assumptions of a :class:`Cluster` in one line, which
the planner and the dry run print; calibrate ``efficiency`` with a measured one-GPU step (``bench/gpu.py``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from megazero.observe.flops import PEAK_FLOPS, megatron_hardware_flops
from megazero.pipeline.schedules import SPLIT_SCHEDULES, simulate

__all__ = [
    "GPUS",
    "Cluster",
    "GPUSpec",
    "StepTime",
    "bubble_fraction",
    "cluster",
    "collective_seconds",
    "describe",
    "group_nodes",
    "mfu",
    "ring_kv_bytes",
    "step_time",
]

_GB = 1e9


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: dense peak FLOP/s by dtype, memory, and the links of its usual node."""

    name: str
    peak_flops: dict[str, float]  # "bf16", "fp16", "tf32", "fp32"
    memory_bytes: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # NVLink (or PCIe) per GPU, one direction
    inter_node_bytes_per_s: float  # the node's network divided by its GPUs, one direction
    pcie_bytes_per_s: float  # host <-> device, one direction
    gpus_per_node: int = 8


def _peaks(pattern: str) -> dict[str, float]:
    for name, peaks in PEAK_FLOPS:
        if name == pattern:
            return dict(peaks)
    raise KeyError(pattern)  # pragma: no cover - the table below names rows of PEAK_FLOPS


GPUS: dict[str, GPUSpec] = {
    "h100": GPUSpec("H100 SXM 80GB", _peaks("H100"), 80 * _GB, 3.35e12, 450 * _GB, 50 * _GB, 64 * _GB),
    "h100-pcie": GPUSpec("H100 PCIe 80GB", _peaks("H100 PCIe"), 80 * _GB, 2.0e12, 64 * _GB, 50 * _GB, 64 * _GB),
    "h200": GPUSpec("H200 SXM 141GB", _peaks("H200"), 141 * _GB, 4.8e12, 450 * _GB, 50 * _GB, 64 * _GB),
    "b200": GPUSpec("B200 180GB", _peaks("B200"), 180 * _GB, 8.0e12, 900 * _GB, 50 * _GB, 64 * _GB),
    "a100": GPUSpec("A100 SXM 80GB", _peaks("A100"), 80 * _GB, 2.04e12, 300 * _GB, 25 * _GB, 32 * _GB),
    "a100-40gb": GPUSpec("A100 SXM 40GB", _peaks("A100"), 40 * _GB, 1.56e12, 300 * _GB, 25 * _GB, 32 * _GB),
    "l40s": GPUSpec("L40S 48GB", _peaks("L40S"), 48 * _GB, 0.864e12, 32 * _GB, 12.5 * _GB, 32 * _GB),
}


@dataclass(frozen=True)
class Cluster:
    """The GPUs of a run and the assumptions of the estimate."""

    gpu: GPUSpec
    gpus_per_node: int
    efficiency: float = 0.5  # achieved fraction of the dense peak on the model's FLOPs
    dp_overlap: float = 0.0  # fraction of DP traffic hidden behind backward
    host_adam_params_per_s: float = 1e9  # offloaded Adam, per rank
    memory_fraction: float = 0.9  # usable share of device memory (CUDA context, fragmentation)

    @property
    def usable_memory_bytes(self) -> float:
        return self.gpu.memory_bytes * self.memory_fraction


def cluster(gpu: str, gpus_per_node: int | None = None, **overrides: float) -> Cluster:
    """A :class:`Cluster` of a known GPU (a key of :data:`GPUS`); ``overrides`` replace GPU or cluster fields
    (``memory_bytes``, ``intra_node_bytes_per_s``, ``efficiency``...), None values are ignored."""
    key = gpu.lower()
    if key not in GPUS:
        raise ValueError(f"--gpu {gpu!r} is not in the table; choose one of {', '.join(GPUS)} or give its figures "
                         "with --peak-tflops/--memory-gb/--nvlink-gbps/--network-gbps")
    spec = GPUS[key]
    gpu_fields = {k: v for k, v in overrides.items() if v is not None and hasattr(spec, k)}
    if "peak_tflops" in overrides and overrides["peak_tflops"] is not None:
        tf = float(overrides["peak_tflops"]) * 1e12
        gpu_fields["peak_flops"] = {k: tf for k in ("bf16", "fp16", "tf32", "fp32")}
    spec = replace(spec, **gpu_fields) if gpu_fields else spec
    rest = {k: v for k, v in overrides.items()
            if v is not None and k in Cluster.__dataclass_fields__ and k not in ("gpu", "gpus_per_node")}
    return Cluster(gpu=spec, gpus_per_node=gpus_per_node or spec.gpus_per_node, **rest)


def describe(c: Cluster, precision: str) -> str:
    """The assumptions behind a step-time estimate on ``c``, in one line."""
    key = "tf32" if precision == "fp32" and "tf32" in c.gpu.peak_flops else precision
    peak = c.gpu.peak_flops.get(key) or c.gpu.peak_flops["fp32"]
    return (f"roofline assumes {c.efficiency:.0%} of {peak / 1e12:.0f} TFLOP/s ({key} dense peak of {c.gpu.name}; "
            f"--efficiency), NVLink {c.gpu.intra_node_bytes_per_s / 1e9:.0f} GB/s and network "
            f"{c.gpu.inter_node_bytes_per_s / 1e9:.0f} GB/s per GPU and direction at full rate, "
            f"{c.gpus_per_node} GPUs per node, {c.dp_overlap:.0%} of DP traffic overlapped")


def group_nodes(ranks: list[int], gpus_per_node: int) -> int:
    """How many nodes the ranks of a group span."""
    return len({r // gpus_per_node for r in ranks})


def collective_seconds(logical_elements: float, element_bytes: float, group_size: int, crosses_nodes: bool,
                       c: Cluster) -> float:
    """Time of collectives whose logical volume (as the ledger counts it) is ``logical_elements``, on a ring
    of ``group_size`` ranks: ``bytes x (g - 1)/g / bandwidth`` of the slowest link crossed."""
    if group_size <= 1 or logical_elements <= 0:
        return 0.0
    bw = c.gpu.inter_node_bytes_per_s if crosses_nodes else c.gpu.intra_node_bytes_per_s
    return logical_elements * element_bytes * (group_size - 1) / group_size / bw


def bubble_fraction(pp_size: int, micro_batches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle time over compute time of a pipeline: ``(1/v)(p - 1)/m``; a zero-bubble schedule's from its timeline
    (:func:`~megazero.pipeline.schedules.simulate`, F = B = W)."""
    if pp_size <= 1:
        return 0.0
    if schedule in SPLIT_SCHEDULES:
        return _timeline_bubble(schedule, pp_size, micro_batches, virtual_stages)
    return (pp_size - 1) / (virtual_stages * micro_batches)


@functools.lru_cache(maxsize=1024)
def _timeline_bubble(schedule: str, pp_size: int, micro_batches: int, virtual_stages: int) -> float:
    return simulate(schedule, pp_size, micro_batches, virtual_stages).bubble_fraction


@dataclass
class StepTime:
    """One rank's estimated step, in seconds, by part."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    flops_per_rank: float
    parts: dict[str, float] = field(default_factory=dict)
    cp_comm: float = 0.0  # the context-parallel ring's (or all-gather's) K/V traffic

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp_comm + self.cp_comm + self.pp_comm + self.dp_comm
                + self.optimizer)

    @property
    def comm(self) -> float:
        """Every group's communication: TP, CP, PP and DP."""
        return self.tp_comm + self.cp_comm + self.pp_comm + self.dp_comm

    def as_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute, "bubble_s": self.bubble, "tp_comm_s": self.tp_comm,
                "cp_comm_s": self.cp_comm, "pp_comm_s": self.pp_comm, "dp_comm_s": self.dp_comm,
                "optimizer_s": self.optimizer, "total_s": self.total, "flops_per_rank": self.flops_per_rank}


def step_time(*, c: Cluster, precision: str, global_batch: int, seq_len: int, num_layers: int, hidden: int,
              vocab: int, checkpointing: str, tp: int, pp: int, dp: int, micro_batches: int,
              virtual_stages: int, tp_elements: float, pp_elements: float, dp_grad_elements: float,
              dp_param_elements: float, grad_bytes: int, owned_params: float, offload: bool,
              tp_crosses: bool, pp_crosses: bool, dp_crosses: bool, shape: dict[str, Any] | None = None,
              cp: int = 1, cp_send_bytes: float = 0.0, cp_tail_bytes: float = 0.0,
              cp_collective_bytes: float = 0.0, cp_crosses: bool = False, schedule: str = "1f1b") -> StepTime:
    """Estimate one rank's step from the volumes it moves (elements, as the ledger counts them).

    Under context parallelism ``dp`` is ZeRO's group, dp x cp (the work is spread over ``tp·pp·dp`` ranks as
    given); ``cp`` is the CP group's size, ``cp_send_bytes`` the ring's point-to-point bytes per step (K/V in the
    compute dtype, dK/dV in fp32: :func:`ring_kv_bytes`), ``cp_tail_bytes`` the part of them that cannot hide
    (each layer's last dK/dV hop) and ``cp_collective_bytes`` the all-gather mode's logical bytes.

    ``shape``: :func:`megazero.observe.flops.flops_shape` of a model other than GPT-2 (GQA, SwiGLU).

    ``tp_elements``/``pp_elements``: 16-bit (or fp32) activations per step over TP/PP; ``dp_grad_elements`` at
    ``grad_bytes`` per element, ``dp_param_elements`` at the compute dtype's size; ``owned_params``: the
    parameters whose optimizer state this rank updates.
    """
    e = 4 if precision == "fp32" else 2
    key = "tf32" if precision == "fp32" and "tf32" in c.gpu.peak_flops else precision
    peak = c.gpu.peak_flops.get(key) or c.gpu.peak_flops["fp32"]
    world = tp * pp * dp
    flops = megatron_hardware_flops(global_batch, seq_len, num_layers, hidden, vocab, checkpointing,
                                    **(shape or {})) / world
    compute = flops / (peak * c.efficiency)
    bubble = compute * bubble_fraction(pp, micro_batches, virtual_stages, schedule)
    tp_s = collective_seconds(tp_elements, e, tp, tp_crosses, c)
    # a send's volume crosses one link once: (g - 1)/g does not apply to point-to-point traffic
    pp_s = 0.0 if pp == 1 else pp_elements * e / (c.gpu.inter_node_bytes_per_s if pp_crosses
                                                   else c.gpu.intra_node_bytes_per_s)
    dp_s = (collective_seconds(dp_grad_elements, grad_bytes, dp, dp_crosses, c)
            + collective_seconds(dp_param_elements, e, dp, dp_crosses, c)) * (1.0 - c.dp_overlap)
    cp_bw = c.gpu.inter_node_bytes_per_s if cp_crosses else c.gpu.intra_node_bytes_per_s
    cp_s = 0.0
    if cp > 1:  # the ring's sends hide behind this rank's causal attention matmuls (2 s²h per layer forward, x3)
        attention = 6.0 * global_batch * seq_len * seq_len * hidden * num_layers / world / (peak * c.efficiency)
        cp_s = max(cp_tail_bytes / cp_bw, cp_send_bytes / cp_bw - attention)
        cp_s += collective_seconds(cp_collective_bytes, 1, cp, cp_crosses, c)
    if offload:  # gradients down, parameters up over PCIe, Adam on the host
        opt = owned_params * (grad_bytes + e) / c.gpu.pcie_bytes_per_s + owned_params / c.host_adam_params_per_s
    else:  # read/write master, two moments, gradient, 16-bit copy at HBM bandwidth
        opt = owned_params * (3 * 8 + grad_bytes + e) / c.gpu.hbm_bytes_per_s
    return StepTime(compute, bubble, tp_s, pp_s, dp_s, opt, flops, cp_comm=cp_s)


def ring_kv_bytes(kv_elements: float, cp: int, element_bytes: int, recomputed: bool = False) -> float:
    """Bytes one rank sends around the CP ring per layer and micro-batch, ``kv_elements`` being this rank's K
    and V together (``2N``, :mod:`megazero.context_parallel.ring`): ``(cp - 1)`` hops of K/V in the forward and
    again in the backward (once more where recomputation replays the forward), and ``cp`` hops of dK/dV in fp32."""
    if cp <= 1:
        return 0.0
    forwards = 3 if recomputed else 2
    return forwards * (cp - 1) * kv_elements * element_bytes + cp * kv_elements * 4


def mfu(model_flops: float, seconds: float, world: int, c: Cluster, precision: str) -> float:
    """Model FLOPs utilisation of an estimated step."""
    key = "tf32" if precision == "fp32" and "tf32" in c.gpu.peak_flops else precision
    peak = c.gpu.peak_flops.get(key) or c.gpu.peak_flops["fp32"]
    return model_flops / (seconds * world * peak) if seconds > 0 and not math.isinf(seconds) else 0.0
