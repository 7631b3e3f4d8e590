"""A short profile of megazero's training step with torch.profiler: kernels per step, the GPU-busy fraction and
the ten kernels that take the most time.

    python bench/gpu_profile.py --model gpt2-124m --micro-batch-size 16 --json profile.json
    python bench/gpu_profile.py --device cpu --model tiny --no-compile     # CPU smoke run (tests/test_bench_gpu.py)

The engine is built as bench/gpu.py builds it (same flags, same batch), warmed up (compilation happens there),
then ``--steps`` steps are profiled, each inside a ``megazero_step`` range that ends with a device
synchronisation, so each step's window holds all of its device work. On CUDA, the device events in those
windows are the kernels and the memory copies/sets (counted apart); busy is the union of their intervals over the
windows' total length: the time the GPU had something running. On the CPU (the smoke run) the top-level aten ops
stand in for kernels, so the plumbing is tested without a GPU. ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COPY_PREFIXES = ("Memcpy", "Memset")
STEP_RANGE = "megazero_step"


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the union of ``(start, end)`` intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize(work: list[tuple[str, float, float]], windows: list[tuple[float, float]], top: int = 10) -> dict:
    """Figures of ``work`` (name, start, end; microseconds) inside the step ``windows``: kernels and copies per
    step, busy fraction and the ``top`` kernels by total time (copies and sets apart)."""
    inside = [(n, max(s, lo), min(e, hi)) for n, s, e in work for lo, hi in windows if s < hi and e > lo]
    kernels = [w for w in inside if not w[0].startswith(COPY_PREFIXES)]
    copies = [w for w in inside if w[0].startswith(COPY_PREFIXES)]
    span = sum(hi - lo for lo, hi in windows)
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for n, s, e in kernels:
        per_name[n][0] += 1
        per_name[n][1] += e - s
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    steps = max(len(windows), 1)
    kernel_us = sum(e - s for _, s, e in kernels)
    return {
        "steps": len(windows), "step_ms": [(hi - lo) / 1e3 for lo, hi in windows],
        "kernels_per_step": len(kernels) / steps, "copies_per_step": len(copies) / steps,
        "busy_fraction": union_length((s, e) for _, s, e in inside) / span if span else None,
        "kernel_ms_per_step": kernel_us / 1e3 / steps,
        "copy_ms_per_step": sum(e - s for _, s, e in copies) / 1e3 / steps,
        "top_kernels": [{"name": n[:120], "calls_per_step": c / steps, "ms_per_step": t / 1e3 / steps,
                         "share_of_kernel_time": t / kernel_us if kernel_us else None} for n, (c, t) in ranked],
    }


def _device_work(events, device_type) -> list[tuple[str, float, float]]:
    """(name, start, end) of the profile's work: device events on CUDA; on the CPU, aten ops with no aten op
    above them."""
    import torch

    if device_type == "cuda":  # kernels, copies and sets; not the ranges record_function mirrors on the GPU
        return [(e.name, e.time_range.start, e.time_range.end) for e in events
                if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                and e.name != STEP_RANGE]

    def top_level(e) -> bool:
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return False
            p = p.cpu_parent
        return True

    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.name.startswith("aten::") and top_level(e)]


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.gpu import MODELS, _batch, _flags, _sync, finish, setup
    from megazero.config.cli import parse_args
    from megazero.config.schema import model_preset
    from megazero.train.engine import Engine

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-124m", choices=MODELS)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (compilation happens here)")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"), help="default: bf16 on CUDA")
    p.add_argument("--compile", default=None, action=argparse.BooleanOptionalAction, help="default: on CUDA")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out: dict = {"model": args.model, "micro_batch": args.micro_batch_size, "torch": torch.__version__}
    try:
        device, ctx, name = setup(args)
        out.update(device=name, precision=args.precision, compile=args.compile)
        m = model_preset(args.model)
        cfg = parse_args(_flags(args.model, m, args.micro_batch_size, args.precision, args.compile, []))
        engine = Engine(cfg.resolve(1, device_type=device.type), ctx, device)
        batch = [_batch(args.micro_batch_size, m.seq_len, m.vocab_size, device)]
        for _ in range(args.warmup):
            engine.train_step(batch, measure=False)
        _sync(device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                with record_function(STEP_RANGE):
                    engine.train_step(batch, measure=False)
                    _sync(device)
        out["profiled_wall_s"] = time.perf_counter() - t0
        events = prof.events()
        windows = sorted((e.time_range.start, e.time_range.end) for e in events  # the host's ranges only
                         if e.name == STEP_RANGE and e.device_type == torch.autograd.DeviceType.CPU)
        out["work"] = "CUDA kernels" if device.type == "cuda" else "top-level aten ops (CPU smoke run)"
        out.update(summarize(_device_work(events, device.type), windows, args.top))
        busy = out["busy_fraction"]
        print(f"\n{args.model}, micro-batch {args.micro_batch_size}, {name}: {out['kernels_per_step']:.0f} "
              f"{out['work']} and {out['copies_per_step']:.0f} copies per step, busy "
              f"{'n/a' if busy is None else f'{100 * busy:.1f}%'} of {sum(out['step_ms']) / len(windows):.1f} ms")
        print("| kernel | calls/step | ms/step | share |\n|---|---|---|---|")
        for k in out["top_kernels"]:
            share = k["share_of_kernel_time"]
            print(f"| {k['name'][:80]} | {k['calls_per_step']:.0f} | {k['ms_per_step']:.2f} | "
                  f"{'n/a' if share is None else f'{100 * share:.1f}%'} |")
    except Exception as e:  # noqa: BLE001 - write what was measured, say what broke, exit non-zero
        finish(out, args.json, e)
    finish(out, args.json)


if __name__ == "__main__":
    main()
