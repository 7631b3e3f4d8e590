"""The chunked vocab-parallel cross-entropy: equal to PyTorch's on the unsharded logits (tp 1 and tp 2 with a
padded vocabulary, forward and gradient), and it never makes an fp32 copy of the whole vocabulary's logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.observe.memory import ActivationMemoryCounter
from megazero.tensor_parallel import IGNORE_INDEX, vocab_parallel_cross_entropy
from tests.dist import run_world

V, PADDED, N = 1000, 1024, 37  # vocabulary padded as VocabParallelEmbedding pads it at tp 2; tokens


def _case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unpadded logits [3, N/3.., V] (some large, to exercise the max shift), targets with ignored entries
    and targets at both ends of the vocabulary, and an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, V, generator=g, dtype=torch.float64) * 4
    logits[5] += 80.0  # a row whose exp would overflow without the shift
    target = torch.randint(0, V, (N,), generator=g)
    target[0], target[1], target[2], target[7] = 0, V - 1, IGNORE_INDEX, IGNORE_INDEX
    grad = torch.rand(N, generator=g, dtype=torch.float64) + 0.5
    return logits.float(), target, grad.float()


def _reference(logits: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, dtype=torch.float32):
    """PyTorch's cross-entropy on the whole unpadded vocabulary (what megazero computed before chunking)."""
    x = logits.to(dtype, copy=True).requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=IGNORE_INDEX, reduction="none")
    loss.backward(grad.to(dtype))
    return loss.detach(), x.grad


def _padded_slice(logits: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    full = torch.cat([logits, logits.new_full((logits.shape[0], PADDED - V), float("-inf"))], dim=-1)
    return full.chunk(size, dim=-1)[rank].contiguous()


def _ours(logits, target, grad, group, rank, size, chunk_tokens=None, inplace=False):
    x = _padded_slice(logits, rank, size).requires_grad_()
    kept = x.detach().clone()
    # in place, the gradient overwrites the logits: give it an intermediate, as the model does
    loss = vocab_parallel_cross_entropy(x * 1.0 if inplace else x, target, group,
                                        vocab_start=rank * PADDED // size, chunk_tokens=chunk_tokens,
                                        inplace_backward=inplace)
    loss.backward(grad)
    assert torch.equal(x.detach(), kept)  # the caller's logits are untouched
    return loss.detach(), x.grad


def _check(ctx) -> int:
    tp = ctx.tp_group
    logits, target, grad = _case()
    ref_loss, ref_grad = _reference(logits, target, grad)
    ref64_loss, _ = _reference(logits, target, grad, torch.float64)
    ref_grad_slice = _padded_slice(torch.cat([ref_grad]), tp.rank, tp.size).nan_to_num(neginf=0.0)
    checks = 0
    # one chunk, one token at a time, chunks that do not divide N, exactly N; gradient in place or not
    for chunk, inplace in ((None, False), (1, False), (5, True), (N, True)):
        loss, g = _ours(logits, target, grad, tp, tp.rank, tp.size, chunk, inplace)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss.double(), ref64_loss, rtol=1e-6, atol=1e-6)
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, ref_grad_slice, rtol=1e-6, atol=1e-6)
        assert torch.count_nonzero(g[:, max(0, V - tp.rank * PADDED // tp.size):]) == 0  # padding: no gradient
        assert torch.count_nonzero(loss[target == IGNORE_INDEX]) == 0
        checks += 1
    # batched shape [B, S, V/tp] -> [B, S]
    loss = vocab_parallel_cross_entropy(_padded_slice(logits[:36], tp.rank, tp.size).view(4, 9, -1),
                                        target[:36].view(4, 9), tp, tp.rank * PADDED // tp.size)
    torch.testing.assert_close(loss, ref_loss[:36].view(4, 9), rtol=1e-6, atol=1e-6)
    return checks + 1


def test_equals_pytorch_cross_entropy_at_tp_1_and_2():
    assert run_world(_check, 1) == [5]
    assert run_world(_check, 2, tp=2) == [5, 5]


class _LargestFloat32(TorchDispatchMode):
    """Records the largest fp32 tensor any operation returns (views included: they count their base)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _naive_fp32(logits, target):
    """The pattern the chunked loss replaces: the whole vocabulary's logits upcast at once."""
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE_INDEX, reduction="none")


def test_bf16_logits_never_become_fp32_as_a_whole():
    logits, target, grad = _case(1)
    x = logits.to(torch.bfloat16).requires_grad_()
    ref_loss, ref_grad = _reference(x.detach(), target, grad, torch.float64)  # on the same bf16 values
    chunk = 4
    mode = _LargestFloat32()
    counter = ActivationMemoryCounter(torch.nn.Linear(1, 1))
    with mode:
        with counter.track():
            loss = vocab_parallel_cross_entropy(x, target, None, chunk_tokens=chunk)
        loss.backward(grad)
    assert x.grad.dtype == torch.bfloat16
    assert mode.largest <= chunk * V  # one fp32 chunk at a time, forward and backward
    # saved for backward: the bf16 logits themselves, the fp32 log-sum-exp and the int64 targets
    assert counter.last == x.numel() * 2 + N * 4 + N * 8
    # fp32 arithmetic on the bf16 values: the loss to fp32 rounding, the gradient to bf16 rounding
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=1e-2, atol=1e-4)
    # negative control: the detector sees a whole-vocabulary fp32 copy when one is made
    naive = _LargestFloat32()
    with naive:
        _naive_fp32(logits.to(torch.bfloat16), target)
    assert naive.largest >= N * V
