"""Cross-entropy over a vocabulary split across TP ranks: one fused pass over the logits in their own dtype.

Each rank holds the logits of its slice of the (padded) vocabulary, ``[N, V/tp]`` in the compute dtype (bf16 on
a GPU); the first ``n_real`` columns are real words, the rest padding that the loss never reads (the caller
passes the real ``vocab_size``; no mask pass over the logits). The loss runs in three parts:

1. **Local statistics**, per token: this rank's log-sum-exp over its real columns and the target's logit where
   this rank owns the target, as one ``[N, 2]`` fp32 tensor. On CUDA with triton installed that is one Triton
   kernel (:mod:`~megazero.tensor_parallel.ce_triton`): an online max / sum-exp reading each logit once in its
   own dtype, fp32 in registers. Elsewhere (the CPU, or CUDA without triton) it is the eager path below.
2. **One collective.** The ``[N, 2]`` statistics of every TP rank are all-gathered in one call and combined
   locally: ``lse = logsumexp_r(lse_r)``, ``target = sum_r target_r`` (one owner per token). This replaces
   three all-reduces (max, rescaled sum, target logit): one latency instead of three. In elements it moves
   ``2N(tp - 1)`` per rank against ``3N(tp - 1)/tp`` x 2 for the all-reduces, more beyond tp 4 but only
   ``2N`` fp32 a rank (128 KiB at 16k tokens): latency, not bandwidth, is what these small messages cost.
3. **Backward**, one pass: ``(softmax - onehot(target)) * grad`` with the global log-sum-exp, written in the
   logits' dtype into a new buffer or, with ``inplace_backward``, over the saved logits themselves (Megatron-LM
   overwrites its saved softmax the same way), so backward needs no second vocabulary-sized buffer; padded
   columns get 0. The model passes ``inplace_backward`` because its logits are an intermediate nobody else reads
   (the linear layer that made them keeps its input, not its output); if another node had saved them,
   autograd's version check would raise rather than let it read the overwritten values.

**The eager path** (no Triton): the tokens are cut into a *fixed* number of pieces, :data:`EAGER_PIECES`, not
pieces of a fixed size, so the number of dispatched operations (kernel launches on a GPU) does not grow with the
tokens, while the fp32 transient stays a fraction of the logits: one piece, ``N/8 x V/tp`` fp32, which is a
quarter of bf16 logits' bytes and an eighth of fp32 ones'. fp32 logits with ``inplace_backward`` need no copy at
all backward and run as one piece. The earlier loss upcast fixed-size pieces of ~330 tokens (64 MiB): about 50
pieces of ~5 eager passes each per step on an H100 at GPT-2 124M, which with the full-logits ``masked_fill`` of
the padded vocabulary came to 25-30 ms of a 73 ms step (issue 27). A compiled piece function was the other
candidate for the eager path; it costs a compilation per shape and dtype in every CPU test that trains, and a C++
compiler at run time, for a path whose GPU role is only a fallback.

Peak extra memory of the loss, forward or backward: Triton O(N); eager one fp32 piece ``ceil(N/8) x V/tp`` plus
O(N). Saved for backward either way: the logits as they came (no copy), the fp32 global log-sum-exp and the
targets.
"""

from __future__ import annotations

import torch

from megazero.distributed import device_io
from megazero.distributed.group import Group
from megazero.tensor_parallel import ce_triton

__all__ = ["BACKENDS", "EAGER_PIECES", "IGNORE_INDEX", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100
EAGER_PIECES = 8  # the eager path's token pieces: constant ops per call, fp32 transient N/8 x V/tp
BACKENDS = ("auto", "triton", "eager")


def _local_targets(target: torch.Tensor, vocab_start: int, n_real: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's column of each target (0 where it is not here) and whether this rank owns it."""
    local = target - vocab_start
    own = (local >= 0) & (local < n_real) & (target != IGNORE_INDEX)
    return local.masked_fill(~own, 0), own


def _eager_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, n_real: int,
                 pieces: int) -> torch.Tensor:
    """``[N, 2]`` fp32 (local log-sum-exp, local target logit) in ``pieces`` fp32 pieces of the real columns."""
    n = logits.shape[0]
    stats = torch.empty(n, 2, dtype=torch.float32, device=logits.device)
    if n_real == 0:  # this rank holds padding only
        stats[:, 0], stats[:, 1] = float("-inf"), 0.0
        return stats
    real = logits[:, :n_real]  # a view: the padded columns are never read
    for rows, out in zip(real.tensor_split(pieces), stats.tensor_split(pieces)):
        piece = rows.to(torch.float32, copy=True)  # the only vocabulary-sized transient, worked on in place
        top = piece.amax(dim=-1, keepdim=True)
        top.masked_fill_(top == float("-inf"), 0.0)  # a row of -inf only (a masked caller's padding) stays -inf
        out[:, 0] = piece.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
    local_target, own = _local_targets(target, vocab_start, n_real)
    picked = real.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
    stats[:, 1] = picked.float().masked_fill(~own, 0.0)
    return stats


def _eager_backward(logits: torch.Tensor, grad: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                    scale: torch.Tensor, vocab_start: int, n_real: int, pieces: int) -> None:
    """``grad = (softmax - onehot) * scale`` in ``pieces`` fp32 pieces, 0 on the padded columns."""
    if n_real < grad.shape[1]:
        grad[:, n_real:].zero_()  # the padded columns only: no gradient reaches the padded rows
    if n_real == 0:
        return
    local_target, own = _local_targets(target, vocab_start, n_real)
    direct = logits.dtype == torch.float32 and device_io.same_data(grad, logits)  # fp32 in place: no copy
    parts = zip(*(t.tensor_split(1 if direct else pieces) for t in (logits[:, :n_real], grad[:, :n_real], lse,
                                                                     local_target, own, scale)))
    for x, g, lse_p, t, own_p, scale_p in parts:
        chunk = x if direct else x.to(torch.float32, copy=True)  # a copy even of fp32 logits kept by the caller
        chunk.sub_(lse_p.unsqueeze(-1)).exp_()  # softmax over the whole (TP-split) vocabulary
        chunk.scatter_add_(-1, t.unsqueeze(-1), -own_p.unsqueeze(-1).float())
        chunk.mul_(scale_p.unsqueeze(-1))
        if not direct:
            g.copy_(chunk)


def _combine(stats: torch.Tensor, group: Group | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Global log-sum-exp and target logit per token from every rank's ``[N, 2]`` statistics: one all-gather."""
    if group is None or group.size == 1:
        return stats[:, 0], stats[:, 1]
    every = torch.empty((group.size, *stats.shape), dtype=stats.dtype, device=stats.device)
    group.all_gather_into(every.view(-1), stats.view(-1), tag="act")  # [tp, N, 2]
    return torch.logsumexp(every[..., 0], dim=0), every[..., 1].sum(0)


def _use_triton(logits: torch.Tensor, backend: str) -> bool:
    if backend == "eager":
        return False
    if backend == "triton":
        if logits.device.type == "meta":  # the dry run emulating a GPU: the kernels' allocations, no launch
            return True
        if not ce_triton.available():
            raise RuntimeError("backend='triton' needs triton installed (pip install triton)")
        if logits.device.type != "cuda" and not ce_triton.interpreting():
            raise RuntimeError("backend='triton' on a CPU tensor needs TRITON_INTERPRET=1")
        return True
    return ce_triton.available() and logits.device.type == "cuda"


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group | None, vocab_start: int,
                n_real: int, inplace_backward: bool, triton: bool, pieces: int):
        if triton:
            stats = ce_triton.triton_forward(logits, target, vocab_start, n_real, IGNORE_INDEX)
        else:
            stats = _eager_stats(logits, target, vocab_start, n_real, pieces)
        lse, target_logit = _combine(stats, group)
        loss = (lse - target_logit).masked_fill(target == IGNORE_INDEX, 0.0)
        lse = lse.contiguous()
        ctx.save_for_backward(logits, lse, target)
        ctx.args = vocab_start, n_real, inplace_backward, triton, pieces
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, lse, target = ctx.saved_tensors
        vocab_start, n_real, inplace, triton, pieces = ctx.args
        scale = grad_loss.float().masked_fill(target == IGNORE_INDEX, 0.0).contiguous()  # [N]
        grad = logits if inplace else torch.empty_like(logits)  # in place: see the module docstring
        if triton:
            ce_triton.triton_backward(logits, grad, target, lse, scale, vocab_start, n_real)
        else:
            _eager_backward(logits, grad, target, lse, scale, vocab_start, n_real, pieces)
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Group | None,
                                 vocab_start: int = 0, vocab_size: int | None = None,
                                 inplace_backward: bool = False, backend: str = "auto",
                                 eager_pieces: int = EAGER_PIECES) -> torch.Tensor:
    """Per-token loss (fp32, same shape as ``target``; 0 where ``target == IGNORE_INDEX``).

    ``logits`` [..., V/tp] is this rank's vocabulary slice starting at ``vocab_start`` (any float dtype);
    ``tp_group`` None or of size 1 means the whole vocabulary is here. ``vocab_size`` is the real vocabulary:
    columns at or past it are padding, never read and given no gradient (None: every column is real, padding
    arriving as ``-inf`` works too). The gradient comes back in the logits' dtype; ``inplace_backward`` writes it
    over ``logits`` (only for logits that nothing else reads after this call, such as the model's own).
    ``backend``: "auto" (Triton on CUDA when installed, else eager), "triton" (also on the CPU under
    ``TRITON_INTERPRET=1``, and on meta tensors as a GPU's allocations without a launch) or "eager"; ``eager_pieces`` is how many fp32 pieces the eager path cuts the tokens in.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(target.shape)} disagree: expected "
                         "logits [..., V/tp] over the targets' shape")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if eager_pieces < 1:
        raise ValueError(f"eager_pieces must be positive, got {eager_pieces}")
    local_vocab = logits.shape[-1]
    n_real = local_vocab if vocab_size is None else min(max(vocab_size - vocab_start, 0), local_vocab)
    triton = _use_triton(logits, backend)
    flat = logits.reshape(-1, local_vocab)
    if triton and flat.stride(-1) != 1:
        flat = flat.contiguous()
    loss = _VocabParallelCE.apply(flat, target.reshape(-1).contiguous(), tp_group, vocab_start, n_real,
                                  inplace_backward, triton, eager_pieces)
    return loss.view(target.shape)
