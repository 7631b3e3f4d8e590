"""Cross-entropy over a vocabulary split across TP ranks, without materialising the full logits anywhere.

Each rank holds logits for its slice of the (padded) vocabulary. The log-sum-exp is assembled from one
all-reduce of the maxima and one of the sums; the target's logit from one all-reduce where only its owner
contributes. Padded vocabulary entries arrive as ``-inf`` and so carry zero probability and zero gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megazero.distributed import Group

__all__ = ["IGNORE_INDEX", "vocab_parallel_cross_entropy"]

IGNORE_INDEX = -100


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_start: int):
        logits = logits.float()
        local_vocab = logits.shape[-1]
        logits_max = logits.max(dim=-1).values
        group.all_reduce(logits_max, op="max", tag="act")
        shifted = logits - logits_max.unsqueeze(-1)

        ignored = target == IGNORE_INDEX
        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_vocab) | ignored
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        group.all_reduce(target_logit, tag="act")

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        group.all_reduce(sum_exp, tag="act")
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        grad = softmax
        own = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -own.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, tp_group: Group | None, vocab_start: int = 0
) -> torch.Tensor:
    """Per-token loss (fp32, same shape as ``target``; 0 where ``target == IGNORE_INDEX``).

    ``logits`` is this rank's vocabulary slice starting at ``vocab_start``.
    """
    if tp_group is None or tp_group.size == 1:
        return F.cross_entropy(
            logits.float().flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view_as(target)
    return _VocabParallelCE.apply(logits, target, tp_group, vocab_start)
