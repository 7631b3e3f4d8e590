"""Training: the recipe that builds one rank's share of the model and wraps it (:mod:`.recipe`), the engine that
runs one optimizer step (:mod:`.engine`), the loop around it (:mod:`.loop`) and the learning-rate schedule."""

from megazero.train.engine import Engine, StepResult
from megazero.train.loop import TrainSummary, run_training
from megazero.train.lr_schedule import lr_at

__all__ = ["Engine", "StepResult", "TrainSummary", "lr_at", "run_training"]
