"""Cross-entropy over a vocabulary split across TP ranks, without materialising fp32 logits of the whole vocab.

Each rank holds logits for its slice of the (padded) vocabulary, in the compute dtype (bf16 on a GPU). The
loss is computed chunk by chunk over the tokens: each chunk of ``chunk_tokens`` rows is upcast to fp32 on its
own, reduced to three numbers per token (this rank's log-sum-exp, the target's logit where this rank owns the
target) and dropped. Across TP ranks the log-sum-exps are combined with one all-reduce of the maxima and one of
the rescaled sums; the target's logit with one all-reduce where only its owner contributes. Padded vocabulary
entries arrive as ``-inf`` and so carry zero probability and zero gradient.

For backward the Function saves the logits as they came (no copy, no mask), the fp32 log-sum-exp and the
targets. The gradient ``softmax - onehot(target)`` is formed chunk by chunk in fp32 and written in the
logits' dtype into a new buffer, or, with ``inplace_backward``, over the saved logits themselves (as
Megatron-LM does with its saved softmax), so that backward needs no second vocabulary-sized buffer. The model
passes ``inplace_backward`` because its logits are an intermediate nobody else reads (the linear layer that
made them keeps its input, not its output); if some other node had saved them, autograd's version check would
raise rather than let it read the overwritten values. A caller who keeps the logits must not pass it.

Peak extra memory of the loss, forward or backward: one fp32 chunk ``chunk_tokens x V/tp`` plus O(tokens).
"""

from __future__ import annotations

import torch

from megazero.distributed import device_io
from megazero.distributed.group import Group

__all__ = ["DEFAULT_CHUNK_BYTES", "IGNORE_INDEX", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 64 * 2**20  # fp32 bytes of one chunk of logits: 64 MiB (~330 tokens at V/tp = 50304)


def _local_targets(target: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's column of each target (0 where it is not here) and whether this rank owns it."""
    local = target - vocab_start
    own = (local >= 0) & (local < local_vocab) & (target != IGNORE_INDEX)
    return local.masked_fill(~own, 0), own


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group | None, vocab_start: int,
                chunk_tokens: int, inplace_backward: bool):
        n, local_vocab = logits.shape
        local_target, own = _local_targets(target, vocab_start, local_vocab)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)  # this rank's log-sum-exp, then global
        target_logit = torch.zeros(n, dtype=torch.float32, device=logits.device)
        for a in range(0, n, chunk_tokens):
            chunk = logits[a: a + chunk_tokens].float()  # [C, V/tp] fp32, the only vocabulary-sized transient
            lse[a: a + chunk_tokens] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(-1, local_target[a: a + chunk_tokens].unsqueeze(-1)).squeeze(-1)
            target_logit[a: a + chunk_tokens] = picked.masked_fill(~own[a: a + chunk_tokens], 0.0)
            del chunk
        if group is not None and group.size > 1:
            # log sum_r exp(lse_r) = M + log sum_r exp(lse_r - M), M = max_r lse_r
            top = lse.clone()
            group.all_reduce(top, op="max", tag="act")
            rescaled = (lse - top).exp()
            group.all_reduce(rescaled, tag="act")
            lse = top + rescaled.log()
            group.all_reduce(target_logit, tag="act")
        ignored = target == IGNORE_INDEX
        loss = (lse - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(logits, lse, target)
        ctx.vocab_start, ctx.chunk_tokens, ctx.inplace = vocab_start, chunk_tokens, inplace_backward
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, lse, target = ctx.saved_tensors
        n, local_vocab = logits.shape
        local_target, own = _local_targets(target, ctx.vocab_start, local_vocab)
        scale = grad_loss.float().masked_fill(target == IGNORE_INDEX, 0.0)  # [N]
        grad = logits if ctx.inplace else torch.empty_like(logits)  # in place: see the module docstring
        c = ctx.chunk_tokens
        for a in range(0, n, c):
            rows = grad[a: a + c]
            # fp32 logits in place: work on them directly; otherwise an fp32 copy of this chunk only
            chunk = logits[a: a + c].to(torch.float32, copy=not (ctx.inplace and logits.dtype == torch.float32))
            chunk.sub_(lse[a: a + c].unsqueeze(-1)).exp_()  # softmax over the whole (TP-split) vocabulary
            chunk.scatter_add_(-1, local_target[a: a + c].unsqueeze(-1), -own[a: a + c].unsqueeze(-1).float())
            chunk.mul_(scale[a: a + c].unsqueeze(-1))
            if not device_io.same_data(chunk, rows):
                rows.copy_(chunk)
            del chunk
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Group | None,
                                 vocab_start: int = 0, chunk_tokens: int | None = None,
                                 inplace_backward: bool = False) -> torch.Tensor:
    """Per-token loss (fp32, same shape as ``target``; 0 where ``target == IGNORE_INDEX``).

    ``logits`` [..., V/tp] is this rank's vocabulary slice starting at ``vocab_start`` (any float dtype;
    padded entries ``-inf``); ``tp_group`` None or of size 1 means the whole vocabulary is here.
    ``chunk_tokens`` is how many tokens are upcast to fp32 at a time (default: :data:`DEFAULT_CHUNK_BYTES`
    worth). The gradient comes back in the logits' dtype; ``inplace_backward`` writes it over ``logits``
    (only for logits that nothing else reads after this call, such as the model's own).
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(target.shape)} disagree: expected "
                         "logits [..., V/tp] over the targets' shape")
    local_vocab = logits.shape[-1]
    if chunk_tokens is None:
        chunk_tokens = max(1, DEFAULT_CHUNK_BYTES // (4 * local_vocab))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    flat = logits.reshape(-1, local_vocab)
    loss = _VocabParallelCE.apply(flat, target.reshape(-1), tp_group, vocab_start, chunk_tokens,
                                  inplace_backward)
    return loss.view(target.shape)
