"""The step around the model per training step: ops it dispatches and the CPU time it takes (issue 27 item 2).

    python bench/step_ops.py                                  # GPT-2 124M's shape of step at a tiny width
    python bench/step_ops.py --stages 0,1,2,3 --precision fp32 --steps 8

One world of ``--dp`` forked gloo ranks runs the production step (:meth:`Engine.train_step`) for each ZeRO stage:
one warm-up step, one step counted by :class:`tests.test_step_ops.StepOps` (aten ops the ZeRO step issues in
the forwards/backwards and in the optimizer step, views and allocations left out; the step's collectives from the
ledger), then ``--steps`` timed steps: CPU time (``time.process_time``, all threads) summed over the ranks and
the slowest rank's wall time, medians. Run it on two trees (``PYTHONPATH=<tree>``) to compare them; on a shared
machine the CPU time is the steadier figure. Counted ops predict launches on a GPU, where CPU timings cannot.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from tests.dist import run_world  # noqa: E402
from tests.test_step_ops import count_step  # noqa: E402


def _rank(ctx, flags: list[str], stages: list[int], steps: int, micro: int) -> dict:
    from megazero.config.cli import parse_args
    from megazero.train.engine import Engine

    torch.manual_seed(0)
    out = {}
    for stage in stages:
        cfg = parse_args([*flags, "--zero-stage", str(stage),
                          "--global-batch-size", str(2 * micro * ctx.dp_size)]).resolve(ctx.world_size)
        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0))
        m = cfg.model
        engine = Engine(cfg, ctx)
        gen = torch.Generator().manual_seed(ctx.dp_rank)
        batch = [(torch.randint(0, m.vocab_size, (2, m.seq_len), generator=gen),
                  torch.randint(0, m.vocab_size, (2, m.seq_len), generator=gen)) for _ in range(micro)]
        engine.train_step(batch, measure=False)
        counts = count_step(ctx, engine, batch)
        times = []
        for _ in range(steps):
            ctx.world_group.barrier()
            cpu, wall = time.process_time(), time.perf_counter()
            engine.train_step(batch, measure=False)
            times.append((time.process_time() - cpu, time.perf_counter() - wall))
        params = sum(1 for p in engine.model.parameters() if p.requires_grad)
        out[stage] = (counts.get(("step", "backward"), 0), counts.get(("step", "update"), 0),
                      counts[("step", "collective")], len(engine.optimizer.store.segments), params, times)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--num-layers", default="12")
    ap.add_argument("--hidden-size", default="128")
    ap.add_argument("--num-heads", default="4")
    ap.add_argument("--seq-len", default="32")
    ap.add_argument("--vocab-size", default="8192")
    a = ap.parse_args()
    flags = ["--num-layers", a.num_layers, "--hidden-size", a.hidden_size, "--num-heads", a.num_heads,
             "--seq-len", a.seq_len, "--vocab-size", a.vocab_size, "--micro-batch-size", "2",
             "--precision", a.precision]
    stages = [int(s) for s in a.stages.split(",")]
    res = run_world(_rank, a.dp, flags, stages, a.steps, a.micro_batches, timeout=1800)
    print(f"dp {a.dp}, {a.num_layers} x {a.hidden_size}, vocab {a.vocab_size}, seq {a.seq_len}, {a.precision}, "
          f"{a.micro_batches} micro-batch(es); medians over {a.steps} steps")
    print("| stage | params | buckets | step kernels, fwd/bwd | step kernels, update | collectives "
          "| CPU ms / step, all ranks | wall ms / step |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in stages:
        bwd, upd, coll, buckets, params, _ = res[0][stage]
        cpu = statistics.median(sum(r[stage][5][i][0] for r in res) for i in range(a.steps)) * 1e3
        wall = statistics.median(max(r[stage][5][i][1] for r in res) for i in range(a.steps)) * 1e3
        print(f"| {stage} | {params} | {buckets} | {bwd} | {upd} | {coll} | {cpu:.0f} | {wall:.0f} |")


if __name__ == "__main__":
    main()
