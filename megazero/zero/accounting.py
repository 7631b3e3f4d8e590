"""Memory accounting of the model states a ZeRO rank holds, measured on the live tensors.

The categories are the ZeRO paper's (parameters, gradients, fp32 master copy, optimizer states), as
``metrics.jsonl`` memory records and the estimator (:func:`megazero.plan.estimate.model_state_bytes`) name them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megazero.distributed import device_io
from megazero.zero.bucketed import BucketedParams, storage_bytes
from megazero.zero.stage3.params import Stage3Params

__all__ = ["model_state_bytes"]


def model_state_bytes(model: nn.Module, store: BucketedParams | Stage3Params, master: torch.Tensor | None,
                      moments: Sequence[torch.Tensor], host_grads: torch.Tensor | None = None) -> dict[str, int]:
    """Bytes of the model states this rank holds now (storages counted once).

    ``params_bytes``: the model's parameter storages plus parameter shards/buffers the store keeps;
    ``grads_bytes``: the accumulated gradient (full at stages 0-1, the owned partition at 2-3, in
    ``grad_dtype``), ``host_grads`` (the fp32 host copy under optimizer offload) and stray ``.grad``;
    ``master_params_bytes``: the fp32 ``master`` partition (None in fp32, where parameters are their own
    master); ``optimizer_states_bytes``: the Adam ``moments``; ``offloaded_bytes``: how much of all the above
    lives in host memory while the rest is on an accelerator, read from each tensor's device (0 when
    everything is on the CPU), so the device holds the sum of the four minus this; ``comm_buffers_bytes``:
    buffers allocated once for communication (stage 2's staging pool of ``max_inflight_buckets`` buckets), not
    a model state.
    """
    seen: set[int] = set()
    held = store.held_tensors()
    kinds = {"params_bytes": [p for p in model.parameters()] + held["params"],
             "grads_bytes": [p.grad for p in model.parameters()] + held["grads"] + [host_grads],
             "master_params_bytes": [master] if master is not None else [],
             "optimizer_states_bytes": list(moments)}
    out = {k: storage_bytes(ts, seen) for k, ts in kinds.items()}
    tensors = [t for ts in kinds.values() for t in ts if t is not None and t.untyped_storage().nbytes()]
    on_accelerator = any(not device_io.is_host(t) for t in tensors)
    out["offloaded_bytes"] = storage_bytes([t for t in tensors if device_io.is_host(t)]) if on_accelerator else 0
    out["comm_buffers_bytes"] = storage_bytes(held.get("comm", []), seen)
    return out
