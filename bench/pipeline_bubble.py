"""Pipeline bubbles: counted from each schedule's own timeline, and measured on CPU ranks.

    python bench/pipeline_bubble.py            # the timelines (instant)
    python bench/pipeline_bubble.py --run      # + step time and idle fraction at pp 4 on CPU gloo ranks

**Timelines.** Every rank's timeline (the exact action list the executor runs) is replayed with a micro-batch's
forward through one rank's share of the model costing 1 and its backward 2 (a split schedule's B and W 1 each),
communication free; idle slots divided by busy slots is the bubble fraction, compared with the analytic
(p - 1)/m and (1/v)(p - 1)/m.

**Measured** (``--run``): gpipe, 1f1b, interleaved (v = 2), zb-h1 and zbv at pp 4 in one world of 4 forked gloo
ranks (one thread each), one engine per schedule on the same model and batch, stepped in turn (so that a loaded
machine slows all alike); per rank the step's wall time, the time spent inside point-to-point calls (waiting for a
neighbour: gloo buffers sends, so this is the idle time), the process's CPU time and its point-to-point
exchanges, median over the measured steps. On a machine with fewer cores than ranks the ranks also wait for a
core, which no schedule removes: read the idle fractions side by side, not as absolutes. A schedule whose engine
cannot be built (a build without its runtime) prints its row as skipped, with the reason; the others still run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.pipeline.schedules import SPLIT_SCHEDULES, simulate  # noqa: E402

TIMELINES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4), ("zb-h1", 1), ("zbv", 2))
RUNS = (("gpipe", []), ("1f1b", []), ("interleaved", ["--virtual-stages", "2"]), ("zb-h1", []), ("zbv", []))
CHUNKS = {"interleaved": 2, "zbv": 2}  # model chunks per rank of each measured schedule


def timelines() -> None:
    print("| schedule | p | v | m | bubble (timeline) | vs 1F1B | peak in-flight F..B (stage 0 .. p-1) |"
          " peak W stashes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, v in TIMELINES:
        for p in (2, 4, 8):
            for m in (p, 2 * p, 4 * p):
                if name == "interleaved" and m % p:
                    continue
                r = simulate(name, p, m, v)
                base = simulate("1f1b", p, m).bubble_fraction
                peak = " ".join(f"{x:g}" for x in r.peak_in_flight)
                stash = " ".join(f"{x:g}" for x in r.peak_weight_stash) if name in SPLIT_SCHEDULES else "-"
                print(f"| {name} | {p} | {v} | {m} | {r.bubble_fraction:.4f} | {r.bubble_fraction / base:.3f} |"
                      f" {peak} | {stash} |")


def _rank(ctx, runs: list[tuple[str, list[str]]], steps: int, warmup: int, m: int, cache: str):
    """Every schedule's engine in this one world, stepped in turn (schedule after schedule, round after round,
    so that the machine's load falls on all alike). Per schedule, per measured step: (wall seconds, seconds
    inside point-to-point calls, CPU seconds of this process, point-to-point exchanges) on this rank; a schedule
    whose engine cannot be built here maps to the error's text."""
    import torch

    from megazero.config.cli import parse_args
    from megazero.pipeline.p2p import PipelineP2P
    from megazero.train.engine import Engine

    torch.set_num_threads(1)
    engines, out = {}, {}
    for name, flags in runs:
        try:
            engines[name] = Engine(parse_args([*flags, "--cache-dir", cache]).resolve(ctx.world_size), ctx)
            out[name] = []
        except Exception as e:  # noqa: BLE001 - a schedule this build cannot run: say why, measure the others
            out[name] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
    waited, calls = [0.0], [0]
    real = PipelineP2P.exchange

    def timed(self, call, outbox):
        t0 = time.perf_counter()
        calls[0] += 1
        try:
            return real(self, call, outbox)
        finally:
            waited[0] += time.perf_counter() - t0

    PipelineP2P.exchange = timed
    gen = torch.Generator().manual_seed(0)
    cfg = next(iter(engines.values())).cfg
    mb, seq, vocab = cfg.training.micro_batch_size, cfg.model.seq_len, cfg.model.vocab_size
    batch = [(torch.randint(0, vocab, (mb, seq), generator=gen), torch.randint(0, vocab, (mb, seq), generator=gen))
             for _ in range(m)]
    for i in range(warmup + steps):
        for name, engine in engines.items():
            ctx.world_group.all_reduce(torch.zeros(1), tag="other")  # start the step together
            waited[0], calls[0] = 0.0, 0
            t0, c0 = time.perf_counter(), time.process_time()
            engine.train_step(batch, measure=False)
            if i >= warmup:
                out[name].append((time.perf_counter() - t0, waited[0], time.process_time() - c0, calls[0]))
    return out


def measured(args) -> None:
    from tests.dist import run_world

    cache = args.cache_dir
    if cache is None:
        import tempfile

        from megazero.data import build_datasets, resolve_tokenizer

        cache = tempfile.mkdtemp(prefix="mz-bubble-")
        tok = resolve_tokenizer([], args.vocab_size, cache)
        build_datasets([], tok, args.seq_len, cache)
    base = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden), "--num-heads", "4",
            "--seq-len", str(args.seq_len), "--vocab-size", str(args.vocab_size), "--pp", "4",
            "--micro-batch-size", "1", "--global-batch-size", str(args.m), "--no-progress"]
    runs = [(name, [*base, "--pp-schedule", name, *extra]) for name, extra in RUNS
            if not args.schedules or name in args.schedules]
    print(f"pp 4, m = {args.m}, {args.layers} layers x hidden {args.hidden}, seq {args.seq_len}, fp32, "
          f"{args.steps} measured steps after {args.warmup}, the schedules stepped in turn in one world (medians)")
    print("| schedule | step time (s) | fastest step (s) | idle fraction, per rank (p2p wait / step) | mean idle |"
          " timeline idle / step | CPU s per step (rank max) | p2p exchanges per step (rank max) |")
    print("|---|---|---|---|---|---|---|---|")
    ranks = run_world(_rank, 4, runs, args.steps, args.warmup, args.m, cache, pp=4, timeout=3600)
    for name, _ in runs:
        per_rank = [r[name] for r in ranks]
        if isinstance(per_rank[0], str):
            print(f"| {name} | skipped: {per_rank[0]} | | | | | | |")
            continue
        walls = [max(r[i][0] for r in per_rank) for i in range(args.steps)]
        idle = [statistics.median(w / t for t, w, _c, _n in r) for r in per_rank]
        cpu = max(statistics.median(c for _t, _w, c, _n in r) for r in per_rank)
        exchanges = max(r[-1][3] for r in per_rank)
        sim = simulate(name, 4, args.m, CHUNKS.get(name, 1)).bubble_fraction
        print(f"| {name} | {statistics.median(walls):.3f} | {min(walls):.3f} | {' '.join(f'{x:.3f}' for x in idle)} |"
              f" {statistics.mean(idle):.3f} | {sim / (1 + sim):.3f} | {cpu:.3f} | {exchanges} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="store_true", help="also measure step time and idle on CPU ranks")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--schedules", nargs="*", default=None, help="measure only these (default: all five)")
    args = ap.parse_args(argv)
    timelines()
    if args.run:
        measured(args)


if __name__ == "__main__":
    main()
