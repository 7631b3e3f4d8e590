"""Model definitions."""

from megazero.model.gpt import GPT, init_parameters

__all__ = ["GPT", "init_parameters"]
