"""Loss scaling for fp16 training, with DeepSpeed's semantics.

``fp16.loss_scale`` 0 selects the :class:`DynamicLossScaler`: the scale starts at ``2**initial_scale_power``;
an overflow (a non-finite gradient anywhere, agreed across all ranks by the optimizer) skips the step and,
once ``hysteresis`` overflows have been seen, halves the scale (never below ``min_loss_scale``); after
``loss_scale_window`` consecutive good steps since the last overflow the scale doubles and the hysteresis
budget is restored. This is DeepSpeed's ``DynamicLossScaler`` with ``consecutive_hysteresis=False`` and
``raise_error_at_min_scale=True``: an overflow at the minimum scale stops the run. A positive
``loss_scale`` is static (:class:`StaticLossScaler`): overflowing steps are still skipped, the scale never
changes. bf16 and fp32 use no scaler (:func:`make_loss_scaler` returns None).
"""

from __future__ import annotations

from megazero.config.schema import LossScaleConfig

__all__ = ["DynamicLossScaler", "LossScaleError", "StaticLossScaler", "make_loss_scaler"]


class LossScaleError(RuntimeError):
    """The dynamic loss scale cannot be lowered any further."""


class StaticLossScaler:
    """A fixed loss scale."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Static scaling ignores overflows (the optimizer still skips the step)."""

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    """DeepSpeed's dynamic loss scaler (see the module docstring)."""

    dynamic = True

    def __init__(self, init_scale: float, scale_window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0,
                 scale_factor: float = 2.0, raise_error_at_min_scale: bool = True) -> None:
        self.scale = float(init_scale)
        self.scale_window = scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.scale_factor = scale_factor
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.cur_hysteresis = hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def update(self, overflow: bool) -> None:
        """Account for one optimizer step that did (``overflow``) or did not overflow."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleError(
                        f"fp16 gradients overflow at the minimum loss scale {self.min_scale}; lower "
                        "fp16.min_loss_scale, lower the learning rate, or train in bf16 (--precision bf16)")
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter")}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def make_loss_scaler(precision: str, cfg: LossScaleConfig | None) -> DynamicLossScaler | StaticLossScaler | None:
    """The scaler for ``precision``: fp16 gets a dynamic (``loss_scale`` 0) or static one, others None."""
    if precision != "fp16":
        return None
    cfg = cfg or LossScaleConfig()
    if cfg.loss_scale > 0:
        return StaticLossScaler(cfg.loss_scale)
    return DynamicLossScaler(init_scale=2.0 ** cfg.initial_scale_power, scale_window=cfg.loss_scale_window,
                             hysteresis=cfg.hysteresis, min_scale=cfg.min_loss_scale)
