"""Sharded checkpoints on CPU: size, save and load time (same topology and resharded), converter peak memory.

    python bench/checkpoint_io.py [--model gpt2-124m] [--dir /tmp/megazero-ckpt-bench]

Part 1 builds GPT-2 124M (fp32) at tp2·dp2·ZeRO-1 on 4 gloo ranks and saves it; loads it back at the same
topology, then resharded at tp1·pp2·dp2·ZeRO-3 (4 ranks) and at tp1·pp1·dp1·ZeRO-0 (1 rank). Part 2 runs
tools/convert_checkpoint.py on it (both formats) under /usr/bin/time and reports the peak RSS next to the
converter's RSS on a tiny checkpoint (the interpreter + torch baseline) and the model's fp32 size.

Measured on the 2-core CPU machine (shared, load average ~10), torch 2.13, ``python bench/checkpoint_io.py``:

    gpt2-124m tp2·dp2·ZeRO-1 fp32: 4 shard files, 1495 MB (374 MB per rank); save 3.8s
    load at same topology: 4.1s
    load at tp1·pp2·dp2·ZeRO-3: 9.5s
    load at tp1·pp1·dp1·ZeRO-0: 7.3s
    converter --format safetensors: peak RSS 450 MB = 225 MB on a tiny checkpoint + 224 MB; model fp32 498 MB
    converter --format hf: peak RSS 451 MB = 253 MB on a tiny checkpoint + 198 MB; model fp32 498 MB

1495 MB is 12 bytes per parameter (fp32 master + two moments; the tied embedding and TP-replicated vectors
stored once). Load times include the SHA-256 check of every file read. The converter's increment is the
largest tensor (the 154 MB token embedding) plus one TP shard of it: peak memory is set by the largest
parameter, not by the model.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from megazero.config.cli import parse_args  # noqa: E402
from megazero.train.engine import Engine  # noqa: E402
from tests.dist import run_world  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _rank(ctx, flags: list[str], path: str, save: bool) -> float:
    cfg = parse_args([*flags, "--micro-batch-size", "1", "--global-batch-size", str(ctx.dp_size)])
    engine = Engine(cfg.resolve(ctx.world_size), ctx)
    ctx.world_group.barrier()
    start = time.perf_counter()
    if save:
        save_checkpoint(engine, None, path)
    else:
        load_checkpoint(engine, None, path)
    ctx.world_group.barrier()
    return time.perf_counter() - start


def _max_rss_mb(cmd: list[str]) -> tuple[float, str]:
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], cwd=ROOT, capture_output=True, text=True, check=True)
    kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return kb / 1024, r.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-124m")
    parser.add_argument("--dir", default="/tmp/megazero-ckpt-bench")
    args = parser.parse_args()
    out = Path(args.dir)
    shutil.rmtree(out, ignore_errors=True)
    model = ["--model", args.model]
    ck = str(out / "ck")
    saved = run_world(_rank, 4, [*model, "--tp", "2", "--zero-stage", "1"], ck, True, tp=2, timeout=1800)[0]
    files = sorted((out / "ck" / "step_00000000").glob("rank_*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    print(f"{args.model} tp2·dp2·ZeRO-1 fp32: {len(files)} shard files, {size / 1e6:.0f} MB "
          f"({size / len(files) / 1e6:.0f} MB per rank); save {saved:.1f}s")
    for label, world, flags, grid in (("same topology", 4, ["--tp", "2", "--zero-stage", "1"], {"tp": 2}),
                                      ("tp1·pp2·dp2·ZeRO-3", 4, ["--pp", "2", "--zero-stage", "3"], {"pp": 2}),
                                      ("tp1·pp1·dp1·ZeRO-0", 1, [], {})):
        seconds = run_world(_rank, world, [*model, *flags], ck, False, timeout=1800, **grid)[0]
        print(f"load at {label}: {seconds:.1f}s")
    n_params = parse_args(model).model.num_parameters()
    tiny = str(out / "tiny")
    run_world(_rank, 1, ["--num-layers", "1", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32",
                         "--vocab-size", "512"], tiny, True)
    for fmt in ("safetensors", "hf"):
        base, _ = _max_rss_mb([sys.executable, "tools/convert_checkpoint.py", tiny, "--out", str(out / f"tiny-{fmt}"),
                               "--format", fmt])
        rss, text = _max_rss_mb([sys.executable, "tools/convert_checkpoint.py", ck, "--out", str(out / fmt),
                                 "--format", fmt])
        print(f"converter --format {fmt}: peak RSS {rss:.0f} MB = {base:.0f} MB on a tiny checkpoint + {rss - base:.0f} MB; model fp32 "
              f"{n_params * 4 / 1e6:.0f} MB\n  {text.splitlines()[-1]}")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
