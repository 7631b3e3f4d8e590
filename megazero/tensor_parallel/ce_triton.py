"""Triton kernels of the vocabulary-parallel cross-entropy: one read of the logits forward, one read and one
in-place write backward.

Forward, one program per token row: an online max / sum-exp over this rank's *real* columns (``n_real``; the
padded tail of the vocabulary is never read), loading the logits in their own dtype (bf16 on a GPU) and
accumulating in fp32 registers, then one scalar load of the target's logit where this rank owns the target. It
writes ``stats[row] = (local log-sum-exp, local target logit)``, which is exactly the payload the TP combine
all-gathers: no fp32 copy of the logits exists at any point.

Backward, one program per token row: ``(exp(x - lse) - onehot(target)) * grad`` in fp32 registers, stored in the
gradient's dtype, over the logits themselves when the caller allows it (each element is read, then written, by
the same program). Padded columns are written 0 without being read, so the padded vocabulary needs no mask pass.

The kernels are decorated on first use, not at import: Triton picks its interpreter (``TRITON_INTERPRET=1``, the
CPU tests) or its compiler when ``triton.jit`` runs, and a test sets the variable after megazero was imported.
Without triton installed :func:`available` is False and the caller takes the eager path. On the meta device
(the dry run emulating a GPU) the two functions allocate what the kernels' callers see and launch nothing.
"""

import functools
import os
from types import SimpleNamespace

import torch

try:  # an optional dependency: megazero runs without it (the eager path)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None
# the kernels' compile-time parameter type (evaluated at definition: no postponed annotations in this module)
constexpr = tl.constexpr if tl is not None else int

__all__ = ["available", "interpreting", "triton_backward", "triton_forward"]

BLOCK_MAX = 4096  # columns per loop iteration: 16 elements per thread at 8 warps
NUM_WARPS = 8


def available() -> bool:
    """Whether triton imports here."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _forward(logits_ptr, stride, target_ptr, stats_ptr, n_real, vocab_start, ignore_index, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = float("-inf")  # running max of this rank's real logits
    s = 0.0  # running sum of exp(x - m)
    for start in range(0, n_real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < n_real, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row of -inf (masked input) stays exact
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), 0)
        m = m_new
    # s >= 1 (the max's own term) wherever a real column exists; with none, m = -inf and so is the log-sum-exp
    lse = m + tl.log(tl.maximum(s, 1.0))
    t = tl.load(target_ptr + row)
    local = t - vocab_start
    own = (t != ignore_index) & (local >= 0) & (local < n_real)
    picked = tl.load(base + tl.where(own, local, 0), mask=own, other=0.0).to(tl.float32)
    tl.store(stats_ptr + 2 * row, lse)
    tl.store(stats_ptr + 2 * row + 1, picked)


def _backward(logits_ptr, stride, grad_ptr, grad_stride, target_ptr, lse_ptr, scale_ptr, n_cols, n_real,
              vocab_start, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    out = grad_ptr + row * grad_stride
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)  # the upstream gradient, 0 for ignored tokens
    local = tl.load(target_ptr + row) - vocab_start  # never in [0, n_real) for an ignored or foreign target
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = cols < n_real
        x = tl.load(base + cols, mask=real, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - lse)  # softmax over the whole TP-split vocabulary; 0 on padded columns
        g = (p - tl.where(cols == local, 1.0, 0.0)) * scale
        tl.store(out + cols, g.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> SimpleNamespace:
    """The jitted pair, built once per mode (``interpret`` is the cache key only: triton reads the variable)."""
    del interpret
    return SimpleNamespace(forward=triton.jit(_forward), backward=triton.jit(_backward))


def _block(n: int) -> int:
    return max(16, min(BLOCK_MAX, triton.next_power_of_2(max(n, 1))))


def triton_forward(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_real: int,
                   ignore_index: int) -> torch.Tensor:
    """``[N, 2]`` fp32: this rank's log-sum-exp over its ``n_real`` real columns and its target logit (0 where
    the target is not here or ignored). ``logits`` [N, V/tp] with unit column stride, any float dtype."""
    n = logits.shape[0]
    stats = torch.empty(n, 2, dtype=torch.float32, device=logits.device)
    if n and logits.device.type != "meta":  # meta (the dry run): what the kernel allocates, nothing to run
        _kernels(interpreting()).forward[(n,)](logits, logits.stride(0), target, stats, n_real, vocab_start,
                                                ignore_index, BLOCK=_block(n_real), num_warps=NUM_WARPS)
    return stats


def triton_backward(logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                    scale: torch.Tensor, vocab_start: int, n_real: int) -> None:
    """Write ``(softmax - onehot) * scale`` of every row into ``grad`` (which may be ``logits`` itself), 0 on
    the padded columns ``[n_real, V/tp)``."""
    n, n_cols = logits.shape
    if n and logits.device.type != "meta":
        _kernels(interpreting()).backward[(n,)](logits, logits.stride(0), grad, grad.stride(0), target, lse,
                                                 scale, n_cols, n_real, vocab_start, BLOCK=_block(n_cols),
                                                 num_warps=NUM_WARPS)
