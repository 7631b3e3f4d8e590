"""Configuration: the typed dataclasses of a run, their resolution against a world and validation, the command
line, and the DeepSpeed JSON adapter. Every other package receives a resolved :class:`Config` (or one of its
sections); nothing here imports the runtime."""

from megazero.config.schema import (
    PRESETS,
    ActivationCheckpointingConfig,
    Config,
    ConfigError,
    ConfigWarning,
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
    resolve_config,
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
