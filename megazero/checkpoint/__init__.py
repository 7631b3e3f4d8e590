"""Sharded checkpoints: each rank writes the states it owns, then rank 0 the manifest, then the ``latest``
pointer, each atomically; loading re-splits them for any topology."""

from megazero.checkpoint.sharded import (
    CheckpointError,
    CheckpointReader,
    find_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointReader",
    "find_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]
