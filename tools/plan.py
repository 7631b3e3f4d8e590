"""Pick the fastest layout of a GPT run that fits: enumerate, prune by memory, rank by a roofline step time.

    python tools/plan.py --model gpt2-1.3b --gpus 128 --gpu h100 --gpus-per-node 8 --global-batch-size 1024
    python tools/plan.py --num-layers 96 --hidden-size 12288 --num-heads 96 --seq-len 2048 --gpus 1024 \\
        --global-batch-size 1536 --gpu a100 --efficiency 0.45 --top 5

Enumerates tp (dividing the GPUs of a node), cp (sequences of 8192 tokens or more: seq_len % (2·cp) == 0, tp·cp
inside a node first), pp, dp, ZeRO stage 0-3, micro-batch size, recomputation
(none/selective/full), optimizer offload, sequence parallelism and the interleaved and zb-h1 schedules; estimates each
layout's per-rank peak memory (:mod:`megazero.plan.estimate`) and drops those above the usable device memory;
estimates the step time of the rest (:mod:`megazero.plan.roofline`: FLOPs at ``--efficiency`` x the dense peak,
each collective's bytes over NVLink inside a node or the network across nodes, the pipeline bubble, the
optimizer step); prints the fastest ``--top`` and the torchrun command of the first. Hardware figures come
from the table in :mod:`megazero.plan.roofline`, each overridable by a flag. Confirm a plan with
``python pretrain/gpt.py --dry-run <its flags>``, or the fastest N with ``--confirm N``: each is dry-run as a
CUDA run (its defaults and kernels on meta tensors) and cached under ``--cache-dir``
(:mod:`megazero.plan.cache`), so planning again reruns only what changed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import megazero  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.config.schema import PRESETS, ConfigError, model_preset
from megazero.plan.roofline import GPUS, cluster, describe
from megazero.plan.search import Plan, search, torchrun_command

__all__ = ["build_parser", "confirm", "main", "report"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tools/plan.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=tuple(PRESETS), default="gpt2-1.3b", help="preset (default gpt2-1.3b)")
    for flag, typ in (("--num-layers", int), ("--hidden-size", int), ("--num-heads", int), ("--seq-len", int),
                      ("--vocab-size", int)):
        g.add_argument(flag, type=typ, help="override the preset's value")
    g = p.add_argument_group("run")
    g.add_argument("--gpus", type=int, required=True, help="GPUs in the run")
    g.add_argument("--global-batch-size", type=int, required=True, help="sequences per optimizer step")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16",
                   help="compute precision (default %(default)s)")
    g.add_argument("--micro-batch-sizes", default="1,2,4,8,16", help="candidates, comma-separated (default "
                   "%(default)s)")
    g.add_argument("--zero-stages", default="0,1,2,3", help="candidates, comma-separated (default %(default)s)")
    g = p.add_argument_group("hardware (defaults from the GPU table; each overridable)")
    g.add_argument("--gpu", default="h100", choices=tuple(GPUS), help="GPU model (default h100 = SXM 80GB)")
    g.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    g.add_argument("--peak-tflops", type=float, help="dense peak TFLOP/s for the compute dtype")
    g.add_argument("--memory-gb", type=float, help="device memory, GB (1e9 bytes)")
    g.add_argument("--nvlink-gbps", type=float, help="intra-node bandwidth per GPU, one direction, GB/s")
    g.add_argument("--network-gbps", type=float, help="inter-node bandwidth per GPU, one direction, GB/s")
    g.add_argument("--efficiency", type=float, default=0.5, help="achieved fraction of peak FLOP/s (default 0.5)")
    g.add_argument("--dp-overlap", type=float, default=0.0,
                   help="fraction of DP traffic hidden behind backward (default 0: none)")
    g.add_argument("--memory-fraction", type=float, default=0.9,
                   help="usable share of device memory (default 0.9)")
    p.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    p.add_argument("--zeropp", action="store_true",
                   help="rank ZeRO++ settings (hpZ, qwZ, qgZ) on the fastest ZeRO-3 layout that fits (whose ZeRO group "
                        "spans nodes, if any): step time and "
                        "bytes per link, beside the fastest layout of any stage (megazero/plan/zeropp.py)")
    p.add_argument("--confirm", type=int, default=0, metavar="N",
                   help="dry-run the N fastest layouts (every rank role, the real step on meta tensors) and "
                        "print their measured peaks (default 0; minutes for large models)")
    p.add_argument("--cache-dir", default=None,
                   help="where --confirm keeps its dry runs, keyed by config, cluster and code (default "
                        "$XDG_CACHE_HOME/megazero/plan, i.e. ~/.cache/megazero/plan)")
    p.add_argument("--no-cache", action="store_true", help="run every --confirm dry run afresh, store nothing")
    return p


def _gb(x: float) -> str:
    return f"{x / 1e9:.1f}"


def report(plans: list[Plan], tried: int, seconds: float, args: argparse.Namespace, model_flags: list[str],
           c) -> str:
    head = ["#", "tp", "cp", "pp", "dp", "sched", "zero", "mbs", "recompute", "offl", "sp", "peak GB", "states",
            "acts", "other", "TP GB", "CP GB", "PP GB", "DP GB", "compute s", "bubble", "comm s", "step s", "MFU"]
    rows = []
    for i, pl in enumerate(plans[:args.top]):
        lay, t = pl.layout, pl.time
        sched = f"int v{lay.virtual_stages}" if lay.virtual_stages > 1 else (lay.schedule if lay.pp > 1 else "-")
        rows.append([str(i + 1), str(lay.tp), str(lay.cp), str(lay.pp), str(lay.dp), sched, str(lay.zero_stage),
                     str(lay.micro_batch_size), lay.checkpointing, "opt" if lay.offload else "-",
                     "y" if lay.sequence_parallel else "-", _gb(pl.peak_bytes), _gb(pl.states_bytes),
                     _gb(pl.activation_bytes), _gb(pl.other_bytes), _gb(pl.tp_bytes), _gb(pl.cp_bytes), _gb(pl.pp_bytes),
                     _gb(pl.dp_bytes), f"{t.compute:.3f}", f"{t.bubble:.3f}",
                     f"{t.comm:.3f}", f"{t.total:.3f}", f"{pl.mfu:.0%}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"megazero plan: {args.gpus} x {c.gpu.name}, {c.gpus_per_node} per node; {args.precision}; global "
             f"batch {args.global_batch_size}; {tried} layouts tried, {len(plans)} fit in "
             f"{_gb(c.usable_memory_bytes)} GB ({seconds:.1f} s)",
             describe(c, args.precision), ""]
    for r in [head, *rows]:
        lines.append("  ".join(c_.rjust(w) for c_, w in zip(r, widths)))
    if not plans:
        lines.append("no layout fits: add GPUs, lower --global-batch-size, or try --gpu with more memory")
        return "\n".join(lines)
    lines += ["", "peak: the largest rank's estimate (states + activations + other); TP/CP/PP/DP GB: bytes one rank "
              "moves per step; step s = compute + bubble + comm + optimizer step.",
              "", "fastest layout (check it first with: python pretrain/gpt.py --dry-run <the same flags>):",
              "  " + torchrun_command(plans[0], model_flags, args.global_batch_size, args.precision,
                                      c.gpus_per_node)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    shape = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size")}
    try:
        model = model_preset(args.model, **shape)
        c = cluster(args.gpu, args.gpus_per_node, peak_tflops=args.peak_tflops,
                    memory_bytes=args.memory_gb * 1e9 if args.memory_gb else None,
                    intra_node_bytes_per_s=args.nvlink_gbps * 1e9 if args.nvlink_gbps else None,
                    inter_node_bytes_per_s=args.network_gbps * 1e9 if args.network_gbps else None,
                    efficiency=args.efficiency, dp_overlap=args.dp_overlap, memory_fraction=args.memory_fraction)
        mbs = tuple(int(x) for x in args.micro_batch_sizes.split(","))
        stages = tuple(int(x) for x in args.zero_stages.split(","))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.gpus < 1 or args.global_batch_size < 1:
        print("error: --gpus and --global-batch-size must be positive", file=sys.stderr)
        return 2
    plans, tried = search(model, args.gpus, args.global_batch_size, c, args.precision,
                          micro_batch_sizes=mbs, stages=stages)
    model_flags = ["--model", args.model] + [f"--{k.replace('_', '-')} {v}" for k, v in shape.items()
                                             if v is not None]
    print(report(plans, tried, time.perf_counter() - start, args, model_flags, c))
    if args.zeropp and plans:
        print("\n" + zeropp_report(plans, model, args, c))
    if args.confirm and plans:
        print("\n" + confirm(plans[:args.confirm], model_flags, args, c))
    return 0 if plans else 1


def zeropp_report(plans: list[Plan], model, args: argparse.Namespace, c) -> str:
    """ZeRO++ settings on the fastest ZeRO-3 layout that fits, fastest first, with the bytes behind each."""
    from megazero.plan.zeropp import rank_zeropp, spans_nodes

    stage3 = [pl for pl in plans if pl.layout.zero_stage == 3]
    if not stage3:
        return "ZeRO++: no ZeRO-3 layout fits (add 3 to --zero-stages)"
    across = [pl for pl in stage3 if spans_nodes(pl.layout, c)]  # ZeRO++ changes nothing inside one node
    lay = (across or stage3)[0].layout
    ranked = rank_zeropp(model, lay, args.global_batch_size, c, args.precision)
    best = plans[0]
    lines = [f"ZeRO++ on the fastest ZeRO-3 layout{' whose ZeRO group spans nodes' if across else ''} (tp {lay.tp}, pp {lay.pp}, dp {lay.dp}, cp {lay.cp}, micro-batch "
             f"{lay.micro_batch_size}, {lay.checkpointing} recompute); the fastest layout of any stage (#1, ZeRO-"
             f"{best.layout.zero_stage}) takes {best.time.total:.3f} s",
             "setting        step s   DP s  inter GB/rank  inter GB/node  intra GB/rank  hpZ extra GB  peak GB  fits"]
    for z in ranked:
        pl = z.plan
        lines.append(f"{z.name:<13} {pl.time.total:7.3f} {pl.time.dp_comm:6.3f} {z.inter_bytes / 1e9:14.2f} "
                     f"{z.node_inter_bytes / 1e9:14.2f} {z.intra_bytes / 1e9:14.2f} {z.extra_bytes / 1e9:13.2f} "
                     f"{pl.peak_bytes / 1e9:8.1f}  {'yes' if pl.fits else 'no'}")
    lines.append("bytes per step: inter-node per rank as the ledger counts them, per node what its network carries "
                 "(flat collectives cross it once, qgZ's inter-node all-to-all once per rank of the node)")
    return "\n".join(lines)


def confirm(plans: list[Plan], model_flags: list[str], args: argparse.Namespace, c) -> str:
    """Dry-run each plan (megazero/plan/dryrun.py) and set its measured peak beside the estimate; dry runs come from
    the cache (megazero/plan/cache.py) when an identical one ran before."""
    from megazero.config.cli import parse_args
    from megazero.plan.cache import DryRunCache, default_cache_dir
    from megazero.plan.dryrun import dry_run

    cache = None if args.no_cache else DryRunCache(args.cache_dir or default_cache_dir())
    lines = ["dry runs (measured on the real step; python pretrain/gpt.py --dry-run <flags>):"]
    for i, pl in enumerate(plans):
        lay = pl.layout
        flags = " ".join(model_flags).split() + lay.flags() + ["--global-batch-size", str(args.global_batch_size),
                                                                "--precision", args.precision]
        cfg = parse_args(flags).resolve(lay.world, device_type="cuda")  # the GPU run's defaults
        if cache is None:
            rep, hit = dry_run(cfg, c, device_type="cuda"), False
        else:
            rep, hit = cache.dry_run(cfg, c, device_type="cuda")
        worst = max(r.peak_bytes for r in rep.roles)
        lines.append(f"  #{i + 1}: measured peak {worst / 1e9:.2f} GB vs estimated {pl.peak_bytes / 1e9:.2f} GB; "
                     f"{rep.verdict} ({len(rep.roles)} roles, {rep.wall_seconds:.0f} s{', cached' if hit else ''})")
    if cache is not None:
        lines.append(f"cache {cache.directory}: {cache.hits} dry runs reused, {cache.misses} run")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
