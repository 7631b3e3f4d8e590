"""ZeRO: optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) partitioned over DP ranks."""

from megazero.zero.optimizer import StepStats, ZeroOptimizer, grad_norm_weights

__all__ = ["StepStats", "ZeroOptimizer", "grad_norm_weights"]
