"""ZeRO++ on CPU ranks (issue 28): bytes per link, step time, convergence and the quantizers' block sizes.

    python bench/zeropp_bench.py --bytes      # dp 8 on 2 simulated nodes of 4: CPU ms/step, bytes per link
    python bench/zeropp_bench.py --converge   # 300 steps of tiny at dp 4 on 2 nodes: final loss per setting
    python bench/zeropp_bench.py --blocks     # round-trip error by block size on trained weights and gradients

A CPU cannot show ZeRO++'s bandwidth gain (the ranks share one memory); the bytes are the evidence, counted by the
ledger per rank and per node (megazero/zero/qgz.py derives the formulas). ``--converge`` runs plain ZeRO-3, all
three techniques, and a negative control that quantizes with one scale per slice instead of per block; each
finishes within 2% of ZeRO-3's final loss (mean of the last 20 steps) or not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.config.cli import parse_args  # noqa: E402
from megazero.distributed.ledger import VOLUME_TAGS  # noqa: E402
from megazero.train.engine import Engine  # noqa: E402
from megazero.train.loop import run_training  # noqa: E402
from tests.dist import run_world  # noqa: E402

ZPP = {"zero3": [], "hpz": ["--zero-hpz-partition-size", "4"],
       "hpz+qwz": ["--zero-hpz-partition-size", "4", "--zero-quantized-weights"],
       "qwz": ["--zero-quantized-weights"], "qgz": ["--zero-quantized-gradients"],
       "all": ["--zero-hpz-partition-size", "4", "--zero-quantized-weights", "--zero-quantized-gradients"]}


def _bytes_rank(ctx, steps: int) -> dict:
    out = {}
    for name, extra in ZPP.items():
        cfg = parse_args(["--model", "tiny", "--zero-stage", "3", "--precision", "bf16", "--grad-dtype", "model",
                          "--ranks-per-node", "4", "--micro-batch-size", "2", "--global-batch-size", "16", *extra])
        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0)).resolve(ctx.world_size)
        eng = Engine(cfg, ctx)
        gen = torch.Generator().manual_seed(ctx.dp_rank)
        batch = [(torch.randint(0, 1024, (2, 128), generator=gen), torch.randint(0, 1024, (2, 128), generator=gen))]
        eng.train_step(batch)  # traces the gather order
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            eng.train_step(batch)
            times.append(time.perf_counter() - t)
        psi = eng.optimizer.padded_numel()["gathered"]
        out[name] = {"ms": 1e3 * statistics.median(times), "psi": psi,
                     "link": ctx.ledger.link_bytes_last_step(VOLUME_TAGS),
                     "share": ctx.ledger.node_share_last_step(VOLUME_TAGS)}
    return out


def bytes_table(steps: int) -> None:
    ranks = run_world(_bytes_rank, 8, steps, timeout=3600)
    psi = ranks[0]["zero3"]["psi"]
    print(f"tiny (Ψ = {psi:,} gathered elements, bf16 weights and gradients), dp 8 on 2 nodes of 4, "
          f"median of {steps} steps on rank 0")
    print("| setting | CPU ms/step | inter-node bytes/rank | (16-bit Ψ) | intra-node bytes/rank | inter-node bytes/node |"
          " (16-bit Ψ) |")
    print("|---|---|---|---|---|---|---|")
    for name in ZPP:
        r = ranks[0][name]
        node = sum(x[name]["share"] for x in ranks[:4])
        print(f"| {name} | {r['ms']:.0f} | {r['link']['inter']:,} | {r['link']['inter'] / 2 / psi:.3f} | "
              f"{r['link']['intra']:,} | {node:,.0f} | {node / 2 / psi:.3f} |")


def _converge_rank(ctx, runs: dict, steps: int, cache: str, logs: str, negative: bool) -> dict:
    if negative == "scales":  # the control: one scale per slice (no blocks) for weights and gradients
        import megazero.zero.qgz as qgz
        import megazero.zero.stage3.hpz as hpz
        from megazero.zero import quantize as q

        for mod in (qgz, hpz):
            mod.quantize = lambda x, bits, block: q.quantize(x, bits, x.shape[-1] + x.shape[-1] % 2)
            mod.dequantize = lambda v, s, bits, block, n, out=None: q.dequantize(v, s, bits, n + n % 2, n, out)
    if negative == "int-sum":  # the other control: qgZ sums the INT4 values of a node, scaled by one peer's scales
        import megazero.zero.qgz as qgz
        from megazero.zero import quantize as q

        def planted(values, scales, bits, block, n, out=None):
            deq = q.dequantize(values, scales, bits, block, n)
            if out is not None:
                return out.copy_(deq)
            ints = deq / scales.repeat_interleave(block, dim=1)[:, :n].clamp_min(1e-30)
            return ints.round() * scales[:1].repeat_interleave(block, dim=1)[:, :n]
        qgz.dequantize = planted
    out = {}
    for name, extra in runs.items():
        cfg = parse_args(["--model", "tiny", "--zero-stage", "3", "--ranks-per-node", "2", "--train-steps", str(steps),
                          "--eval-interval", "0", "--log-interval", "50", "--no-progress", "--cache-dir", cache,
                          "--log-dir", f"{logs}/{name}", *extra]).resolve(ctx.world_size)
        t = time.perf_counter()
        s = run_training(cfg, ctx)
        out[name] = (s.losses, time.perf_counter() - t)
    return out


def converge(steps: int, controls: list[str], reference: bool) -> None:
    all3 = ["--zero-hpz-partition-size", "2", "--zero-quantized-weights", "--zero-quantized-gradients"]
    cache = str(Path(__file__).resolve().parents[1] / ".cache" / "zeropp_bench")  # the tokenizer, trained once
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"zero3": [], "all": all3}
        res = run_world(_converge_rank, 4, runs, steps, cache, tmp, "", timeout=7200)[0] if reference else {}
        for name in controls:
            label = {"scales": "control: one scale per slice", "int-sum": "control: INT4 summed, one scale"}[name]
            res.update(run_world(_converge_rank, 4, {label: all3}, steps, cache, tmp, name, timeout=7200)[0])
    if "zero3" not in res:
        for name, (losses, wall) in res.items():
            print(f"| {name} | {statistics.mean(losses[-20:]):.4f} | wall {wall:.0f} s |")
        return
    ref = statistics.mean(res["zero3"][0][-20:])
    print(f"tiny, dp 4 on 2 nodes of 2, {steps} steps, built-in corpus; final loss = mean of the last 20 steps")
    print("| setting | final loss | vs ZeRO-3 | within 2% | wall s |")
    print("|---|---|---|---|---|")
    for name, (losses, wall) in res.items():
        final = statistics.mean(losses[-20:])
        rel = final / ref - 1
        print(f"| {name} | {final:.4f} | {rel:+.2%} | {'yes' if abs(rel) <= 0.02 else 'NO'} | {wall:.0f} |")


def blocks() -> None:
    from megazero.zero.quantize import dequantize, quantize
    from tests.test_zeropp import _trained_tensors

    ts = _trained_tensors()
    weights, grads = ts[0::2], ts[1::2]

    def err(tensors: list[torch.Tensor], bits: int, block: int) -> float:
        num = den = 0.0
        for x in tensors:
            r = x.reshape(1, -1)
            back = dequantize(*quantize(r, bits, block), bits, block, r.shape[1])
            num += (r - back).pow(2).sum().item()
            den += r.pow(2).sum().item()
        return (num / den) ** 0.5

    print("normwise round-trip error, 2-D weights and gradients of a small GPT after 10 AdamW steps")
    print("| block | weights INT8 | scale bytes / INT8 | gradients INT4 | scale bytes / INT4 | gradients INT8 |")
    print("|---|---|---|---|---|---|")
    for block in (32, 64, 128, 256, 512, 1024, 4096):
        print(f"| {block} | {err(weights, 8, block):.2%} | {4 / block:.1%} | {err(grads, 4, block):.1%} | "
              f"{8 / block:.1%} | {err(grads, 8, block):.2%} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bytes", action="store_true")
    ap.add_argument("--converge", action="store_true")
    ap.add_argument("--blocks", action="store_true")
    ap.add_argument("--controls", default="scales", help="--converge's negative controls, comma-separated: scales "
                    "(one scale per slice), int-sum (qgZ sums INT4 values under one peer's scales)")
    ap.add_argument("--no-reference", action="store_true", help="--converge: run the controls only")
    ap.add_argument("--steps", type=int, default=None, help="steps (default: 3 timed for --bytes, 300 for --converge)")
    args = ap.parse_args(argv)
    if args.blocks:
        blocks()
    if args.bytes:
        bytes_table(args.steps or 3)
    if args.converge:
        converge(args.steps or 300, args.controls.split(","), not args.no_reference)
    return 0


if __name__ == "__main__":
    sys.exit(main())
