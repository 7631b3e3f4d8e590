"""Tensor parallelism on a GPU's terms, checked on the CPU: the column-parallel backward issues its collective
asynchronously and computes the weight gradient before waiting on it (Megatron-LM's
``LinearWithGradAccumulationAndAsyncCommunication``); sequence parallelism's replicated gradients (LayerNorms,
row-parallel biases, positions) are all-reduced over TP once per step, in one coalesced call
(``finalize_model_grads``), however many layers and micro-batches the step has; both keep parity."""

from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.distributed.group import Group
from megazero.tensor_parallel import ColumnParallelLinear, shard_full_tensor
from megazero.tensor_parallel.mappings import _batch_major, _rank_major, scatter_to_sequence_parallel_region
from tests.dist import run_world


class _SpyGroup(Group):
    """A TP group that logs each collective as it is issued (and whether async) and each wait on it."""

    events: list

    def _spy(self, op: str, call, *args, async_op: bool = False, **kw):
        self.events.append(("issue", op, async_op))
        work = call(*args, async_op=async_op, **kw)
        if not async_op:
            return work
        events = self.events

        class _Work:
            def wait(self):
                events.append(("wait", op))
                return work.wait()

        return _Work()

    def all_reduce(self, *args, **kw):
        return self._spy("all_reduce", super().all_reduce, *args, **kw)

    def all_gather_into(self, *args, **kw):
        return self._spy("all_gather", super().all_gather_into, *args, **kw)

    def reduce_scatter(self, *args, **kw):
        return self._spy("reduce_scatter", super().reduce_scatter, *args, **kw)


class _GemmLog(TorchDispatchMode):
    """Appends ("mm", output shape) to ``events`` for every matrix multiply."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in ("mm", "addmm", "bmm"):
            self.events.append(("mm", tuple(out.shape)))
        return out


def _backward_order(ctx) -> dict:
    """Per (sequence_parallel, micro-batch size): the backward's events, the weight-gradient shape, parity."""
    spy = copy.copy(ctx.tp_group)
    spy.__class__ = _SpyGroup
    B, S, H, OUT = 2, 8, 16, 24
    gen = torch.Generator().manual_seed(0)
    x_full, w, b = torch.randn(B, S, H, generator=gen), torch.randn(OUT, H, generator=gen), torch.randn(OUT, generator=gen)
    out = {}
    for sp in (False, True):
        for micro in (1, 2):
            col = ColumnParallelLinear(H, OUT, spy, sequence_parallel=sp)
            with torch.no_grad():
                col.weight.copy_(shard_full_tensor(w, col.weight.shard_spec, spy.rank, spy.size))
                col.bias.copy_(shard_full_tensor(b, col.bias.shard_spec, spy.rank, spy.size))
            x = x_full[:micro].clone().requires_grad_()
            y = col(scatter_to_sequence_parallel_region(x, spy) if sp else x)
            spy.events = []
            with _GemmLog(spy.events):
                y.square().sum().backward()
            ref_x, ref_w = x_full[:micro].clone().requires_grad_(), w.clone().requires_grad_()
            torch.nn.functional.linear(ref_x, ref_w, b).square().sum().backward()
            want_w = shard_full_tensor(ref_w.grad, col.weight.shard_spec, spy.rank, spy.size)
            ok = torch.allclose(x.grad, ref_x.grad, atol=1e-5) and torch.allclose(col.weight.grad, want_w, atol=1e-5)
            out[(sp, micro)] = (spy.events, tuple(col.weight.shape), ok)
    return out


def test_column_backward_computes_the_weight_gradient_while_its_collective_runs():
    for (sp, micro), (events, w_shape, parity) in run_world(_backward_order, 2, tp=2)[0].items():
        assert parity, (sp, micro)
        op = "reduce_scatter" if sp else "all_reduce"
        issued = events.index(("issue", op, True))  # issued asynchronously
        waited = events.index(("wait", op))
        grad_w = events.index(("mm", w_shape))
        assert issued < grad_w < waited, (sp, micro, events)
        if sp:  # the input's all-gather runs while the input gradient's GEMM does
            gathered, gather_waited = events.index(("issue", "all_gather", True)), events.index(("wait", "all_gather"))
            assert gathered < next(i for i, e in enumerate(events) if e[0] == "mm") < gather_waited < issued, events


def test_sequence_collectives_copy_nothing_at_micro_batch_one():
    """Rank-major and [B, S, H] coincide at B == 1: the flat buffers are views; at B > 1 one reordering copy."""
    x = torch.randn(1, 8, 4)
    assert _rank_major(x, 2).data_ptr() == x.data_ptr()
    flat = torch.randn(2 * 4 * 4)
    assert _batch_major(flat, torch.Size((1, 4, 4)), 2).data_ptr() == flat.data_ptr()
    x2 = torch.randn(2, 8, 4)
    back = _batch_major(_rank_major(x2, 2), torch.Size((2, 4, 4)), 2)
    assert torch.equal(back, x2)


def _sp_grad_collectives(ctx, cache: str, log_dir: str) -> dict:
    """Per (layers, micro-batches per step): TP all-reduce calls and elements of gradients per step."""
    from megazero.config.cli import parse_args
    from megazero.train.loop import run_training
    from tests.common import SMALL_FLAGS

    key, out, steps = ("tp", "all_reduce", "grad"), {}, 2
    for layers in (2, 4):
        for micro in (1, 2):
            flags = [*SMALL_FLAGS, "--num-layers", str(layers), "--tp", "2", "--sequence-parallel",
                     "--micro-batch-size", str(8 // micro), "--global-batch-size", "8", "--train-steps", str(steps),
                     "--cache-dir", cache, "--log-dir", f"{log_dir}/{layers}-{micro}"]
            calls, elements = ctx.ledger.calls.get(key, 0), ctx.ledger.totals.get(key, 0)
            run_training(parse_args(flags).resolve(ctx.world_size), ctx)
            out[(layers, micro)] = ((ctx.ledger.calls[key] - calls) / steps, (ctx.ledger.totals[key] - elements) / steps)
    return out


def test_sequence_parallel_gradients_are_all_reduced_once_per_step(data_cache, tmp_path):
    """tp 2 + SP, 2 vs 4 layers, 1 vs 2 micro-batches: one TP all-reduce of gradients per step, carrying every
    replicated parameter once (2n elements: per layer two LayerNorms and two row biases, 6H; ln_f 2H; positions
    S x H), whatever the micro-batches."""
    H, S = 64, 32
    for (layers, micro), (calls, elements) in run_world(_sp_grad_collectives, 2, data_cache, str(tmp_path), tp=2)[0].items():
        assert calls == 1, (layers, micro, calls)
        assert elements == 2 * ((6 * layers + 2) * H + S * H), (layers, micro, elements)
