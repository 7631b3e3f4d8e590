"""One copy of the tied embedding's gradient in backward, not three (issue 31 item 1).

GPT-2's token embedding is also the LM head's weight. Left to autograd, backward holds the head's [V, H] weight
gradient until the lookup's backward has made its own, then adds the two out of place: three tables alive at once,
the peak of a small-batch step. ``megazero.tensor_parallel.weight_grad.TiedGrad`` makes the lookup add its rows into
the head's gradient instead, which autograd then takes as ``.grad`` without a copy.

Measured from the tensors: a dispatch mode counts the storages of exactly one table's gradient (model dtype,
this rank's vocabulary shard) that operators allocate and that are alive at once during backward. The same run
with the meeting point switched off (``GPT.forward`` builds none: autograd's own path, as before) is the control
that shows the count can see three. Gradients are compared with that control: plain backward in fp32 and bf16
with gradient accumulation, TP 2 with and without sequence parallelism, and ZeRO stages 0-3 at dp 2 (the reduced
gradient each rank owns). With few tokens the head's GEMM runs at the lookup's backward, so no table is held
through the blocks' backward (counted as the lookup's output gradient arrives). A zero-bubble B pass on such a
chunk still defers both uses to W, whose sum is checked.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megazero.config.schema import ModelConfig
from tests.dist import run_world

CFG = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=1000)


class TableCopies(TorchDispatchMode):
    """The most storages of exactly ``nbytes`` that operators allocate (not views, not in place) alive at once."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes, self.live, self.most = nbytes, set(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            if st.nbytes() == self.nbytes and id(st) not in inputs and id(st) not in self.live:
                self.live.add(id(st))
                weakref.finalize(st, self.live.discard, id(st))
                self.most = max(self.most, len(self.live))
        return out


@contextmanager
def autograd_sum():
    """The control: no meeting point, so autograd makes the table's two gradients and their sum (as before)."""
    with mock.patch("megazero.model.gpt.TiedGrad", lambda: None):
        yield


def _table_bytes(model) -> int:
    w = model.wte.weight
    return w.numel() * w.element_size()


def _backward_copies(model, ids, passes: int = 1, backward=None) -> tuple[int, torch.Tensor]:
    """(most table gradients made in one backward and alive at once, over ``passes`` forward+backward passes;
    the table's ``.grad``: later passes accumulate into it)."""
    most = 0
    for _ in range(passes):
        loss = model(ids, ids).float().mean()
        with TableCopies(_table_bytes(model)) as counter:
            (backward or torch.autograd.backward)(loss)
        most = max(most, counter.most)
    return most, model.wte.weight.grad


def _model(dtype=torch.float32, tp_group=None, sequence_parallel=False):
    from megazero.model import GPT, init_parameters

    model = GPT(CFG, tp_group, sequence_parallel=sequence_parallel)
    init_parameters(model, 0, tp_group)
    return model.to(dtype)


def test_plain_backward_holds_one_table_gradient():
    """fp32 and bf16, two micro-batches accumulated into ``.grad``: one table at a time (three in the control),
    the same gradient as the control (fp32 to rounding; bf16 to its precision)."""
    ids = torch.randint(0, CFG.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        most, grad = _backward_copies(_model(dtype), ids, passes=2)
        with autograd_sum():
            most_ctl, grad_ctl = _backward_copies(_model(dtype), ids, passes=2)
        assert (most, most_ctl) == (1, 3), (dtype, most, most_ctl)
        err = (grad.float() - grad_ctl.float()).norm() / grad_ctl.float().norm()
        assert err < tol, (dtype, err.item())




def _held_at_lookup(model, ids) -> tuple[int, torch.Tensor]:
    """(table gradients alive as the lookup's output gradient arrives, after every block's backward; the table's
    ``.grad``)."""
    held: list[int] = []

    def probe(_module, _args, out: torch.Tensor) -> None:
        out.register_hook(lambda _g: held.append(len(counter.live)))

    with TableCopies(_table_bytes(model)) as counter:
        handle = model.wte.register_forward_hook(probe)
        model(ids, ids).mean().backward()
        handle.remove()
    return held[0], model.wte.weight.grad


def test_short_batches_hold_the_head_gemm_inputs_through_the_blocks():
    """Where the head's weight-gradient GEMM inputs are smaller than the table (8 tokens: 8 x (1024 + 64) elements
    against 1024 x 64), the lookup's backward runs the GEMM: no table gradient is alive through the blocks'
    backward (one with 128 tokens, and in the control at both sizes); the gradient equals the control's."""
    gen = torch.Generator().manual_seed(2)
    for shape, want in (((1, 8), 0), ((4, 32), 1)):
        ids = torch.randint(0, CFG.vocab_size, shape, generator=gen)
        held, grad = _held_at_lookup(_model(), ids)
        with autograd_sum():
            held_ctl, grad_ctl = _held_at_lookup(_model(), ids)
        assert (held, held_ctl) == (want, 1), (shape, held, held_ctl)
        assert _rel(grad, grad_ctl) < 1e-6, shape

def test_split_backward_defers_both_uses_and_w_sums_them():
    """A zero-bubble B pass on a chunk holding both uses (the store checked before the meeting point): nothing
    reaches ``.grad`` in B, both uses are deferred, and W's table gradient equals a plain backward's."""
    from megazero.tensor_parallel import weight_grad

    ids = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    model = _model()
    model(ids, ids).mean().backward()
    want = model.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    store = weight_grad.WeightGradStore()
    store.attach(params)
    _, work = weight_grad.input_gradients(store, model(ids, ids).mean(), None, None, params)
    assert all(p.grad is None for p in params)
    assert sum(p is model.wte.weight for ps, _ in work.deferred for p in ps) == 2  # the lookup and the head
    got = {id(p): g for p, g in weight_grad.weight_gradients(work, params[::-1])}
    torch.testing.assert_close(got[id(model.wte.weight)], want, rtol=1e-6, atol=1e-6)

def _tp_and_zero(ctx) -> dict:
    from megazero.config.schema import OptimizerConfig, ZeroConfig
    from megazero.zero import ZeroOptimizer

    torch.set_num_threads(1)
    out = {}
    ids = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(ctx.dp_rank))
    if ctx.tp_size == 2:  # vocabulary-parallel table: the lookup's masked rows and the head's TP collective
        for sp in (False, True):
            runs = []
            for control in (False, True):
                with autograd_sum() if control else nullcontext():
                    runs.append(_backward_copies(_model(tp_group=ctx.tp_group, sequence_parallel=sp), ids))
            out[f"tp sp={sp}"] = (runs[0][0], runs[1][0], _rel(runs[0][1], runs[1][1]))
        return out
    for stage in (0, 1, 2, 3):  # dp 2: the stores' hooks take the one gradient; compare what each rank owns
        runs = []
        for control in (False, True):
            with autograd_sum() if control else nullcontext():
                model = _model()
                nbytes = _table_bytes(model)
                opt = ZeroOptimizer(model, ZeroConfig(stage=stage, stage3_param_persistence_threshold=1000),
                                    OptimizerConfig(), ctx.dp_group, precision="fp32")
                most = 0
                opt.zero_grad()
                for _ in range(2):  # gradient accumulation over two micro-batches
                    loss = model(ids, ids).mean()
                    with TableCopies(nbytes) as counter:
                        opt.backward(loss)
                    most = max(most, counter.most)
                opt.store.reduce_gradients()
                owned = torch.cat([s.grad.reshape(-1).float() for s in opt.store.segments])
                runs.append((most, owned.clone()))
        out[f"stage {stage}"] = (runs[0][0], runs[1][0], _rel(runs[0][1], runs[1][1]))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_tp_and_every_zero_stage_hold_one_table_gradient():
    """TP 2 (with and without SP) and ZeRO 0-3 at dp 2 with two micro-batches: one table gradient (this rank's
    shard) alive at a time in backward, three in the control; the gradients agree with the control to 1e-6."""
    results = run_world(_tp_and_zero, 2, tp=2, timeout=240) + run_world(_tp_and_zero, 2, timeout=240)
    for got in results:
        for what, (most, most_ctl, err) in got.items():
            assert (most, most_ctl) == (1, 3), (what, most, most_ctl)
            assert err < 1e-6, (what, err)
