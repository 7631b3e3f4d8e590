"""Per-rank activation memory of GPT training with activation checkpointing, measured against the estimator.

    python bench/activation_checkpointing.py --model gpt2-124m --seq-len 1024 --micro-batch-size 1

For tp in {1, 2} (and tp 2 with sequence parallelism) one forward and backward of the model runs on CPU gloo
ranks per setting: no recomputation, selective (attention core), full (every block), full with
``partition_activations`` and/or ``cpu_checkpointing``, at dropout 0 (fused attention) and, for the attention
settings, dropout 0.1 (CPU runs attention with dropout unfused, which is where selective recomputation pays).

Columns, per rank (fp32, MB = 1e6 bytes):

* device stash: bytes autograd saves for backward during the forward (saved-tensor hooks, de-duplicated by
  storage, parameters excluded: :class:`megazero.observe.memory.ActivationMemoryCounter`, metrics.jsonl's
  ``activation_peak_bytes``);
* host: bytes ``cpu_checkpointing`` moved out of the autograd graph into host buffers (held between forward
  and backward). On CPU ranks this is the same RAM; the columns say where each byte is kept, not that it left;
* recompute: what one recomputation saves during backward, the transient on top of the stash;
* peak bound: stash + recompute (an upper bound on saved activations alive at once during backward);
* estimate: :func:`megazero.plan.estimate.activation_bytes` / ``recompute_bytes`` / ``checkpoint_host_bytes`` with
  the CPU kernels' settings (unfused attention with dropout, masks in fp32);

Time is not reported: on the shared 2-core machine it is noise. Recomputation costs one more forward of
each block (full: Megatron-LM's 96 vs 72 B·s·l·h² FLOPs, :func:`megazero.observe.flops.megatron_hardware_flops`)
or of the attention core (selective: 4·B·s²·h per layer).

Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.config.schema import ActivationCheckpointingConfig, ModelConfig, model_preset  # noqa: E402
from megazero.model import GPT, init_parameters  # noqa: E402
from megazero.observe.memory import ActivationMemoryCounter  # noqa: E402
from megazero.plan.estimate import activation_bytes, checkpoint_host_bytes, recompute_bytes  # noqa: E402
from megazero.tensor_parallel.random import RNGTracker  # noqa: E402
from tests.dist import run_world  # noqa: E402

__all__ = ["SETTINGS", "main", "measure"]

# (dropout, mode, partition_activations, cpu_checkpointing); partitioning needs tp > 1 and no SP
SETTINGS = [
    (0.0, "none", False, False), (0.0, "selective", False, False), (0.0, "full", False, False),
    (0.0, "full", True, False), (0.0, "full", False, True), (0.0, "full", True, True),
    (0.1, "none", False, False), (0.1, "selective", False, False), (0.1, "selective", False, True),
    (0.1, "full", False, False),
]


def measure(ctx, cfg: ModelConfig, micro_batch: int, sp: bool, settings: list) -> list[tuple[int, int, int]]:
    """Rank function: (device stash, recompute transient, host bytes) per setting."""
    out = []
    for dropout, mode, part, cpu in settings:
        model = GPT(replace(cfg, dropout=dropout), ctx.tp_group, sequence_parallel=sp,
                    rng_tracker=RNGTracker(0, ctx.tp_rank),
                    activation_checkpointing=ActivationCheckpointingConfig(mode, part, cpu))
        init_parameters(model, 0, ctx.tp_group)
        counter = ActivationMemoryCounter(model)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        with counter.track():
            loss = model(ids[:, :-1].clone(), ids[:, 1:].clone()).mean()
        host = model.checkpoint_stats.host_bytes
        loss.backward()
        out.append((counter.last, model.checkpoint_stats.recompute_peak_bytes, host))
        del model, loss
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    cfg = model_preset(args.model, seq_len=args.seq_len, num_layers=args.num_layers)
    b = args.micro_batch_size
    print(f"{args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_heads}, seq "
          f"{cfg.seq_len}, micro-batch {b}, fp32; MB = 1e6 bytes per rank\n")
    print("| tp | SP | dropout | recompute | partition | cpu | device stash (MB) | vs none | host (MB) | "
          "recompute (MB) | peak bound (MB) | estimate stash / recompute / host (MB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes: list[str] = []
    grids = [(tp, sp) for tp in args.tp for sp in ((False, True) if tp > 1 else (False,))]
    for tp, sp in grids:
        settings = [s for s in SETTINGS if not (s[2] and (tp == 1 or sp))]
        ranks = run_world(measure, tp, cfg, b, sp, settings, tp=tp, timeout=3600)
        # TP ranks hold the same, but for the LM head's mask over a padded vocabulary slice (the last rank's)
        extra = {r[i][0] - ranks[0][i][0] for r in ranks for i in range(len(settings))}
        if any([x[1:3] for x in r] != [x[1:3] for x in ranks[0]] for r in ranks) or len(extra - {0}) > 1:
            raise RuntimeError(f"TP ranks measured different bytes at tp={tp}: {extra}")
        notes.extend(f"tp={tp}{' SP' if sp else ''}: TP rank {i} stashes {d:,} bytes more in every setting"
                     for i, d in enumerate(r[0][0] - ranks[0][0][0] for r in ranks) if d)
        base: dict[float, int] = {}
        for (dropout, mode, part, cpu), (stash, transient, host) in zip(settings, ranks[0]):
            base.setdefault(dropout, stash)
            kw = dict(tp_size=tp, sequence_parallel=sp, precision="fp32", checkpointing=mode)
            kernels = dict(fused_attention=dropout == 0, mask_bytes=4)
            m = replace(cfg, dropout=dropout)
            est = (activation_bytes(m, b, **kw, **kernels, partition_activations=part, cpu_checkpointing=cpu),
                   recompute_bytes(m, b, **kw, **kernels),
                   checkpoint_host_bytes(m, b, **kw, partition_activations=part) if cpu else 0)
            print(f"| {tp} | {'yes' if sp else 'no'} | {dropout} | {mode} | {'yes' if part else 'no'} | "
                  f"{'yes' if cpu else 'no'} | {_mb(stash)} | {stash / base[dropout]:.3f} | {_mb(host)} | "
                  f"{_mb(transient)} | {_mb(stash + transient)} | {' / '.join(_mb(x) for x in est)} |", flush=True)
    print("\nRows are TP rank 0. " + "; ".join(notes) if notes else "")


if __name__ == "__main__":
    main()
