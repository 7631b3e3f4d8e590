"""ZeRO stage 3: parameters live only as shards, gathered and released one unit (a transformer block, or a
chunk's own parameters) at a time."""

from megazero.zero.stage3.gather import GatherOrderError, GatherScheduler
from megazero.zero.stage3.params import Stage3Params

__all__ = ["GatherOrderError", "GatherScheduler", "Stage3Params"]
