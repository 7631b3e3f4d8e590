"""Context-parallel attention, like for like: megazero's ring (its blocks through SDPA's fused kernel and
through plain fp32 matmuls) and all-gather modes at cp 2 and 4 (gloo ranks on this CPU) against one process
running ``scaled_dot_product_attention`` over the whole sequence, and torch's own
``torch.distributed.tensor.experimental.context_parallel`` at the same sizes where it runs.

    python bench/cp_attention.py                       # B 1, 8 heads of 64, S 2048, 5 repetitions
    python bench/cp_attention.py --seq-len 4096 --reps 7

Each measurement is one forward + backward of causal attention (fp32, q, k, v ``[B, H, S, D]``); every process
runs one thread, so cp ranks compete for the machine's cores as GPUs would not. A repetition's time is the
slowest rank's (an all-reduce of max after a barrier); the table gives the median and the range of ``--reps``
repetitions after one warm-up, all in one run. The error column is the largest absolute difference of this
rank's output and input gradients from the single-process result's rows.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.context_parallel import context_parallel_attention  # noqa: E402
from megazero.context_parallel.sharding import shard_sequence  # noqa: E402
from megazero.distributed.context import ParallelContext, RankGrid  # noqa: E402


def _inputs(args) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq_len, args.head_dim)
    return tuple(torch.randn(shape, generator=g) for _ in range(4))  # q, k, v, dout


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _timed(fn, reps: int, sync) -> list[float]:
    out = []
    for i in range(reps + 1):  # the first is a warm-up
        sync()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0])
        sync(dt)
        if i:
            out.append(float(dt))
    return out


def _megazero(ctx, mode: str, full, ref, reps: int, kernel: str = "auto") -> tuple[list[float], float]:
    n, r = ctx.cp_size, ctx.cp_rank
    q, k, v, dout = (shard_sequence(t, r, n, 2) for t in full)
    res = {}

    def step():
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(qs, ks, vs, ctx.cp_group, mode=mode, kernel=kernel)
        out.backward(dout)
        res["got"] = (out.detach(), qs.grad, ks.grad, vs.grad)

    times = _timed(step, reps, _sync)
    err = max((a - shard_sequence(b, r, n, 2)).abs().max().item() for a, b in zip(res["got"], ref))
    return times, err


def _torch_cp(n: int, full, ref, reps: int) -> tuple[list[float], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (n,))
    q0, k0, v0, dout0 = full
    res = {}

    def step():
        q, k, v, dout = bufs = [t.clone() for t in (q0, k0, v0, dout0)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers=set(bufs)):
            qs, ks, vs = (t.requires_grad_() for t in (q, k, v))
            out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out.backward(dout)
        res["got"] = (out.detach(), qs.grad, ks.grad, vs.grad)

    times = _timed(step, reps, _sync)
    # torch shards each buffer its own way (round-robin by default); compare through its unsharding
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    got = context_parallel_unshard(mesh, list(res["got"]), [2, 2, 2, 2])
    err = max((a - b).abs().max().item() for a, b in zip(got, ref))
    return times, err


def _sync(t: torch.Tensor | None = None) -> None:
    if t is None:
        dist.barrier()
    else:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)


def _rank(rank: int, n: int, port: int, args, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        ctx = ParallelContext.from_grid(RankGrid(n, cp_size=n))
        full = _inputs(args)
        ref = _reference(*full)
        rows = {}
        for kernel in ("fused", "matmul"):  # the ring's blocks through SDPA's fused op, and the plain fp32 path
            rows[f"megazero ring, {kernel} blocks"] = _megazero(ctx, "ring", full, ref, args.reps, kernel)
        rows["megazero allgather"] = _megazero(ctx, "allgather", full, ref, args.reps)
        try:
            rows["torch context_parallel"] = _torch_cp(n, full, ref, args.reps)
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            rows["torch context_parallel"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        errs = [torch.tensor([v[1] if isinstance(v, tuple) else 0.0]) for v in rows.values()]
        for e in errs:
            dist.all_reduce(e, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put({k: (v[0], float(e)) if isinstance(v, tuple) else v for (k, v), e in zip(rows.items(), errs)})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _row(name: str, cp: int, times: list[float], base: float, err: str) -> str:
    med = statistics.median(times)
    return (f"| {name} | {cp} | {med * 1e3:.1f} | {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f} | "
            f"{base / med:.2f}x | {err} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cp", default="2,4", help="CP sizes, comma-separated (default %(default)s)")
    args = p.parse_args()
    torch.set_num_threads(1)
    full = _inputs(args)
    base_times = _timed(lambda: _reference(*full), args.reps, lambda t=None: None)
    base = statistics.median(base_times)
    print(f"causal attention fwd+bwd, fp32, B {args.batch}, {args.heads} heads x {args.head_dim}, S {args.seq_len}; "
          f"median of {args.reps} after a warm-up; torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread/process")
    print("| attention | cp | median ms | range ms | vs one process | max error |")
    print("|---|---|---|---|---|---|")
    print(_row("single-process SDPA, whole sequence", 1, base_times, base, "-"))
    failures = []
    ctx = mp.get_context("spawn")
    for n in (int(x) for x in args.cp.split(",")):
        queue = ctx.Queue()
        mp.start_processes(_rank, args=(n, _free_port(), args, queue), nprocs=n, start_method="spawn")
        for name, val in queue.get().items():
            if isinstance(val, str):
                failures.append(f"cp {n}: {name} failed: {val}")
                continue
            times, err = val
            print(_row(name, n, times, base, f"{err:.1e}"))
    for line in failures:
        print(line)


if __name__ == "__main__":
    main()
