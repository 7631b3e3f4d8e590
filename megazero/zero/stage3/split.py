"""ZeRO-3 in a zero-bubble B pass: the input-gradient half of a split backward
(:mod:`megazero.tensor_parallel.weight_grad`).

B runs autograd through the blocks for the stage input's gradient only, so each block must be gathered for it,
exactly as in a backward (the same pre-backward hooks, traced order, prefetch and order check). But no gradient
reaches the hooks in B, and the hooks are what release a block in an ordinary backward; so during B a block is
released when the next one is used (``Stage3Params._use_block``) and whatever is still gathered at the end of
B. Nothing is reduced in B. W runs between ``start_backward`` and ``finish_backward`` like a backward without a
graph: its gradients file into the units and each unit is reduce-scattered when its last W gradient arrives.
W needs no parameter gathered: a weight gradient is ``g^T x`` (layer input and output gradient, both stashed by
B), so the stage-3 volume stays 3mΨ (a gather in F, one in B, a reduce-scatter in W), less mΨ_own under ZB-H1
(one chunk per rank: its own units are gathered once per micro-batch, :mod:`.gather`'s "Carry").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

from megazero.zero.stage3.gather import BWD
from megazero.zero.stage3.params import Stage3Params

__all__ = ["input_backward"]


@contextmanager
def _stage3_input_backward(store: Stage3Params) -> Iterator[None]:
    store._in_backward = store._input_only = True
    store.sched.begin(BWD)
    try:
        yield
    finally:
        for unit in list(store.sched.gathered.values()):
            store.sched.release(unit)
        store.sched.end()
        store._in_backward = store._input_only = False
        store._touched = set()


def input_backward(store: object):
    """The context a B pass runs in for ``store`` (module docstring); nothing to do below stage 3."""
    return _stage3_input_backward(store) if isinstance(store, Stage3Params) else nullcontext()
