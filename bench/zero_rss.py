"""Peak process RSS of ZeRO stages 0-3 in a real run, above a small-model baseline (issue 21, item 2).

    python bench/zero_rss.py --reps 3                     # dp 4 ranks of pretrain/gpt.py under torchrun

Each (repetition, stage, model) launches ``pretrain/gpt.py`` with ``torchrun --nproc-per-node 4`` under GNU
``/usr/bin/time -v`` and reads its "Maximum resident set size": the largest process of the run (a rank), with the
default malloc settings. The model is the 49M GPT (6 x 768, 12 heads, sequence 32, vocabulary 8192) trained 5
steps at micro-batch 1 (global batch 4), fp32, no evaluation; the baseline is the ``tiny`` preset run the same
way, whose RSS (libraries, data, the loop) is subtracted. The table gives medians over the repetitions and each
stage's figure relative to stage 0's. ``--env K=V`` adds to the ranks' environment (e.g. the probe
``MALLOC_MMAP_THRESHOLD_=131072``, which makes glibc hand freed memory back and so shows the live-tensor floor).

``--trim`` runs each rank through this script (``--as-rank-with-trim``), which adds one glibc ``malloc_trim(0)``
after the engine is built (what ``device_io.release_free_memory`` did until construction stopped leaving freed
heap behind, issue 31 item 1): the same tree with and without it shows what a trim would still hand back.

``--eval`` (issue 31, item 2) measures instead what evaluation adds at ZeRO-3: each ``--layouts`` entry (``dp4``;
``pp2``: pp 2 x dp 2, 1F1B; ``pp2i``: pp 2 x dp 2, interleaved, two chunks of 2 + 1 layers per rank) trains the
49M GPT with global batch 8 (4 micro-batches per step at dp 2) with and without an evaluation of 2 batches
after the last step (``--eval-interval 5 --eval-iters 2``), and the table gives the peak RSS with over without.

    python bench/zero_rss.py --eval --reps 3
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"49M": ["--num-layers", "6", "--hidden-size", "768", "--num-heads", "12", "--seq-len", "32",
                  "--vocab-size", "8192"], "tiny": ["--model", "tiny"]}


LAYOUTS = {"dp4": [], "pp2": ["--pp", "2"],
           "pp2i": ["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "2", "--pp-layout", "2,1,2,1"]}
EVAL = ["--eval-interval", "5", "--eval-iters", "2"]  # one evaluation of 2 global batches, after the last step


TRIM_FLAG = "--as-rank-with-trim"  # argv[1] of a rank launched by --trim


def rank_with_trim(argv: list[str]) -> None:
    """One rank of pretrain/gpt.py with ``malloc_trim(0)`` once the engine is built (``--trim``)."""
    import ctypes
    import runpy

    sys.path.insert(0, ROOT)
    from megazero.distributed import device_io

    release = device_io.release_free_memory

    def release_and_trim(device) -> None:
        release(device)
        ctypes.CDLL("libc.so.6").malloc_trim(0)

    device_io.release_free_memory = release_and_trim  # the engine calls it through the module
    sys.argv = [os.path.join(ROOT, "pretrain", "gpt.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def peak_rss_mb(stage: int, model: str, cache: str, env: dict[str, str], extra: list[str] | None = None,
                batch: int = 4, trim: bool = False) -> float:
    """The largest process's peak RSS (MB) of one 4-rank run (``extra``: more flags; with an evaluation they
    replace ``--eval-interval 0``; ``trim``: one ``malloc_trim(0)`` after construction)."""
    extra = extra or []
    script = ["bench/zero_rss.py", TRIM_FLAG] if trim else ["pretrain/gpt.py"]
    cmd = ["/usr/bin/time", "-v", "torchrun", "--standalone", "--nproc-per-node", "4", *script,
           *MODELS[model], "--zero-stage", str(stage), "--train-steps", "5", "--global-batch-size", str(batch),
           "--micro-batch-size", "1", *([] if "--eval-interval" in extra else ["--eval-interval", "0"]), *extra,
           "--cache-dir", cache, "--no-progress"]
    # this checkout's megazero, even where another is installed (pretrain/gpt.py imports the installed one first)
    path = os.pathsep.join(x for x in (ROOT, os.environ.get("PYTHONPATH")) if x)
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": path, **env}
    out = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True)
    if "trained steps" not in out.stdout + out.stderr:
        raise RuntimeError(f"stage {stage} {model} failed:\n{out.stderr[-2000:]}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1)) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cache-dir", default=None, help="data/tokenizer cache (default: a fresh one, built once)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("--trim", action="store_true", help="one malloc_trim(0) in each rank after construction")
    ap.add_argument("--eval", action="store_true", help="ZeRO-3 with an evaluation against without, per layout")
    ap.add_argument("--layouts", default="dp4,pp2,pp2i", help="with --eval: " + ", ".join(LAYOUTS))
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    env = dict(kv.split("=", 1) for kv in args.env)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="zero_rss_")
    peak_rss_mb(0, "49M", cache, env)  # builds the tokenizer and token caches first: not measured
    if args.eval:
        return eval_table(args.layouts.split(","), args.reps, cache, env)
    peak_rss_mb(0, "tiny", cache, env)
    peaks: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        for stage in stages:
            for model in MODELS:
                mb = peak_rss_mb(stage, model, cache, env, trim=args.trim)
                peaks.setdefault((model, stage), []).append(mb)
                print(f"rep {rep + 1}: stage {stage} {model:4s} peak RSS {mb:7.1f} MB", flush=True)
    med = {k: statistics.median(v) for k, v in peaks.items()}
    above = {s: med["49M", s] - med["tiny", s] for s in stages}
    print("\n| stage | 49M peak RSS (MB) | tiny (MB) | 49M above tiny (MB) | vs stage 0 |\n|---|---|---|---|---|")
    for s in stages:
        ratio = f"{above[s] / above[0]:.2f}" if 0 in above else "-"
        print(f"| {s} | {med['49M', s]:.0f} | {med['tiny', s]:.0f} | {above[s]:.0f} | {ratio} |")
    return 0


def eval_table(layouts: list[str], reps: int, cache: str, env: dict[str, str]) -> int:
    """ZeRO-3 peak RSS with an evaluation after the last step against without, per layout (medians)."""
    peaks: dict[tuple[str, bool], list[float]] = {}
    for rep in range(reps):
        for layout in layouts:
            for ev in (False, True):
                mb = peak_rss_mb(3, "49M", cache, env, LAYOUTS[layout] + (EVAL if ev else []), batch=8)
                peaks.setdefault((layout, ev), []).append(mb)
                print(f"rep {rep + 1}: {layout:5s} {'eval' if ev else 'train':5s} peak RSS {mb:7.1f} MB", flush=True)
    med = {k: statistics.median(v) for k, v in peaks.items()}
    print("\n| layout | train only (MB) | with evaluation (MB) | ratio |\n|---|---|---|---|")
    for layout in layouts:
        a, b = med[layout, False], med[layout, True]
        print(f"| {layout} | {a:.0f} | {b:.0f} | {b / a:.3f} |")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [TRIM_FLAG]:
        rank_with_trim(sys.argv[2:])
    else:
        sys.exit(main())
