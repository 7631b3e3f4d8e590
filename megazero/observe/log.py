"""Rank-aware logging through one helper: rank 0 logs at INFO, other ranks only warnings and errors.

Every line carries the rank, so interleaved output from many processes stays readable.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["get_logger", "setup_logging"]


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
