"""Context parallelism: one sample's sequence split across the CP group, and attention over the split sequence.

The sequence is cut into 2·cp chunks and CP rank ``i`` holds chunks ``i`` and ``2cp - 1 - i`` so that causal
work is balanced (:mod:`.sharding`, which also gives each local token its true position for position
embeddings and masks). :func:`context_parallel_attention` is the call a model makes in place of
``scaled_dot_product_attention``: ring attention by default (:mod:`.ring`: K/V pass around the ring in batched,
NCCL-ordered hops, partial results merged by their log-sum-exp, dK/dV passed back round in the backward), or
an all-gather of K/V per layer (:mod:`.attention` says when each fits). Leaf code receives the CP ``Group``
only.
"""

from megazero.context_parallel.attention import (
    CP_ATTENTION_MODES,
    allgather_attention,
    context_parallel_attention,
)
from megazero.context_parallel.ring import ring_attention
from megazero.context_parallel.sharding import (
    chunk_ids,
    gather_sequence,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "CP_ATTENTION_MODES",
    "allgather_attention",
    "chunk_ids",
    "context_parallel_attention",
    "gather_sequence",
    "local_positions",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]
