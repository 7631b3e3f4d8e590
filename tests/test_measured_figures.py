"""Figures measured from the tensors themselves rather than from the code that reports them.

Pipeline in-flight micro-batches: each chunk's forward output gets a gradient hook from the test; a
micro-batch is in flight from the forward that built its graph until autograd actually runs backward
through it (the hook fires), and every output must be freed once the step is over. The executor's own
count (replayed from the schedule it runs) is compared with that measurement, not used as it.
"""

from __future__ import annotations

import gc
import weakref

import torch

from megazero.config.cli import parse_args
from megazero.train.engine import Engine
from tests.dist import run_world


def _in_flight(ctx, cache: str, schedule: str):
    cfg = parse_args(["--num-layers", "8", "--pp", str(ctx.pp_size), "--pp-schedule", schedule,
                      "--micro-batch-size", "1", "--global-batch-size", "8", "--vocab-size", "512", "--seq-len",
                      "32", "--hidden-size", "64", "--num-heads", "4", "--cache-dir", cache]).resolve(ctx.world_size)
    engine = Engine(cfg, ctx)
    live, peak, outputs = [0], [0], []

    def on_grad(g):
        live[0] -= 1

    def on_forward(module, args, out):
        if out.requires_grad:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            out.register_hook(on_grad)
            outputs.append(weakref.ref(out))

    for chunk in engine.chunks:
        chunk.register_forward_hook(on_forward)
    batch = [(torch.randint(0, 512, (1, 32)), torch.randint(0, 512, (1, 32))) for _ in range(8)]
    res = engine.train_step(batch)
    gc.collect()
    return {"measured": peak[0], "reported": res.peak_in_flight, "after": live[0], "forwards": len(outputs),
            "alive": sum(r() is not None for r in outputs), "bytes": engine.activation_peak_bytes}


def test_pipeline_in_flight_micro_batches_measured_from_live_graphs(data_cache):
    """pp 4, 8 micro-batches: 1F1B holds at most pp - r graphs on stage r, GPipe all 8; each backward ran and
    every output was freed; the executor reports what was measured; GPipe's saved activations are larger."""
    pp = 4
    one_f_one_b = run_world(_in_flight, pp, data_cache, "1f1b", pp=pp)
    gpipe = run_world(_in_flight, pp, data_cache, "gpipe", pp=pp)
    for runs, want in ((one_f_one_b, [pp - r for r in range(pp)]), (gpipe, [8] * pp)):
        assert [r["measured"] for r in runs] == want, runs
        assert [r["reported"] for r in runs] == want, runs
        assert all(r["after"] == 0 and r["forwards"] == 8 and r["alive"] == 0 for r in runs), runs
    assert all(g["bytes"] > f["bytes"] for g, f in zip(gpipe, one_f_one_b))
