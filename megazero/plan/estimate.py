"""Memory estimator: per-rank model-state and activation bytes of a GPT for a (tp, pp, dp) grid and ZeRO stage.

Model states follow the ZeRO paper (arXiv 1910.02054) with Ψ replaced by Ψ_r, the parameters one rank really
holds (DESIGN.md): its TP shard of its pipeline stage, the vocabulary padded as :class:`VocabParallelEmbedding`
pads it, TP-replicated pieces (LayerNorms, row-parallel biases, position embeddings) in full, and the tied
embedding copy on the last stage. What each stage keeps per rank, as ``megazero/zero`` holds it:

===========  ==========================  ===========================  ==========================
precision    parameters                  gradients                    master + Adam moments
===========  ==========================  ===========================  ==========================
bf16/fp16    2Ψ (stage 3: 2Ψ/Nd)         2Ψ (stages 2-3: 2Ψ/Nd)       (4 + 8)Ψ (stages 1-3: /Nd)
fp32         4Ψ (stage 3: 4Ψ/Nd)         4Ψ (stages 2-3: 4Ψ/Nd)       0 + 8Ψ (stages 1-3: /Nd)
===========  ==========================  ===========================  ==========================

In fp32 the parameters are their own master copy, so there is no separate master (``master_params_bytes`` is
0 in the measured records too). At stage 3, parameters of at most ``stage3_param_persistence_threshold``
elements stay whole on every rank (DeepSpeed's rule, as :mod:`megazero.zero.stage3.params` does). Padding of the
flat buffers (under ``dp * 16`` elements per buffer) is not counted.

Activations are the bytes autograd saves for backward during one micro-batch's forward, which is what
:class:`megazero.observe.memory.ActivationMemoryCounter` measures, per model family: :mod:`megazero.plan.activations`
(:func:`activation_bytes`, :func:`recompute_bytes`, :func:`checkpoint_host_bytes`, :func:`korthikanti_layer_bytes`,
re-exported here).

The stage split (:func:`megazero.pipeline.partition.partition_layers`), the vocabulary padding
(:class:`~megazero.tensor_parallel.layers.VocabParallelEmbedding`'s) and the gradient dtype
(:func:`megazero.zero.grads.grad_dtype_for`) are the runtime's own, so the estimate cannot drift from them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from megazero.config.precision import ELEMENT_BYTES
from megazero.config.resolve import chunks_per_rank
from megazero.config.schema import ModelConfig, ZeroConfig
from megazero.pipeline.p2p import received_waiting, transfer_plan
from megazero.pipeline.partition import partition_layers, stage_specs
from megazero.pipeline.schedules import SPLIT_SCHEDULES, build_schedule, transfer_ticks, transfer_units
from megazero.plan.activations import (
    activation_bytes,
    checkpoint_host_bytes,
    korthikanti_layer_bytes,
    recompute_bytes,
)
from megazero.tensor_parallel.layers import VOCAB_PAD_MULTIPLE, pad_size
from megazero.zero.grads import grad_dtype_for

__all__ = [
    "ModelStateBytes",
    "PeakEstimate",
    "activation_bytes",
    "checkpoint_host_bytes",
    "head_gemm_deferred",
    "in_flight_micro_batches",
    "korthikanti_layer_bytes",
    "model_state_bytes",
    "padded_vocab_size",
    "peak_bytes",
    "rank_parameter_numels",
    "recompute_bytes",
    "stage_layers",
    "weight_stash_bytes",
]

def padded_vocab_size(vocab_size: int, tp_size: int, pad_multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    """The vocabulary as the model lays it out: a multiple of ``pad_multiple * tp_size``."""
    return pad_size(vocab_size, pad_multiple * tp_size)


def stage_layers(num_layers: int, pp_size: int, layout: Sequence[int] | None = None) -> list[range]:
    """Contiguous layer ranges per pipeline stage: :func:`megazero.pipeline.partition.partition_layers`'s split
    (``layout``: each stage's layer count, ``--pp-layout``)."""
    return partition_layers(num_layers, pp_size, None if layout is None else list(layout))


def rank_parameter_numels(model: ModelConfig, tp_size: int = 1, pp_size: int = 1, pp_rank: int = 0,
                          layers: range | None = None, virtual_stages: int = 1,
                          layout: Sequence[int] | None = None, schedule: str = "") -> dict[str, int]:
    """Element count of every parameter one rank holds, by the model's parameter name (Ψ_r is their sum).

    The first stage holds the token and position embeddings (GPT-2's learned ones), the last the final norm and
    the output layer: the tied token embedding (its own copy when pp > 1) or the untied ``lm_head``;
    column-parallel weights and biases and the vocabulary are split over TP, the rest is replicated in full.
    Llama's blocks have RMSNorm weights, no biases, a fused q/k/v of ``(nh + 2·nkv)·hd`` rows and SwiGLU's gate
    and up rows in one weight. With ``virtual_stages`` V > 1 the rank holds chunks ``c * pp + rank`` of
    ``pp * V`` stages, named ``"{c}.{name}"`` as in an ``nn.ModuleList`` of chunks; ``schedule`` "zbv" places
    the two chunks in a V (virtual stages ``rank`` and ``2 pp - 1 - rank``: rank 0 holds the embeddings and the
    final norm and output layer, for GPT-2 both copies of the tied embedding).
    """
    if virtual_stages > 1:
        out: dict[str, int] = {}
        total, layout = pp_size * virtual_stages, None if layout is None else list(layout)
        for c, spec in enumerate(stage_specs(model.num_layers, pp_size, pp_rank, virtual_stages, layout, schedule)):
            chunk = rank_parameter_numels(model, tp_size, total, spec.virtual_stage, spec.layers)
            out.update({f"{c}.{k}": n for k, n in chunk.items()})
        return out
    h, t = model.hidden_size, tp_size
    if model.num_heads % t or h % t or (model.kv_heads % t and t % model.kv_heads):
        raise ValueError(f"--num-heads {model.num_heads} and --hidden-size {h} must be divisible by --tp {t}, and "
                         f"--num-kv-heads {model.kv_heads} a multiple or a divisor of it")
    layers = stage_layers(model.num_layers, pp_size, layout)[pp_rank] if layers is None else layers
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    vocab = padded_vocab_size(model.vocab_size, t) // t * h
    llama = model.arch == "llama"
    out = {}
    if first or (last and model.tied):
        out["wte.weight"] = vocab
    if first and not llama:
        out["wpe.weight"] = model.seq_len * h
    # a rank's q, k, v rows: its query heads, and its K/V heads (one, shared by tp / kv ranks, when tp > kv heads)
    ffn, qkv = model.ffn_hidden_size, h // t + 2 * max(model.kv_heads // t, 1) * model.head_dim
    for i in layers:
        p = f"blocks.{i}."
        if llama:
            out.update({p + "ln_1.weight": h, p + "attn.qkv.weight": qkv * h, p + "attn.proj.weight": h * h // t,
                        p + "ln_2.weight": h, p + "mlp.fc.weight": 2 * ffn * h // t, p + "mlp.proj.weight": h * ffn // t})
            continue
        out.update({
            p + "ln_1.weight": h, p + "ln_1.bias": h,
            p + "attn.qkv.weight": 3 * h * h // t, p + "attn.qkv.bias": 3 * h // t,
            p + "attn.proj.weight": h * h // t, p + "attn.proj.bias": h,
            p + "ln_2.weight": h, p + "ln_2.bias": h,
            p + "mlp.fc.weight": ffn * h // t, p + "mlp.fc.bias": ffn // t,
            p + "mlp.proj.weight": h * ffn // t, p + "mlp.proj.bias": h,
        })
    if last:
        out["ln_f.weight"] = h
        if not llama:
            out["ln_f.bias"] = h
        if not model.tied:
            out["lm_head.weight"] = vocab
    return out


@dataclass(frozen=True)
class ModelStateBytes:
    """Model-state bytes one rank holds; ``offloaded`` is the part of them kept in host memory."""

    params: float
    grads: float
    master_params: float
    optimizer_states: float
    offloaded: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_states

    @property
    def device(self) -> float:
        """What stays in accelerator memory."""
        return self.total - self.offloaded

    def as_record(self) -> dict[str, float]:
        """The figures under the keys of a metrics.jsonl memory record."""
        return {"params_bytes": self.params, "grads_bytes": self.grads, "master_params_bytes": self.master_params,
                "optimizer_states_bytes": self.optimizer_states}


def model_state_bytes(numels: Sequence[int] | float, stage: int, dp_size: int, precision: str = "bf16",
                      persistence_threshold: int = 0, offload_optimizer: bool = False,
                      offload_param: bool = False, grad_dtype: str = "auto") -> ModelStateBytes:
    """Per-rank model-state bytes of a replica of ``numels`` parameters (a list, or just their total Ψ_r).

    ``persistence_threshold`` applies at stage 3 and needs the per-parameter list. ``offload_optimizer``
    moves the fp32 master copy and Adam moments to host memory, ``offload_param`` (stage 3) the parameter
    shards as well; both count in ``offloaded``, with the fp32 host copy of the owned gradients that offload
    adds to ``grads``. ``grad_dtype`` (``--grad-dtype``) sets the gradient bytes g
    per parameter: ``auto`` is 4 in bf16 (fp32 accumulation and reduction) and the model's in fp16/fp32,
    ``fp32`` 4, ``model`` the model's (the ZeRO paper's 2Ψ). bf16 with fp32 gradients holds 18Ψ at stage 0,
    6Ψ + 12Ψ/Nd at stage 1 and 2Ψ + 16Ψ/Nd at stage 2.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0-3, got {stage}")
    if precision not in ELEMENT_BYTES:
        raise ValueError(f"precision must be one of {sorted(ELEMENT_BYTES)}, got {precision!r}")
    sizes = [float(numels)] if isinstance(numels, (int, float)) else [float(n) for n in numels]
    psi = sum(sizes)
    persistent = sum(n for n in sizes if n <= persistence_threshold) if stage == 3 else 0.0
    e, nd = ELEMENT_BYTES[precision], dp_size
    g = grad_dtype_for(precision, grad_dtype).itemsize
    params = e * persistent + e * (psi - persistent) / nd if stage == 3 else e * psi
    grads = g * psi / nd if stage >= 2 else g * psi
    owned = psi / nd if stage >= 1 else psi
    # fp32: the parameters are their own master copy, unless offload keeps a separate one (in host memory, or on
    # the device apart from parameter shards offloaded alone)
    master = 4 * owned if e != 4 or offload_optimizer or (offload_param and stage == 3) else 0.0
    states = 8 * owned  # Adam's two fp32 moments
    host_grads = 4 * owned if offload_optimizer else 0.0  # the fp32 host copy Adam reads, allocated once
    grads += host_grads
    offloaded = (master + states + host_grads if offload_optimizer else 0.0) + (
        e * (psi - persistent) / nd if offload_param and stage == 3 else 0.0)
    return ModelStateBytes(params, grads, master, states, offloaded)


def in_flight_micro_batches(pp_size: int, pp_rank: int, schedule: str = "1f1b", micro_batches: int = 1) -> int:
    """Micro-batches whose activations a pipeline stage holds at once: 1 without PP, ``pp - pp_rank`` with
    1F1B (at most ``micro_batches``), all ``micro_batches`` with GPipe."""
    if pp_size == 1:
        return 1
    if schedule == "gpipe":
        return micro_batches
    return max(1, min(pp_size - pp_rank, micro_batches))


def _grad_outputs_per_token(model: ModelConfig, tp_size: int) -> float:
    """Elements per token of one block's four linears' output gradients on a rank (what W keeps beside their
    inputs): this rank's q, k, v rows (its query heads and its K/V heads: one, shared by tp / kv ranks, when tp >
    kv), the projection's full h, the MLP's up (SwiGLU: gate|up) rows, the down projection's full h."""
    h, t = model.hidden_size, tp_size
    qkv = h / t + 2 * max(model.kv_heads // t, 1) * model.head_dim
    up = 2 * model.ffn_hidden_size if model.arch == "llama" else model.ffn_hidden_size
    return qkv + h + up / t + h


def weight_stash_bytes(model: ModelConfig, micro_batch: int, *, tp_size: int = 1, sequence_parallel: bool = False,
                       precision: str = "bf16", layers: int, first_stage: bool, last_stage: bool) -> float:
    """What a zero-bubble B leaves for its W, per micro-batch (``megazero/tensor_parallel/weight_grad.py``):
    each linear's input (under SP a column-parallel layer's sequence shard, gathered again in W) and output
    gradient, the first stage's embedding output gradient and the kept gradient of its position table; the
    last stage's LM head input and logits gradient. Norm and bias gradients (O(h)) are left out."""
    e, t = ELEMENT_BYTES[precision], tp_size
    sp = t if sequence_parallel and t > 1 else 1
    s, b, h, f = model.seq_len, micro_batch, model.hidden_size, model.ffn_hidden_size
    per_token = (h / sp + h / t + h / sp + f / t) + _grad_outputs_per_token(model, t)  # inputs, output gradients
    out = layers * per_token * s * b
    if first_stage:
        out += s * b * h + (0 if model.arch == "llama" else s * h)
    if last_stage:
        out += s * b * (h / sp + padded_vocab_size(model.vocab_size, t) / t)
    return e * out


def head_gemm_deferred(model: ModelConfig, micro_batch: int, tp_size: int = 1, pp_size: int = 1,
                       virtual_stages: int = 1) -> bool:
    """Whether the tied LM head's weight-gradient GEMM waits for the lookup's backward
    (:meth:`TiedGrad.file <megazero.tensor_parallel.weight_grad.TiedGrad.file>`): where one chunk runs both uses of
    the table (one pipeline stage, one chunk) and the GEMM's inputs, the logits [b·s, V/t] and the head's input
    [b·s, h], are fewer elements than the table [V/t, h]: ``b·s·(V/t + h) < V/t·h``. Then no table gradient
    exists from the head's backward to the lookup's; else the head makes it and it is held until then."""
    if not (model.tied and pp_size == 1 and virtual_stages == 1):
        return False
    table = padded_vocab_size(model.vocab_size, tp_size) // tp_size
    return micro_batch * model.seq_len * (table + model.hidden_size) < table * model.hidden_size


def _timeline_activations(schedule: str, pp_size: int, pp_rank: int, micro_batches: int,
                          acts: Sequence[float], stashes: Sequence[float]) -> float:
    """The most bytes a rank holds between F and W: its timeline replayed with ``acts[c]`` per micro-batch of
    chunk ``c`` from F to B and ``stashes[c]`` from B to W (one chunk per rank under zb-h1; zbv's two, whose
    bytes differ: rank 0's first chunk holds the embedding, its second the LM head; the interleaved schedule's V
    chunks, without W: ``stashes`` zero)."""
    return max(sum(f * a + w * st for (f, w), a, st in zip(state, acts, stashes))
               for state in _held_counts(schedule, pp_size, pp_rank, micro_batches, len(acts)))


@functools.lru_cache(maxsize=4096)
def _held_counts(schedule: str, pp_size: int, pp_rank: int, micro_batches: int, chunks: int = 1
                 ) -> frozenset[tuple[tuple[int, int], ...]]:
    """Every state a rank's timeline passes through: per chunk, (micro-batches between F and B, between B and
    W)."""
    held = [[0, 0] for _ in range(chunks)]
    seen = {tuple((0, 0) for _ in range(chunks))}
    for a in build_schedule(schedule, pp_size, pp_rank, micro_batches, chunks):
        c = held[a.chunk]
        c[0], c[1] = c[0] + {"F": 1, "B": -1, "W": 0}[a.kind], c[1] + {"F": 0, "B": 1, "W": -1}[a.kind]
        seen.add(tuple((f, w) for f, w in held))
    return frozenset(seen)


@functools.lru_cache(maxsize=4096)
def _most_received_waiting(schedule: str, pp_size: int, pp_rank: int, micro_batches: int, chunks: int = 1) -> int:
    """The most received boundary tensors a rank's inbox holds at once, from the transfer plan the executor runs
    (:func:`megazero.pipeline.p2p.received_waiting`): 1 under 1F1B, GPipe and zb-h1; 2 under interleaved (a
    unit's call receives for its forward and its backward); up to 3 under zbv (a tick's call receives for
    later actions: both chunks' inputs and gradients)."""
    actions = build_schedule(schedule, pp_size, pp_rank, micro_batches, chunks)
    units = transfer_units(schedule, pp_size, pp_rank, micro_batches, chunks)
    plan = transfer_plan(actions, pp_rank, pp_size, chunks, units=units, schedule=schedule,
                         ticks=transfer_ticks(schedule, pp_size, micro_batches))
    return max(received_waiting(actions, plan, pp_rank, pp_size, chunks, schedule), default=0)


@dataclass(frozen=True)
class PeakEstimate:
    """A rank's predicted peak of live tensors during a step, in the parts the tracker
    (:class:`megazero.observe.memory.PeakMemoryTracker`) measures."""

    model_states: float  # parameters, gradients, master copy and Adam moments at rest (where they count)
    activations: float  # the micro-batches stashed at once
    comm_buffers: float  # gradient staging buckets (stage 2, stage 3's persistent parameters)
    transient: float  # what backward allocates on top at its peak: recomputation, fresh gradients; stage 3:
    # gathered units and a block's gradient staging
    optimizer_transient: float = 0.0  # on top of the states and buffers once activations are freed
    released: float = 0.0  # of the above, not live at the backward peak (stage 3; see peak_bytes)

    @property
    def backward(self) -> float:
        """The peak of backward."""
        return self.model_states + self.activations + self.comm_buffers + self.transient - self.released

    @property
    def optimizer_step(self) -> float:
        """The peak once the activations are freed: the end of backward and the optimizer step."""
        return self.model_states + self.comm_buffers + self.optimizer_transient

    @property
    def total(self) -> float:
        return max(self.backward, self.optimizer_step)


def peak_bytes(model: ModelConfig, micro_batch: int, *, stage: int, dp_size: int, tp_size: int = 1,
               pp_size: int = 1, pp_rank: int = 0, precision: str = "bf16", checkpointing: str = "none",
               sequence_parallel: bool = False, micro_batches: int = 1, schedule: str = "1f1b",
               offload_optimizer: bool = False, offload_param: bool = False, host_counts: bool = False,
               persistence_threshold: int = 100_000, bucket_numel: int | None = None, overlap_comm: bool = False,
               max_inflight: int = 2, fused_attention: bool = True, mask_bytes: int = 1,
               fused_norm: bool = True, virtual_stages: int = 1) -> PeakEstimate:
    """The peak of one training step on one rank: the larger of the peak where backward begins on the stashed
    micro-batches and the peak of the optimizer step.

    * model states as :func:`model_state_bytes` (offloaded ones only with ``host_counts``, e.g. on a CPU run
      where host and device are one memory);
    * activations: :func:`activation_bytes` times :func:`in_flight_micro_batches` (``fused_attention``,
      ``mask_bytes`` and ``fused_norm`` say which kernels run, :mod:`megazero.plan.activations`); under the
      zero-bubble schedules the most that the rank's timeline holds between F and W, each micro-batch's
      activations from F to B and its W stash (:func:`weight_stash_bytes`) from B to W, chunk by chunk for
      ``zbv`` (two chunks per rank in a V: rank 0 runs the first stage, with the embeddings, and the last, with
      the final norm, the logits and the loss); under ``interleaved`` (``virtual_stages`` chunks per rank) the
      most that the timeline holds between F and B, chunk by chunk;
    * communication buffers (stages 2-3, as ``megazero/zero`` holds them): the gradient staging buckets of
      stage 2 and of stage 3's persistent parameters, ``e·min(bucket, Ψ)`` per buffer: one without
      ``overlap_comm`` (each reduction completes before the next bucket opens), ``max_inflight`` with it.
      ``bucket_numel`` None is :meth:`ZeroConfig.bucket_numel <megazero.config.schema.ZeroConfig.bucket_numel>`'s
      default for this rank's Ψ (stage 2: Ψ/16 over the buffers); stage 3: see below;
    * transients: one layer's recomputation (:func:`recompute_bytes`) and fresh gradients before they are
      accumulated, the largest parameter's size: stages 0-2 file a bucket's fresh gradients until they reach the
      largest parameter's size (``megazero/zero/bucketed.py``'s ``flush_numel``), a tied LM head's table gradient
      (where the head makes it, not :func:`head_gemm_deferred`) is one; so the term stands whether the head's GEMM
      waits or not (GPT-2 124M, seq 32, dp 4: 151 MB of block gradients filed at the stage-0 and stage-1 peaks)
      but overcounts where fewer gradients arrive before a flush (tiny models, stage 2's small buckets) -- plus
      the gradient of the LM head's input, ``e·sbh``
      (before the last pipeline stage: the gradient received; the output sent is freed once its send
      completes, before that gradient arrives at the start of backward: ``megazero/pipeline/executor.py``);
      where one call receives for several later actions (interleaved's units, zbv's ticks), the other
      received tensors waiting in the inbox (:func:`megazero.pipeline.p2p.received_waiting`; an upper bound:
      their most, whenever it comes);
    * once activations are freed (stages 0-2): the states, the buffers above and one model-dtype tensor the
      size of the largest parameter. On a GPT that is the tied embedding at the end of backward: the LM head's
      weight gradient, into which the lookup adds its rows in place before it is accumulated
      (:class:`~megazero.tensor_parallel.weight_grad.TiedGrad`; autograd alone would hold three: the head's, the
      lookup's and their out-of-place sum).

    An upper bound where the peak of a phase does not coincide with the others' (the staging buckets fill as
    activations are freed).

    Stage 3 (:mod:`megazero.zero.stage3.params`) is followed through its backward, the largest of: as it begins
    (the chunk's own units gathered, the two block slots the forward filled, one holding the prefetched last block,
    and the LM head's fresh gradient of the tied embedding -- unless :func:`head_gemm_deferred`: then no table
    gradient exists until the lookup's backward, and the GEMM's inputs it waits with are the logits, overwritten
    by their gradient, and the head's input, both counted in the activations); during each block's backward (that
    block and the next gathered, its gradients staged over its own gathered parameters where the staging dtype is
    the model's, else one block's gradient staging, the largest block parameter's fresh gradient, the head's
    gradient of the tied embedding held until the embedding's backward adds to it, where the head made it; the
    chunk's own units are released by then, and the activations of the blocks already done are freed); at each
    block's reduction (the block released, its staging and, where the reduction dtype is wider than the model's,
    one converted chunk of the model dtype's bytes, its owned part allocated); and at the embedding's backward:
    the table's one gradient made (the head's with the lookup's rows added in place, or the deferred GEMM's, its
    inputs still alive) with the own units' staging, less that of own parameters larger than a block, reduced
    from their gradient; then that reduction, the owned part of such a unit allocated beside the table's gradient
    and the head's activations freed (GPT-2 124M at seq 32, dp 4, fp32: the step's peak, 650.4 MB tracked, the
    states and the table's gradient). With one micro-batch
    per step the owned gradient partition fills unit by unit as backward reduces it (:attr:`PeakEstimate.
    released` says what is not yet there, and the activations freed); with several it is whole from the
    second on. ``released`` is that difference from the sum of the other fields.
    """
    e = ELEMENT_BYTES[precision]
    v = chunks_per_rank(schedule, pp_size, virtual_stages)  # zbv: two chunks per rank in a V
    numel = rank_parameter_numels(model, tp_size, pp_size, pp_rank, virtual_stages=v, schedule=schedule)
    sizes = list(numel.values())
    ms = model_state_bytes(sizes, stage, dp_size, precision, persistence_threshold, offload_optimizer,
                           offload_param and stage == 3)
    states = ms.total if host_counts else ms.device
    specs = stage_specs(model.num_layers, pp_size, pp_rank, v, schedule=schedule)
    n_layers = sum(len(sp.layers) for sp in specs)
    first, last = any(sp.pre_process for sp in specs), any(sp.post_process for sp in specs)
    common = dict(tp_size=tp_size, sequence_parallel=sequence_parallel, precision=precision,
                  checkpointing=checkpointing, fused_attention=fused_attention, mask_bytes=mask_bytes,
                  fused_norm=fused_norm)
    acts = [activation_bytes(model, micro_batch, **common, layers=len(sp.layers), first_stage=sp.pre_process,
                             last_stage=sp.post_process) for sp in specs]
    split = schedule in SPLIT_SCHEDULES and pp_size > 1
    if split:  # the stashed W inputs count too
        stashes = [weight_stash_bytes(model, micro_batch, tp_size=tp_size, sequence_parallel=sequence_parallel,
                                      precision=precision, layers=len(sp.layers), first_stage=sp.pre_process,
                                      last_stage=sp.post_process) for sp in specs]
        act = _timeline_activations(schedule, pp_size, pp_rank, micro_batches, acts, stashes)
    elif v > 1:  # interleaved: every chunk's micro-batches between F and B, from the timeline
        act = _timeline_activations(schedule, pp_size, pp_rank, micro_batches, acts, [0.0] * v)
    else:
        act = acts[0] * in_flight_micro_batches(pp_size, pp_rank, schedule, micro_batches)
    comm = 0.0
    eg = grad_dtype_for(precision).itemsize  # what gradients are staged and reduced in (--grad-dtype auto)
    if stage >= 2:
        whole = [n for n in sizes if stage == 2 or n <= persistence_threshold]  # staged in buckets
        psi_w = sum(whole)
        if bucket_numel is None:
            bucket_numel = ZeroConfig(stage=stage, max_inflight_buckets=max_inflight,
                                      overlap_comm=overlap_comm).bucket_numel(int(psi_w), dp_size)
        buffers = min(max_inflight, math.ceil(psi_w / bucket_numel)) if overlap_comm else 1
        comm = eg * min(bucket_numel, psi_w) * buffers
    s, h = model.seq_len, model.hidden_size
    sp = tp_size if sequence_parallel and tp_size > 1 else 1
    # the LM head input's gradient (last stage), or the gradient received from the next stage (the others)
    transient = recompute_bytes(model, micro_batch, **common) + e * max(sizes) + e * s * micro_batch * h / sp
    if split:  # inside a B each layer's output gradients, kept for W, appear before its saved tensors are freed:
        # one layer's on top of what the rank held as that B began (later layers free more than they add)
        transient += e * s * micro_batch * _grad_outputs_per_token(model, tp_size)
    if v > 1:  # received tensors waiting for a later action of the same call beyond the one counted above (one
        # chunk per rank: every call receives for the next action only)
        waiting = _most_received_waiting(schedule, pp_size, pp_rank, micro_batches, v)
        transient += e * s * micro_batch * h / sp * max(0, waiting - 1)
    if stage != 3:
        return PeakEstimate(states, act, comm, transient, e * max(sizes))
    blocks_act = activation_bytes(model, micro_batch, **common, layers=n_layers, first_stage=False,
                                  last_stage=False)
    if v > 1:  # several chunks (interleaved, zbv): blocks by their (global) layer, later chunks' others apart
        numel = {(rest if rest.startswith("blocks.") or c == "0" else f"head.{rest}"): n
                 for (c, rest), n in ((k.split(".", 1), n) for k, n in numel.items())}
    # the head's gradient of the tied table, held from the head's backward to the lookup's (zbv's LM head has its
    # own copy of the tied embedding on rank 0: no gradient held across the chunk); where the GEMM waits for the
    # lookup (TiedGrad), what its closure holds beyond the activations: the head's input gathered under SP
    deferred = head_gemm_deferred(model, micro_batch, tp_size, pp_size, v)
    held = e * s * micro_batch * h * (1 - 1 / sp) if deferred else e * numel.get("wte.weight", 0)
    head_act = activation_bytes(model, micro_batch, **common, layers=0, first_stage=False, last_stage=True)
    gathered, released = _stage3_backward(numel, persistence_threshold, e, eg, dp_size, micro_batches,
                                          blocks_act, first, last and v == 1, pp_size, held, deferred, head_act)
    # the optimizer step works on owned slices: three fp32 tensors of the largest one at most
    return PeakEstimate(states, act, comm, transient + gathered, 3 * e * max(sizes) / dp_size, released)


def _stage3_backward(numel: dict[str, int], threshold: int, e: int, eg: int, dp_size: int, micro_batches: int,
                     blocks_act: float, first: bool, last: bool, pp_size: int, held: float = 0.0,
                     deferred: bool = False, head_act: float = 0.0) -> tuple[float, float]:
    """Stage 3's backward peak beyond the states, activations and the common transients of :func:`peak_bytes`
    (its docstring): ``(bytes added, bytes released)`` at the largest of the moments it lists. ``held``: what the
    tied head leaves for the lookup's backward (its table gradient, or with ``deferred`` the GEMM's inputs beyond
    the activations); ``head_act``: the last stage's activations outside the blocks (freed after its GEMM)."""
    big = {k: n for k, n in numel.items() if n > threshold}
    blocks: dict[str, float] = {}
    for k, n in big.items():
        if k.startswith("blocks."):
            blocks[k.split(".")[1]] = blocks.get(k.split(".")[1], 0) + n
    root = sum(n for k, n in big.items() if not k.startswith("blocks."))
    block, n_blocks = max(blocks.values(), default=0), len(blocks)
    block_param = max((n for k, n in big.items() if k.startswith("blocks.")), default=0)
    largest = max(numel.values())  # counted in the common transient: the fresh gradient at the head
    wte = big.get("wte.weight", 0)
    held = held if first and last else 0.0  # until the lookup's backward

    def missing(reduced_blocks: float) -> float:  # owned gradient parts not yet reduced (one micro-batch)
        return eg * (root + (n_blocks - reduced_blocks) * block) / dp_size if micro_batches == 1 else 0.0

    # staging in the model dtype where the reduction's is wider, converted in chunks of the model dtype's bytes
    es, chunk = min(e, eg), (e if e < eg else 0)
    own = 0 if es == e else es  # staged in the model dtype: in the block's own gathered buffer, no slot of its own
    # (added, released): as backward begins, during the i-th block's backward and at its reduction (the
    # block released, its owned part allocated), at the embedding's backward
    # as it begins: the own units gathered and the block slots the forward filled (the last block and the one it
    # prefetched: the pool keeps both, megazero/zero/stage3/slots.py); the common transient's largest fresh gradient
    # is the head's of the tied table, unless its GEMM waits for the lookup (deferred): then what that holds
    start = e * (root + min(n_blocks, 2) * block) + (held - e * largest if deferred and first and last else 0)
    moments = [(start, missing(0))]
    for i in range(n_blocks):
        prefetched = block if i < n_blocks - 1 else 0
        done = blocks_act * i / max(n_blocks, 1)
        added = e * (block + prefetched) + own * block + e * block_param + held - e * largest
        moments.append((added, missing(i) + done))
        added = e * prefetched + (es + chunk) * block + held - e * largest
        moments.append((added, missing(i + 1) + done))
    # own parameters larger than a whole block are units of their own, reduced straight from their gradient
    # (megazero/zero/stage3/units.py): no staging of their size, only the converted chunks where wider
    whole: dict[str, int] = {}
    for k, n in numel.items():
        if k.startswith("blocks."):
            whole[k.split(".")[1]] = whole.get(k.split(".")[1], 0) + n
    limit = max(whole.values(), default=0)
    apart = sum(n for k, n in big.items() if not k.startswith("blocks.") and limit and n > limit)
    if first and wte:  # one table gradient (TiedGrad), tied or not: made (a deferred GEMM's inputs still held) ...
        added = e * wte + (es + chunk) * (root - apart) + chunk * apart - e * largest
        moments.append((added + (held if deferred else 0.0), missing(n_blocks) + blocks_act))
        # ... and reduce-scattered straight from it where it is a unit apart, its owned part allocated, the head's
        # activations freed with the GEMM's closure (one micro-batch: the owned part is new)
        owned_apart = eg * apart / dp_size if micro_batches == 1 else 0.0
        moments.append((added, missing(n_blocks) - owned_apart + blocks_act + (head_act if last else 0.0)))
    return max(moments, key=lambda m: m[0] - m[1])
