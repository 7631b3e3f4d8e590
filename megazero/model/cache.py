"""The KV cache of incremental decoding: the keys and values of the positions a model has already processed.

One :class:`LayerKV` slot per transformer layer, keyed by the layer's global index, so the chunks one pipeline
rank holds share a cache, each touching only its own layers. A slot counts its own positions, so no caller has
to advance the cache: an attention call appends the keys and values of its new positions and attends over the
slot's whole prefix. A model reads the position of its first new token from its first layer's slot (learned
positions index the embedding with it; rotary ones rotate q and k by it). Slots hold this rank's heads (the
key/value heads, which grouped-query attention shares among several query heads), at ``max_len`` positions
allocated on first use in the dtype and device of the keys.
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "LayerKV"]


class LayerKV:
    """One layer's keys and values: two ``[B, heads, max_len, hd]`` buffers, the first ``length`` positions set."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' ``k``, ``v`` ([B, heads, S, hd]) after the cached ones; return the keys and
        values of every position so far ([B, heads, length + S, hd] views of the buffers)."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"the KV cache holds {self.max_len} positions; {end} do not fit")
        if self.k is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.k, self.v = k.new_empty(shape), v.new_empty(shape)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class KVCache:
    """The cache of one batch of sequences, for every layer this rank runs: pass it to ``GPT.forward``.

    ``max_len`` bounds the positions it can hold (the model's context).
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.layers: dict[int, LayerKV] = {}

    def layer(self, index: int) -> LayerKV:
        """The slot of the layer with global index ``index`` (empty on first use)."""
        if index not in self.layers:
            self.layers[index] = LayerKV(self.max_len)
        return self.layers[index]

    @property
    def length(self) -> int:
        """The positions cached so far: those every layer of this rank holds between forward calls."""
        return min((slot.length for slot in self.layers.values()), default=0)
