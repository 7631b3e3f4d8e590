"""Where a ZeRO step's CPU goes on gloo ranks: user against kernel time, page faults, and gloo's collectives.

    python bench/zero_cpu.py steps ddp,mz2,mz3 --reps 3                 # the 49M GPT, dp 4, fp32
    python bench/zero_cpu.py steps ddp,mz3 --model gpt2-124m --seq-len 32
    python bench/zero_cpu.py collectives --numel 7077888 --reps 3        # one 49M block, 4 ranks

``steps``: each contender of ``bench/zero_bench.py`` (same model, batches, AdamW, fused kernel everywhere) in a
fresh world per repetition, order rotated; per step, summed over the ranks, ``getrusage``'s user and system CPU
time, minor page faults and context switches, and the slowest rank's wall time; medians per repetition, then
the median over repetitions (wall: min-max too). On this machine the kernel time is mostly gloo's TCP copies
(``_copy_to_iter`` / ``_copy_from_iter`` in ``perf``) and page faults (about 1.4 us each, zeroing included).

``collectives``: the ways a 4-rank gloo group can reduce-scatter or gather ``--numel`` fp32 elements in place:
``all_reduce`` (the old fast path), ``reduce`` (one reduce per shard to its owner: megazero's fast path now),
``reduce_scatter`` (gloo's own), ``all_to_all`` (+ a local sum) and ``broadcast`` (one per shard: the all-gather's
fast path), with CPU time summed over the ranks.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import zero_bench as zb  # noqa: E402

from megazero.config.schema import OptimizerConfig, model_preset  # noqa: E402
from tests.dist import run_world  # noqa: E402


def _usage() -> tuple[float, float, int, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_nvcsw


def _steps_rank(ctx, c: zb.Contender, cfg, opt_cfg: OptimizerConfig, warmup: int, steps: int) -> list[tuple]:
    torch.set_num_threads(1)
    batches = zb._global_batches(cfg, ctx.dp_size, warmup + steps)
    r = ctx.dp_rank
    setup = zb.SETUPS[c.kind](ctx, c, cfg, opt_cfg, tokens=ctx.dp_size * cfg.seq_len, local_tokens=cfg.seq_len,
                              micro=1, adam="fused", precision="fp32")
    out = []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        u0, t0 = _usage(), time.perf_counter()
        setup.step(x[r: r + 1], y[r: r + 1])
        t1, u1 = time.perf_counter(), _usage()
        if i >= warmup:
            out.append((t1 - t0, *(b - a for a, b in zip(u0, u1))))
    if setup.close is not None:
        setup.close()
    return out


def _collective_rank(ctx, which: str, numel: int, reps: int) -> list[tuple]:
    torch.set_num_threads(1)
    g, n, rank = ctx.dp_group.process_group, ctx.dp_size, ctx.dp_rank
    s = numel // n
    x, out, res = torch.randn(s * n), torch.empty(s * n), []
    for i in range(reps + 1):
        dist.barrier(group=g)
        u0, t0 = _usage(), time.perf_counter()
        if which == "all_reduce":
            dist.all_reduce(x, group=g)
        elif which == "reduce":
            for w in [dist.reduce(x[k * s:(k + 1) * s], dst=k, group=g, async_op=True) for k in range(n)]:
                w.wait()
        elif which == "reduce_scatter":
            dist.reduce_scatter_tensor(x[rank * s:(rank + 1) * s], x, group=g)
        elif which == "all_to_all":
            dist.all_to_all_single(out, x, group=g)
            torch.sum(out.view(n, s), 0, out=x[rank * s:(rank + 1) * s])
        elif which == "broadcast":
            for w in [dist.broadcast(x[k * s:(k + 1) * s], src=k, group=g, async_op=True) for k in range(n)]:
                w.wait()
        t1, u1 = time.perf_counter(), _usage()
        if i:
            res.append((t1 - t0, *(b - a for a, b in zip(u0, u1))))
    return res


def _summarise(per_rank: list[list[tuple]]) -> list[float]:
    """Per step: the slowest rank's wall, the rest summed over ranks; then the median over steps."""
    steps = [(max(r[k][0] for r in per_rank), *[sum(r[k][j] for r in per_rank) for j in range(1, 5)])
             for k in range(len(per_rank[0]))]
    return [statistics.median(st[j] for st in steps) for j in range(5)]


def _line(name: str, reps: list[list[float]]) -> str:
    m = [statistics.median(r[j] for r in reps) for j in range(5)]
    walls = [r[0] for r in reps]
    return (f"| {name} | {1e3 * m[0]:.1f} | {1e3 * min(walls):.0f}-{1e3 * max(walls):.0f} | {1e3 * (m[1] + m[2]):.1f} "
            f"| {1e3 * m[1]:.1f} | {1e3 * m[2]:.1f} | {m[3]:.0f} | {m[4]:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("steps", "collectives"))
    ap.add_argument("contenders", nargs="?", default="ddp,mz2,mz3", help="steps: zero_bench.py contender names")
    ap.add_argument("--model", default=None, help="a preset (default: the 49M GPT, 6 x 768, vocab 8192, seq 32)")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--numel", type=int, default=7_077_888, help="collectives: fp32 elements (default: a 49M block)")
    a = ap.parse_args(argv)
    print(f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}; {os.cpu_count()} cores, dp {a.dp}")
    print("| contender | wall median (ms) | rep medians (ms) | CPU, all ranks (ms) | user | sys | minor faults "
          "| voluntary switches |\n|---|---|---|---|---|---|---|---|")
    if a.mode == "collectives":
        for which in ("all_reduce", "reduce", "reduce_scatter", "all_to_all", "broadcast"):
            print(_line(which, [_summarise(run_world(_collective_rank, a.dp, which, a.numel, a.reps, timeout=600))]),
                  flush=True)
        return 0
    cfg = (model_preset(a.model, seq_len=a.seq_len) if a.model else
           model_preset("tiny", num_layers=6, hidden_size=768, num_heads=12, seq_len=a.seq_len, vocab_size=8192))
    opt_cfg = OptimizerConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip_grad=1.0)
    names = a.contenders.split(",")
    results: dict[str, list[list[float]]] = {n: [] for n in names}
    for rep in range(a.reps):
        for n in names[rep % len(names):] + names[: rep % len(names)]:
            per_rank = run_world(_steps_rank, a.dp, zb.CONTENDERS[n], cfg, opt_cfg, a.warmup, a.steps, timeout=900)
            results[n].append(_summarise(per_rank))
    for n in names:
        print(_line(n, results[n]))
    print(f"load average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
