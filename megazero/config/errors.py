"""The two ways configuration reports a problem, shared by the schema, resolution, the command line and the
DeepSpeed adapter: an error that stops the run, or a warning for a setting that is accepted without effect."""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigWarning"]


class ConfigError(ValueError):
    """A setting that cannot work; the message names the setting and how to fix it."""


class ConfigWarning(UserWarning):
    """A setting that is accepted but has no effect (e.g. an ignored DeepSpeed key)."""
