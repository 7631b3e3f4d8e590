"""Per-rank parameter and activation memory of a GPT under tensor (and sequence) parallelism, measured.

    python bench/tp_memory.py --model gpt2-124m --seq-len 1024 --micro-batch-size 1

For tp in {1, 2, 4}, with and without sequence parallelism, one forward pass runs on CPU gloo ranks; the
activation bytes are those autograd saves for backward (saved-tensor hooks, de-duplicated by storage,
parameters excluded) and the parameter bytes those the rank holds. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.config.schema import model_preset  # noqa: E402
from megazero.model import GPT, init_parameters  # noqa: E402
from megazero.observe.memory import ActivationMemoryCounter  # noqa: E402
from tests.dist import run_world  # noqa: E402


def _measure(ctx, cfg, micro_batch: int, sp: bool) -> tuple[int, int]:
    model = GPT(cfg, ctx.tp_group, sequence_parallel=sp)
    init_parameters(model, 0, ctx.tp_group)
    counter = ActivationMemoryCounter(model)
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with counter.track():
        model(ids, ids)
    return sum(p.numel() * p.element_size() for p in model.parameters()), counter.last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    cfg = model_preset(args.model, seq_len=args.seq_len, num_layers=args.num_layers)
    print(f"{args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, seq {cfg.seq_len}, "
          f"micro-batch {args.micro_batch_size}, fp32\n")
    print("| tp | sequence parallel | params / rank (MB) | params vs tp=1 | activations / rank (MB) | vs tp=1 |")
    print("|---|---|---|---|---|---|")
    base = None
    for tp in args.tp:
        for sp in ((False, True) if tp > 1 else (False,)):
            params, acts = run_world(_measure, tp, cfg, args.micro_batch_size, sp, tp=tp, timeout=1800)[0]
            base = base or (params, acts)
            print(f"| {tp} | {'yes' if sp else 'no'} | {params / 1e6:.1f} | {params / base[0]:.3f} | "
                  f"{acts / 1e6:.1f} | {acts / base[1]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
