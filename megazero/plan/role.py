"""One rank role's training step on the meta device: the real engine, optimizer, schedule and hooks as one rank
of the full world on torch's ``fake`` process-group backend, measured by the same tracker and ledger as a real
run.

The fake group is registered for the meta device only, so a CPU tensor that reaches a collective fails as it
would under NCCL. Values the code reads back go through :mod:`megazero.distributed.device_io`, which the step
switches to a :class:`PlaceholderHost`: reads return placeholders (and are counted), and host memory for offload
is emulated on meta, so offloaded states are reported as host bytes and stay out of the device peak.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from megazero.config.resolve import chunks_per_rank
from megazero.config.schema import Config
from megazero.distributed import device_io
from megazero.distributed.context import ParallelContext, RankGrid
from megazero.distributed.group import Group
from megazero.distributed.ledger import ZERO_GROUPS
from megazero.model.gpt import GPT
from megazero.observe.flops import flops_shape
from megazero.observe.memory import PeakMemoryTracker, zero_buffers
from megazero.pipeline.p2p_replay import record_p2p
from megazero.pipeline.partition import stage_specs
from megazero.plan.roofline import Cluster, group_nodes, step_time
from megazero.tensor_parallel.layers import VOCAB_PAD_MULTIPLE, pad_size
from megazero.tensor_parallel.random import RNGTracker
from megazero.train.engine import Engine

__all__ = ["DRY_BACKEND", "PlaceholderHost", "RoleResult", "rank_roles", "run_role", "roofline_seconds", "volumes"]

DRY_BACKEND = "meta:fake"  # the fake backend serves meta tensors only: a CPU tensor in a collective fails


class PlaceholderHost(device_io.EmulatedHost):
    """For tensors without values (meta): every read returns ``value`` per element and is counted; host memory
    is emulated on meta."""

    def __init__(self, value: float = 1.0) -> None:
        super().__init__("meta")
        self.value = float(value)
        self.reads = 0  # host reads (synchronisations a real device would make)
        self.read_elements = 0

    def read(self, tensor: torch.Tensor) -> list[float]:
        self.reads += 1
        self.read_elements += tensor.numel()
        if tensor.device.type != "meta":
            return super().read(tensor)
        return [self.value] * tensor.numel()


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
    micro_batches_run: list[int] = field(default_factory=list)  # counts run (megazero/plan/extrapolate.py)
    eval_peak_bytes: int = 0  # the evaluation pass after the steps (Engine.eval_loss on the same batch)
    eval_peak_by_category: dict[str, int] = field(default_factory=dict)
    link_bytes: dict[str, int] = field(default_factory=dict)  # ZeRO's gradients and parameters: "intra"/"inter"

    def larger_peak(self) -> tuple[str, int, dict[str, int]]:
        """``(which, bytes, by category)`` of the larger of the training step's and the evaluation's peaks."""
        if self.eval_peak_bytes > self.peak_bytes:
            return "evaluation", self.eval_peak_bytes, self.eval_peak_by_category
        return "training step", self.peak_bytes, self.peak_by_category


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
    """A :class:`~megazero.distributed.group.Group` on the fake backend whose asynchronous collectives and point-to-
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


def rank_roles(grid: RankGrid, vocab: int, schedule: str = "") -> list[tuple[int, bool]]:
    """One representative global rank per distinct role (dp rank 0), with its padding flag: every pipeline
    stage; on the stages that hold the embedding (first, last; under ``schedule`` "zbv" both are pipeline rank
    0's), one TP rank with and one without padding."""
    pad = _padding_ranks(vocab, grid.tp_size)
    out = []
    for p in range(grid.pp_size):
        has_vocab = p == 0 or (p == grid.pp_size - 1 and schedule != "zbv")
        seen: set[bool] = set()
        for t in range(grid.tp_size):
            flag = pad[t] if has_vocab else False
            if flag not in seen:
                seen.add(flag)
                out.append((grid.rank_of(p, 0, t), flag))
    return out


def volumes(breakdown: dict[tuple[str, str, str], int]) -> dict[str, int]:
    vols: dict[str, int] = {}
    for (g, _op, _tag), n in breakdown.items():
        vols[g] = vols.get(g, 0) + n
    return vols


def _device_bytes(buffers: dict[str, list[torch.Tensor | None]]) -> int:
    """Bytes of the distinct device storages among ``buffers`` (host memory left out)."""
    seen: dict[int, int] = {}
    for t in (t for ts in buffers.values() for t in ts if isinstance(t, torch.Tensor)):
        if not device_io.is_host(t):
            seen[device_io.storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _tracked_step(engine: Engine, batch: list, device: torch.device, buffers: Any,
                  reader: PlaceholderHost) -> dict[str, Any]:
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
    sets the agreed size, as the real rank would end up with. Under zbv both copies are pipeline rank 0's and
    nothing is agreed."""
    z, p, m = cfg.zero, cfg.parallel, cfg.model
    if (z.reduce_bucket_size is not None or ctx.pp_size == 1 or ctx.embedding_group is None
            or p.pp_schedule == "zbv"):
        return cfg
    v = chunks_per_rank(p.pp_schedule, ctx.pp_size, p.virtual_stages)
    rng = RNGTracker(cfg.training.seed, ctx.tp_rank, "meta")

    def psi(pp_rank: int) -> int:
        with torch.device("meta"):
            chunks = [GPT(m, ctx.tp_group, layers=s.layers, pre_process=s.pre_process, post_process=s.post_process,
                          sequence_parallel=p.sequence_parallel, rng_tracker=rng,
                          activation_checkpointing=cfg.activation_checkpointing)
                      for s in stage_specs(m.num_layers, ctx.pp_size, pp_rank, v, p.pp_layout)]
        return sum(q.numel() for c in chunks for q in c.parameters() if q.requires_grad)

    agreed = min(z.bucket_numel(psi(r), ctx.dp_cp_group.size) for r in (0, ctx.pp_size - 1))  # ZeRO's group
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
    # the fake backend is a custom one: say so, or tearing the group down warns "No backend of type 0 found"
    dist.group.WORLD._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    try:
        device = torch.device("meta")
        ctx = ParallelContext.from_grid(grid, device=device, group_cls=_DryGroup)  # devices checked against meta
        p2p_log = record_p2p(ctx.pp_group) if grid.pp_size > 1 else None
        # host reads give placeholders; offloaded states live in host memory emulated on meta
        with device_io.use(PlaceholderHost()) as reader:
            with device:  # parameters are created without storage (no weights, no initialisation cost)
                if cfg.parallel.ranks_per_node is None and c is not None and grid.world_size % c.gpus_per_node == 0:
                    # the cluster's nodes (ZeRO++, bytes per link); a world within one node stays one node
                    cfg = replace(cfg, parallel=replace(cfg.parallel, ranks_per_node=c.gpus_per_node))
                engine = Engine(_agreed_bucket(cfg, ctx), ctx, device)
            t = cfg.training
            ids = torch.zeros(t.micro_batch_size, cfg.model.seq_len, dtype=torch.long)  # host, whole, like collate
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
            reads = reader.reads
            evaluation = PeakMemoryTracker(device, buffers, engine.chunks)  # what a run does between steps too
            with evaluation:
                engine.eval_loss(batch)
            evaluation = evaluation.result()
        breakdown = ctx.ledger.last_step()
        result = RoleResult(
            rank=rank, pp_rank=ctx.pp_rank, tp_rank=ctx.tp_rank, holds_vocab_padding=False, states=states,
            peak_bytes=int(peak["peak_bytes"]), peak_by_category=dict(peak["peak_by_category"]),
            volumes=volumes(breakdown), breakdown=ctx.ledger.breakdown_last_step(), host_reads=reads,
            p2p_calls=p2p_first, steps=steps, eval_peak_bytes=int(evaluation["peak_bytes"]),
            eval_peak_by_category=dict(evaluation["peak_by_category"]),
            link_bytes=ctx.ledger.link_bytes_last_step(("grad", "param")))
        if c is not None:
            result.step_seconds = roofline_seconds(cfg, grid, rank, breakdown, c)
    finally:
        dist.destroy_process_group()
    result.wall_seconds = time.perf_counter() - start
    return result


def roofline_seconds(cfg: Config, grid: RankGrid, rank: int, breakdown: dict[tuple[str, str, str], int],
              c: Cluster) -> dict[str, float]:
    """Roofline step time of this rank from the volumes it recorded. Under CP the step's work and ZeRO's group
    are spread over dp x cp ranks; the CP group's sends (the ring: K/V in the compute dtype, dK/dV in fp32) and
    collectives (the all-gather mode) go over its link (:func:`~megazero.plan.roofline.step_time`)."""
    m, t = cfg.model, cfg.training
    crosses = {k: group_nodes(grid.group_of(k, rank), c.gpus_per_node) > 1 for k in ("tp", "cp", "pp", "dp_cp")}
    crosses["dp"] = crosses.pop("dp_cp")  # ZeRO's group: dp x cp (the dp group itself at cp 1)
    tp_el = sum(n for (g, _o, _t), n in breakdown.items() if g == "tp")
    pp_el = sum(n for (g, o, _t), n in breakdown.items() if g == "pp" and o == "send")
    grad_el = sum(n for (g, _o, tag), n in breakdown.items() if g in ZERO_GROUPS and tag == "grad")
    param_el = sum(n for (g, _o, tag), n in breakdown.items() if g in ZERO_GROUPS and tag == "param")
    e = 4 if t.precision == "fp32" else 2
    cp_sends = {tag: n for (g, o, tag), n in breakdown.items() if g == "cp" and o == "send"}
    cp_coll = sum(n for (g, o, _t), n in breakdown.items() if g == "cp" and o != "send") * e
    cp_send_bytes = sum(n * (4 if tag == "kv_grad" else e) for tag, n in cp_sends.items())
    v = chunks_per_rank(cfg.parallel.pp_schedule, grid.pp_size, cfg.parallel.virtual_stages)
    st = step_time(c=c, precision=t.precision, global_batch=t.global_batch_size, seq_len=m.seq_len,
                   num_layers=m.num_layers, hidden=m.hidden_size, vocab=m.vocab_size,
                   checkpointing=cfg.activation_checkpointing.mode, tp=grid.tp_size, pp=grid.pp_size,
                   dp=grid.dp_size * grid.cp_size, micro_batches=t.gradient_accumulation_steps, virtual_stages=v,
                   tp_elements=tp_el, pp_elements=pp_el, dp_grad_elements=grad_el, dp_param_elements=param_el,
                   grad_bytes=2 if t.precision == "fp16" else 4, owned_params=0.0,
                   offload=cfg.zero.offload_optimizer is not None, tp_crosses=crosses["tp"],
                   pp_crosses=crosses["pp"], dp_crosses=crosses["dp"], shape=flops_shape(m), cp=grid.cp_size,
                   cp_send_bytes=cp_send_bytes, cp_tail_bytes=4 * cp_sends.get("kv_grad", 0) / grid.cp_size,
                   cp_collective_bytes=cp_coll, cp_crosses=crosses["cp"],
                   schedule=cfg.parallel.pp_schedule if grid.pp_size > 1 else "1f1b")
    return st.as_dict()


