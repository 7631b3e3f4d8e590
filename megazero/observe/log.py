"""Rank-aware logging through one helper: rank 0 logs at INFO, other ranks only warnings and errors; and the one
line an entry point prints for a failure (:func:`report_failure`).

Every line carries the rank, so interleaved output from many processes stays readable.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import TextIO

import torch

from megazero.config.errors import ConfigError, ConfigWarning, UserError
from megazero.distributed.context import TopologyError
from megazero.distributed.failure import announce_failure, explain_peer_failure, is_peer_failure

__all__ = ["DEBUG_ENV", "debug_requested", "get_logger", "log_warnings", "report_failure", "setup_logging",
           "write_line"]

DEBUG_ENV = "MEGAZERO_DEBUG"  # non-empty and not "0": a failure prints its traceback too
_SETTINGS = (ConfigError, TopologyError)  # a setting is wrong: the line says all, exit status 2 as argparse


def setup_logging(rank: int, world_size: int, level: int = logging.INFO) -> logging.Logger:
    """Configure the ``megazero`` logger for this rank and return it."""
    logger = logging.getLogger("megazero")
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(level if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger("megazero")


def log_warnings(caught: list[warnings.WarningMessage], rank: int) -> None:
    """Warnings caught while the settings were read: a :class:`~megazero.config.errors.ConfigWarning` is the same
    on every rank, so rank 0 logs it as one line; any other warning is shown as Python shows it."""
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            if rank == 0:
                get_logger().warning("%s", w.message)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def debug_requested(argv: Sequence[str] = ()) -> bool:
    """``--debug`` among ``argv`` or ``MEGAZERO_DEBUG`` set (not to "0"): failures show their traceback."""
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "0") not in ("", "0")


def _one_line(e: BaseException) -> str | None:
    """The message of a failure the user can act on, or None for a bug (it keeps its traceback)."""
    if isinstance(e, (UserError, *_SETTINGS)):
        return str(e)
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        first = (str(e).strip().splitlines() or [""])[0]
        return (f"out of memory ({first[:200]}): lower --micro-batch-size (keeping --global-batch-size), use "
                "--activation-checkpointing full, a higher --zero-stage or more ranks; tools/estimate_memory.py "
                "shows what a rank needs")
    if isinstance(e, OSError):  # a file, directory or disk: what the user gave or has
        return f"{type(e).__name__}: {e}"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    return None


def write_line(text: str, stream: TextIO | None = None) -> None:
    """``text`` and its newline on ``stream`` (stderr) in one write to the file descriptor, so that the lines of
    ranks sharing a terminal or a pipe never run together (``print`` writes the text and the newline apart)."""
    stream = stream or sys.stderr
    data = (text + "\n").encode(getattr(stream, "encoding", None) or "utf-8", errors="replace")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream (pytest): no descriptor to share
        stream.write(text + "\n")
        stream.flush()
        return
    stream.flush()
    while data:
        data = data[os.write(fd, data):]


def _tell_launcher(line: str) -> None:
    """Under torchrun, ``line`` as this worker's error file (what ``@record`` writes): torchrun's closing summary then
    shows it for each failed rank, and picks the earliest as its "Root Cause", instead of a pointer to its docs."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass  # the summary is a courtesy; the line is on stderr already


def report_failure(e: BaseException, rank: int | None = None, *, world_size: int = 1, timeout_s: float = 300.0,
                   debug: bool = False, how_to_debug: str = "--debug") -> int:
    """Print ``e`` as one line on this rank's stderr and return the exit status for it.

    A :class:`~megazero.config.errors.UserError` (and an ``OSError``, out of memory, Ctrl-C) is one line,
    ``error (rank R): message``, with its traceback only when ``debug``; a broken collective becomes a line
    naming the peer that failed or stopped (:func:`~megazero.distributed.failure.explain_peer_failure`); any
    other exception is a bug and prints its traceback before the line. In a world of several ranks the line is
    posted to the job's store too, so that the peers can name this rank. Exit status: 2 for settings
    (``ConfigError``, ``TopologyError``: as argparse), 130 for Ctrl-C, else 1. The hint for the traceback is
    ``how_to_debug``: ``--debug``, which every entry point takes.
    """
    if world_size > 1 and is_peer_failure(e):
        e = explain_peer_failure(e, rank or 0, world_size, timeout_s)
    line = _one_line(e)
    if line is None or debug:
        traceback.print_exception(e, file=sys.stderr)
    if line is None:
        line = f"unexpected {type(e).__name__}: {e} (a bug: the traceback above shows where; please report it)"
    elif not debug and not isinstance(e, (*_SETTINGS, KeyboardInterrupt)):
        line += f" [traceback: {how_to_debug}]"
    prefix = "error: " if rank is None else f"error (rank {rank}): "
    write_line(prefix + line)  # first: a peer that reads the reason below must not print before this rank
    _tell_launcher(prefix + line)
    if world_size > 1:
        announce_failure(rank or 0, line)
    if isinstance(e, KeyboardInterrupt):
        return 130
    return 2 if isinstance(e, _SETTINGS) else 1
