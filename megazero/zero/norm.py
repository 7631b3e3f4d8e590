"""The global gradient norm's bookkeeping: which parameters each rank counts in it, and what a step made of it
(:class:`StepStats`; :class:`NonFiniteGradientError` when it stays non-finite).

Clipping uses the global norm of the unpartitioned gradient: squares are summed over this rank's partition,
then over ``dp_group`` (stages 1-3; stage 0 holds the full reduced gradient) and over ``norm_group`` (the
model-parallel group), counting TP-replicated parameters once (``norm_counted``). The coefficient is
``torch.nn.utils.clip_grad_norm_``'s: ``min(1, clip / (norm + 1e-6))``. The Adam/AdamW update is torch's fused
kernel (``torch.optim.AdamW(fused=True)``'s arithmetic) over the flat partition; weight decay applies to
parameters with ``ndim >= 2``. Without a loss scaler the coefficient and the non-finite skip are decided on
the device (:meth:`ZeroOptimizer.launch_step <megazero.zero.optimizer.ZeroOptimizer.launch_step>`), so the step's
one host read comes after the update.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from megazero.config.schema import OptimizerConfig

__all__ = ["NonFiniteGradientError", "StepStats", "grad_norm_weights", "skipped_steps_error"]


class NonFiniteGradientError(FloatingPointError):
    """Too many consecutive steps had a non-finite gradient norm (see :meth:`ZeroOptimizer.check_skipped_steps`)."""


def skipped_steps_error(skips: int, step: int, cfg: OptimizerConfig) -> NonFiniteGradientError:
    """The error every rank raises after ``skips`` (>= ``cfg.max_skipped_steps``) skipped steps in a row, the last
    at ``step``: what to change."""
    return NonFiniteGradientError(
        f"the gradient norm was not finite in {skips} consecutive steps (the last at step {step}), so each was "
        f"skipped; the run is diverging: lower the learning rate (--lr, now {cfg.lr:g}), lengthen --warmup-steps, "
        f"keep --clip-grad on, or raise --max-skipped-steps ({cfg.max_skipped_steps}) to tolerate more")


@dataclass
class StepStats:
    """What one optimizer step did: the (unscaled, pre-clipping) global gradient norm (``inf`` when an fp16
    step overflowed), whether the step was skipped, and the fp16 loss scale for the next step (None otherwise)."""

    grad_norm: float
    skipped: bool = False
    loss_scale: float | None = None


def grad_norm_weights(model: nn.Module, tp_rank: int) -> dict[nn.Parameter, bool | int]:
    """Which parameters (or leading elements of them) this rank counts in the global gradient norm.

    TP-sharded parameters count on every TP rank (each holds a different slice); parameters replicated across
    TP (LayerNorms, row-parallel biases, position embeddings) count on TP rank 0 only; K/V rows shared by
    several TP ranks (tp > KV heads) count on the first of them, the others counting their shard's leading
    elements only (an int). A summed all-reduce of the squares over the model-parallel group then gives exactly
    the unsharded model's norm.
    """
    def counted(p: nn.Parameter) -> bool | int:
        spec = p.shard_spec
        if spec.partition_dim is None:
            return tp_rank == 0
        n = spec.unique_numel(tuple(p.shape), tp_rank)
        return True if n == p.numel() else n

    return {p: counted(p) for p in model.parameters()}
