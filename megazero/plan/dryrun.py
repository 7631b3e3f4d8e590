"""Dry run: one real training step per rank role of any topology, on one CPU, with no GPU and no weights.

``python pretrain/gpt.py --dry-run [any flags]`` runs :func:`dry_run`. A *rank role* is a pipeline stage times
whether the TP rank holds vocabulary padding (CP ranks are roles like DP ranks: chunks i and 2cp-1-i give each
the same shapes, work and volumes); ranks of one role hold the same shapes and move the same volumes,
so one step per role (:func:`megazero.plan.role.run_role`, on the meta device and torch's ``fake`` backend)
measures the whole world. Under 1F1B and interleaved a role runs at two short micro-batch counts and its volumes
are extrapolated (:mod:`megazero.plan.extrapolate`).

Per role the report gives the model states at rest, the peak by category (the same tracker as metrics.jsonl),
the ledger's volume per group, the pipeline bubble (:func:`~megazero.pipeline.schedules.simulate`), the
NCCL-order replay of the pipeline's point-to-point calls and a roofline step time (:mod:`megazero.plan.roofline`);
then a verdict on the larger of each role's two peaks, its training step's and an evaluation pass's (what a run
does between steps; at ZeRO-3 it gathers block by block like the step): fits, or which rank and category
overflow.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from megazero.config.resolve import chunks_per_rank
from megazero.config.schema import Config
from megazero.distributed.context import RankGrid
from megazero.model.kernels import emulate
from megazero.pipeline.p2p_replay import replay
from megazero.pipeline.schedules import simulate
from megazero.plan.extrapolate import run_role_steady
from megazero.plan.role import RoleResult, rank_roles, run_role
from megazero.plan.roofline import Cluster, describe

__all__ = ["DryRunReport", "dry_run", "format_report"]


@dataclass
class DryRunReport:
    topology: dict[str, Any]
    roles: list[RoleResult]
    bubble_fraction: float
    usable_memory_bytes: float
    gpu: str
    fits: bool
    verdict: str
    wall_seconds: float
    p2p_replay: str = "no pipeline"  # the NCCL-order replay of the recorded point-to-point calls
    p2p_ok: bool = True

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def dry_run(cfg: Config, c: Cluster, log_dir: str | None = None, device_type: str = "cuda",
            steady: bool = True) -> DryRunReport:
    """Dry-run every rank role of ``cfg`` (resolved for its world and ``device_type``) and judge whether it fits
    ``c``. The meta tensors run the kernels of ``device_type`` (:func:`megazero.model.kernels.emulate`: fused
    attention and dropout on CUDA); compiled blocks (``--compile``) run eagerly, as the tracker sees them.
    With ``steady`` (default) each role runs at two small micro-batch counts and its volumes are extrapolated
    when the two agree (:func:`megazero.plan.extrapolate.run_role_steady`); ``steady=False`` runs the full count."""
    start = time.perf_counter()
    p, m, t = cfg.parallel, cfg.model, cfg.training
    step_cfg = replace(cfg, training=replace(t, compile=False))  # nothing to compile for on meta
    grid = RankGrid(p.tp_size * p.cp_size * p.pp_size * p.dp_size, p.tp_size, p.pp_size, p.dp_size, p.cp_size)
    roles = []
    schedule = p.pp_schedule if p.pp_size > 1 else "1f1b"
    for rank, padded in rank_roles(grid, m.vocab_size, schedule):
        with emulate(device_type):
            res = run_role_steady(step_cfg, grid, rank, c) if steady else run_role(step_cfg, grid, rank, c)
        res.holds_vocab_padding = padded
        roles.append(res)
    p2p_ok, p2p_text = True, "no pipeline"
    if p.pp_size > 1:  # the pipeline group of dp 0 / tp 0: every stage's role holds one of its ranks
        pp_ranks = set(grid.group_of("pp", 0))
        calls = {r.rank: r.p2p_calls for r in roles if r.rank in pp_ranks}
        result = replay(calls)
        counts = {r.micro_batches_run[0] if r.micro_batches_run else t.gradient_accumulation_steps for r in roles}
        p2p_ok, p2p_text = result.ok, (str(result) + f" ({sum(len(c) for c in calls.values())} batched calls"
                                       f" at {'/'.join(map(str, sorted(counts)))} micro-batches)")
    for r in roles:
        r.p2p_calls = None  # replayed; not written to the JSON
    v = chunks_per_rank(schedule, p.pp_size, p.virtual_stages)
    bubble = simulate(schedule, p.pp_size, t.gradient_accumulation_steps, v).bubble_fraction if p.pp_size > 1 else 0.0
    usable = c.usable_memory_bytes
    worst = max(roles, key=lambda r: r.larger_peak()[1])  # the training step's or the evaluation's peak
    phase, peak, by_cat = worst.larger_peak()
    fits = peak <= usable and p2p_ok
    if fits:
        verdict = (f"fits: the largest peak is rank {worst.rank}'s {peak / 1e9:.2f} GB ({phase}) of "
                   f"{usable / 1e9:.1f} GB usable on {c.gpu.name}")
    elif peak <= usable:
        verdict = f"does not run: the point-to-point calls fail the NCCL-order replay: {p2p_text}"
    else:
        cat = max(by_cat, key=by_cat.get)
        verdict = (f"does not fit: rank {worst.rank} (pp {worst.pp_rank}, tp {worst.tp_rank}) peaks at "
                   f"{peak / 1e9:.2f} GB ({phase}) > {usable / 1e9:.1f} GB usable on {c.gpu.name}; its largest "
                   f"category is {cat} ({by_cat[cat] / 1e9:.2f} GB)")
    report = DryRunReport(
        topology={"tp": p.tp_size, "cp": p.cp_size, "pp": p.pp_size, "dp": p.dp_size, "world_size": grid.world_size,
                  "zero_stage": cfg.zero.stage, "schedule": schedule, "virtual_stages": v,
                  "micro_batches": t.gradient_accumulation_steps, "micro_batch_size": t.micro_batch_size,
                  "precision": t.precision, "gpus_per_node": c.gpus_per_node, "device_type": device_type,
                  "compile": bool(t.compile), "roofline": describe(c, t.precision)},
        roles=roles, bubble_fraction=bubble, usable_memory_bytes=usable, gpu=c.gpu.name, fits=fits,
        verdict=verdict, wall_seconds=time.perf_counter() - start, p2p_replay=p2p_text, p2p_ok=p2p_ok)
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, "dryrun.json"), "w") as f:
            json.dump(report.as_dict(), f, indent=1)
    return report


def format_report(r: DryRunReport) -> str:
    """The report as a table, one row per rank role."""
    big = max([x.peak_bytes for x in r.roles] + [1])
    unit, gb = ("GB", 1e9) if big >= 1e9 else ("MB", 1e6)
    tp = r.topology
    head = ["rank", "pp", "tp", "pad", f"states {unit}", f"host {unit}", f"peak {unit}", "params", "grads", "master",
            "optim", "acts", "comm", "other", "TP Melem", "CP Melem", "PP Melem", "DP Melem", "DP inter MB", "DP intra MB", "reads", "step s",
            "steps", "dry s"]
    rows = []
    for x in r.roles:
        s = x.states
        c = x.peak_by_category
        states = sum(s.get(k, 0) for k in ("params_bytes", "grads_bytes", "master_params_bytes",
                                           "optimizer_states_bytes")) - s.get("offloaded_bytes", 0)
        rows.append([str(x.rank), str(x.pp_rank), str(x.tp_rank), "y" if x.holds_vocab_padding else "-",
                     f"{states / gb:.2f}", f"{s.get('offloaded_bytes', 0) / gb:.2f}", f"{x.peak_bytes / gb:.2f}",
                     *(f"{c.get(k, 0) / gb:.2f}" for k in ("params", "grads", "master_params", "optimizer_states",
                                                          "activations", "comm_buffers", "other")),
                     *(f"{x.volumes.get(g, 0) / 1e6:.1f}" for g in ("tp", "cp", "pp")),
                     f"{(x.volumes.get('dp', 0) + x.volumes.get('dp_cp', 0)) / 1e6:.1f}",
                     *(f"{x.link_bytes.get(k, 0) / 1e6:.1f}" for k in ("inter", "intra")), str(x.host_reads),
                     f"{x.step_seconds.get('total_s', 0):.3f}", str(x.steps), f"{x.wall_seconds:.1f}"])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    cp = f" x cp {tp['cp']}" if tp.get("cp", 1) > 1 else ""
    lines = [f"megazero dry run: tp {tp['tp']}{cp} x pp {tp['pp']} x dp {tp['dp']} = {tp['world_size']} ranks, ZeRO "
             f"{tp['zero_stage']}, {tp['precision']}, {tp['micro_batches']} micro-batches of {tp['micro_batch_size']}"
             f" ({tp['schedule']}); {len(r.roles)} rank roles in {r.wall_seconds:.1f} s",
             ""]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in [head, *rows]]
    lines += ["", f"pipeline bubble: {r.bubble_fraction:.1%} of compute (simulated schedule)",
              f"NCCL-order replay of the pipeline's point-to-point calls: {r.p2p_replay}",
              "states: model states on the device at rest; host: offloaded states in host memory; peak: live "
              "device tensors by category at the step's peak (the tracker of metrics.jsonl; steps 2: the first "
              "step left buffers later steps start with, the larger peak of two); Melem: elements"
              " per step as the ledger counts them (all-reduce 2n); DP inter/intra MB: ZeRO's bytes per step over groups "
              "that span nodes / stay in one (--ranks-per-node, default the cluster's node); step s: roofline "
              "estimate on "
              f"{tp['gpus_per_node']}-GPU nodes of {r.gpu}",
              tp.get("roofline", ""),
              f"kernels as on {tp.get('device_type', 'cuda')} (fused attention and dropout on cuda)"
              + ("; --compile's blocks run eagerly here" if tp.get("compile") else ""),
              f"verdict: {r.verdict}"]
    return "\n".join(lines)
