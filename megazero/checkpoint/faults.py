"""Crash tests' seam: kill or stop this rank at a named point, when ``MEGAZERO_FAULT`` asks for it.

It exists for the crash-safety tests (tests/test_checkpoint.py), which cannot reach into a torchrun job: they
set ``MEGAZERO_FAULT=point:rank:step[:stop]`` and the job SIGKILLs (with ``:stop``, SIGSTOPs: a hung rank) that
rank at that point, on a torchrun job's first attempt only, so that a restart resumes. The points are
``after_shards`` and ``after_manifest`` in :func:`~megazero.checkpoint.save.save_checkpoint` and ``step`` in the
training loop. Without the variable every call returns at once.
"""

from __future__ import annotations

import os
import signal

__all__ = ["FAULT_ENV", "maybe_inject_fault"]

FAULT_ENV = "MEGAZERO_FAULT"


def maybe_inject_fault(point: str, rank: int, step: int) -> None:
    """Testing hook: SIGKILL (or with a ``:stop`` suffix SIGSTOP, a hung rank) this process if
    ``MEGAZERO_FAULT`` is ``point:rank:step`` (on a torchrun job's first attempt only)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    want_point, want_rank, want_step, *action = spec.split(":")
    if point == want_point and rank == int(want_rank) and step == int(want_step):
        os.kill(os.getpid(), signal.SIGSTOP if action == ["stop"] else signal.SIGKILL)
