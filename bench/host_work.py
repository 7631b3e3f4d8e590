"""Host work per training step, before and after issue 21's item 6, on CPU gloo ranks.

    python bench/host_work.py                       # the tiny preset, dp 4
    python bench/host_work.py --num-layers 6 --hidden-size 768 --num-heads 12 --seq-len 32 --vocab-size 8192

Both variants run the production step (:meth:`megazero.train.engine.Engine.train_step`) in the same world, in
alternating blocks of steps, on the same batches:

* ``before``: the batch collated on the training thread between steps (``collate`` over the sampler), the
  saved-tensor hooks counting activations in every forward, and the squared gradient norm through one
  ``torch.linalg.vector_norm`` per counted run (``torch._foreach_norm`` replaced by that loop for the variant);
* ``after``: the batch taken from :class:`megazero.data.loader.PrefetchLoader` (collated on its thread while the
  previous step ran), the hooks off (the trainer counts on logged steps only), ``torch._foreach_norm``.

A step is timed on every rank from asking for its batch to the end of the optimizer step: wall time (the slowest
rank's) and CPU time (``time.process_time``, all threads of the rank, the loader's included, summed over the
ranks). The table gives medians over the timed steps. On a shared machine wall time follows the neighbours'
load; CPU time is the work a variant asks of the machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from tests.dist import run_world  # noqa: E402


def _rank(ctx, flags: list[str], steps: int, warmup: int, blocks: int) -> dict[str, list[tuple[float, float]]]:
    from megazero.config.cli import parse_args
    from megazero.data import DistributedBatchSampler, TokenDataset, collate
    from megazero.data.loader import PrefetchLoader
    from megazero.train.engine import Engine

    cfg = parse_args(flags).resolve(ctx.world_size)
    m, t = cfg.model, cfg.training
    tokens = np.random.default_rng(0).integers(0, m.vocab_size, 64 * t.global_batch_size * (m.seq_len + 1))
    ds = TokenDataset(tokens.astype(np.int64), seq_len=m.seq_len)
    engine = Engine(cfg, ctx)
    foreach_norm = torch._foreach_norm

    def norm_loop(tensors, ord=2, dtype=None):  # the code before: one vector_norm per counted run
        return [torch.linalg.vector_norm(x, ord, dtype=dtype) for x in tensors]

    out: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for block in range(blocks):
        for variant in (("before", "after") if block % 2 == 0 else ("after", "before")):
            sampler = DistributedBatchSampler(len(ds), t.global_batch_size, t.micro_batch_size, ctx.dp_rank,
                                              ctx.dp_size, seed=0)
            loader = PrefetchLoader(ds, sampler) if variant == "after" else None
            torch._foreach_norm = norm_loop if variant == "before" else foreach_norm
            try:
                for i in range(warmup + steps):
                    ctx.world_group.barrier()
                    wall, cpu = time.perf_counter(), time.process_time()
                    if loader is None:
                        batch = [collate(ds, idx) for idx in sampler.next_global_batch()]
                    else:
                        batch = loader.next_global_batch()
                    engine.train_step(batch, measure=variant == "before")
                    if i >= warmup:
                        out[variant].append((time.perf_counter() - wall, time.process_time() - cpu))
            finally:
                torch._foreach_norm = foreach_norm
                if loader is not None:
                    loader.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per block")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per variant, alternating which goes first")
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--global-batch-size", type=int, default=16)
    args, model_flags = ap.parse_known_args(argv)
    flags = [*model_flags, "--dp", str(args.dp), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.global_batch_size)]
    ranks = run_world(_rank, args.dp, flags, args.steps, args.warmup, args.blocks, timeout=3600)
    print(f"flags: {' '.join(flags)}; {args.blocks} blocks x {args.steps} timed steps per variant")
    print("| variant | median wall / step (ms) | median CPU / step, all ranks (ms) |")
    print("|---|---|---|")
    for variant in ("before", "after"):
        n = len(ranks[0][variant])
        wall = [max(r[variant][i][0] for r in ranks) for i in range(n)]
        cpu = [sum(r[variant][i][1] for r in ranks) for i in range(n)]
        print(f"| {variant} | {statistics.median(wall) * 1e3:.1f} | {statistics.median(cpu) * 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
