"""Peak process RSS of ZeRO stages 0-3 in a real run, above a small-model baseline (issue 21, item 2).

    python bench/zero_rss.py --reps 3                     # dp 4 ranks of pretrain/gpt.py under torchrun

Each (repetition, stage, model) launches ``pretrain/gpt.py`` with ``torchrun --nproc-per-node 4`` under GNU
``/usr/bin/time -v`` and reads its "Maximum resident set size": the largest process of the run (a rank), with the
default malloc settings. The model is the 49M GPT (6 x 768, 12 heads, sequence 32, vocabulary 8192) trained 5
steps at micro-batch 1 (global batch 4), fp32, no evaluation; the baseline is the ``tiny`` preset run the same
way, whose RSS (libraries, data, the loop) is subtracted. The table gives medians over the repetitions and each
stage's figure relative to stage 0's. ``--env K=V`` adds to the ranks' environment (e.g. the probe
``MALLOC_MMAP_THRESHOLD_=131072``, which makes glibc hand freed memory back and so shows the live-tensor floor).
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


def peak_rss_mb(stage: int, model: str, cache: str, env: dict[str, str]) -> float:
    """The largest process's peak RSS (MB) of one 4-rank run."""
    cmd = ["/usr/bin/time", "-v", "torchrun", "--standalone", "--nproc-per-node", "4", "pretrain/gpt.py",
           *MODELS[model], "--zero-stage", str(stage), "--train-steps", "5", "--global-batch-size", "4",
           "--micro-batch-size", "1", "--eval-interval", "0", "--cache-dir", cache, "--no-progress"]
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
    args = ap.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    env = dict(kv.split("=", 1) for kv in args.env)
    cache = args.cache_dir or tempfile.mkdtemp(prefix="zero_rss_")
    peak_rss_mb(0, "49M", cache, env)  # builds the tokenizer and token caches first: not measured
    peak_rss_mb(0, "tiny", cache, env)
    peaks: dict[tuple[str, int], list[float]] = {}
    for rep in range(args.reps):
        for stage in stages:
            for model in MODELS:
                mb = peak_rss_mb(stage, model, cache, env)
                peaks.setdefault((model, stage), []).append(mb)
                print(f"rep {rep + 1}: stage {stage} {model:4s} peak RSS {mb:7.1f} MB", flush=True)
    med = {k: statistics.median(v) for k, v in peaks.items()}
    above = {s: med["49M", s] - med["tiny", s] for s in stages}
    print("\n| stage | 49M peak RSS (MB) | tiny (MB) | 49M above tiny (MB) | vs stage 0 |\n|---|---|---|---|---|")
    for s in stages:
        ratio = f"{above[s] / above[0]:.2f}" if 0 in above else "-"
        print(f"| {s} | {med['49M', s]:.0f} | {med['tiny', s]:.0f} | {above[s]:.0f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
