"""Checkpoint storage: the step directories under ``--save DIR``, the ``latest`` pointer, listing, finding
and pruning them, and the collective verdict that makes a step that can fail on some ranks fail on all.

Layout of ``--save DIR``::

    DIR/latest                          "step_00000200": the newest complete checkpoint (atomic pointer)
    DIR/step_00000200/rank_00000.safetensors ... rank_{world-1}.safetensors
    DIR/step_00000200/tokenizer.model   the run's SentencePiece model (copied)
    DIR/step_00000200/manifest.json     written last: its presence makes the step directory a checkpoint

A step directory without a manifest is incomplete (its save was interrupted) and is never loaded; a complete
one being replaced is moved aside to ``step_X.replaced`` until the new one is complete.

**Failure handling.** A step that can fail on some ranks only ends in a collective verdict (:func:`agree`):
*every* rank raises :class:`CheckpointError` with the lowest failing rank's message (naming the file or
setting at fault), so no rank waits for a peer that has already failed. A failure that is a bug rather than a
bad file or setting keeps its own exception (and traceback) on the rank where it happened.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megazero.config.errors import UserError
from megazero.observe.log import get_logger

if TYPE_CHECKING:
    from megazero.distributed.context import ParallelContext

__all__ = [
    "LATEST",
    "MANIFEST",
    "TOKENIZER",
    "CheckpointError",
    "agree",
    "describe",
    "find_checkpoint",
    "first_failure",
    "list_checkpoints",
    "resume_step_dir",
    "prepare_step_dir",
    "prune",
    "step_dir_name",
]

MANIFEST, LATEST, TOKENIZER = "manifest.json", "latest", "tokenizer.model"
_STEP_RE = re.compile(r"step_(\d{8})(\.replaced)?$")
_MSG_BYTES = 4096


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be written or read; the message names the file or setting at fault."""


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step`` (``step_00000200``)."""
    return f"step_{step:08d}"


def list_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints (step directories with a manifest) under ``root``, oldest first."""
    root = Path(root)
    out = []
    for d in root.glob("step_*") if root.is_dir() else []:
        m = _STEP_RE.fullmatch(d.name)
        if m and (d / MANIFEST).is_file():
            out.append((int(m.group(1)), 0 if m.group(2) else 1, d))
    return [(s, d) for s, _, d in sorted(out)]


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The step directory to load for ``path``: itself if it holds a manifest, else the one ``latest`` names
    under it, else (``latest`` missing or naming an incomplete step) the newest complete one; None if none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    if _STEP_RE.fullmatch(path.name) and path.is_dir():
        raise CheckpointError(f"{path} has no {MANIFEST}: it is an incomplete checkpoint (its save was interrupted)"
                              f"; load another step or the directory above it")
    latest = path / LATEST
    if latest.is_file():
        target = path / latest.read_text().strip()
        if (target / MANIFEST).is_file():
            return target
        get_logger().warning("%s names %s, which is not a complete checkpoint; using the newest complete one",
                             latest, target.name)
    found = list_checkpoints(path)
    return found[-1][1] if found else None



def resume_step_dir(load: str | os.PathLike | None, save: str | os.PathLike | None) -> Path | None:
    """The step directory a run with ``--load load`` (``"auto"``: the newest under ``save``) resumes from, or
    None: no ``--load``, none saved yet, or one that cannot be read (loading itself reports what is wrong)."""
    root = save if load == "auto" else load
    try:
        return find_checkpoint(root) if root is not None else None
    except (CheckpointError, OSError):
        return None

def _remove_step_dir(d: Path) -> None:
    (d / MANIFEST).unlink(missing_ok=True)  # first: a half-deleted directory must not look complete
    shutil.rmtree(d, ignore_errors=True)


def prepare_step_dir(step_dir: Path) -> None:
    """An empty ``step_dir``: an incomplete one is removed, a complete one moved aside to ``.replaced``."""
    if step_dir.exists():
        if (step_dir / MANIFEST).is_file():
            aside = step_dir.with_name(step_dir.name + ".replaced")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(step_dir, aside)  # still loadable until the new one is complete
        else:
            shutil.rmtree(step_dir)
    step_dir.mkdir(parents=True)


def prune(root: Path, current: Path, keep_last: int | None) -> None:
    """Remove incomplete or replaced step directories and, with ``keep_last``, all but the newest complete."""
    for d in root.glob("step_*"):
        m = _STEP_RE.fullmatch(d.name)
        if d != current and d.is_dir() and (not m or m.group(2) or not (d / MANIFEST).is_file()):
            _remove_step_dir(d)
    for f in root.glob(f".{LATEST}.tmp-*"):  # left by a kill while the pointer was written
        f.unlink(missing_ok=True)
    if keep_last:
        for _, d in list_checkpoints(root)[:-keep_last]:
            if d != current:
                _remove_step_dir(d)


def describe(e: BaseException) -> str:
    """The message of a failure as the other ranks will read it."""
    return str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"


def first_failure(ctx: ParallelContext, error: BaseException | None) -> str | None:
    """Collective: None if no rank failed, else the lowest failing rank's message (on the other ranks as ``rank r
    reports: ...``, so that each printed line names its own rank first): a world all-reduce plus, on failure, a
    broadcast of the message. A failure that is a bug
    rather than a bad file or setting re-raises on its rank (keeping its traceback) and raises
    :class:`CheckpointError` on the others."""
    world = ctx.world_group
    if world.size == 1:
        if error is None:
            return None
        _raise_bug(error)
        return describe(error)
    first = torch.tensor([ctx.rank if error is not None else world.size], dtype=torch.int64, device=world.device)
    world.all_reduce(first, op="min", tag="checkpoint")
    src = int(first.item())
    if src == world.size:
        return None
    buf = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
    if ctx.rank == src:
        data = (b"U" if isinstance(error, (UserError, OSError)) else b"B") + describe(error).encode()
        data = data[:_MSG_BYTES]
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(world.device)
    world.broadcast(buf, src=src, tag="checkpoint")
    text = bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")
    if ctx.rank == src:
        _raise_bug(error)
        return text[1:]
    if text[0] == "B":
        raise CheckpointError(f"rank {src} reports: {text[1:]}") from error
    return f"rank {src} reports: {text[1:]}"  # this line is printed as rank ctx.rank's: the finder named first


def agree(ctx: ParallelContext, error: BaseException | None) -> None:
    """Collective: if any rank failed, every rank raises :class:`CheckpointError` with the lowest failing
    rank's message (:func:`first_failure`)."""
    msg = first_failure(ctx, error)
    if msg is not None:
        raise CheckpointError(msg) from error


def _raise_bug(error: BaseException) -> None:
    """Re-raise a failure that is neither the user's nor the file system's: a bug keeps its traceback."""
    if not isinstance(error, (UserError, OSError)):
        raise error

