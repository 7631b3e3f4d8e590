"""One training step: the recipe that composes the model, the ZeRO optimizer and (later) the pipeline schedule.

The recipe, in order: build this rank's model (its TP shard of its pipeline stage) -> initialise it from the
seed so every topology starts from the same weights -> wrap it in the ZeRO optimizer over the DP group ->
each step, run the micro-batches and let the optimizer reduce, clip and update.

The loss of a step is the token-weighted mean over the whole global batch (all micro-batches, all DP ranks):
each micro-batch contributes ``sum(per-token loss) / tokens_in_global_batch`` to the gradient, so the summed
gradient over DP ranks equals the single-process gradient of the mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megazero.config import Config
from megazero.lr_schedule import lr_at
from megazero.metrics import ActivationMemoryCounter
from megazero.model.gpt import GPT, init_parameters
from megazero.parallel_context import ParallelContext
from megazero.tensor_parallel import IGNORE_INDEX
from megazero.tensor_parallel.random import RNGTracker
from megazero.zero.optimizer import ZeroOptimizer, grad_norm_weights

__all__ = ["Engine", "StepResult"]

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (input ids [B, S], targets [B, S])


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    loss_scale: float | None
    skipped: bool
    tokens: int  # tokens in the global batch
    micro_batches: int


class Engine:
    """Builds this rank's model and optimizer from a resolved :class:`Config` and runs training steps."""

    def __init__(self, cfg: Config, ctx: ParallelContext, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.device = device or torch.device("cpu")
        if ctx.pp_size != 1:
            raise NotImplementedError("pipeline parallelism (--pp > 1) is not supported yet")
        self.rng_tracker = RNGTracker(cfg.training.seed, ctx.tp_rank, self.device)
        self.model = GPT(cfg.model, ctx.tp_group, sequence_parallel=cfg.parallel.sequence_parallel,
                         rng_tracker=self.rng_tracker).to(self.device)
        init_parameters(self.model, cfg.training.seed, ctx.tp_group)
        self.activations = ActivationMemoryCounter(self.model)
        self.optimizer = ZeroOptimizer(
            self.model,
            cfg.zero,
            cfg.optimizer,
            dp_group=ctx.dp_group,
            norm_group=ctx.mp_group,
            norm_counted=grad_norm_weights(self.model, ctx.tp_rank),
            precision=cfg.training.precision,
            loss_scale_cfg=cfg.loss_scale,
        )
        self.step = 0  # optimizer steps taken

    def lr(self, step: int | None = None) -> float:
        t = self.cfg.training
        return lr_at(self.step if step is None else step, self.cfg.scheduler, self.cfg.optimizer.lr, t.train_steps)

    def _global_tokens(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        local = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)
        n = torch.tensor([float(local)], dtype=torch.float64)
        self.ctx.dp_group.all_reduce(n, tag="loss")
        return n

    def train_step(self, micro_batches: list[MicroBatch]) -> StepResult:
        """One optimizer step over this DP rank's micro-batches of the global batch."""
        self.model.train()
        opt = self.optimizer
        opt.zero_grad()
        global_tokens = self._global_tokens(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for x, y in micro_batches:
            x, y = x.to(self.device), y.to(self.device)
            with self.activations.track():
                per_token = self.model(x, y)  # [B, S] fp32
            mb_sum = per_token.sum()
            opt.backward(mb_sum / global_tokens.item())
            loss_sum += mb_sum.detach().double().cpu()
        self.ctx.dp_group.all_reduce(loss_sum, tag="loss")
        lr = self.lr()
        stats = opt.step(lr)
        self.ctx.ledger.mark_step()
        self.step += 1
        return StepResult(
            step=self.step, loss=(loss_sum / global_tokens).item(), lr=lr, grad_norm=stats.grad_norm,
            loss_scale=stats.loss_scale, skipped=stats.skipped, tokens=int(global_tokens.item()),
            micro_batches=len(micro_batches),
        )

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[MicroBatch]) -> float:
        """Token-weighted mean loss over this DP rank's micro-batches, reduced over the DP group."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        for x, y in micro_batches:
            per_token = self.model(x.to(self.device), y.to(self.device))
            totals[0] += per_token.sum().double().cpu()
            totals[1] += int((y != IGNORE_INDEX).sum())
        self.ctx.dp_group.all_reduce(totals, tag="loss")
        return (totals[0] / totals[1]).item()
