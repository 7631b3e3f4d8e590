"""The fused vocab-parallel cross-entropy: equal to PyTorch's on the unsharded logits at tp 1, 2 and 4 (fp32 and
bf16, forward and gradient, both backends: eager and the Triton kernels under Triton's CPU interpreter), with the
padded vocabulary never read, one collective per call, a dispatched-op count that does not grow with the tokens,
and no fp32 copy of the whole vocabulary's logits. The implementation it replaced is kept here as
:func:`chunked_loss_before` (the negative control of the op count, and the baseline of bench/ce_bench.py)."""

from __future__ import annotations

import ast
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.distributed.device_io import same_data
from megazero.observe.memory import ActivationMemoryCounter
from megazero.tensor_parallel import (
    IGNORE_INDEX,
    VocabParallelEmbedding,
    ce_triton,
    vocab_parallel_cross_entropy,
)
from tests.dist import run_world

ROOT = Path(__file__).resolve().parent.parent
N = 37  # tokens
CASES = ((1000, 1024), (129, 512))  # (vocabulary, padded); the second at tp 4: 128, 1, 0 and 0 real columns a rank
BACKENDS = ("eager", "triton") if ce_triton.available() else ("eager",)
BF16_GRAD_RTOL = 2.0**-8  # one bf16 rounding (to nearest) of an fp32-exact gradient
# Triton's interpreter casts fp32 to bf16 by truncation (the compiled kernel rounds to nearest): one whole ulp
INTERPRETED_BF16_GRAD_RTOL = 2.0**-7
VARIANTS = ((False, True), (True, True), (False, False))  # (gradient in place, padding skipped rather than -inf)


def _case(v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpadded logits [N, v] (one row large, to exercise the max shift), targets at both ends of the vocabulary
    and ignored ones, and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, v, generator=g, dtype=torch.float64) * 4
    logits[5] += 80.0  # a row whose exp would overflow without the shift
    target = torch.randint(0, v, (N,), generator=g)
    target[0], target[1], target[2], target[7] = 0, v - 1, IGNORE_INDEX, IGNORE_INDEX
    grad = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    return logits.float(), target, grad.float()


def _reference(logits: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, dtype=torch.float32):
    """PyTorch's cross-entropy on the whole unpadded vocabulary."""
    x = logits.to(dtype, copy=True).requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=IGNORE_INDEX, reduction="none")
    loss.backward(grad.to(dtype))
    return loss.detach(), x.grad


def _padded_slice(full: torch.Tensor, padded: int, rank: int, size: int, fill: float) -> torch.Tensor:
    """This rank's columns of ``full`` padded with ``fill`` to ``padded`` columns."""
    pad = full.new_full((full.shape[0], padded - full.shape[1]), fill)
    return torch.cat([full, pad], dim=-1).chunk(size, dim=-1)[rank].contiguous()


def _ours(x_full, target, grad, tp, padded, *, backend, inplace, skip_padding, vocab_start=None):
    """Our loss and gradient of this rank's slice. ``skip_padding``: padded columns hold large finite values and
    the loss is told the real vocabulary (the model's way); else they hold -inf (the caller's mask)."""
    v = x_full.shape[1]
    x = _padded_slice(x_full, padded, tp.rank, tp.size, 1e4 if skip_padding else float("-inf")).requires_grad_()
    kept = x.detach().clone()
    y = x * 1.0 if inplace else x  # in place, the gradient overwrites the logits: give it an intermediate
    start = tp.rank * padded // tp.size if vocab_start is None else vocab_start
    loss = vocab_parallel_cross_entropy(y, target, tp, vocab_start=start, vocab_size=v if skip_padding else None,
                                        inplace_backward=inplace, backend=backend)
    (g,) = torch.autograd.grad(loss, y, grad)
    assert same_data(g, y) == inplace  # in place: the gradient is written over the logits
    assert torch.equal(x.detach(), kept)  # the caller's logits are untouched
    assert g.dtype == x.dtype
    return loss.detach(), g


def _spy_collectives(group) -> Counter:
    """Count this group's collective calls from now on (instance attributes over the bound methods)."""
    calls: Counter = Counter()

    def spy(name: str):
        orig = getattr(group, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return orig(*args, **kwargs)
        return counted

    for name in ("all_reduce", "all_gather_into", "all_gather_list", "reduce_scatter", "broadcast"):
        setattr(group, name, spy(name))
    return calls


def _check(ctx, backends: tuple[str, ...]) -> int:
    tp = ctx.tp_group
    calls = _spy_collectives(tp)
    checks = 0
    for v, padded in CASES:
        logits, target, grad = _case(v)
        ref32_loss, ref32_grad = _reference(logits, target, grad)
        ref64_loss, _ = _reference(logits, target, grad, torch.float64)
        bf = logits.to(torch.bfloat16)
        refbf_loss, refbf_grad = _reference(bf, target, grad, torch.float64)  # exact maths on the bf16 values
        n_real = min(max(v - tp.rank * padded // tp.size, 0), padded // tp.size)
        for backend in backends:
            # the interpreter is slow: one variant per case there, a different one per case and rank
            chosen = VARIANTS if backend == "eager" else [VARIANTS[(v + tp.rank) % len(VARIANTS)]]
            for inplace, skip in chosen:
                before = calls.copy()
                loss, g = _ours(logits, target, grad, tp, padded, backend=backend, inplace=inplace, skip_padding=skip)
                # one collective per call: the all-gather of [lse, target logit]; none at tp 1, none in backward
                assert calls - before == (Counter(all_gather_into=1) if tp.size > 1 else Counter())
                torch.testing.assert_close(loss, ref32_loss, rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(loss.double(), ref64_loss, rtol=1e-6, atol=1e-6)
                want = _padded_slice(ref32_grad, padded, tp.rank, tp.size, 0.0)
                torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)
                assert torch.count_nonzero(g[:, n_real:]) == 0  # padding: no gradient
                assert torch.count_nonzero(g[target == IGNORE_INDEX]) == 0
                assert torch.count_nonzero(loss[target == IGNORE_INDEX]) == 0
                # bf16 logits: fp32 arithmetic, the loss to fp32 rounding, the gradient to one bf16 rounding
                loss, g = _ours(bf, target, grad, tp, padded, backend=backend, inplace=inplace, skip_padding=skip)
                torch.testing.assert_close(loss.double(), refbf_loss, rtol=1e-6, atol=1e-5)
                want = _padded_slice(refbf_grad, padded, tp.rank, tp.size, 0.0)
                rtol = INTERPRETED_BF16_GRAD_RTOL if backend == "triton" else BF16_GRAD_RTOL
                torch.testing.assert_close(g.double(), want, rtol=rtol, atol=1e-7)
                assert torch.count_nonzero(g[:, n_real:]) == 0
                checks += 1
    # negative controls, each of which the tolerances above must catch:
    v, padded = CASES[1]
    logits, target, grad = _case(v)
    ref_loss, _ = _reference(logits, target, grad)
    # (1) the padded columns (zeros, as the model's raw logits hold) counted as words
    loss = vocab_parallel_cross_entropy(_padded_slice(logits, padded, tp.rank, tp.size, 0.0), target, tp,
                                        tp.rank * padded // tp.size, backend="eager")
    assert not torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    # (2) the bf16 loss of plain F.cross_entropy (bf16 log-softmax) against the fp32-accumulated bf16 tolerance
    bf = logits.to(torch.bfloat16)
    refbf_loss, refbf_grad = _reference(bf, target, grad, torch.float64)
    naive = F.cross_entropy(bf, target, ignore_index=IGNORE_INDEX, reduction="none")
    assert not torch.allclose(naive.double(), refbf_loss, rtol=1e-6, atol=1e-5)
    # (3) a gradient from a log-sum-exp kept in bf16, against the looser (interpreted) bf16 gradient tolerance
    lse = torch.logsumexp(bf.double(), -1).to(torch.bfloat16).double()
    wrong = (bf.double() - lse[:, None]).exp() - F.one_hot(target.clamp(min=0), v)
    wrong = (wrong * grad[:, None].double()).masked_fill((target == IGNORE_INDEX)[:, None], 0).to(torch.bfloat16)
    assert not torch.allclose(wrong.double(), refbf_grad, rtol=INTERPRETED_BF16_GRAD_RTOL, atol=1e-7)
    # batched shape [B, S, V/tp] -> [B, S]
    logits, target, _ = _case(1000)
    x = _padded_slice(logits[:36], 1024, tp.rank, tp.size, 0.0).view(4, 9, -1)
    loss = vocab_parallel_cross_entropy(x, target[:36].view(4, 9), tp, tp.rank * 1024 // tp.size, 1000)
    torch.testing.assert_close(loss, _reference(logits, target, grad)[0][:36].view(4, 9), rtol=1e-6, atol=1e-6)
    return checks + 1


def parity_worlds() -> list[list[int]]:
    """The parity checks at tp 1, 2 and 4; each rank returns how many configurations it checked."""
    return [run_world(_check, 1, BACKENDS), run_world(_check, 2, BACKENDS, tp=2),
            run_world(_check, 4, BACKENDS, tp=4)]


def test_equals_pytorch_cross_entropy_at_tp_1_2_4():
    """In a fresh process with ``TRITON_INTERPRET=1``: Triton chooses its interpreter when triton is imported (its
    own library functions are decorated then), and this process may have imported it already."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.test_cross_entropy import parity_worlds; print(repr(parity_worlds()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-6000:]
    per_rank = 2 * (3 + (len(BACKENDS) > 1)) + 1
    assert ast.literal_eval(run.stdout.strip().splitlines()[-1]) == [[per_rank] * n for n in (1, 2, 4)]


# --- dispatched operations: constant in the number of tokens ---------------------------------------------------


def chunked_loss_before(logits: torch.Tensor, target: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """The loss this module replaced (megazero adf4bd3, tp 1, in-place backward), for the op-count control and
    the benchmark: the tokens upcast to fp32 in fixed-size chunks of 64 MiB (~330 tokens at V = 50304), each
    forward and backward chunk several eager passes; the padded vocabulary arrives masked to -inf."""
    return _ChunkedBefore.apply(logits, target, chunk_tokens or max(1, 64 * 2**20 // (4 * logits.shape[-1])))


class _ChunkedBefore(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, c):
        n = logits.shape[0]
        own = target != IGNORE_INDEX
        local = target.masked_fill(~own, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=logits.device)
        for a in range(0, n, c):
            chunk = logits[a: a + c].float()
            lse[a: a + c] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(-1, local[a: a + c].unsqueeze(-1)).squeeze(-1)
            target_logit[a: a + c] = picked.masked_fill(~own[a: a + c], 0.0)
        ctx.save_for_backward(logits, lse, target)
        ctx.c = c
        return (lse - target_logit).masked_fill(~own, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, target = ctx.saved_tensors
        own = target != IGNORE_INDEX
        local = target.masked_fill(~own, 0)
        scale = grad_loss.float().masked_fill(~own, 0.0)
        c = ctx.c
        for a in range(0, logits.shape[0], c):
            chunk = logits[a: a + c].to(torch.float32, copy=logits.dtype != torch.float32)
            chunk.sub_(lse[a: a + c].unsqueeze(-1)).exp_()
            chunk.scatter_add_(-1, local[a: a + c].unsqueeze(-1), -own[a: a + c].unsqueeze(-1).float())
            chunk.mul_(scale[a: a + c].unsqueeze(-1))
            if not same_data(chunk, logits[a: a + c]):
                logits[a: a + c].copy_(chunk)
        return logits, None, None


class _OpCounter(TorchDispatchMode):
    """Counts every aten operation dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_of_loss(loss_fn, n: int, dtype: torch.dtype) -> int:
    """Aten ops of one forward + backward of ``loss_fn(logits, target)`` over ``n`` tokens of 1024 columns."""
    g = torch.Generator().manual_seed(n)
    y = (torch.randn(n, 1024, generator=g).to(dtype).requires_grad_() * 1.0)  # an intermediate, as the model's
    target = torch.randint(0, 1000, (n,), generator=g)
    counter = _OpCounter()
    with counter:
        loss = loss_fn(y, target)
        torch.autograd.grad(loss, y, torch.ones_like(loss))
    return counter.ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_count_does_not_grow_with_tokens(dtype):
    def ours(y, target):
        return vocab_parallel_cross_entropy(y, target, None, 0, 1000, inplace_backward=True, backend="eager")

    counts = [_ops_of_loss(ours, n, dtype) for n in (64, 256)]
    assert counts[0] == counts[1], counts
    # negative control: the loss it replaced, in chunks of a fixed 16 tokens, grows with them
    before = [_ops_of_loss(lambda y, t: chunked_loss_before(y, t, 16), n, dtype) for n in (64, 256)]
    assert before[1] > before[0] + 40, before


# --- memory: no fp32 copy of the whole logits; the padded vocabulary never masked in full ----------------------


class _LargestFloat32(TorchDispatchMode):
    """Records the largest fp32 tensor any operation returns (views included: they count their base), and every
    operation whose output has at least ``watch`` elements."""

    def __init__(self, watch: int | None = None) -> None:
        super().__init__()
        self.largest, self.watch, self.big_ops = 0, watch, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
            if isinstance(t, torch.Tensor) and self.watch is not None and t.numel() >= self.watch:
                self.big_ops.append(func.__name__)
        return out


def test_bf16_logits_never_become_fp32_as_a_whole():
    v = 1000
    logits, target, grad = _case(v, 1)
    x = logits.to(torch.bfloat16).requires_grad_()
    ref_loss, ref_grad = _reference(x.detach(), target, grad, torch.float64)  # on the same bf16 values
    pieces = 4
    mode = _LargestFloat32()
    counter = ActivationMemoryCounter(torch.nn.Linear(1, 1))
    with mode:
        with counter.track():
            loss = vocab_parallel_cross_entropy(x, target, None, eager_pieces=pieces, backend="eager")
        loss.backward(grad)
    assert x.grad.dtype == torch.bfloat16
    assert mode.largest <= math.ceil(N / pieces) * v  # one fp32 piece at a time, forward and backward
    # saved for backward: the bf16 logits themselves, the fp32 log-sum-exp and the int64 targets
    assert counter.last == x.numel() * 2 + N * 4 + N * 8
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=BF16_GRAD_RTOL, atol=1e-7)
    # negative control: the detector sees a whole-vocabulary fp32 copy when one is made
    naive = _LargestFloat32()
    with naive:
        F.cross_entropy(logits.to(torch.bfloat16).float(), target, ignore_index=IGNORE_INDEX, reduction="none")
    assert naive.largest >= N * v


def test_meta_allocates_what_the_kernels_do():
    """The dry run (meta tensors emulating a GPU, as gpt.py asks) sees the Triton path's allocations: [N, 2] and
    [N] fp32, the gradient in place; the eager path on meta shows its fp32 piece (the control)."""
    n, padded = 4096, 50304
    largest = {}
    for backend in ("triton", "eager"):
        y = torch.empty(n, padded, device="meta", dtype=torch.bfloat16, requires_grad=True) * 1.0
        target = torch.zeros(n, dtype=torch.long, device="meta")
        mode = _LargestFloat32()
        with mode:
            loss = vocab_parallel_cross_entropy(y, target, None, 0, 50257, inplace_backward=True, backend=backend)
            (g,) = torch.autograd.grad(loss, y, torch.ones_like(loss))
        assert same_data(g, y) and g.dtype == torch.bfloat16
        largest[backend] = mode.largest
    assert largest["triton"] <= 2 * n
    assert largest["eager"] >= n // 8 * 50257


def test_a_dry_run_emulating_cuda_takes_the_kernels_path(monkeypatch):
    """gpt.py asks for the Triton path on meta tensors when the dry run emulates CUDA, and only then."""
    from megazero.config.cli import parse_args
    from megazero.distributed.context import RankGrid
    from megazero.model import kernels
    from megazero.plan.role import run_role

    calls: list[str] = []
    forward = ce_triton.triton_forward
    monkeypatch.setattr(ce_triton, "triton_forward", lambda logits, *a: (calls.append(logits.device.type),
                                                                        forward(logits, *a))[1])
    cfg = parse_args(["--num-layers", "1", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "16",
                      "--vocab-size", "256", "--micro-batch-size", "2", "--global-batch-size", "2",
                      "--no-compile"]).resolve(1)
    seen = {}
    for device_type in ("cuda", "cpu"):
        with kernels.emulate(device_type):
            run_role(cfg, RankGrid(1, 1, 1, 1), 0)
        seen[device_type] = len(calls) - sum(seen.values())
    assert seen["cuda"] >= 1 and set(calls) == {"meta"} and seen["cpu"] == 0, seen


def test_head_and_loss_skip_the_padding_without_a_mask_pass():
    """The model's way: raw logits of the tied head, the loss told the real vocabulary. No operation as large as
    the logits runs besides the head's matmuls and the loss's own passes; loss and weight gradient equal
    PyTorch's on the unpadded head. The masked head (generation's) is the negative control."""
    torch.manual_seed(0)
    head = VocabParallelEmbedding(1000, 16, None)
    with torch.no_grad():  # as the recipe materialises it: the padded rows zero
        head.weight.normal_(0.0, 1.0)[1000:] = 0.0
    assert head.padded_vocab_size == 1024 and head.local_real_vocab == 1000
    h = torch.randn(N, 16)
    target = torch.randint(0, 1000, (N,))
    mode = _LargestFloat32(watch=N * 1000)
    with mode:
        loss = vocab_parallel_cross_entropy(head.logits(h, mask_padding=False), target, None, 0, head.vocab_size,
                                            inplace_backward=True, backend="eager")
        loss.sum().backward()
    assert not {"masked_fill.Scalar", "where.self", "masked_fill_.Scalar"} & set(mode.big_ops), mode.big_ops
    w = head.weight.detach()[:1000].clone().requires_grad_()
    ref = F.cross_entropy(h @ w.T, target, reduction="none")
    ref.sum().backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.weight.grad[:1000], w.grad, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(head.weight.grad[1000:]) == 0  # padded rows: no gradient
    masked = _LargestFloat32(watch=N * 1000)
    with masked:
        head.logits(h)
    assert "masked_fill.Scalar" in masked.big_ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not ce_triton.available(), reason="needs CUDA and triton")
def test_triton_on_cuda_equals_eager_at_gpt2_width():
    """The compiled kernels (not the interpreter) on bf16 logits of GPT-2's padded width."""
    torch.manual_seed(0)
    v, padded, n = 50257, 50304, 2048
    x = (torch.randn(n, padded, device="cuda") * 3).to(torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    target[::17] = IGNORE_INDEX
    grad = torch.rand(n, device="cuda") + 0.5
    out = {}
    for backend in ("triton", "eager"):
        y = x.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(y, target, None, 0, v, backend=backend)
        loss.backward(grad)
        out[backend] = loss.detach(), y.grad
    torch.testing.assert_close(out["triton"][0], out["eager"][0], rtol=1e-5, atol=1e-5)
    # two bf16 roundings of slightly different fp32 values (the kernel's exp is not eager's) may land one bf16 step
    # apart: up to 2^-7 relative at the bottom of a binade (seen on an H200: 54 of 103M elements beyond 2^-8)
    torch.testing.assert_close(out["triton"][1].float(), out["eager"][1].float(), rtol=2.0**-7, atol=1e-7)
    # and nearly all agree within one rounding: a systematic error would move far more than a few in a million
    near = torch.isclose(out["triton"][1].float(), out["eager"][1].float(), rtol=BF16_GRAD_RTOL, atol=1e-7)
    assert (~near).sum().item() <= 1e-5 * near.numel()
    assert torch.count_nonzero(out["triton"][1][:, v:]) == 0
