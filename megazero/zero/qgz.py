"""qgZ: ZeRO++'s gradient reduce-scatter as a hierarchical all-to-all of block-quantized gradients, and the
bytes ZeRO++ moves per link.

**The reduction** (:func:`qgz_reduce_scatter`). The ZeRO group of Nd = M·L ranks spans M nodes with L members
each; ZeRO rank d = a·L + i sits on node a at position i (nodes are blocks of consecutive ranks) and owns slice d
of the rank-major input (Nd slices of n values).

1. *Intra-node all-to-all.* Slice (b, k) is owned by position k of node b, so the slices bound for node peer k
   are {(b, k) : b < M}: the input read as ``[M, L, n]`` and swapped to ``[L, M, n]`` puts them together. The
   swap is read by the quantizer itself (INT4, or INT8 by flag, blocks of
   :data:`~megazero.zero.quantize.GRAD_BLOCK` per slice), so no reordered copy of the bucket is made. Values
   and fp32 scales go to the node's peers (``<zero group>.intra``).
2. *Dequantize and reduce in fp32*: this rank now holds its node's L contributions to the M slices
   {(b, i) : b < M}, and sums them.
3. *Re-quantize* the M partial sums.
4. *Inter-node all-to-all* over the ranks at position i of every node (``<zero group>.inter``): slice (b, i)
   goes to node b. Each rank dequantizes the M partial sums of its own slice and adds them in fp32.

Every reduction is in fp32 on dequantized values, so the quantization error of the two hops adds once each
instead of compounding over a ring's Nd - 1 steps. A block holding inf or NaN dequantizes to NaN (its scale is
not finite), so the optimizer's non-finite check still skips the step on every rank.

**Bytes per step and link** (one micro-batch, the ledger's per-rank count: a collective's volume is inter-node
when its group spans nodes). Let Ψ be the elements of the gathered units (padded), 16-bit weights and, for the
formulas, 16-bit gradients (``--grad-dtype model`` under bf16; fp32 gradients double the reduce-scatter's term);
s the scale bytes of quantizing each rank's slices in blocks (4 bytes per block, blocks counted per slice).

=====================  ================================  =====================  ==========================
setting                per-rank inter-node               per-node inter-node    intra-node per rank
=====================  ================================  =====================  ==========================
ZeRO-3                 2Ψ + 2Ψ + 2Ψ = 6Ψ  (3Ψ 16-bit)     6Ψ                     0
+ hpZ                  2Ψ (fwd) + 2Ψ (grad) = 4Ψ          4Ψ                     2Ψ (bwd gather)
+ hpZ + qwZ            Ψ + s_w (fwd INT8) + 2Ψ            3Ψ + s_w               2Ψ
+ hpZ + qwZ + qgZ      Ψ + s_w + Ψ/(2L) + s_g'            Ψ + s_w + Ψ/2 + L·s_g' 2Ψ + Ψ/2 + s_g
=====================  ================================  =====================  ==========================

(bytes; "16-bit" units are bytes / 2). The paper's 3Ψ -> 2Ψ -> 1.5Ψ -> 0.75Ψ (in 16-bit units) is the *per-node*
column: a flat collective's ring crosses the node boundary once with its per-rank volume, so for ZeRO-3, hpZ and
qwZ per-node = per-rank; qgZ's inter-node all-to-all runs over L groups side by side (one rank per node each),
each rank sending Ψ/L INT4 values (Ψ/(2L) bytes), so the node sends L·Ψ/(2L) = Ψ/2 bytes = 0.25Ψ 16-bit. The
ledger keeps both (:meth:`~megazero.distributed.ledger.CommLedger.node_share_last_step`). The intra-node hop
moves the whole gradient in INT4 (Ψ/2 bytes) plus its scales s_g; the inter-node hop's scales s_g' are those of
the M partial sums.
"""

from __future__ import annotations

import torch

from megazero.distributed.group import Group, _Done
from megazero.zero.quantize import GRAD_BLOCK, dequantize, quantize

__all__ = ["QuantizedReduce", "qgz_reduce_scatter"]


def qgz_reduce_scatter(flat: torch.Tensor, intra: Group, inter: Group, bits: int = 4,
                       block: int = GRAD_BLOCK) -> torch.Tensor:
    """Sum the rank-major ``flat`` (Nd = inter.size x intra.size slices) over the ZeRO group and return this rank's
    slice reduced in fp32 (module docstring). Blocking; every rank of the group calls it with equal shapes."""
    nodes, local = inter.size, intra.size
    n = flat.numel() // (nodes * local)
    if local == 1:  # one member per node: nothing to reduce inside the node
        partial = flat.view(nodes, n).float()
    else:  # 1. slices bound for node peer k together: [M, L, n] read as [L, M, n] by the quantizer, per slice
        values, scales = quantize(flat.view(nodes, local, n).transpose(0, 1), bits, block)
        got_v, got_s = torch.empty_like(values), torch.empty_like(scales)
        intra.all_to_all(got_v, values, tag="grad")
        intra.all_to_all(got_s, scales, tag="grad")
        # 2. the node's L contributions to slices (b, i), b < M: dequantized, summed in fp32
        partial = dequantize(got_v, got_s, bits, block, n).view(local, nodes, n).sum(dim=0)
    if nodes == 1:
        return partial.view(n)
    # 3. re-quantize; 4. partial sum b to node b, this slice's M partial sums back, summed in fp32
    values, scales = quantize(partial, bits, block)
    got_v, got_s = torch.empty_like(values), torch.empty_like(scales)
    inter.all_to_all(got_v, values, tag="grad")
    inter.all_to_all(got_s, scales, tag="grad")
    return dequantize(got_v, got_s, bits, block, n).sum(dim=0)



class QuantizedReduce:
    """qgZ in the place of a group's reduce-scatter: ``reduce_scatter(mine, flat)`` as
    :meth:`Group.reduce_scatter <megazero.distributed.group.Group.reduce_scatter>` with ``mine`` this rank's slice
    of ``flat`` (blocking; the handle is already done). Like NCCL's in-place reduce-scatter it writes ``mine`` only;
    with the group's ``poison`` (the test worlds) the rest of ``flat`` becomes NaN, so nothing may read it."""

    def __init__(self, group: Group, intra: Group, inter: Group, bits: int, block: int = GRAD_BLOCK) -> None:
        self.group, self.intra, self.inter, self.bits, self.block = group, intra, inter, bits, block

    @classmethod
    def from_config(cls, cfg, group: Group) -> QuantizedReduce | None:
        """qgZ over ``group``'s node groups (``ParallelContext.configure_nodes``) when ``cfg`` (a ZeroConfig) asks."""
        if not cfg.zero_quantized_gradients or group.size == 1:
            return None
        nodes = getattr(group, "nodes", None)
        if nodes is None:
            raise ValueError("qgZ needs the ZeRO group's node groups: call ctx.configure_nodes(ranks_per_node) "
                             "before building the optimizer")
        return cls(group, nodes.intra, nodes.inter, cfg.zero_quantized_gradients_bits)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum", tag: str = "grad",
                       async_op: bool = False):
        if op != "sum":
            raise ValueError(f"qgZ reduces by sum, not {op!r}")
        self.group.check_device("reduce_scatter", tag, output, input)
        flat = input.view(-1)
        output.copy_(qgz_reduce_scatter(flat, self.intra, self.inter, self.bits, self.block))
        if self.group.poison and input.is_floating_point():
            n, lo = output.numel(), self.group.rank * output.numel()
            flat[:lo].fill_(float("nan"))
            flat[lo + n:].fill_(float("nan"))
        return _Done() if async_op else None
