"""Search the layouts of a GPT run on N GPUs: estimate each one's peak memory and step time, rank the fits.

A :class:`Layout` is one choice of tp (inside a node), cp, pp, dp, ZeRO stage, micro-batch size, recomputation,
optimizer offload, sequence parallelism and pipeline schedule (1F1B, interleaved, zb-h1 or zbv; under zbv each
rank holds two chunks in a V, so rank 0 carries both ends of the model and the V's turn on the last rank sends
nothing). :func:`evaluate` gives its per-rank peak
(:func:`megazero.plan.estimate.peak_bytes`: model states, the stashed micro-batches -- rescaled for the interleaved
schedule's in-flight chunks --, communication buffers and backward's transients), the volume each rank moves per step over TP, PP and DP (counted the
way :class:`megazero.distributed.ledger.CommLedger` counts them) and a roofline step time
(:func:`megazero.plan.roofline.step_time`). :func:`search` enumerates every layout, drops those that do not fit
and ranks the rest by estimated step time. ``tools/plan.py`` is the command line.

Context parallelism (``--cp``) enters when the sequence is long (:data:`CP_MIN_SEQ_LEN` tokens or more): cp
divides the GPUs left by tp with ``seq_len % (2·cp) == 0`` (two chunks per rank), with tp·cp inside a node first
(the grid puts TP fastest, then CP) and across nodes only when nothing fits so. Under CP a rank's activations,
TP and PP volumes follow its ``seq_len / cp`` tokens, ZeRO shards over dp·cp ranks, the FLOPs spread over all
ranks, and the ring's K/V traffic (:func:`megazero.plan.roofline.ring_kv_bytes`) goes over NVLink or the network
by where the CP group sits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import lru_cache

from megazero.config.precision import ELEMENT_BYTES
from megazero.config.resolve import chunks_per_rank
from megazero.config.schema import ModelConfig
from megazero.distributed.context import RankGrid
from megazero.observe.flops import flops_shape, megatron_model_flops
from megazero.pipeline.partition import stage_specs
from megazero.pipeline.schedules import build_schedule
from megazero.plan.estimate import (
    in_flight_micro_batches,
    model_state_bytes,
    peak_bytes,
    rank_parameter_numels,
)
from megazero.plan.roofline import Cluster, StepTime, group_nodes, mfu, ring_kv_bytes, step_time
from megazero.zero.grads import grad_dtype_for

__all__ = ["CP_MIN_SEQ_LEN", "Layout", "Plan", "dp_volume", "evaluate", "layouts", "own_forward_gathers",
           "rank_dp_numels", "search", "torchrun_command"]

CP_MIN_SEQ_LEN = 8192  # sequences this long are also tried split over a CP group


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch_size: int
    checkpointing: str = "none"
    offload: bool = False
    sequence_parallel: bool = False
    virtual_stages: int = 1  # > 1: the interleaved schedule
    cp: int = 1  # context parallel: each sequence split over cp ranks
    zero_bubble: bool = False  # the zb-h1 schedule (split backward)
    zbv: bool = False  # the ZB-V schedule: split backward, two chunks per rank in a V

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def schedule(self) -> str:
        return ("interleaved" if self.virtual_stages > 1 else "zbv" if self.zbv else "zb-h1" if self.zero_bubble
                else "1f1b")

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: ``virtual_stages`` (interleaved), 2 (zbv) or 1."""
        return chunks_per_rank(self.schedule, self.pp, self.virtual_stages)

    def flags(self) -> list[str]:
        """The ``pretrain/gpt.py`` flags of this layout."""
        out = ["--tp", str(self.tp), *(["--cp", str(self.cp)] if self.cp > 1 else []), "--pp", str(self.pp), "--dp", str(self.dp), "--zero-stage",
               str(self.zero_stage), "--micro-batch-size", str(self.micro_batch_size)]
        if self.sequence_parallel:
            out.append("--sequence-parallel")
        if self.virtual_stages > 1:
            out += ["--pp-schedule", "interleaved", "--virtual-stages", str(self.virtual_stages)]
        if self.zero_bubble or self.zbv:
            out += ["--pp-schedule", self.schedule]
        if self.checkpointing != "none":
            out += ["--activation-checkpointing", self.checkpointing]
        if self.offload:
            out.append("--offload-optimizer")
        return out


@dataclass
class Plan:
    layout: Layout
    peak_bytes: float  # the largest rank's estimated peak
    peak_pp_rank: int  # the pipeline stage where it occurs
    states_bytes: float  # that rank's model states on the device
    activation_bytes: float  # that rank's activations at the peak (stash + backward's transients)
    other_bytes: float  # communication buffers: gradient staging, stage 3's gathered units
    tp_bytes: float  # per rank and step
    pp_bytes: float
    dp_bytes: float
    time: StepTime
    mfu: float
    fits: bool
    cp_bytes: float = 0.0  # per rank and step: the ring's K/V and dK/dV


def dp_volume(stage: int, psi: float, micro_batches: int, carried: float = 0.0) -> tuple[float, float]:
    """(gradient, parameter) elements one rank moves over DP per step (the ledger's logical counts).

    Stage 0: one all-reduce of the gradient (2Ψ). Stage 1: reduce-scatter Ψ, all-gather of the updated
    parameters Ψ. Stage 2 reduces every micro-batch: mΨ, plus the all-gather Ψ. Stage 3 gathers in forward and
    backward and reduce-scatters per micro-batch: mΨ of gradients, 2mΨ of parameters, less m·``carried``: the
    elements of a chunk's own units (embeddings, final norm, output layer), which a rank running one chunk
    gathers once per micro-batch (:mod:`megazero.zero.stage3.gather`, "Carry").
    """
    m = micro_batches
    return {0: (2 * psi, 0.0), 1: (psi, psi), 2: (m * psi, psi), 3: (m * psi, m * (2 * psi - carried))}[stage]


def _tp_elements(model: ModelConfig, lay: Layout, layers: int, first: bool, last: bool, m: int) -> float:
    """TP elements per step: per layer and micro-batch 4 all-reduces of b·s·h (2 forward, 2 backward; SP's
    all-gather + reduce-scatter count the same), 2 more recomputed with full recomputation; the vocab-parallel
    embedding's forward all-reduce and the LM head's backward all-reduce (``model.seq_len``: this CP rank's)."""
    if lay.tp == 1:
        return 0.0
    bsh = lay.micro_batch_size * model.seq_len * model.hidden_size
    per_layer = (8 + (4 if lay.checkpointing == "full" else 0)) * bsh
    return m * (layers * per_layer + (2 * bsh if first else 0) + (2 * bsh if last else 0))


@lru_cache(maxsize=4096)
def _numels(model: ModelConfig, tp: int, pp: int, rank: int, v: int, schedule: str) -> tuple[int, ...]:
    return tuple(rank_parameter_numels(model, tp, pp, rank, virtual_stages=v, schedule=schedule).values())


def rank_dp_numels(model: ModelConfig, lay: Layout, persistence_threshold: int = 100_000) -> tuple[float, float, int]:
    """(Ψ_r, Ψ_own, r) of the pipeline rank r that moves the most over DP: the most parameters, and of equals the
    fewest of its ZeRO-3 own units (0 where a rank runs several chunks), as :func:`evaluate` counts them for
    :func:`dp_volume`."""
    ranks = [(float(sum(_numels(model, lay.tp, lay.pp, r, lay.chunks, lay.schedule))),
              float(_own_numel(model, lay.tp, lay.pp, r, persistence_threshold)) if lay.chunks == 1 else 0.0, r)
             for r in range(lay.pp)]
    return max(ranks, key=lambda t: (t[0], -t[1]))  # (the first of equals)


def own_forward_gathers(lay: Layout, rank: int, micro_batches: int) -> int:
    """How many of a step's m gathers of a chunk's own ZeRO-3 units fall in forward passes on pipeline rank
    ``rank`` (the rest in backward passes): a forward parks them and the next pass of either kind takes them back
    without a gather, a backward frees them (``zero/stage3/gather.py``, "Carry"). m without a pipeline or where
    every backward follows its own forward; 1 under GPipe; m - (pp - rank - 1) under 1F1B."""
    if lay.pp == 1:
        return micro_batches
    parked, forward = False, 0
    for a in build_schedule(lay.schedule, lay.pp, rank, micro_batches, lay.chunks):
        if a.kind == "F":
            forward += not parked
            parked = True
        elif a.kind == "B":
            parked = False
    return forward


@lru_cache(maxsize=4096)
def _own_numel(model: ModelConfig, tp: int, pp: int, rank: int, persistence_threshold: int) -> int:
    """Elements of the stage-3 units outside the blocks (embeddings, final norm, output layer) on one chunk."""
    return sum(n for name, n in rank_parameter_numels(model, tp, pp, rank).items()
               if not name.startswith("blocks.") and n > persistence_threshold)


def evaluate(model: ModelConfig, lay: Layout, global_batch: int, c: Cluster, precision: str = "bf16",
             persistence_threshold: int = 100_000, reduce_bucket_size: int | None = None) -> Plan:
    """Peak memory, volumes and step time of one layout (the worst pipeline stage for memory and time).

    ``reduce_bucket_size`` None uses the bucket a run with default settings picks
    (:meth:`ZeroConfig.bucket_numel <megazero.config.schema.ZeroConfig.bucket_numel>`)."""
    e = ELEMENT_BYTES[precision]
    grad_bytes = grad_dtype_for(precision).itemsize  # bf16 accumulates and reduces gradients in fp32
    m = global_batch // (lay.micro_batch_size * lay.dp)
    v, cp, nd = lay.virtual_stages, lay.cp, lay.dp * lay.cp  # ZeRO shards over dp x cp
    local = replace(model, seq_len=model.seq_len // cp) if cp > 1 else model  # the tokens a CP rank holds
    grid = RankGrid(lay.world, lay.tp, lay.pp, lay.dp, cp)
    gpn = c.gpus_per_node
    crosses = {k: group_nodes(grid.group_of(k, grid.world_size - 1), gpn) > 1 for k in ("tp", "cp", "pp", "dp_cp")}
    kv = 2 * lay.micro_batch_size * local.seq_len * max(model.kv_heads // lay.tp, 1) * model.head_dim  # K, V per layer
    worst_mem: tuple | None = None
    slowest: StepTime | None = None
    vols = [0.0, 0.0, 0.0, 0.0]  # tp, pp, dp, cp bytes: the largest over the stages
    chunks = lay.chunks  # zbv: two chunks per rank in a V (stage_specs places them by the schedule's name)
    for r in range(lay.pp):
        numels = _numels(model, lay.tp, lay.pp, r, chunks, lay.schedule)
        psi = float(sum(numels))
        specs = stage_specs(model.num_layers, lay.pp, r, chunks, schedule=lay.schedule)
        layers = sum(len(spec.layers) for spec in specs)
        first, last = any(sp.pre_process for sp in specs), any(sp.post_process for sp in specs)
        pe = peak_bytes(local, lay.micro_batch_size, stage=lay.zero_stage, dp_size=nd, tp_size=lay.tp,
                        pp_size=lay.pp, pp_rank=r, precision=precision, checkpointing=lay.checkpointing,
                        sequence_parallel=lay.sequence_parallel, micro_batches=m,
                        schedule="1f1b" if v > 1 else lay.schedule,
                        offload_optimizer=lay.offload and lay.zero_stage >= 1,
                        persistence_threshold=persistence_threshold, bucket_numel=reduce_bucket_size)
        states, acts, other = pe.model_states, pe.activations, pe.comm_buffers
        if local is not model and first and model.arch != "llama":  # learned positions: the whole table
            states += model_state_bytes((model.seq_len - local.seq_len) * model.hidden_size, lay.zero_stage, nd,
                                        precision, offload_optimizer=lay.offload and lay.zero_stage >= 1).device
        if v > 1:  # interleaved: (pp - rank - 1)*2 + (v - 1)*pp + 1 chunk forwards in flight, 1/v of the stage each
            k1 = in_flight_micro_batches(lay.pp, r, "1f1b", m)
            acts *= min(m * v, (lay.pp - r - 1) * 2 + (v - 1) * lay.pp + 1) / (v * k1)
        acts += pe.transient
        peak = states + acts + other
        own = _own_numel(model, lay.tp, lay.pp, r, persistence_threshold) if chunks == 1 else 0.0
        g, p_ = dp_volume(lay.zero_stage, psi, m, own)
        tp_el = _tp_elements(local, lay, layers, first, last, m)
        cp_b = m * layers * ring_kv_bytes(kv, cp, e, recomputed=lay.checkpointing != "none")
        seq = local.seq_len // (lay.tp if lay.sequence_parallel else 1)
        # per micro-batch and chunk an activation forward and its gradient back, but not out of the pipeline's ends
        # nor (zbv) across the V's turn on the last rank; zbv's rank 0 holds both ends
        sends = (2 * ((r < lay.pp - 1) + (r > 0)) if lay.zbv
                 else v * ((0 if last and v == 1 else 1) + (0 if first and v == 1 else 1)))
        pp_el = 0.0 if lay.pp == 1 else m * sends * lay.micro_batch_size * seq * model.hidden_size
        owned = psi / nd if lay.zero_stage >= 1 else psi
        t = step_time(c=c, precision=precision, global_batch=global_batch, seq_len=model.seq_len,
                      num_layers=model.num_layers, hidden=model.hidden_size,
                      vocab=model.vocab_size, checkpointing=lay.checkpointing, tp=lay.tp, pp=lay.pp, dp=nd,
                      micro_batches=m, virtual_stages=chunks, tp_elements=tp_el, pp_elements=pp_el,
                      dp_grad_elements=g, dp_param_elements=p_, grad_bytes=grad_bytes, owned_params=owned,
                      offload=lay.offload, tp_crosses=crosses["tp"], pp_crosses=crosses["pp"],
                      dp_crosses=crosses["dp_cp"], shape=flops_shape(model), cp=cp, cp_send_bytes=cp_b,
                      cp_tail_bytes=m * layers * kv * 4, cp_crosses=crosses["cp"], schedule=lay.schedule)
        mem = (peak, r, states, acts, other)
        worst_mem = mem if worst_mem is None or peak > worst_mem[0] else worst_mem
        slowest = t if slowest is None or t.total > slowest.total else slowest
        vols = [max(a, b) for a, b in zip(vols, (tp_el * e, pp_el * e, g * grad_bytes + p_ * e, cp_b))]
    assert worst_mem is not None and slowest is not None
    peak, r, states, acts, other = worst_mem
    t = slowest
    model_flops = megatron_model_flops(global_batch, model.seq_len, model.num_layers, model.hidden_size,
                                       model.vocab_size, **flops_shape(model))
    return Plan(lay, peak, r, states, acts, other, *vols[:3], t,
                mfu(model_flops, t.total, grid.world_size, c, precision), peak <= c.usable_memory_bytes, vols[3])


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelConfig, gpus: int, global_batch: int, gpus_per_node: int, *,
            micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16), stages: tuple[int, ...] = (0, 1, 2, 3),
            checkpointing: tuple[str, ...] = ("none", "selective", "full"), offload: tuple[bool, ...] = (False, True),
            virtual_stages: tuple[int, ...] = (1, 2), cp_across_nodes: bool = False,
            zero_bubble: tuple[bool, ...] = (False, True), zbv: tuple[bool, ...] = (False, True)) -> list[Layout]:
    """Every valid layout: tp divides the GPUs of a node and the heads; cp as :func:`_cp_sizes`; pp <= layers;
    the global batch splits into dp x micro-batch x accumulation; interleaving needs m divisible by pp and
    enough layers; zb-h1 (``zero_bubble``) a pipeline of one chunk per rank; zbv (``zbv``) a pipeline and at
    least two layers per rank (its two chunks); offload needs a ZeRO stage;
    sequence parallelism needs tp > 1 dividing the CP-local
    sequence."""
    out = []
    for tp in _divisors(min(gpus_per_node, gpus)):
        if model.num_heads % tp or model.hidden_size % tp or gpus % tp:
            continue
        for cp in _cp_sizes(model, gpus // tp, tp, gpus_per_node, cp_across_nodes):
            for pp in _divisors(gpus // (tp * cp)):
                dp = gpus // (tp * cp * pp)
                if pp > model.num_layers or global_batch % dp:
                    continue
                for mbs, stage, ckpt, off, v, sp, zb, vee in itertools.product(
                        micro_batch_sizes, stages, checkpointing, offload, virtual_stages, (False, True),
                        zero_bubble, zbv):
                    m, rem = divmod(global_batch, mbs * dp)
                    if rem or m < 1 or (off and stage == 0) or (sp and (tp == 1 or model.seq_len // cp % tp)):
                        continue
                    if v > 1 and (pp == 1 or m % pp or model.num_layers < pp * v or stage == 3):
                        continue
                    if zb and (pp == 1 or v > 1):  # zb-h1: one chunk per rank, a pipeline to fill
                        continue
                    if vee and (pp == 1 or v > 1 or zb or model.num_layers < 2 * pp):  # zbv: its own two chunks
                        continue
                    out.append(Layout(tp, pp, dp, stage, mbs, ckpt, off, sp, v, cp, zb, vee))
    return out


def _cp_sizes(model: ModelConfig, gpus: int, tp: int, gpus_per_node: int, across_nodes: bool) -> list[int]:
    """CP sizes to try with ``gpus`` GPUs left by tp: 1, and for a sequence of :data:`CP_MIN_SEQ_LEN` tokens or
    more every divisor with ``seq_len % (2·cp) == 0``, tp·cp within a node unless ``across_nodes`` (CP attention
    has no dropout, so a model with dropout stays at cp 1)."""
    if model.seq_len < CP_MIN_SEQ_LEN or model.dropout > 0:
        return [1]
    return [cp for cp in _divisors(gpus)
            if cp == 1 or (model.seq_len % (2 * cp) == 0 and (across_nodes or tp * cp <= gpus_per_node))]


def search(model: ModelConfig, gpus: int, global_batch: int, c: Cluster, precision: str = "bf16",
           **kw) -> tuple[list[Plan], int]:
    """Every fitting layout ranked by estimated step time (fastest first), and how many were tried. CP groups
    that span nodes are tried only when no layout fits with tp·cp inside a node."""
    cands = layouts(model, gpus, global_batch, c.gpus_per_node, **kw)
    plans = [evaluate(model, lay, global_batch, c, precision) for lay in cands]
    tried = len(cands)
    if not any(p.fits for p in plans) and model.seq_len >= CP_MIN_SEQ_LEN and "cp_across_nodes" not in kw:
        seen = set(cands)
        wider = [lay for lay in layouts(model, gpus, global_batch, c.gpus_per_node, cp_across_nodes=True, **kw)
                 if lay not in seen]
        plans += [evaluate(model, lay, global_batch, c, precision) for lay in wider]
        tried += len(wider)
    fits = sorted((p for p in plans if p.fits), key=lambda p: (p.time.total, p.peak_bytes))
    return fits, tried


def torchrun_command(plan: Plan, model_flags: list[str], global_batch: int, precision: str,
                     gpus_per_node: int) -> str:
    """The launch command of a plan on ``world / gpus_per_node`` nodes (run it on every node)."""
    world = plan.layout.world
    nodes = max(1, world // gpus_per_node)
    per_node = min(world, gpus_per_node)
    launch = [f"torchrun --nnodes {nodes} --nproc-per-node {per_node}"]
    if nodes > 1:
        launch.append("--rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id megazero")
    args = [*model_flags, *plan.layout.flags(), "--global-batch-size", str(global_batch), "--precision", precision]
    return " ".join([*launch, "pretrain/gpt.py", *args])
