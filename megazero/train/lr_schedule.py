"""Learning-rate schedules as pure functions of the step.

``lr_at(step, cfg, base_lr, train_steps)`` is the learning rate used by optimizer step ``step`` (counted from
0). ``base_lr`` is the peak (``OptimizerConfig.lr``); W is ``cfg.warmup_steps``, D the decay end
(``cfg.decay_steps``, default ``train_steps``), lo = ``cfg.warmup_min_lr``.

megazero schedules (DESIGN.md; warm-up as nanoGPT/Megatron, so step 0 already has a non-zero lr):

- ``cosine``: ``lo + (base_lr - lo) * (i + 1) / W`` for i < W; then cosine from base_lr to ``cfg.min_lr``
  with progress ``(i - W) / (D - W)``, so step W is at base_lr and steps >= D at min_lr (flat after D).
- ``constant``: the same warm-up, then base_lr.

DeepSpeed schedules (``deepspeed.runtime.lr_schedules``), DeepSpeed's formula at ``last_batch_iteration =
step``. DeepSpeed raises the warm-up length to at least 2, and its warm-up factor at step i < W is
``log(i + 1) / log(W)`` ("log", its default) or ``i / W`` ("linear"), so step 0 runs at the warm-up start:

- ``warmup_lr`` (WarmupLR): ``lo + (base_lr - lo) * factor`` during warm-up, then base_lr
  (= ``warmup_max_lr``).
- ``warmup_decay_lr`` (WarmupDecayLR): the same warm-up, then linear decay back to lo, reached at step D
  (``total_num_steps``): ``lo + (base_lr - lo) * max(0, (D - i) / max(1, D - W))``.
- ``warmup_cosine_lr`` (WarmupCosineLR): ``base_lr * ratio``; warm-up ratio ``r0 + (1 - r0) * factor`` with
  r0 = ``cfg.warmup_min_ratio``; then ``rmin + (1 - rmin) * (1 + cos(pi * (i - W + 1) / (D - W))) / 2`` with
  rmin = ``cfg.min_ratio`` (``cos_min_ratio``). DeepSpeed's cosine turns back up after D; here it stays at
  rmin.

(DeepSpeed itself applies these one step late: its engine runs optimizer step 0 before the scheduler's first
``step()``. megazero uses the formula at the step it is applied to.)
"""

from __future__ import annotations

import math

from megazero.config.schema import ConfigError, SchedulerConfig

__all__ = ["lr_at"]


def lr_at(step: int, cfg: SchedulerConfig, base_lr: float, train_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (from 0) under schedule ``cfg`` with peak ``base_lr``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    warmup = cfg.warmup_steps
    decay_end = train_steps if cfg.decay_steps is None else cfg.decay_steps
    lo = cfg.warmup_min_lr
    if cfg.name in ("cosine", "constant"):
        if step < warmup:
            return lo + (base_lr - lo) * (step + 1) / warmup
        if cfg.name == "constant":
            return base_lr
        if step >= decay_end:
            return cfg.min_lr
        progress = (step - warmup) / (decay_end - warmup)
        return cfg.min_lr + (base_lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    warmup = max(2, warmup)  # as DeepSpeed
    if step < warmup:
        if cfg.warmup_type == "log":
            factor = math.log(step + 1) / math.log(warmup)
        elif cfg.warmup_type == "linear":
            factor = step / warmup
        else:
            raise ConfigError(f"scheduler warmup_type {cfg.warmup_type!r} is not valid; use log or linear")
        if cfg.name == "warmup_cosine_lr":
            return base_lr * (cfg.warmup_min_ratio + (1.0 - cfg.warmup_min_ratio) * factor)
        if cfg.name in ("warmup_lr", "warmup_decay_lr"):
            return lo + (base_lr - lo) * factor
    if cfg.name == "warmup_lr":
        return base_lr
    if cfg.name == "warmup_decay_lr":
        return lo + (base_lr - lo) * max(0.0, (decay_end - step) / max(1, decay_end - warmup))
    if cfg.name == "warmup_cosine_lr":
        span = decay_end - warmup
        progress = 1.0 if span <= 0 else min(1.0, (step - warmup + 1) / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return base_lr * (cfg.min_ratio + (1.0 - cfg.min_ratio) * cosine)
    raise ConfigError(f"unknown learning-rate schedule {cfg.name!r} (--lr-schedule / scheduler.type)")
