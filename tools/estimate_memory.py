"""Estimate per-rank memory of GPT training across ZeRO stages: model states and activations.

    python tools/estimate_memory.py --params 7.5e9 --dp 64           # the ZeRO paper: 120 / 31.4 / 16.6 / 1.9 GB
    python tools/estimate_memory.py --model gpt2-350m --dp 8 --micro-batch-size 8
    python tools/estimate_memory.py --model gpt2-1.3b --tp 2 --pp 4 --dp 4 --sequence-parallel \\
        --activation-checkpointing full --zero-stage 1
    python tools/estimate_memory.py --model gpt2-350m --pp 4 --pp-schedule zbv --micro-batches 8

Prints one row per ZeRO stage (and per pipeline stage where they differ): Ψ_r, the parameters the rank holds
(its TP shard of its pipeline stage, replicated pieces in full), the model-state bytes as megazero holds them
(params, grads, fp32 master copy, Adam moments) and the activation bytes of the micro-batches in flight. Under
the interleaved schedule (``--virtual-stages``) and zbv (two chunks per rank in a V) a rank's layers,
parameters and activations are those of its real chunks (:func:`megazero.pipeline.partition.stage_specs`).
Figures are decimal GB (1e9 bytes, as the ZeRO paper) unless ``--units`` says otherwise. The arithmetic lives
in :mod:`megazero.plan.estimate`; ``metrics.jsonl`` records the same quantities measured on a real run.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import megazero  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.config.resolve import chunks_per_rank
from megazero.config.schema import PRESETS, ConfigError, ZeroConfig, model_preset
from megazero.pipeline.partition import stage_specs
from megazero.pipeline.schedules import SCHEDULES, SPLIT_SCHEDULES, build_schedule
from megazero.plan.estimate import (
    activation_bytes,
    in_flight_micro_batches,
    korthikanti_layer_bytes,
    model_state_bytes,
    padded_vocab_size,
    peak_bytes,
    rank_parameter_numels,
    recompute_bytes,
)

__all__ = ["build_parser", "estimate", "main"]

UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags (named like ``pretrain/gpt.py``'s where they overlap)."""
    p = argparse.ArgumentParser(prog="tools/estimate_memory.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model (a preset, or just a parameter count)")
    g.add_argument("--model", choices=tuple(PRESETS), help="architecture preset (default: tiny, unless --params)")
    g.add_argument("--params", type=float, metavar="N",
                   help="total parameters, e.g. 7.5e9: model states only, Ψ_r ~ N / (tp * pp)")
    for flag, typ in (("--num-layers", int), ("--hidden-size", int), ("--num-heads", int), ("--seq-len", int),
                      ("--vocab-size", int), ("--dropout", float)):
        g.add_argument(flag, type=typ, help="override the preset's value")
    g = p.add_argument_group("parallelism and ZeRO")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel size Nd (default 1)")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), help="mark this stage's rows with *")
    g.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/dropout activations over TP")
    g.add_argument("--persistence-threshold", type=int, default=ZeroConfig().stage3_param_persistence_threshold,
                   metavar="N", help="stage 3 keeps parameters of <= N elements whole (default %(default)s)")
    g.add_argument("--offload-optimizer", action="store_true", help="master copy and Adam moments in host memory")
    g.add_argument("--offload-param", action="store_true", help="stage 3 parameter shards in host memory")
    g = p.add_argument_group("batch and activations")
    g.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16",
                   help="bf16/fp16: mixed precision with fp32 master (default); fp32: no master copy")
    g.add_argument("--grad-dtype", choices=("auto", "fp32", "model"), default="auto",
                   help="gradient accumulation/reduction dtype: auto = fp32 in bf16 (4 bytes/param), the model's "
                   "in fp16 (2 bytes, the ZeRO paper's table); model = 2 bytes in bf16 too (default auto)")
    g.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    g.add_argument("--activation-checkpointing", choices=("none", "selective", "full"), default="none",
                   help="recompute activations in backward (default %(default)s)")
    g.add_argument("--partition-activations", action="store_true",
                   help="full checkpointing keeps each layer input split over the TP ranks")
    g.add_argument("--cpu-checkpointing", action="store_true", help="checkpointed inputs kept in host memory")
    g.add_argument("--pp-schedule", choices=SCHEDULES, default="1f1b",
                   help="decides how many micro-batches a stage holds and (interleaved, zbv) which layers a rank's"
                   " chunks hold (default 1f1b)")
    g.add_argument("--virtual-stages", type=int, default=1, metavar="V",
                   help="interleaved: model chunks per rank (>= 2); zbv always runs 2 (default 1)")
    g.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches per step (default: pp)")
    g.add_argument("--unfused-attention", action="store_true",
                   help="attention materialises the softmax (math SDPA) instead of a fused kernel")
    p.add_argument("--units", choices=tuple(UNITS), default="GB", help="default GB = 1e9 bytes")
    return p


def _count(n: float) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.4g}{suffix}"
    return f"{n:.0f}"


def _size(n: float | None, unit: float) -> str:
    if n is None:
        return "n/a"
    v = n / unit
    if v == 0:
        return "0"
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


def _ranges(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def estimate(args: argparse.Namespace) -> str:
    """The report for parsed ``args``: header, table, footnotes."""
    unit = UNITS[args.units]
    shape = {k: getattr(args, k) for k in ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size",
                                           "dropout")}
    opaque = args.params is not None and args.model is None and all(v is None for v in shape.values())
    model = None if opaque else model_preset(args.model or "tiny", **shape)
    if model is not None and not 1 <= args.pp <= model.num_layers:
        raise ConfigError(f"--pp {args.pp} must be between 1 and --num-layers {model.num_layers}")
    m_count = args.micro_batches or args.pp
    mixed = args.precision != "fp32"

    if args.virtual_stages != 1 and args.pp_schedule not in ("interleaved", "zbv"):
        raise ConfigError(f"--virtual-stages {args.virtual_stages} needs --pp-schedule interleaved (zbv runs 2 "
                          "chunks per rank by itself)")
    if args.pp > 1:  # the schedule's own checks (interleaved: V >= 2 and m a multiple of pp; zbv: V 1 or 2)
        if args.pp_schedule == "zbv" and args.virtual_stages not in (1, 2):
            raise ConfigError(f"--pp-schedule zbv runs 2 model chunks per rank; leave --virtual-stages at 1 or give"
                              f" 2, not {args.virtual_stages}")
        build_schedule(args.pp_schedule, args.pp, 0, m_count, chunks_per_rank(args.pp_schedule, args.pp,
                                                                               args.virtual_stages))
    v = chunks_per_rank(args.pp_schedule, args.pp, args.virtual_stages)
    timeline = v > 1 or (args.pp_schedule in SPLIT_SCHEDULES and args.pp > 1)
    if timeline and (args.partition_activations or args.cpu_checkpointing):
        flag = "--partition-activations" if args.partition_activations else "--cpu-checkpointing"
        raise ConfigError(f"{flag} is estimated for --pp-schedule 1f1b and gpipe only, not {args.pp_schedule}; drop "
                          f"{flag} or pick one of those schedules")
    if model is not None and model.num_layers < args.pp * v:
        raise ConfigError(f"--num-layers {model.num_layers} is fewer than the {args.pp * v} (virtual) pipeline "
                          "stages; lower --pp/--virtual-stages or add layers")

    # per pipeline rank: (Ψ_r numels, activations held at once, micro-batches in flight, its chunks' layers)
    per_stage = []
    for r in range(args.pp):
        if model is None:
            per_stage.append(([args.params / (args.tp * args.pp)], None, 1, None))
            continue
        specs = stage_specs(model.num_layers, args.pp, r, v, schedule=args.pp_schedule)
        numels = list(rank_parameter_numels(model, args.tp, args.pp, r, virtual_stages=v, schedule=args.pp_schedule).values())
        common = dict(tp_size=args.tp, sequence_parallel=args.sequence_parallel, precision=args.precision,
                      checkpointing=args.activation_checkpointing)
        if timeline:  # each chunk's micro-batches from F to B (and W) as the rank's timeline holds them
            held = peak_bytes(model, args.micro_batch_size, stage=0, dp_size=1, tp_size=args.tp, pp_size=args.pp,
                              pp_rank=r, precision=args.precision, checkpointing=args.activation_checkpointing,
                              sequence_parallel=args.sequence_parallel, micro_batches=m_count,
                              schedule=args.pp_schedule, fused_attention=not args.unfused_attention,
                              virtual_stages=v).activations
            k = 1
        else:
            held = activation_bytes(model, args.micro_batch_size, **common, layers=len(specs[0].layers),
                                    first_stage=r == 0, last_stage=r == args.pp - 1,
                                    fused_attention=not args.unfused_attention,
                                    partition_activations=args.partition_activations,
                                    cpu_checkpointing=args.cpu_checkpointing)
            k = in_flight_micro_batches(args.pp, r, args.pp_schedule, m_count)
            held *= k
        # the stashed micro-batches, plus (with recomputation) the one layer being recomputed, once per rank
        held += recompute_bytes(model, args.micro_batch_size, **common, fused_attention=not args.unfused_attention)
        per_stage.append((numels, held, k, [sp.layers for sp in specs]))

    header = ["ZeRO", "pp stage", "layers", "Ψ_r", "params", "grads", "master", "optim states", "model states",
              "activations", "total", "step peak"]
    if args.offload_optimizer or args.offload_param:
        header.insert(-1, "host")
    rows = []
    for stage in range(4):
        groups: list[tuple[list[int], list[str]]] = []
        for r, (numels, acts, k, _layers) in enumerate(per_stage):
            ms = model_state_bytes(numels, stage, args.dp, args.precision, args.persistence_threshold,
                                   args.offload_optimizer, args.offload_param and stage == 3, args.grad_dtype)
            cells = [_count(sum(numels)), _size(ms.params, unit), _size(ms.grads, unit),
                     _size(ms.master_params, unit), _size(ms.optimizer_states, unit), _size(ms.device, unit),
                     _size(acts, unit) + (f" ({k} mb)" if k > 1 else "")]
            if "host" in header:
                cells.append(_size(ms.offloaded, unit))
            cells.append(_size(ms.device + (acts or 0), unit))
            peak = None if model is None else peak_bytes(
                model, args.micro_batch_size, stage=stage, dp_size=args.dp, tp_size=args.tp, pp_size=args.pp,
                pp_rank=r, precision=args.precision, checkpointing=args.activation_checkpointing,
                sequence_parallel=args.sequence_parallel, micro_batches=m_count, schedule=args.pp_schedule,
                offload_optimizer=args.offload_optimizer, offload_param=args.offload_param,
                persistence_threshold=args.persistence_threshold,
                fused_attention=not args.unfused_attention, virtual_stages=v).total
            cells.append(_size(peak, unit))
            if groups and groups[-1][1] == cells and v == 1:  # chunks: one row per rank
                groups[-1][0].append(r)
            else:
                groups.append(([r], cells))
        mark = "*" if args.zero_stage == stage else " "
        for ranks, cells in groups:
            pp_cell = "all" if len(ranks) == args.pp else _ranges(ranks)
            first, last = per_stage[ranks[0]][3], per_stage[ranks[-1]][3]
            layers = ("-" if first is None else _ranges([first[0][0], last[-1][-1]]) if v == 1
                      else ",".join(_ranges(sorted({c[0], c[-1]})) for c in first))
            rows.append([f"{mark}{stage}", pp_cell, layers, *cells])

    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    table = ["  ".join(str(c).rjust(w) if i >= 3 else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    table.insert(1, "  ".join("-" * w for w in widths))

    lines = [f"megazero memory estimate per rank ({args.units} = {unit:.0f} bytes)"]
    if model is None:
        lines.append(f"model: {_count(args.params)} parameters (opaque: Ψ_r ~ N / (tp * pp); activations need "
                     "--model or shape flags)")
    else:
        vpad = padded_vocab_size(model.vocab_size, args.tp)
        lines.append(f"model: {args.model or 'tiny'} ({model.num_layers} layers, hidden {model.hidden_size}, "
                     f"{model.num_heads} heads, seq {model.seq_len}, vocab {model.vocab_size} -> {vpad} padded), "
                     f"{_count(model.num_parameters())} parameters")
    lines.append(f"grid: tp {args.tp} x pp {args.pp} x dp {args.dp} = {args.tp * args.pp * args.dp} ranks; "
                 f"{args.precision}; micro-batch {args.micro_batch_size}"
                 + (f", {m_count} per step ({args.pp_schedule}"
                    + (f", {v} chunks per rank" if v > 1 else "") + ")" if args.pp > 1 else "")
                 + f"; activation checkpointing {args.activation_checkpointing}"
                 + ("; sequence parallel" if args.sequence_parallel else ""))
    lines += ["", *table, ""]
    notes = [
        "Ψ_r: parameters one rank holds -- its TP shard of its pipeline stage (embeddings on the first, final "
        "LayerNorm and the tied embedding copy on the last), vocabulary padded to a multiple of 128*tp, "
        "LayerNorms/row-parallel biases/positions replicated in full.",
        ("model states: 16-bit params and grads (2 + 2 bytes) plus an fp32 master copy and two fp32 Adam moments "
         "(K = 12 bytes) per parameter" if mixed else
         "model states, fp32: the parameters are their own master copy (no separate master, as "
         "megazero/zero/state.py holds them): params 4 + grads 4 + Adam moments 8 bytes per parameter")
        + f"; stage 1 partitions master and moments over dp = {args.dp}, stage 2 also the grads, stage 3 also "
        f"the params (ZeRO paper, arXiv 1910.02054).",
        f"stage 3 keeps parameters of <= {args.persistence_threshold} elements whole on every rank "
        "(stage3_param_persistence_threshold); while running it also holds the gathered units being used and "
        "prefetched (up to stage3_prefetch_bucket_size elements), not counted here.",
    ]
    if model is not None:
        s, b, h, a = model.seq_len, args.micro_batch_size, model.hidden_size, model.num_heads
        paper = korthikanti_layer_bytes(s, b, h, a, args.tp, args.sequence_parallel, args.activation_checkpointing)
        kw = dict(tp_size=args.tp, sequence_parallel=args.sequence_parallel, precision=args.precision,
                  checkpointing=args.activation_checkpointing, first_stage=False, last_stage=False,
                  fused_attention=not args.unfused_attention)
        ours = activation_bytes(model, b, layers=2, **kw) - activation_bytes(model, b, layers=1, **kw)
        notes.append(
            "activations: bytes saved for backward by one micro-batch (metrics.jsonl's activation_peak_bytes "
            "measures the same), times the micro-batches a stage holds at once (1F1B: pp - stage; GPipe: all; "
            "interleaved, zb-h1, zbv: the most the rank's timeline holds, chunk by chunk, between F and B and, "
            "for zb-h1 and zbv, the W stashes between B and W: megazero.plan.estimate.peak_bytes). "
            f"Per layer here {_size(ours, unit)} {args.units} (CUDA's kernels; megazero.plan.activations); "
            f"Korthikanti et al.'s GPT figure, sbh(34 + 5as/h), gives "
            f"{_size(paper, unit)} {args.units} (16-bit, dropout masks, unfused attention; Megatron saves the "
            "sequence shard, not the gathered input, of column-parallel layers under SP).")
    if "host" in header:
        notes.append("host: the part of the model states offloaded to CPU memory (not in the device totals).")
    notes.append("step peak: the larger of the peak as backward begins (model states + activations in flight + "
                 "gradient staging buckets / ZeRO-3 gathered units + recomputation and fresh-gradient transients) "
                 "and the peak once activations are freed (end of backward: the tied embedding's gradient sum; "
                 "optimizer step) (megazero.plan.estimate.peak_bytes); metrics.jsonl's memory[r].peak_bytes measures it "
                 "(megazero/observe/memory.py); default ZeroConfig buckets (stage 2: Ψ/16 elements, one staging buffer "
                 "without overlap_comm), no overlap_comm.")
    notes.append("not counted (except in step peak): flat-buffer padding (< dp*16 elements per buffer), gradient staging buckets, "
                 "communication buffers, the CUDA context and allocator fragmentation.")
    lines += [f"  {i + 1}. {n}" for i, n in enumerate(notes)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv``, print the estimate; usage errors exit with status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("tp", "pp", "dp", "micro_batch_size"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer")
    if args.offload_param and args.zero_stage not in (None, 3):
        parser.error("--offload-param needs ZeRO stage 3")
    try:
        print(estimate(args))
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
