"""Sharded checkpoints: each rank writes the states it owns, then rank 0 the manifest, then the ``latest``
pointer, each atomically; loading re-splits them for any topology.

By role: :mod:`~megazero.checkpoint.store` (step directories, ``latest``, the collective verdict),
:mod:`~megazero.checkpoint.canonical` (the stored form and the engine state it comes from),
:mod:`~megazero.checkpoint.save`, :mod:`~megazero.checkpoint.load` (reader and reshard on load),
:mod:`~megazero.checkpoint.safetensors_io`, and :mod:`~megazero.checkpoint.faults`, the crash tests' seam."""

from megazero.checkpoint.canonical import TrainState
from megazero.checkpoint.load import CheckpointReader, load_checkpoint
from megazero.checkpoint.save import save_checkpoint
from megazero.checkpoint.store import CheckpointError, find_checkpoint, list_checkpoints

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "TrainState",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
