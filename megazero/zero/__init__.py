"""ZeRO: optimizer states (stage 1), gradients (stage 2) and parameters (stage 3) partitioned over DP ranks."""

from megazero.zero.bucketed import FlatLayout, ShardedState, build_buckets, sharded_state
from megazero.zero.loss_scaler import DynamicLossScaler, LossScaleError, StaticLossScaler, make_loss_scaler
from megazero.zero.norm import StepStats, grad_norm_weights
from megazero.zero.optimizer import ZeroOptimizer

__all__ = [
    "DynamicLossScaler",
    "FlatLayout",
    "LossScaleError",
    "ShardedState",
    "StaticLossScaler",
    "StepStats",
    "ZeroOptimizer",
    "build_buckets",
    "grad_norm_weights",
    "make_loss_scaler",
    "sharded_state",
]
