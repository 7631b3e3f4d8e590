"""How megazero reports a problem the user can fix, shared by every package: :class:`UserError` and its kinds,
and a warning for a setting that is accepted without effect.

A :class:`UserError` is a setting, a file, a checkpoint or a peer the user can do something about. Its message
names what is wrong (the flag, file or rank) and the fix; the entry points (``pretrain/gpt.py``, ``tools/``)
print it as one line per rank, without a traceback, and exit non-zero (``--debug`` or ``MEGAZERO_DEBUG=1`` adds
the traceback; :func:`megazero.observe.log.report_failure`). Any other exception is a bug and keeps its
traceback. The kinds: :class:`ConfigError` (settings), ``CheckpointError`` (``megazero.checkpoint``),
``TopologyError`` and ``PeerError`` (``megazero.distributed``), ``DataError`` (``megazero.data``).
"""

from __future__ import annotations

__all__ = ["ConfigError", "ConfigWarning", "UserError"]


class UserError(Exception):
    """A failure the user can fix; the message names the setting, file or rank at fault and the fix."""


class ConfigError(UserError, ValueError):
    """A setting that cannot work; the message names the setting and how to fix it."""


class ConfigWarning(UserWarning):
    """A setting that is accepted but has no effect (e.g. an ignored DeepSpeed key)."""
