"""Distributed runtime: start-up, the rank grid and its process groups, checked collectives with their ledger,
and the one seam through which values are read back from the device.

Order of the grid: TP fastest, then CP, then DP, then PP (:mod:`.context`). Leaf code receives one :class:`Group`; only
the training recipe sees the whole :class:`ParallelContext`.
"""

from megazero.distributed.context import GridPosition, ParallelContext, RankGrid, TopologyError
from megazero.distributed.group import Group, P2PCall, backend_device
from megazero.distributed.launch import (
    DistEnv,
    default_backend,
    destroy_distributed,
    detect_env,
    init_distributed,
)
from megazero.distributed.ledger import VOLUME_TAGS, CommLedger

__all__ = [
    "VOLUME_TAGS",
    "CommLedger",
    "DistEnv",
    "GridPosition",
    "Group",
    "P2PCall",
    "ParallelContext",
    "RankGrid",
    "TopologyError",
    "backend_device",
    "default_backend",
    "destroy_distributed",
    "detect_env",
    "init_distributed",
]
