"""Sequence parallelism's partial gradients, summed over TP once per step (Megatron-LM's ``finalize_model_grads``).

Under sequence parallelism the TP-replicated parameters of a sequence-parallel module (LayerNorm/RMSNorm
weights and biases, row-parallel biases, learned positions) act on this rank's sequence shard only, so each TP
rank holds a partial gradient and the true one is their sum. Summing is linear, so it commutes with gradient
accumulation over micro-batches and with the reduction over DP: it is done once per step, after both, as one
flat all-reduce of every such gradient together (a fixed number of calls per step, whatever the layers and
micro-batches; a hook per parameter would make a call per parameter per micro-batch).

The ZeRO optimizer does it in its ``prepare_step`` on the gradients this rank owns (their layout is the same on
every TP rank: each holds equal shapes); :func:`finalize_grads` does it on ``.grad`` for a model trained without
the optimizer (tests, benchmarks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megazero.distributed.group import Group

__all__ = ["all_reduce_coalesced", "finalize_grads", "sequence_parallel_grads"]


def sequence_parallel_grads(model: nn.Module) -> tuple[Group | None, list[nn.Parameter]]:
    """The TP group and the parameters whose gradients are partial over it: every TP-replicated parameter
    (``shard_spec.partition_dim is None``) of a module with ``sequence_parallel`` set and a TP group of more than
    one rank (the GPT chunks). ``(None, [])`` without sequence parallelism."""
    group: Group | None = None
    params: dict[int, nn.Parameter] = {}
    for m in model.modules():
        tp_group = getattr(m, "tp_group", None)
        if not getattr(m, "sequence_parallel", False) or tp_group is None or tp_group.size == 1:
            continue
        if group is not None and group.ranks != tp_group.ranks:
            raise ValueError(f"sequence-parallel modules over two TP groups: {group} and {tp_group}")
        group = tp_group
        for p in m.parameters():
            spec = getattr(p, "shard_spec", None)
            if p.requires_grad and spec is not None and spec.partition_dim is None:
                params.setdefault(id(p), p)
    return group, list(params.values())


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: Group, tag: str = "grad",
                         buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Sum ``tensors`` (one dtype, any devices) over ``group`` in place with one all-reduce of a flat buffer on
    the group's device. ``buffer`` is reused when it has the right size and dtype (pass back what this returns,
    so a step allocates nothing); returns the buffer."""
    n = sum(t.numel() for t in tensors)
    dtype = tensors[0].dtype
    if buffer is None or buffer.numel() != n or buffer.dtype != dtype:
        buffer = torch.empty(n, dtype=dtype, device=group.device)
    views = list(torch.split(buffer, [t.numel() for t in tensors]))
    views = [v.view_as(t) for v, t in zip(views, tensors)]
    torch._foreach_copy_(views, list(tensors), non_blocking=True)  # one launch, not one copy per tensor
    group.all_reduce(buffer, tag=tag)
    torch._foreach_copy_(list(tensors), views)  # the sums back into the gradients
    return buffer


def finalize_grads(model: nn.Module) -> None:
    """Sum the partial ``.grad`` of ``model``'s sequence-parallel replicated parameters over TP (one call); a
    no-op without sequence parallelism. For training without the ZeRO optimizer, after the step's backwards."""
    group, params = sequence_parallel_grads(model)
    grads = [p.grad for p in params if p.grad is not None]
    if group is not None and grads:
        all_reduce_coalesced(grads, group)
