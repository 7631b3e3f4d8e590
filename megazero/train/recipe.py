"""The recipe: how one rank's share of the model is built and wrapped, as an ordered list of named steps.

:func:`build` runs them in order (torchtitan's ``parallelize`` reads the same way):

1. :func:`split_for_pp` – which layers each of this rank's model chunks runs (one chunk per virtual stage);
2. :func:`build_on_meta` – the chunks on the meta device (shapes without storage), with tensor parallelism
   applied as they are built: Megatron-style layers are born sharded over the TP group, so no rank ever holds
   a layer's unsharded weight (torchtitan's ``apply_tp`` instead rewrites whole modules into DTensor ones, which
   needs the full module first);
3. :func:`materialiser` – each parameter's initial value from (seed, unsharded name) at its full shape, then
   this rank's slice, so every topology starts from the same model; with ``--init-from`` this rank's slice of
   the Hugging Face tensors instead, read straight from their files (:mod:`megazero.checkpoint.hf_import`);
4. :func:`wrap_for_zero` – the ZeRO optimizer over the DP x CP group (the DP group without context
   parallelism: CP ranks hold the same weights and see different tokens of the same samples); it calls the
   materialiser one parameter (stages 0-2) or one gather unit (stage 3, sharded) at a time, so no rank ever
   holds a second full copy of its replica (and at stage 3 not even one);
5. :func:`pipeline_p2p` – the batched transfers between stages;
6. :func:`apply_compile` – ``torch.compile`` of each transformer block.

Only this module and the engine see the whole :class:`ParallelContext`; each step hands a layer or the optimizer
the one group it needs (the layers their TP and CP groups, the optimizer its DP x CP group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from megazero.checkpoint.hf_import import hf_initializer
from megazero.config import Config
from megazero.config.precision import PRECISION_DTYPES
from megazero.config.resolve import chunks_per_rank
from megazero.distributed.context import ParallelContext
from megazero.model.gpt import GPT, parameter_initializer
from megazero.pipeline.p2p import PipelineP2P
from megazero.pipeline.partition import StageSpec, stage_specs
from megazero.tensor_parallel.random import RNGTracker
from megazero.zero.norm import grad_norm_weights
from megazero.zero.optimizer import ZeroOptimizer

__all__ = ["Parts", "apply_compile", "build", "build_on_meta", "materialiser", "pipeline_p2p",
           "split_for_pp", "wrap_for_zero"]


@dataclass
class Parts:
    """What the recipe produces for one rank."""

    schedule: str  # the pipeline schedule actually run ("1f1b" without pipelining)
    virtual_stages: int
    specs: list[StageSpec]  # one per chunk
    rng_tracker: RNGTracker
    chunks: list[GPT]
    model: nn.Module  # the one chunk, or a ModuleList of them (what the optimizer wraps)
    tied: list[nn.Parameter]  # the tied word embedding's copies on this rank (pp > 1 only)
    optimizer: ZeroOptimizer
    p2p: PipelineP2P | None


def split_for_pp(cfg: Config, ctx: ParallelContext) -> tuple[str, int, list[StageSpec]]:
    """The schedule, the virtual stages per rank and the layers of each of this rank's chunks (zbv: two chunks
    in a V, virtual stages r and 2 pp - 1 - r, so rank 0 holds the first and the last stage)."""
    p = cfg.parallel
    schedule = p.pp_schedule if ctx.pp_enabled else "1f1b"
    virtual_stages = chunks_per_rank(schedule, ctx.pp_size, p.virtual_stages)
    specs = stage_specs(cfg.model.num_layers, ctx.pp_size, ctx.pp_rank, virtual_stages, p.pp_layout, schedule)
    return schedule, virtual_stages, specs


def build_on_meta(cfg: Config, ctx: ParallelContext, specs: list[StageSpec], rng_tracker: RNGTracker) -> list[GPT]:
    """This rank's chunks on the meta device, their parallel layers sharded over ``ctx.tp_group``; attention
    context-parallel over ``ctx.cp_group`` when cp > 1; K/V heads shared over ``ctx.kv_group`` when tp exceeds
    them (a collective call: every rank makes the groups)."""
    replicas = ctx.tp_size // cfg.model.kv_heads
    kv_group = ctx.kv_group(replicas) if replicas > 1 else None
    with torch.device("meta"):
        return [GPT(cfg.model, ctx.tp_group, layers=s.layers, pre_process=s.pre_process,
                    post_process=s.post_process, sequence_parallel=cfg.parallel.sequence_parallel,
                    rng_tracker=rng_tracker, activation_checkpointing=cfg.activation_checkpointing,
                    cp_group=ctx.cp_group, cp_attention=cfg.parallel.cp_attention, kv_group=kv_group)
                for s in specs]


def materialiser(chunks: list[GPT], cfg: Config, ctx: ParallelContext, device: torch.device):
    """The function ZeRO calls to give one meta parameter its initial fp32 value on ``device``."""
    if cfg.training.init_from is not None:
        return hf_initializer(chunks, cfg.model, cfg.training.init_from, ctx.tp_group, device)
    return parameter_initializer(chunks, cfg.training.seed, ctx.tp_group, device)


def wrap_for_zero(chunks: list[GPT], cfg: Config, ctx: ParallelContext, param_init, device: torch.device,
                  schedule: str = "1f1b") -> tuple[ZeroOptimizer, nn.Module, list[nn.Parameter]]:
    """The ZeRO optimizer over the DP x CP group, materialising ``chunks`` as it partitions them.

    Under context parallelism each CP rank's gradient covers its own tokens, so gradients are summed over DP x CP
    and ZeRO partitions over that group (Nd = dp x cp, as Megatron-Core's distributed optimizer); at cp 1
    ``ctx.dp_cp_group`` is the DP group itself. Stage 3 reduces its gradients over ``ctx.zero_reduce_group`` (the
    same ranks, a communicator of their own) while it gathers over the first.

    With pipelining the first and last stage each hold a copy of the tied word embedding: their gradients are
    summed over the embedding group and the last stage's copy is left out of the gradient norm (counted once).
    An untied model (``lm_head`` on the last stage) has no copies and no embedding-group traffic. Under zbv
    pipeline rank 0 holds both copies (the first and the last stage): the optimizer sums them in place, pairing
    their segments (``ZeroOptimizer.tied_pairs``), and the embedding group (pp ranks 0 and p - 1) is not used.
    """
    tied = [c.wte.weight for c in chunks if hasattr(c, "wte")] if ctx.pp_enabled and cfg.model.tied else []
    model = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
    norm_counted = grad_norm_weights(model, ctx.tp_rank)
    for chunk in chunks:
        if chunk.post_process and not chunk.pre_process and tied:
            norm_counted[chunk.wte.weight] = False
    ctx.configure_nodes(cfg.parallel.ranks_per_node, cfg.zero.zero_hpz_partition_size)  # ZeRO++'s node groups
    optimizer = ZeroOptimizer(
        model, cfg.zero, cfg.optimizer, dp_group=ctx.dp_cp_group, reduce_group=ctx.zero_reduce_group,
        norm_group=ctx.mp_group, norm_counted=norm_counted,
        precision=cfg.training.precision, loss_scale_cfg=cfg.loss_scale, tied_params=tied,
        tied_group=ctx.embedding_group if tied and schedule != "zbv" else None, param_init=param_init,
        device=device)
    return optimizer, model, tied


def pipeline_p2p(cfg: Config, ctx: ParallelContext, virtual_stages: int, device: torch.device) -> PipelineP2P | None:
    """The batched point-to-point transfers between stages (activations are [micro, seq / cp (/ tp with SP),
    hidden]: each CP rank's pipeline carries its own tokens)."""
    if not ctx.pp_enabled:
        return None
    m, t = cfg.model, cfg.training
    seq = m.seq_len // ctx.cp_size
    seq = seq // ctx.tp_size if cfg.parallel.sequence_parallel else seq
    return PipelineP2P(ctx.pp_group, (t.micro_batch_size, seq, m.hidden_size), PRECISION_DTYPES[t.precision],
                       device, virtual_stages)


def apply_compile(chunks: list[GPT], cfg: Config, device: torch.device) -> None:
    """``torch.compile`` each block (``--compile``; ``MEGAZERO_COMPILE_BACKEND`` picks another backend, e.g.
    ``aot_eager`` in tests), and set TF32 for fp32 matmuls on CUDA (``--no-tf32`` for exact fp32 parity).
    ``MEGAZERO_TF32`` (0 or 1) wins over the config: the test harness sets 0 for every world and launched run
    (tests/conftest.py), so parity worlds stay exact fp32 whatever their flags say."""
    if device.type == "cuda":
        env = os.environ.get("MEGAZERO_TF32", "")
        tf32 = cfg.training.tf32 if env == "" else env != "0"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    if cfg.training.compile:
        backend = os.environ.get("MEGAZERO_COMPILE_BACKEND", "inductor")
        for chunk in chunks:
            chunk.compile_blocks(backend=backend)


def build(cfg: Config, ctx: ParallelContext, device: torch.device) -> Parts:
    """Run the recipe's steps in order for this rank."""
    schedule, virtual_stages, specs = split_for_pp(cfg, ctx)
    rng_tracker = RNGTracker(cfg.training.seed, ctx.tp_rank, device)
    chunks = build_on_meta(cfg, ctx, specs, rng_tracker)
    param_init = materialiser(chunks, cfg, ctx, device)
    optimizer, model, tied = wrap_for_zero(chunks, cfg, ctx, param_init, device, schedule)
    p2p = pipeline_p2p(cfg, ctx, virtual_stages, device)
    apply_compile(chunks, cfg, device)
    return Parts(schedule, virtual_stages, specs, rng_tracker, chunks, model, tied, optimizer, p2p)
