"""Autograd communication primitives for tensor parallelism (the Megatron paper's "f" and "g" operators).

Each takes the TP :class:`~megazero.distributed.Group` explicitly. With a group of size 1 every one of them is
the identity, so the same model code runs unsharded.

==========================  =========================  ===========================
function                    forward                    backward
==========================  =========================  ===========================
copy_to_tp_region           identity                   all-reduce
reduce_from_tp_region       all-reduce                 identity
scatter_to_tp_region        keep this rank's last-dim  all-gather along last dim
                            chunk
gather_from_tp_region       all-gather along last dim  keep this rank's chunk
==========================  =========================  ===========================
"""

from __future__ import annotations

import torch

from megazero.distributed import Group

__all__ = [
    "copy_to_tp_region",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
]


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    group.all_reduce(x, tag="act")
    return x


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((group.size, *x.shape), dtype=x.dtype, device=x.device)
    group.all_gather_into(out.view(-1), x.view(-1), tag="act")
    return torch.cat(out.unbind(0), dim=-1)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.group), None


def copy_to_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""
    return x if group is None or group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel layer)."""
    return x if group is None or group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension; all-gather the gradient."""
    return x if group is None or group.size == 1 else _ScatterToTP.apply(x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """All-gather along the last dimension; keep this rank's chunk of the gradient."""
    return x if group is None or group.size == 1 else _GatherFromTP.apply(x, group)
