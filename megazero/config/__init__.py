"""Configuration: the typed dataclasses of a run, their resolution against a world and validation, the command
line, and the DeepSpeed JSON adapter. Every other package receives a resolved :class:`Config` (or one of its
sections); nothing here imports the runtime."""

from megazero.config import schema
from megazero.config.resolve import resolve_config
from megazero.config.schema import *  # noqa: F403 - the schema's public names are the package's

__all__ = [*schema.__all__, "resolve_config"]
