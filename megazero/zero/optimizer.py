"""The optimizer wrapper every training step goes through: gradient reduction over DP, clipping, Adam(W).

This first version is ZeRO stage 0 (plain data parallelism): every rank keeps full fp32 parameters,
gradients and Adam moments; gradients are all-reduced over the DP group at the accumulation boundary (one
all-reduce of the flat gradient: 2Ψ elements per step whatever the micro-batch count m). Stages 1-3 build
on the same interface.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from megazero.config import OptimizerConfig, ZeroConfig
from megazero.distributed import Group

__all__ = ["StepStats", "ZeroOptimizer", "grad_norm_weights"]


@dataclass
class StepStats:
    grad_norm: float
    skipped: bool = False
    loss_scale: float | None = None


def grad_norm_weights(model: nn.Module, tp_rank: int) -> dict[nn.Parameter, bool]:
    """Which parameters this rank counts in the global gradient norm.

    TP-sharded parameters count on every TP rank (each holds a different slice); parameters replicated across
    TP (LayerNorms, row-parallel biases, position embeddings) count on TP rank 0 only. A summed all-reduce of
    the squares over the model-parallel group then gives exactly the unsharded model's norm.
    """
    return {p: p.shard_spec.partition_dim is not None or tp_rank == 0 for p in model.parameters()}


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings); none on biases and LayerNorm parameters."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class ZeroOptimizer:
    """Adam/AdamW over the model's parameters with gradients reduced across ``dp_group``.

    Call :meth:`zero_grad`, then :meth:`backward` once per micro-batch with that micro-batch's share of the
    global loss, then :meth:`step`. ``norm_group`` is the group over which squared gradient norms are summed
    (the model-parallel group: tp x pp); ``norm_counted`` says which parameters this rank counts.
    """

    def __init__(
        self,
        model: nn.Module,
        zero_cfg: ZeroConfig,
        opt_cfg: OptimizerConfig,
        dp_group: Group,
        norm_group: Group | None = None,
        norm_counted: dict[nn.Parameter, bool] | None = None,
        precision: str = "fp32",
    ) -> None:
        if zero_cfg.stage != 0:
            raise NotImplementedError(f"ZeRO stage {zero_cfg.stage} is not supported yet")
        if precision != "fp32":
            raise NotImplementedError(f"--precision {precision} is not supported yet")
        self.model = model
        self.cfg = zero_cfg
        self.opt_cfg = opt_cfg
        self.dp_group = dp_group
        self.norm_group = norm_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.norm_counted = norm_counted or {p: True for p in self.params}
        groups = _param_groups(model, opt_cfg.weight_decay)
        kwargs = dict(lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps, foreach=True)
        cls = torch.optim.AdamW if opt_cfg.decoupled_weight_decay else torch.optim.Adam
        self.optimizer = cls(groups, **kwargs)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _reduce_gradients(self) -> None:
        if self.dp_group.size == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dp_group.all_reduce(flat, tag="grad")
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset: offset + n].view_as(p)
            offset += n

    def _grad_norm(self) -> float:
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and self.norm_counted.get(p, True):
                sq += p.grad.detach().double().pow(2).sum()
        if self.norm_group is not None:
            self.norm_group.all_reduce(sq, tag="other")
        return math.sqrt(sq.item())

    def step(self, lr: float) -> StepStats:
        """Reduce gradients, clip by the global norm, and update with learning rate ``lr``."""
        self._reduce_gradients()
        norm = self._grad_norm()
        clip = self.opt_cfg.clip_grad
        if clip > 0:
            coef = clip / (norm + 1e-6)
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return StepStats(grad_norm=norm)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients, master parameters and optimizer states this rank holds."""
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        states = sum(
            t.numel() * t.element_size()
            for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.ndim > 0
        )
        return {"params_bytes": params, "grads_bytes": grads, "master_params_bytes": 0,
                "optimizer_states_bytes": states}
