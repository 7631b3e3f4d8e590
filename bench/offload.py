"""ZeRO-Offload on CPU: where the model states live, and how fast the host-side Adam step is.

    python bench/offload.py

Part 1 trains one step of an 8-layer, 512-wide GPT (bf16, dp 2) at ZeRO stages 1-3 with and without offload
and prints each rank's measured model-state bytes on the device and on the host next to the estimator's.
Part 2 times the Adam update of 124M fp32 parameters (GPT-2 124M's shapes) on the CPU: megazero's flat,
vectorised update (what the offloaded step runs) against torch.optim.AdamW's foreach and fused paths.
"""

from __future__ import annotations

import os
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
from megazero.zero.grads import OwnedGrads  # noqa: E402
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


if __name__ == "__main__":
    memory_table()
    adam_table()
