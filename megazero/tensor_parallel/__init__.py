"""Megatron-style tensor parallelism: communication mappings, parallel layers, vocab-parallel cross-entropy, and the
once-per-step sum of sequence parallelism's partial gradients."""

from megazero.tensor_parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from megazero.tensor_parallel.finalize import finalize_grads
from megazero.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    shard_full_tensor,
)
from megazero.tensor_parallel.mappings import (
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    scatter_to_tp_region,
)

__all__ = [
    "IGNORE_INDEX",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "finalize_grads",
    "gather_from_tp_region",
    "reduce_from_tp_region",
    "scatter_to_tp_region",
    "shard_full_tensor",
    "vocab_parallel_cross_entropy",
]
