"""Autograd communication primitives for tensor parallelism (the Megatron paper's "f" and "g" operators).

Each takes the TP :class:`~megazero.distributed.group.Group` explicitly. With a group of size 1 every one of them is
the identity, so the same model code runs unsharded.

==========================  =========================  ===========================
function                    forward                    backward
==========================  =========================  ===========================
copy_to_tp_region           identity                   all-reduce
reduce_from_tp_region       all-reduce                 identity
scatter_to_tp_region        keep this rank's last-dim  all-gather along last dim
                            chunk
gather_from_tp_region       all-gather along last dim  keep this rank's chunk
scatter_to_sequence_        keep this rank's chunk of  all-gather along sequence
  parallel_region           the sequence
gather_from_sequence_       all-gather along sequence  reduce-scatter along sequence
  parallel_region
reduce_scatter_to_sequence_ reduce-scatter along       all-gather along sequence
  parallel_region           sequence
==========================  =========================  ===========================

Sequence-parallel regions (Korthikanti et al., 2205.05198) hold activations shaped [B, S/tp, H]: the sequence
dimension is dim 1 throughout megazero. A collective works on a flat buffer with one rank's chunk after another
("rank-major", [tp, B, S/tp, ...]), so a sequence all-gather or reduce-scatter costs exactly one reordering copy
of its full-sequence side when B > 1 and none when B == 1 (where rank-major and [B, S, ...] coincide); its
sequence-shard side is used in place. Megatron-LM avoids even that copy by keeping activations [S, B, H]; we
keep [B, S, H] for readable model code (the copy is one pass over memory beside a GEMM).

The ``*_async`` helpers start a collective and return a :class:`Pending`, waited on later: the column-parallel
backward (``layers._ColumnLinear``) computes its weight gradient while its input gradient is being reduced.
"""

from __future__ import annotations

import torch

from megazero.distributed.group import Group

__all__ = [
    "SEQ_DIM",
    "Pending",
    "all_reduce_async",
    "copy_to_tp_region",
    "gather_from_sequence_parallel_region",
    "gather_sequence",
    "gather_sequence_async",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "reduce_scatter_sequence",
    "reduce_scatter_sequence_async",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "sum_shared_rows_grad",
]

SEQ_DIM = 1  # activations are [batch, sequence, hidden]


class Pending:
    """A collective in flight: :meth:`wait` waits for it and returns its result (what the blocking call would)."""

    def __init__(self, work, finish) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
        return self._finish()


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    return all_reduce_async(x, group).wait()


def all_reduce_async(x: torch.Tensor, group: Group) -> Pending:
    """Start an all-reduce of ``x`` (in place when contiguous) over the group (no autograd); ``wait()`` it."""
    x = x.contiguous()
    return Pending(group.all_reduce(x, tag="act", async_op=True), lambda: x)


def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty((group.size, *x.shape), dtype=x.dtype, device=x.device)
    group.all_gather_into(out.view(-1), x.view(-1), tag="act")
    return torch.cat(out.unbind(0), dim=-1)


def _check_seq_divisible(x: torch.Tensor, group: Group) -> None:
    if x.shape[SEQ_DIM] % group.size:
        raise ValueError(f"sequence length {x.shape[SEQ_DIM]} is not divisible by the tensor-parallel size "
                         f"{group.size}; sequence parallelism needs --seq-len divisible by --tp")


def _split_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    _check_seq_divisible(x, group)
    return x.chunk(group.size, dim=SEQ_DIM)[group.rank].contiguous()


def _rank_major(x: torch.Tensor, tp: int) -> torch.Tensor:
    """[B, S, ...] as the flat buffer a sequence collective works on: rank r's chunk [B, S/tp, ...] after rank
    r - 1's. One copy when B > 1 (the sequence is dim 1); a view of a contiguous tensor when B == 1."""
    b, s = x.shape[0], x.shape[SEQ_DIM]
    if b == 1:
        return x.contiguous().view(-1)
    return x.reshape(b, tp, s // tp, *x.shape[2:]).transpose(0, 1).contiguous().view(-1)


def _batch_major(flat: torch.Tensor, shard_shape: torch.Size, tp: int) -> torch.Tensor:
    """The inverse of :func:`_rank_major`: the flat rank-major buffer of ``tp`` shards as [B, S, ...] (one
    copy when B > 1, a view when B == 1)."""
    b, s, rest = shard_shape[0], shard_shape[SEQ_DIM], tuple(shard_shape[2:])
    if b == 1:
        return flat.view(1, tp * s, *rest)
    return flat.view(tp, b, s, *rest).transpose(0, 1).reshape(b, tp * s, *rest)


def gather_sequence_async(x: torch.Tensor, group: Group) -> Pending:
    """Start the all-gather of sequence shards [B, S/tp, ...] into [B, S, ...] (no autograd); ``wait()`` it."""
    x = x.contiguous()
    out = torch.empty(group.size * x.numel(), dtype=x.dtype, device=x.device)
    work = group.all_gather_into(out, x.view(-1), tag="act", async_op=True)
    return Pending(work, lambda: _batch_major(out, x.shape, group.size))


def gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-gather sequence shards [B, S/tp, ...] into [B, S, ...] (no autograd)."""
    return gather_sequence_async(x, group).wait()


def reduce_scatter_sequence_async(x: torch.Tensor, group: Group) -> Pending:
    """Start summing [B, S, ...] over the group into this rank's sequence shard [B, S/tp, ...] (no autograd);
    ``wait()`` it. The shard is written straight into a contiguous [B, S/tp, ...] tensor."""
    _check_seq_divisible(x, group)
    shape = (x.shape[0], x.shape[SEQ_DIM] // group.size, *x.shape[2:])
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    work = group.reduce_scatter(out.view(-1), _rank_major(x, group.size), tag="act", async_op=True)
    return Pending(work, lambda: out)


def reduce_scatter_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum [B, S, ...] over the group and keep this rank's sequence shard [B, S/tp, ...] (no autograd)."""
    return reduce_scatter_sequence_async(x, group).wait()


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_seq(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_sequence(g, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        # the consumer is tensor-parallel, so each rank holds a partial gradient: sum and keep our chunk
        return reduce_scatter_sequence(g, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, g):
        return gather_sequence(g, ctx.group), None


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


@torch.compiler.disable
def _apply(fn: type[torch.autograd.Function], x: torch.Tensor, group: Group) -> torch.Tensor:
    """``fn.apply(x, group)`` run eagerly: under ``torch.compile`` a block splits into graphs here, since the
    collective and the ledger's Python counters are side effects Dynamo must not trace (it would recompile
    on every call)."""
    return fn.apply(x, group)


def copy_to_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel layer)."""
    return x if group is None or group.size == 1 else _apply(_CopyToTP, x, group)


def reduce_from_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """All-reduce forward, identity backward (output of a row-parallel layer)."""
    return x if group is None or group.size == 1 else _apply(_ReduceFromTP, x, group)


def scatter_to_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Keep this rank's chunk of the last dimension; all-gather the gradient."""
    return x if group is None or group.size == 1 else _apply(_ScatterToTP, x, group)


def gather_from_tp_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """All-gather along the last dimension; keep this rank's chunk of the gradient."""
    return x if group is None or group.size == 1 else _apply(_GatherFromTP, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Keep this rank's chunk of the sequence [B, S/tp, ...]; all-gather the gradient."""
    return x if group is None or group.size == 1 else _apply(_ScatterToSP, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """All-gather the sequence [B, S, ...] (input of a TP layer); reduce-scatter the gradient."""
    return x if group is None or group.size == 1 else _apply(_GatherFromSP, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    """Sum partial outputs over the group, keeping this rank's sequence chunk; all-gather the gradient."""
    return x if group is None or group.size == 1 else _apply(_ReduceScatterToSP, x, group)


class _SumSharedRowsGrad(torch.autograd.Function):
    """Identity on a column-parallel weight (or bias) whose rows from ``start`` on are shared by the ranks of
    ``group`` (K/V heads replicated over TP ranks); backward sums those rows' gradient over ``group`` (in place,
    on the gradient this layer alone produced), as :func:`copy_to_tp_region` sums an input's gradient.

    Gradients are not materialised: in a zero-bubble B pass the layer defers its weight gradient and hands back
    None, and then the sum is not run either (it runs in W, on the gradient W produces)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, start: int, group: Group) -> torch.Tensor:
        ctx.start, ctx.group = start, group
        ctx.set_materialize_grads(False)
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:  # the weight gradient was deferred to W (or this rank has none): nothing to sum now
            return None, None, None
        grad = grad.contiguous()
        ctx.group.all_reduce(grad[ctx.start:], tag="kv_grad")  # dim 0's tail: one contiguous run
        return grad, None, None


@torch.compiler.disable
def sum_shared_rows_grad(t: torch.Tensor, start: int, group: Group) -> torch.Tensor:
    """``t`` itself, its rows ``start:`` gradient summed over ``group`` in backward; eager under torch.compile.

    On a split-backward rank (``t.wgrad_store``, :mod:`.weight_grad`) the output carries the store, so the
    layer that consumes it still defers its weight GEMM to W, and ``wgrad_leaf`` = ``t``, so W orders it by
    its parameter; W then hands its gradient to this output, whose backward (the sum, then ``t``'s
    accumulation) runs in W too."""
    out = _SumSharedRowsGrad.apply(t, start, group)
    store = getattr(t, "wgrad_store", None)
    if store is not None:
        out.wgrad_store, out.wgrad_leaf = store, getattr(t, "wgrad_leaf", t)
    return out
