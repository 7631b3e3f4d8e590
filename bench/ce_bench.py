"""The vocabulary-parallel cross-entropy before and after issue 27's fused loss: time, dispatched ops, fp32 transient.

``before`` is the model's loss path at adf4bd3: the padded vocabulary masked to -inf over the whole logits
(``VocabParallelEmbedding.logits``), then the loss upcasting fixed-size 64 MiB chunks of tokens to fp32
(:func:`tests.test_cross_entropy.chunked_loss_before`). ``after`` is today's: raw logits, the loss told the real
vocabulary; the eager path on the CPU (8 token pieces), the Triton kernels on CUDA (and the eager path there too,
for comparison). Each contender runs forward + backward with the gradient written in place, as the model does.

Reported per contender: the median wall time of ``--reps`` repetitions after one warm-up (CUDA: synchronised);
the aten operations dispatched per forward + backward and the largest fp32 tensor any of them returns, both
counted on the meta device at the GPU run's shape (``--count-tokens``, GPT-2 124M at micro-batch 16: 16384 tokens
of 50304 columns), where on a GPU each eager op is at least one kernel launch. Triton's kernels are not aten ops:
its row counts them as the two launches they are plus the aten ops around them.

    python bench/ce_bench.py --tokens 1024 --reps 5           # CPU
    python bench/ce_bench.py --device cuda --tokens 16384      # one GPU: adds the Triton path
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megazero.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from megazero.tensor_parallel.layers import VOCAB_PAD_MULTIPLE, pad_size  # noqa: E402
from tests.test_cross_entropy import chunked_loss_before  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def before(logits: torch.Tensor, target: torch.Tensor, vocab: int) -> torch.Tensor:
    """adf4bd3's model path: full-logits masked_fill of the padding, then the chunked loss."""
    mask = torch.arange(logits.shape[-1], device=logits.device) >= vocab
    return chunked_loss_before(logits.masked_fill(mask, float("-inf")), target)


def after(backend: str):
    def loss(logits: torch.Tensor, target: torch.Tensor, vocab: int) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, target, None, 0, vocab, inplace_backward=True, backend=backend)
    return loss


class _Census(TorchDispatchMode):
    """Counts aten ops, those that compute (an output that is neither a view nor an input: a kernel on a GPU),
    and the largest fp32 tensor one of them allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.compute, self.largest = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        alias = [r.alias_info for r in func._schema.returns]  # None: a new tensor; is_write: written in place
        fresh = [t for t, a in zip(outs, alias) if a is None and isinstance(t, torch.Tensor)]
        self.compute += any(a is None or a.is_write for a in alias)
        for t in fresh:
            if t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def _inputs(n: int, padded: int, vocab: int, dtype: torch.dtype, device: str):
    logits = torch.randn(n, padded, device=device, dtype=dtype)
    target = torch.randint(0, vocab, (n,), device=device)
    return logits, target


def census(fn, n: int, padded: int, vocab: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(aten ops, computing ops, largest fp32 allocation in elements) of one forward + backward on meta."""
    logits, target = _inputs(n, padded, vocab, dtype, "meta")
    y = logits.requires_grad_() * 1.0
    mode = _Census()
    with mode:
        loss = fn(y, target, vocab)
        torch.autograd.grad(loss, y, torch.ones_like(loss))
    return mode.ops, mode.compute, mode.largest


def timed(fn, n: int, padded: int, vocab: int, dtype: torch.dtype, device: str, reps: int) -> tuple[float, float]:
    """Median wall and process-CPU milliseconds of forward + backward (in place, as the model's), after one
    warm-up. The CPU time (all of this process's threads) resists a loaded machine better than the wall time."""
    logits, target = _inputs(n, padded, vocab, dtype, device)
    wall, cpu = [], []
    for i in range(reps + 1):
        y = logits.clone().requires_grad_() * 1.0  # fresh logits: the backward overwrites them
        if device == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = fn(y, target, vocab)
        torch.autograd.grad(loss, y, torch.ones_like(loss))
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            wall.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.process_time() - c0) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per timed call")
    p.add_argument("--vocab", type=int, default=50257, help="real vocabulary (GPT-2's)")
    p.add_argument("--tp", type=int, default=1, help="TP size: the local slice is the padded vocabulary / tp")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--count-tokens", type=int, default=16384, help="tokens for the op census (meta)")
    args = p.parse_args(argv)
    padded = pad_size(args.vocab, VOCAB_PAD_MULTIPLE * args.tp) // args.tp
    vocab = min(args.vocab, padded)  # rank 0's real columns (all of them at tp 1)
    contenders = {"before (mask + 64 MiB chunks)": before, "after, eager (8 pieces)": after("eager")}
    if args.device == "cuda":
        contenders["after, Triton"] = after("triton")
    print(f"# {args.device}, {torch.__version__}, {torch.get_num_threads()} threads; timed at {args.tokens} tokens x "
          f"{padded} columns ({vocab} real); ops counted at {args.count_tokens} tokens")
    print("| dtype | contender | median wall ms (fwd+bwd) | median CPU ms | aten ops, all / computing | "
          "largest fp32 allocation (MB) |")
    print("|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        for label, fn in contenders.items():
            ms, cpu_ms = timed(fn, args.tokens, padded, vocab, dtype, args.device, args.reps)
            if "Triton" in label:  # the kernels are no aten ops and meta tensors cannot run them
                ops_s, big = "2 kernels + O(1) ops on [N] vectors", "O(tokens)"
            else:
                ops, compute, largest = census(fn, args.count_tokens, padded, vocab, dtype)
                ops_s, big = f"{ops} / {compute}", f"{largest * 4 / 2**20:.0f}"
            print(f"| {name} | {label} | {ms:.1f} | {cpu_ms:.1f} | {ops_s} | {big} |", flush=True)


if __name__ == "__main__":
    main()
