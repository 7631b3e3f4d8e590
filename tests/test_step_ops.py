"""The step around the model works on flat buckets, not on parameters: counted in dispatched aten ops.

A :class:`StepOps` dispatch mode sees every aten op of one training step (after a warm-up step) and files each
under the code that issued it: the ZeRO step (``megazero/zero/``, and the sequence-parallel finalisation
``megazero/tensor_parallel/finalize.py``), or the rest (model, loss, pipeline, engine, autograd's own
nodes). An in-place op that autograd runs into the store's gradient buffers (accumulating into a ``p.grad``
view one parameter at a time) counts as the step's too. Views and allocations launch nothing and are left out;
collectives (the ``c10d`` namespace) are counted apart.

The same model at 2 and at 4 layers, buckets of about a layer (stage 3: one unit per block), 2 micro-batches:
the step's kernels and collectives that two more layers add must be bounded by the buckets they add, not by
their 24 parameters (a copy per parameter per micro-batch would add 48). On a GPU each such op is a launch,
which no CPU timing shows.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist import run_world

FLAGS = ["--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512", "--micro-batch-size", "2",
         "--reduce-bucket-size", "50000"]  # about one block of 12 parameters (50k elements) per bucket
MICRO = 2  # micro-batches per step: accumulation is counted too
NO_COUNT = {"empty", "empty_like", "empty_strided", "new_empty", "set_", "resize_", "detach", "lift_fresh"}
STEP_TAGS = ("grad", "param", "norm", "tied")  # the ledger's tags of the step's collectives (not "act", "loss")
STEP_FILES = ("/megazero/zero/", "/megazero/tensor_parallel/finalize.py")


class StepOps(TorchDispatchMode):
    """Counts aten ops by (owner, name): owner ``step`` for ops the ZeRO step issues (module docstring) or
    that write into a storage of ``grad_ptrs`` from autograd, ``rest`` otherwise; views are not counted."""

    def __init__(self, grad_ptrs: set[int]) -> None:
        super().__init__()
        self.grad_ptrs = grad_ptrs
        self.counts: Counter = Counter()
        self.phase = "backward"  # forwards and backwards; "update" from the optimizer's prepare_step on

    @staticmethod
    def _owner() -> str:
        f = sys._getframe(2)
        while f is not None:
            name = f.f_code.co_filename
            if any(s in name for s in STEP_FILES):
                return "step"
            if "/megazero/distributed/" in name:
                return "comm"  # inside a collective's call (gloo's roads, the ledger): counted by the ledger
            if "/megazero/" in name:
                return "rest"
            if name.endswith("autograd/graph.py") and f.f_code.co_name == "_engine_run_backward":
                return "autograd"  # an autograd node run by the engine (no megazero frame inside it)
            f = f.f_back
        return "rest"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if func.is_view or name in NO_COUNT:
            return out
        owner = self._owner()
        if owner == "autograd":
            dest = args[0] if args and isinstance(args[0], torch.Tensor) else None
            into_grads = (name.endswith("_") and dest is not None
                          and dest.untyped_storage().data_ptr() in self.grad_ptrs)
            owner = "step" if into_grads else "rest"
        if func.namespace == "c10d" or owner == "comm":
            return out
        self.counts[(owner, self.phase)] += 1
        self.counts[(owner, name)] += 1
        return out


def _grad_ptrs(opt) -> set[int]:
    held = opt.store.held_tensors()
    return {t.untyped_storage().data_ptr() for t in held["grads"] + held.get("comm", []) if t is not None}


def _count_world(ctx, configs: list[tuple[str, list[str]]], cache: str) -> dict:
    """Per (config, layers): the step's counted ops of one step after a warm-up, buckets (owned segments)."""
    from megazero.config.cli import parse_args
    from megazero.train.engine import Engine

    out = {}
    for name, flags in configs:
        for layers in (2, 4):
            cfg = parse_args([*FLAGS, *flags, "--num-layers", str(layers), "--cache-dir", cache,
                              "--global-batch-size", str(2 * MICRO * ctx.dp_size)]).resolve(ctx.world_size)
            cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0))
            engine = Engine(cfg, ctx)
            gen = torch.Generator().manual_seed(ctx.dp_rank)
            batch = [(torch.randint(0, 512, (2, 32), generator=gen), torch.randint(0, 512, (2, 32), generator=gen))
                     for _ in range(MICRO)]
            engine.train_step(batch, measure=False)  # buffers that persist between steps exist from here on
            params = sum(1 for p in engine.model.parameters() if p.requires_grad)
            out[(name, layers)] = (count_step(ctx, engine, batch), len(engine.optimizer.store.segments), params)
    return out


def count_step(ctx, engine, batch) -> dict:
    """The counted ops of one ``engine.train_step(batch)`` by (phase, kind): ``backward`` up to the optimizer's
    ``prepare_step``, ``update`` from there; ``("step", "collective")`` the ledger's calls of the step's tags."""
    opt, prepare = engine.optimizer, engine.optimizer.prepare_step
    mode = StepOps(_grad_ptrs(opt))

    def update():
        mode.phase = "update"
        return prepare()

    opt.prepare_step = update
    calls = dict(ctx.ledger.calls)
    try:
        with mode:
            engine.train_step(batch, measure=False)
    finally:
        opt.prepare_step = prepare
    mode.counts[("step", "collective")] = sum(n - calls.get(k, 0) for k, n in ctx.ledger.calls.items()
                                              if k[2] in STEP_TAGS)
    return dict(mode.counts)


# every road a gradient takes: into the flat buffer as ``p.grad`` views (fp32 stages 0-1) or cast to fp32 (bf16),
# through stage 2's staging, stage 3's units (bf16: converted chunks), to the host (offload)
BF16 = ["--precision", "bf16"]
DP_CONFIGS = [("zero0", ["--zero-stage", "0"]), ("zero1-bf16", ["--zero-stage", "1", *BF16]),
              ("zero2", ["--zero-stage", "2"]), ("zero2-offload", ["--zero-stage", "2", "--offload-optimizer"]),
              ("zero3", ["--zero-stage", "3"]), ("zero3-bf16", ["--zero-stage", "3", *BF16])]
TP_CONFIGS = [(f"tp2-sp-zero{s}", ["--zero-stage", str(s), "--tp", "2", "--sequence-parallel"]) for s in (1, 3)]

# Kernels per bucket and micro-batch in the forwards and backwards: stages 0-2 a flush (foreach copy or add;
# two where the filed gradients reach the largest parameter's size first), the zeros of the padding or of
# pieces no gradient reached, the reduced slice copied or added into the owned gradient (stage 2); stage 3 a
# flush per largest parameter's worth of a block (a GPT block: about four), the padding's zeros, and in bf16
# two converted chunks, each copied in and out
PER_BUCKET_BACKWARD = {0: 4, 1: 4, 2: 4, 3: 9}
# Kernels per bucket in the optimizer step: the gradient's scaling, Adam's two fused calls (decayed and not)
# where the parameters are their own master, the fp32 conversion of a 16-bit segment, the offloaded copies
PER_BUCKET_UPDATE = 4
# Collectives per bucket and micro-batch: stage 3's two gathers and its reduction (in bf16 two, of converted
# chunks); per bucket and step the updated slices' all-gather
PER_BUCKET_COMM = 4 * MICRO + 1


def test_step_ops_grow_with_buckets_not_parameters(data_cache):
    """ZeRO 0-3 (fp32, bf16, offload) on 2 DP ranks, tp 2 + SP (ZeRO 1, 3) on 2 TP ranks: from 2 to 4 layers
    the step's kernels and collectives grow by at most a few per bucket added (the bounds above), and each
    bound is below what one op per parameter added would make (a per-parameter copy, step tensor or norm
    fails it)."""
    results = run_world(_count_world, 2, DP_CONFIGS, data_cache)[0]
    results.update(run_world(_count_world, 2, TP_CONFIGS, data_cache, tp=2)[0])
    lines, bad = [], []
    for name, _ in DP_CONFIGS + TP_CONFIGS:
        (c2, b2, p2), (c4, b4, p4) = results[(name, 2)], results[(name, 4)]
        d_buckets, d_params = b4 - b2, p4 - p2
        assert d_params == 24 and 0 < d_buckets, (name, d_params, d_buckets)
        stage = int(name.split("zero")[1][0])
        bounds = {"backward": PER_BUCKET_BACKWARD[stage] * MICRO, "update": PER_BUCKET_UPDATE,
                  "collective": PER_BUCKET_COMM}
        row = []
        for kind, per_bucket in bounds.items():
            n2, n4 = c2.get(("step", kind), 0), c4.get(("step", kind), 0)
            per_param = d_params * (MICRO if kind != "update" else 1)  # one op per parameter (per micro-batch)
            assert per_bucket * d_buckets < per_param, (name, kind)  # the bound can tell the two apart
            row.append(f"{kind} {n2:3d} -> {n4:3d}")
            if n4 - n2 > per_bucket * d_buckets:
                bad.append((name, kind))
        lines.append(f"{name:14s} " + "  ".join(row) + f"  buckets {b2} -> {b4}  params {p2} -> {p4}")
    print("\n" + "\n".join(lines))
    assert not bad, f"{bad} grow with parameters:\n" + "\n".join(lines)
