"""ZeRO-Offload on CPU: where the model states live, and how fast the host-side Adam step is.

    python bench/offload.py              # parts 1 and 2
    python bench/offload.py --host-adam  # part 3 only (about 2.3 GB of memory)

Part 1 trains one step of an 8-layer, 512-wide GPT (bf16, dp 2) at ZeRO stages 1-3 with and without offload
and prints each rank's measured model-state bytes on the device and on the host next to the estimator's.
Part 2 times the Adam update of 124M fp32 parameters (GPT-2 124M's shapes) on the CPU: megazero's flat,
vectorised update (what the offloaded step runs) against torch.optim.AdamW's foreach and fused paths.
Part 3 (issue 27 item 4) times the host Adam over one flat fp32 buffer of 100M elements at 1 and 2 intra-op
threads: one ``torch._fused_adamw_`` call, and the offloaded step's pipeline (``HostOffload.adam``: gradient
copy-in, fused Adam and bf16 copy-back per 8M-element sub-group); medians of wall time and of CPU time over wall
time, and how the CPU ticks split over the process's threads (the fused kernel's ``at::parallel_for`` shows
there even when other processes hold the cores, where wall time cannot show it).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megazero.config.cli import parse_args  # noqa: E402
from megazero.config.schema import LossScaleConfig, OptimizerConfig, ZeroConfig, model_preset  # noqa: E402
from megazero.distributed.group import Group  # noqa: E402
from megazero.model import GPT, init_parameters  # noqa: E402
from megazero.plan.estimate import model_state_bytes  # noqa: E402
from megazero.train.engine import Engine  # noqa: E402
from megazero.zero import ZeroOptimizer  # noqa: E402
from megazero.zero.adam import adam_update  # noqa: E402
from megazero.zero.grads import OwnedGrads  # noqa: E402
from megazero.zero.host_adam import using_threads  # noqa: E402
from megazero.zero.offload import HostOffload  # noqa: E402
from tests.dist import run_world  # noqa: E402

RUNS = [(1, []), (1, ["--offload-optimizer"]), (2, []), (2, ["--offload-optimizer"]), (3, []),
        (3, ["--offload-optimizer"]), (3, ["--offload-optimizer", "--offload-param"])]


def _states(ctx):
    out = []
    for stage, flags in RUNS:
        cfg = parse_args(["--num-layers", "8", "--hidden-size", "512", "--num-heads", "8", "--seq-len", "128",
                          "--vocab-size", "1024", "--precision", "bf16", "--zero-stage", str(stage), "--dp", "2",
                          "--micro-batch-size", "2", *flags]).resolve(ctx.world_size)
        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0))
        engine = Engine(cfg, ctx)
        engine.train_step([(torch.randint(0, 1024, (2, 128)), torch.randint(0, 1024, (2, 128)))])
        psi = sum(p.numel() for p in engine.model.parameters())
        out.append((stage, flags, engine.optimizer.model_state_bytes(), psi))
    return out


def memory_table() -> None:
    print("| ZeRO stage | offload | device model states / rank (MB) | host (MB) | estimator device / host (MB) |")
    print("|---|---|---|---|---|")
    for stage, flags, m, psi in run_world(_states, 2, timeout=1200)[0]:
        total = m["params_bytes"] + m["grads_bytes"] + m["master_params_bytes"] + m["optimizer_states_bytes"]
        est = model_state_bytes(psi, stage, 2, "bf16", offload_optimizer="--offload-optimizer" in flags,
                                offload_param="--offload-param" in flags)
        what = {0: "none", 1: "optimizer", 2: "optimizer + params"}[len(flags)]
        print(f"| {stage} | {what} | {(total - m['offloaded_bytes']) / 1e6:.2f} | {m['offloaded_bytes'] / 1e6:.2f} "
              f"| {est.device / 1e6:.2f} / {est.offloaded / 1e6:.2f} |", flush=True)


def _time(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def adam_table() -> None:
    torch.manual_seed(0)
    model = GPT(model_preset("gpt2-124m"))
    init_parameters(model, 0)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for name, kw in (("torch.optim.AdamW (foreach)", {"foreach": True}), ("torch.optim.AdamW (fused)", {"fused": True})):
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **kw)
        rows.append((name, _time(opt.step)))
        del opt
    world = Group("dp", [0], None)
    zero = ZeroOptimizer(model, ZeroConfig(stage=1, offload_optimizer="cpu"), OptimizerConfig(lr=1e-4), world,
                         loss_scale_cfg=LossScaleConfig())
    g = OwnedGrads([(0, torch.randn(zero.owned_numel) * 1e-3)])
    rows.append(("megazero host Adam (offload step)", _time(lambda: zero._adam(g, 1e-4))))
    print(f"\nAdam update of {n / 1e6:.1f}M fp32 parameters on the CPU ({torch.get_num_threads()} threads), median of 5:\n")
    print("| implementation | seconds / step | vs foreach |")
    print("|---|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec:.3f} | {sec / rows[0][1]:.2f}x |")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _thread_ticks() -> dict[str, int]:
    """CPU clock ticks (user + system) of each of this process's threads (Linux /proc; empty elsewhere)."""
    out = {}
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[tid] = int(fields[11]) + int(fields[12])
    except OSError:
        pass
    return out


def _time_cpu(fn, reps: int) -> tuple[float, float, str]:
    """Median wall seconds of ``fn``, median CPU seconds / wall seconds, and the share of the CPU ticks each
    thread that worked took over all reps (which threads did the work, whatever else loads the cores)."""
    fn()
    walls, ratios = [], []
    before = _thread_ticks()
    for _ in range(reps):
        c, t = _cpu_s(), time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        walls.append(wall)
        ratios.append((_cpu_s() - c) / wall)
    after = _thread_ticks()
    ticks = sorted((after[k] - before.get(k, 0) for k in after), reverse=True)
    shares = " / ".join(f"{x / max(1, sum(ticks)):.0%}" for x in ticks if x >= 0.02 * max(1, sum(ticks)))
    return statistics.median(walls), statistics.median(ratios), shares or "n/a"


def host_adam_table(numel: int = 100_000_000, reps: int = 5) -> None:
    """Host Adam over one flat fp32 buffer of ``numel`` elements at 1 and 2 threads (see the module docstring)."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(numel, generator=gen) * 0.02
    m, v = torch.zeros(numel), torch.zeros(numel)
    grad = torch.randn(numel, generator=gen) * 1e-3  # the "device" gradient segment (fp32, as bf16 training keeps)
    param = master.to(torch.bfloat16)  # the "device" bf16 parameters the step writes back
    cfg, step = OptimizerConfig(lr=1e-4), torch.tensor(1.0)
    seg = SimpleNamespace(param=param, grad=grad)

    def fused() -> None:
        torch._fused_adamw_([master], [grad], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)

    rows = []
    for threads in (1, 2):
        host = HostOffload(pin=False, threads=threads)

        def pipelined(host: HostOffload = host) -> None:
            g = host.owned_grads([seg], [0, numel])
            host.adam(master, [seg], [0, numel], lambda p, lo, hi: adam_update(
                p, g, 1e-4, lo, hi, cfg=cfg, step=1, decay_runs=[(0, numel)], exp_avg=m, exp_avg_sq=v,
                step_tensor=step))

        with using_threads(threads):
            rows.append((threads, "one torch._fused_adamw_ call", *_time_cpu(fused, reps)))
        rows.append((threads, "HostOffload.adam pipeline (copy-in, Adam, bf16 copy-back)", *_time_cpu(pipelined, reps)))
    load = os.getloadavg()[0]
    print(f"\nHost Adam over {numel / 1e6:.0f}M fp32 elements, median of {reps} (load average {load:.1f}, "
          f"{os.cpu_count()} cores):\n")
    print("| threads | what | seconds / step | CPU s / wall s | CPU ticks by thread |")
    print("|---|---|---|---|---|")
    for threads, what, sec, busy, shares in rows:
        print(f"| {threads} | {what} | {sec:.3f} | {busy:.2f} | {shares} |", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-adam", action="store_true", help="only part 3: host Adam at 1 and 2 threads")
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not args.host_adam:
        memory_table()
        adam_table()
    host_adam_table(args.numel, args.reps)
