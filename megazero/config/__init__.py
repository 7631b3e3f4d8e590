"""Configuration: the typed dataclasses of a run, their resolution against a world and validation, the command
line, and the DeepSpeed JSON adapter. Every other package receives a resolved :class:`Config` (or one of its
sections); nothing here imports the runtime."""

from megazero.config.errors import ConfigError, ConfigWarning
from megazero.config.resolve import resolve_config
from megazero.config.schema import (
    PRESETS,
    ActivationCheckpointingConfig,
    Config,
    DataConfig,
    LoggingConfig,
    LossScaleConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    SchedulerConfig,
    TrainingConfig,
    ZeroConfig,
    model_preset,
)

__all__ = [
    "PRESETS",
    "ActivationCheckpointingConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "LoggingConfig",
    "LossScaleConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "ZeroConfig",
    "model_preset",
    "resolve_config",
]
