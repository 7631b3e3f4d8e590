"""Dry run: one real training step per rank role of any topology, on one CPU, with no GPU and no weights.

``python pretrain/gpt.py --dry-run [any flags]`` runs :func:`dry_run`. For each distinct *rank role* (each
pipeline stage, times whether the TP rank holds vocabulary padding) it starts torch's ``fake`` process-group
backend as that rank of the full world (collectives return at once, nothing is sent), builds the real
:class:`~megazero.engine.Engine` on the ``meta`` device (tensors with shapes and dtypes but no storage) and runs
one full :meth:`~megazero.engine.Engine.train_step`: the same model, ZeRO optimizer, schedule, hooks and
collectives as a real run. Then it tears the group down and moves to the next role.

The fake group is registered for the meta device only, so a CPU tensor that reaches a collective fails the dry
run as it would fail under NCCL ("No backend type associated with device type cpu"). Values the code reads
back to the host go through :mod:`megazero.host`, which the dry run switches to placeholders (and counts).

Offload (``--offload-optimizer``, ``--offload-param``, ``cpu_checkpointing``) runs too: host memory is emulated on
meta (:class:`~megazero.host.PlaceholderHost`), so offloaded states are reported as host bytes
(``offloaded_bytes``) and stay out of the device peak, and each host-to-device copy is a new device tensor, as
on a GPU.

Per role it reports the model states at rest (measured on the live tensors, as metrics.jsonl), the peak by
category (:class:`~megazero.memory.PeakMemoryTracker`, the same tracker as metrics.jsonl), the ledger's volume
per group, the pipeline bubble (:func:`~megazero.pipeline.schedules.simulate`) and a roofline step time
(:mod:`megazero.roofline`); then a verdict: fits, or which rank and category overflow.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from megazero import host
from megazero.config import Config
from megazero.distributed import Group
from megazero.engine import Engine
from megazero.memory import PeakMemoryTracker, zero_buffers
from megazero.model.gpt import GPT
from megazero.model.kernels import emulate
from megazero.parallel_context import ParallelContext, RankGrid
from megazero.pipeline.p2p_replay import record_p2p, replay
from megazero.pipeline.partition import stage_specs
from megazero.pipeline.schedules import simulate
from megazero.roofline import Cluster, describe, group_nodes, step_time
from megazero.tensor_parallel.layers import VOCAB_PAD_MULTIPLE, pad_size
from megazero.tensor_parallel.random import RNGTracker

__all__ = ["DryRunReport", "RoleResult", "dry_run", "format_report", "rank_roles", "run_role"]

DRY_BACKEND = "meta:fake"  # the fake backend serves meta tensors only: a CPU tensor in a collective fails


@dataclass
class RoleResult:
    """What one rank role measured in its step."""

    rank: int
    pp_rank: int
    tp_rank: int
    holds_vocab_padding: bool
    states: dict[str, int]  # model states at rest after the step (metrics.jsonl's keys; offloaded_bytes: host)
    peak_bytes: int
    peak_by_category: dict[str, int]
    volumes: dict[str, int]  # elements per step by group (tp, pp, dp, ...), the ledger's logical counts
    breakdown: dict[str, int]  # "group/op/tag" -> elements
    host_reads: int  # reads from the device during the step
    step_seconds: dict[str, float] = field(default_factory=dict)  # roofline estimate by part
    wall_seconds: float = 0.0  # how long the dry step of this role took here
    p2p_calls: list | None = None  # the pipeline group's batched point-to-point calls, in issue order
    steps: int = 1  # steps run: 2 when the first left buffers that later steps start with (see run_role)
    micro_batches_run: list[int] = field(default_factory=list)  # counts run (megazero/dryrun_steady.py)


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


class _HeldWork:
    """The fake backend's work handle keeps no tensor; gloo's and NCCL's keep a collective's tensors allocated
    until the handle is waited on and dropped (e.g. ZeRO-3's device copy of an offloaded shard lives until its
    all-gather is waited on). This one keeps them as long as the dry run's code holds the handle."""

    def __init__(self, work: Any, tensors: tuple[torch.Tensor, ...]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class _DryGroup(Group):
    """A :class:`~megazero.distributed.Group` on the fake backend whose asynchronous collectives and point-to-
    point transfers hold their tensors like a real backend's (see :class:`_HeldWork`)."""

    def all_reduce(self, tensor, op="sum", tag="other", async_op=False):
        work = super().all_reduce(tensor, op, tag, async_op)
        return _HeldWork(work, (tensor,)) if async_op else work

    def all_gather_into(self, output, input, tag="other", async_op=False):
        work = super().all_gather_into(output, input, tag, async_op)
        return _HeldWork(work, (output, input)) if async_op else work

    def reduce_scatter(self, output, input, op="sum", tag="other", async_op=False):
        work = super().reduce_scatter(output, input, op, tag, async_op)
        return _HeldWork(work, (output, input)) if async_op else work

    def _issue_p2p(self, ops):
        return [_HeldWork(w, (t,)) for w, (_kind, t, _peer, _tag) in zip(super()._issue_p2p(ops), ops)]


def _padding_ranks(vocab: int, tp: int) -> list[bool]:
    """For each TP rank, whether its slice of the padded vocabulary holds padding rows."""
    padded = pad_size(vocab, VOCAB_PAD_MULTIPLE * tp)
    per = padded // tp
    return [(t + 1) * per > vocab for t in range(tp)]


def rank_roles(grid: RankGrid, vocab: int) -> list[tuple[int, bool]]:
    """One representative global rank per distinct role (dp rank 0), with its padding flag: every pipeline
    stage; on the stages that hold the embedding (first, last), one TP rank with and one without padding."""
    pad = _padding_ranks(vocab, grid.tp_size)
    out = []
    for p in range(grid.pp_size):
        has_vocab = p in (0, grid.pp_size - 1)
        seen: set[bool] = set()
        for t in range(grid.tp_size):
            flag = pad[t] if has_vocab else False
            if flag not in seen:
                seen.add(flag)
                out.append((grid.rank_of(p, 0, t), flag))
    return out


def _volumes(breakdown: dict[tuple[str, str, str], int]) -> dict[str, int]:
    vols: dict[str, int] = {}
    for (g, _op, _tag), n in breakdown.items():
        vols[g] = vols.get(g, 0) + n
    return vols


def _device_bytes(buffers: dict[str, list[torch.Tensor | None]]) -> int:
    """Bytes of the distinct device storages among ``buffers`` (host memory left out)."""
    seen: dict[int, int] = {}
    for t in (t for ts in buffers.values() for t in ts if isinstance(t, torch.Tensor)):
        if not host.is_host(t):
            seen[host.storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _tracked_step(engine: Engine, batch: list, device: torch.device, buffers: Any,
                  reader: host.PlaceholderHost) -> dict[str, Any]:
    """One training step under the peak tracker; ``reader`` counts this step's host reads."""
    tracker = PeakMemoryTracker(device, buffers, engine.chunks)
    reader.reads = 0
    with tracker:
        engine.train_step(batch)
    return tracker.result()


def _agreed_bucket(cfg: Config, ctx: ParallelContext) -> Config:
    """``cfg`` with the gradient bucket the two tied-embedding stages agree on, for a role on one of them.

    A real run agrees the default (Ψ-derived) bucket over the embedding group with an all-reduce (min) at
    construction; on meta there is no value to read back, so the dry run counts both stages' Ψ on meta and
    sets the agreed size, as the real rank would end up with."""
    z, p, m = cfg.zero, cfg.parallel, cfg.model
    if z.reduce_bucket_size is not None or ctx.pp_size == 1 or ctx.embedding_group is None:
        return cfg
    v = p.virtual_stages if p.pp_schedule == "interleaved" else 1
    rng = RNGTracker(cfg.training.seed, ctx.tp_rank, "meta")

    def psi(pp_rank: int) -> int:
        with torch.device("meta"):
            chunks = [GPT(m, ctx.tp_group, layers=s.layers, pre_process=s.pre_process, post_process=s.post_process,
                          sequence_parallel=p.sequence_parallel, rng_tracker=rng,
                          activation_checkpointing=cfg.activation_checkpointing)
                      for s in stage_specs(m.num_layers, ctx.pp_size, pp_rank, v, p.pp_layout)]
        return sum(q.numel() for c in chunks for q in c.parameters() if q.requires_grad)

    agreed = min(z.bucket_numel(psi(r), ctx.dp_size) for r in (0, ctx.pp_size - 1))
    return replace(cfg, zero=replace(z, reduce_bucket_size=agreed))


def run_role(cfg: Config, grid: RankGrid, rank: int, c: Cluster | None = None) -> RoleResult:
    """Run a training step as global ``rank`` of ``grid`` on a fake process group and the meta device.

    When the step leaves more device memory in megazero's buffers than it started with (buffers allocated on
    first use), a second step runs: a real run's later steps start from there. The peak is the larger of the
    two; states, volumes and host reads are the last step's; the point-to-point calls the first's."""
    start = time.perf_counter()
    if dist.is_initialized():
        raise RuntimeError("the dry run starts its own (fake) process group; call it with none initialised")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(DRY_BACKEND, store=FakeStore(), rank=rank, world_size=grid.world_size)
    try:
        device = torch.device("meta")
        ctx = ParallelContext.from_grid(grid, device=device, group_cls=_DryGroup)  # devices checked against meta
        p2p_log = record_p2p(ctx.pp_group) if grid.pp_size > 1 else None
        # host reads give placeholders; offloaded states live in host memory emulated on meta
        with host.use(host.PlaceholderHost()) as reader:
            with device:  # parameters are created without storage (no weights, no initialisation cost)
                engine = Engine(_agreed_bucket(cfg, ctx), ctx, device)
            t = cfg.training
            ids = torch.zeros(t.micro_batch_size, cfg.model.seq_len, dtype=torch.long)  # on the host, like collate
            batch = [(ids, ids) for _ in range(t.gradient_accumulation_steps)]
            ctx.ledger.mark_step()  # volumes per step: construction's collectives are not the step's
            buffers = functools.partial(zero_buffers, engine.optimizer)
            at_rest = _device_bytes(buffers())
            peak, steps = _tracked_step(engine, batch, device, buffers, reader), 1
            p2p_first = list(p2p_log) if p2p_log is not None else None  # the replay takes every stage's first step
            if _device_bytes(buffers()) > at_rest:
                # the step left buffers that every later step starts with (ZeRO-2's staging pool, ZeRO-3's owned
                # gradients until the next zero_grad): the steady state is the second step's; report the larger
                second = _tracked_step(engine, batch, device, buffers, reader)
                peak, steps = max(peak, second, key=lambda x: x["peak_bytes"]), 2
            states = engine.optimizer.model_state_bytes()
        breakdown = ctx.ledger.last_step()
        result = RoleResult(
            rank=rank, pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank, holds_vocab_padding=False, states=states,
            peak_bytes=int(peak["peak_bytes"]), peak_by_category=dict(peak["peak_by_category"]),
            volumes=_volumes(breakdown), breakdown=ctx.ledger.breakdown_last_step(), host_reads=reader.reads,
            p2p_calls=p2p_first, steps=steps)
        if c is not None:
            result.step_seconds = _roofline(cfg, grid, rank, breakdown, c)
    finally:
        dist.destroy_process_group()
    result.wall_seconds = time.perf_counter() - start
    return result


def _roofline(cfg: Config, grid: RankGrid, rank: int, breakdown: dict[tuple[str, str, str], int],
              c: Cluster) -> dict[str, float]:
    """Roofline step time of this rank from the volumes it recorded."""
    m, t = cfg.model, cfg.training
    crosses = {k: group_nodes(grid.group_of(k, rank), c.gpus_per_node) > 1 for k in ("tp", "pp", "dp")}
    tp_el = sum(n for (g, _o, _t), n in breakdown.items() if g == "tp")
    pp_el = sum(n for (g, o, _t), n in breakdown.items() if g == "pp" and o == "send")
    grad_el = sum(n for (g, _o, tag), n in breakdown.items() if g == "dp" and tag == "grad")
    param_el = sum(n for (g, _o, tag), n in breakdown.items() if g == "dp" and tag == "param")
    v = cfg.parallel.virtual_stages if cfg.parallel.pp_schedule == "interleaved" else 1
    st = step_time(c=c, precision=t.precision, global_batch=t.global_batch_size, seq_len=m.seq_len,
                   num_layers=m.num_layers, hidden=m.hidden_size, vocab=m.vocab_size,
                   checkpointing=cfg.activation_checkpointing.mode, tp=grid.tp_size, pp=grid.pp_size,
                   dp=grid.dp_size, micro_batches=t.gradient_accumulation_steps, virtual_stages=v,
                   tp_elements=tp_el, pp_elements=pp_el, dp_grad_elements=grad_el, dp_param_elements=param_el,
                   grad_bytes=2 if t.precision == "fp16" else 4, owned_params=0.0,
                   offload=cfg.zero.offload_optimizer is not None, tp_crosses=crosses["tp"],
                   pp_crosses=crosses["pp"], dp_crosses=crosses["dp"])
    return st.as_dict()


def dry_run(cfg: Config, c: Cluster, log_dir: str | None = None, device_type: str = "cuda",
            steady: bool = True) -> DryRunReport:
    """Dry-run every rank role of ``cfg`` (resolved for its world and ``device_type``) and judge whether it fits
    ``c``. The meta tensors run the kernels of ``device_type`` (:func:`megazero.model.kernels.emulate`: fused
    attention and dropout on CUDA); compiled blocks (``--compile``) run eagerly, as the tracker sees them.
    With ``steady`` (default) each role runs at two small micro-batch counts and its volumes are extrapolated
    when the two agree (:func:`megazero.dryrun_steady.run_role_steady`); ``steady=False`` runs the full count."""
    from megazero.dryrun_steady import run_role_steady

    start = time.perf_counter()
    p, m, t = cfg.parallel, cfg.model, cfg.training
    step_cfg = replace(cfg, training=replace(t, compile=False))  # nothing to compile for on meta
    grid = RankGrid(p.tp_size * p.pp_size * p.dp_size, p.tp_size, p.pp_size, p.dp_size)
    roles = []
    for rank, padded in rank_roles(grid, m.vocab_size):
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
    schedule = p.pp_schedule if p.pp_size > 1 else "1f1b"
    v = p.virtual_stages if schedule == "interleaved" else 1
    bubble = simulate(schedule, p.pp_size, t.gradient_accumulation_steps, v).bubble_fraction if p.pp_size > 1 else 0.0
    usable = c.usable_memory_bytes
    worst = max(roles, key=lambda r: r.peak_bytes)
    fits = worst.peak_bytes <= usable and p2p_ok
    if fits:
        verdict = (f"fits: the largest peak is rank {worst.rank}'s {worst.peak_bytes / 1e9:.2f} GB of "
                   f"{usable / 1e9:.1f} GB usable on {c.gpu.name}")
    elif worst.peak_bytes <= usable:
        verdict = f"does not run: the point-to-point calls fail the NCCL-order replay: {p2p_text}"
    else:
        cat = max(worst.peak_by_category, key=worst.peak_by_category.get)
        verdict = (f"does not fit: rank {worst.rank} (pp {worst.pp_rank}, tp {worst.tp_rank}) peaks at "
                   f"{worst.peak_bytes / 1e9:.2f} GB > {usable / 1e9:.1f} GB usable on {c.gpu.name}; its largest "
                   f"category is {cat} ({worst.peak_by_category[cat] / 1e9:.2f} GB)")
    report = DryRunReport(
        topology={"tp": p.tp_size, "pp": p.pp_size, "dp": p.dp_size, "world_size": grid.world_size,
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
            "optim", "acts", "comm", "other", "TP Melem", "PP Melem", "DP Melem", "reads", "step s", "steps", "dry s"]
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
                     *(f"{x.volumes.get(g, 0) / 1e6:.1f}" for g in ("tp", "pp", "dp")), str(x.host_reads),
                     f"{x.step_seconds.get('total_s', 0):.3f}", str(x.steps), f"{x.wall_seconds:.1f}"])
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = [f"megazero dry run: tp {tp['tp']} x pp {tp['pp']} x dp {tp['dp']} = {tp['world_size']} ranks, ZeRO "
             f"{tp['zero_stage']}, {tp['precision']}, {tp['micro_batches']} micro-batches of {tp['micro_batch_size']}"
             f" ({tp['schedule']}); {len(r.roles)} rank roles in {r.wall_seconds:.1f} s",
             ""]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in [head, *rows]]
    lines += ["", f"pipeline bubble: {r.bubble_fraction:.1%} of compute (simulated schedule)",
              f"NCCL-order replay of the pipeline's point-to-point calls: {r.p2p_replay}",
              "states: model states on the device at rest; host: offloaded states in host memory; peak: live "
              "device tensors by category at the step's peak (the tracker of metrics.jsonl; steps 2: the first "
              "step left buffers later steps start with, the larger peak of two); Melem: elements"
              " per step as the ledger counts them (all-reduce 2n); step s: roofline estimate on "
              f"{tp['gpus_per_node']}-GPU nodes of {r.gpu}",
              tp.get("roofline", ""),
              f"kernels as on {tp.get('device_type', 'cuda')} (fused attention and dropout on cuda)"
              + ("; --compile's blocks run eagerly here" if tp.get("compile") else ""),
              f"verdict: {r.verdict}"]
    return "\n".join(lines)
