"""ZeRO++ in the planner: bytes per link and the DP time of each ZeRO++ setting on a ZeRO-3 layout.

For a ZeRO-3 layout (:func:`megazero.plan.search.evaluate` gives everything but the ZeRO group's traffic), each
setting of hpZ (partition = the ZeRO ranks of a node), qwZ and qgZ moves, per rank and step with m micro-batches,
Ψ the rank's parameters, L ZeRO ranks per node, M nodes, w = 2 bytes (16-bit weights), g the gradient's bytes
(megazero/zero/qgz.py derives the one-micro-batch figures; scales at 4 bytes per block):

* forward all-gather over the whole group: m·w·Ψ, or with qwZ m·(Ψ + 4Ψ/256) (INT8 + scales);
* backward all-gather: the same over the whole group, or with hpZ m·w·Ψ inside the node. Where a rank runs one
  chunk its own units (embeddings, final norm, output layer: Ψ_own) are gathered m times a step, not 2m
  (``zero/stage3/gather.py``, "Carry"): f of them in forwards, m - f in backwards, f from the rank's schedule
  (:func:`~megazero.plan.search.own_forward_gathers`: m without a pipeline, fewer on early stages);
* gradients: m·g·Ψ reduce-scattered over the whole group, or with qgZ an intra-node all-to-all of
  m·(Ψ/2 + 4Ψ/128) and an inter-node one of m·(Ψ/2 + 4Ψ/128)/L (INT4 + scales).

**Time.** A node's network carries, per step, its inter-node bytes: a flat collective over a group spanning the
nodes crosses each node's boundary once with its per-rank volume (x (Nd - 1)/Nd, a ring), and qgZ's inter-node
all-to-all sends L ranks' volumes at once (x (M - 1)/M); each over the node's link, ``gpus_per_node`` times the
cluster's per-GPU network share. Intra-node collectives run over NVLink at the per-GPU rate, x (k - 1)/k for k
ranks. ``dp_overlap`` hides the same fraction as for the other layouts; the quantization kernels are taken as
free (memory-bound passes over Ψ, small beside the network at these link speeds; measure them on a GPU).
**Memory.** hpZ adds the secondary partition, w·Ψ/L per rank, to the layout's peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megazero.config.precision import ELEMENT_BYTES
from megazero.config.schema import ModelConfig
from megazero.plan.roofline import Cluster, StepTime
from megazero.plan.search import Layout, Plan, evaluate, own_forward_gathers, rank_dp_numels
from megazero.zero.grads import grad_dtype_for
from megazero.zero.quantize import GRAD_BLOCK, WEIGHT_BLOCK

__all__ = ["SETTINGS", "ZeroppPlan", "rank_zeropp", "spans_nodes", "zeropp_bytes"]

# name -> (hpZ, qwZ, qgZ)
SETTINGS = {"zero3": (False, False, False), "qwz": (False, True, False), "qgz": (False, False, True),
            "hpz": (True, False, False), "hpz+qwz": (True, True, False), "hpz+qwz+qgz": (True, True, True)}


@dataclass(frozen=True)
class ZeroppPlan:
    name: str
    plan: Plan  # the layout's plan with this setting's DP time and memory
    inter_bytes: float  # per rank and step, over groups that span nodes
    intra_bytes: float  # per rank and step, inside a node
    node_inter_bytes: float  # per node and step: what its network carries
    extra_bytes: float  # hpZ's secondary partition


def zeropp_bytes(psi: float, m: int, local: int, nodes: int, hpz: bool, qwz: bool, qgz: bool, grad_bytes: int,
                 w: int = 2, own: float = 0.0,
                 own_forward: int | None = None) -> tuple[float, float, float, list[tuple[str, float, int]]]:
    """(inter per rank, intra per rank, inter per node, [(link, bytes per rank, ring size)]) per step (docstring);
    ``own``: Ψ_own, gathered ``own_forward`` times in forwards (default m) and the rest of m in backwards."""
    nd = local * nodes
    spans = nodes > 1
    f = m if own_forward is None else own_forward
    fwd_el, bwd_el = m * (psi - own) + f * own, m * (psi - own) + (m - f) * own
    fwd = fwd_el * (1 + 4 / WEIGHT_BLOCK) if qwz else w * fwd_el
    parts = [("inter" if spans else "intra", fwd, nd)]
    parts.append(("intra", w * bwd_el, local) if hpz and spans
                 else ("inter" if spans else "intra", bwd_el * (1 + 4 / WEIGHT_BLOCK) if qwz else w * bwd_el, nd))
    if qgz:
        hop = m * psi * (0.5 + 4 / GRAD_BLOCK)
        parts.append(("intra", hop, local))
        if spans:
            parts.append(("a2a", hop / local, nodes))
    else:
        parts.append(("inter" if spans else "intra", m * grad_bytes * psi, nd))
    inter = sum(b for link, b, _ in parts if link in ("inter", "a2a"))
    intra = sum(b for link, b, _ in parts if link == "intra")
    node = sum(b * (local if link == "a2a" else 1) for link, b, _ in parts if link in ("inter", "a2a"))
    return inter, intra, node, parts


def _seconds(parts: list[tuple[str, float, int]], local: int, c: Cluster) -> float:
    node_link = c.gpu.inter_node_bytes_per_s * c.gpus_per_node
    t = 0.0
    for link, b, g in parts:
        ring = (g - 1) / g if g > 1 else 0.0
        if link == "intra":
            t += b * ring / c.gpu.intra_node_bytes_per_s
        elif link == "inter":
            t += b * ring / node_link
        else:  # qgZ's inter-node all-to-all: the node's L ranks send at once
            t += local * b * ring / node_link
    return t


def _local(lay: Layout, c: Cluster) -> int:
    """ZeRO (dp x cp) ranks per node: the grid's stride between them is tp."""
    return min(lay.dp * lay.cp, max(1, c.gpus_per_node // lay.tp))


def spans_nodes(lay: Layout, c: Cluster) -> bool:
    """Whether the layout's ZeRO group spans nodes with several of its ranks on each (the case ZeRO++ is for)."""
    return 1 < _local(lay, c) < lay.dp * lay.cp


def rank_zeropp(model: ModelConfig, lay: Layout, global_batch: int, c: Cluster, precision: str = "bf16",
                settings: dict[str, tuple[bool, bool, bool]] = SETTINGS) -> list[ZeroppPlan]:
    """Every ZeRO++ setting on the ZeRO-3 layout ``lay``, fastest first (module docstring)."""
    if lay.zero_stage != 3:
        raise ValueError(f"ZeRO++ applies to ZeRO stage 3 layouts, got stage {lay.zero_stage}")
    base = evaluate(model, lay, global_batch, c, precision)
    nd = lay.dp * lay.cp
    local = _local(lay, c)
    nodes = max(1, nd // local)
    w = ELEMENT_BYTES[precision]
    grad_bytes = grad_dtype_for(precision).itemsize  # as evaluate counts them: bf16 reduces in fp32 (DESIGN.md)
    m = global_batch // (lay.micro_batch_size * lay.dp)
    psi, own, rank = rank_dp_numels(model, lay)  # the rank that moves the most over DP
    f = own_forward_gathers(lay, rank, m) if m else 0
    out = []
    for name, (hpz, qwz, qgz) in settings.items():
        if hpz and local == 1:  # no node partner to partition over: hpZ would be a whole 16-bit copy
            continue
        inter, intra, node, parts = zeropp_bytes(psi, m, local, nodes, hpz, qwz, qgz, grad_bytes, w, own, f)
        dp_s = _seconds(parts, local, c) * (1.0 - c.dp_overlap)
        t: StepTime = replace(base.time, dp_comm=dp_s)
        extra = w * psi / local if hpz and nodes > 1 else 0.0
        plan = replace(base, time=t, peak_bytes=base.peak_bytes + extra, dp_bytes=inter + intra,
                       fits=base.peak_bytes + extra <= c.usable_memory_bytes)
        out.append(ZeroppPlan(name, plan, inter, intra, node, extra))
    return sorted(out, key=lambda z: z.plan.time.total)
