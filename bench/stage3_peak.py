"""ZeRO-3 at the peak: gathered-parameter bytes and gradient bytes beyond the owned partition during training
steps, measured on the storages, dp 4, fp32, a 6-layer GPT (5.3M parameters), 2 micro-batches per step.

Sampled after every DP all-gather and reduce-scatter and after every gradient arrival: the bytes of every
all-gather receive buffer (tag ``param``) still alive, and of the store's gradient buffers other than the owned
partition (staging, in flight, pooled). Runs on any megazero checkout (``PYTHONPATH`` picks it), so the same
command measures before and after a change::

    PYTHONPATH=$PWD python bench/stage3_peak.py
"""
import json
import sys
import tempfile
import time
from dataclasses import replace

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from megazero.config.cli import parse_args
from megazero.data import build_datasets, resolve_tokenizer
from megazero.train.engine import Engine
from tests.dist import run_world

MODEL = ["--num-layers", "6", "--hidden-size", "256", "--num-heads", "4", "--seq-len", "64", "--vocab-size", "2048"]


def world(ctx, cache: str, persist: int, overlap: bool, recompute: bool) -> dict:
    """One configuration on this rank: the peaks and the last step's DP volume."""
    flags = [*MODEL, "--zero-stage", "3", "--micro-batch-size", "1", "--global-batch-size", "8", "--cache-dir", cache]
    if recompute:
        flags += ["--activation-checkpointing", "full"]
    cfg = parse_args(flags)
    cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=persist, overlap_comm=overlap))
    engine = Engine(cfg.resolve(ctx.world_size), ctx)
    store = engine.optimizer.store
    outs, peak = {}, {"gathered": 0, "grads": 0}
    group = ctx.dp_group
    gather, scatter = group.all_gather_into, group.reduce_scatter

    def sample():
        live = 0
        for k, ref in list(outs.items()):
            if ref.expired():
                del outs[k]
            else:
                live += torch.UntypedStorage._new_with_weak_ptr(ref.cdata).nbytes()
        # the owned partition: one flat buffer before 2026-11-23, one (lazily allocated) tensor per unit since
        owned = {t.untyped_storage().data_ptr() for t in
                 ([store.owned_grad] if hasattr(store, "owned_grad") else [u.grad for u in store.units])}
        held = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                for g in store.held_tensors()["grads"] if g is not None and g.untyped_storage().data_ptr() not in owned}
        peak["gathered"] = max(peak["gathered"], live)
        peak["grads"] = max(peak["grads"], sum(held.values()))

    def ag(output, input, tag="other", async_op=False):
        if tag == "param":
            ref = StorageWeakRef(output.untyped_storage())
            outs.setdefault(ref.cdata, ref)
        w = gather(output, input, tag=tag, async_op=async_op)
        sample()
        return w

    def rs(output, input, op="sum", tag="other", async_op=False):
        w = scatter(output, input, op=op, tag=tag, async_op=async_op)
        sample()
        return w

    group.all_gather_into, group.reduce_scatter = ag, rs
    for p in engine.model.parameters():
        p.register_post_accumulate_grad_hook(lambda _: sample())
    g = torch.Generator().manual_seed(0)
    b = [(torch.randint(0, 2048, (1, 64), generator=g), torch.randint(0, 2048, (1, 64), generator=g)) for _ in range(2)]
    vols = []
    for _ in range(3):
        engine.train_step(b)
        vols.append(ctx.ledger.dp_volume_last_step())
    psi = sum(p.numel() for p in engine.model.parameters())
    return {"psi": psi, "model_fp32_bytes": 4 * psi, "peak_gathered_bytes": peak["gathered"],
            "peak_grad_bytes_beyond_owned": peak["grads"], "dp_volume_per_step": vols[-1]}


if __name__ == "__main__":
    cache = tempfile.mkdtemp()
    build_datasets([], resolve_tokenizer([], 512, cache), 32, cache)
    for persist, overlap, recompute in [(0, True, False), (0, False, False), (100_000, True, False), (0, True, True)]:
        t = time.time()
        res = run_world(world, 4, cache, persist, overlap, recompute, timeout=900)
        print(json.dumps({"persistence": persist, "overlap_comm": overlap, "full_recompute": recompute,
                          "max_over_ranks": {k: max(r[k] for r in res) for k in res[0]}, "s": round(time.time() - t)}))
        sys.stdout.flush()
