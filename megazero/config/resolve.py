"""Resolution and validation of a :class:`~megazero.config.schema.Config` against a world size and device.

:func:`resolve_config` fills in what the settings leave to be derived (dp, the batch triple, decay steps, the
device's precision and compile defaults) and checks every setting, raising :class:`ConfigError` with a message
that names the flag (and the DeepSpeed key, where one maps to it) and the fix. Validation is pure (no
collectives), so every rank raises the same error at the same point.

This module reads a Config by field name and does not import the schema: ``Config.resolve`` calls
:func:`resolve_config`, so the schema sits above this module.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from typing import Any, TypeVar

from megazero.config.errors import ConfigError, ConfigWarning
from megazero.config.precision import GRAD_DTYPES

__all__ = [
    "ARCHS",
    "BACKENDS",
    "CHECKPOINTING_MODES",
    "CP_ATTENTION_MODES",
    "GRAD_DTYPES",
    "OPTIMIZERS",
    "PP_SCHEDULES",
    "PRECISIONS",
    "SCHEDULES",
    "WANDB_MODES",
    "WARMUP_TYPES",
    "chunks_per_rank",
    "resolve_config",
]

Cfg = TypeVar("Cfg")  # a megazero.config.schema.Config

# Choices shared by the command line (megazero.config.cli) and validation
ARCHS = ("gpt2", "llama")  # the model families (ModelConfig.arch)
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")  # zb-h1, zbv: zero-bubble, split backward
# (pipeline/); zbv runs two model chunks per rank in a V (chunks_per_rank)
CP_ATTENTION_MODES = ("ring", "allgather")  # megazero.context_parallel's modes (a test holds them equal)
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "adamw")
SCHEDULES = ("cosine", "constant", "warmup_lr", "warmup_decay_lr", "warmup_cosine_lr")
WARMUP_TYPES = ("linear", "log")
CHECKPOINTING_MODES = ("none", "full", "selective")
BACKENDS = ("gloo", "nccl")
WANDB_MODES = ("online", "offline", "disabled")


def chunks_per_rank(schedule: str, pp_size: int, virtual_stages: int) -> int:
    """The model chunks each pipeline rank runs: ``--virtual-stages`` under the interleaved schedule, 2 under
    zbv (its V: rank r holds virtual stages r and 2 pp - 1 - r, whatever ``--virtual-stages`` says), else 1;
    always 1 without pipelining (one stage runs 1F1B's timeline)."""
    if pp_size == 1:
        return 1
    return virtual_stages if schedule == "interleaved" else 2 if schedule == "zbv" else 1


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _choice(flag: str, value: Any, choices: tuple[Any, ...]) -> None:
    _require(value in choices, f"{flag} {value!r} is not valid; choose one of {', '.join(map(str, choices))}")


def resolve_config(cfg: Cfg, world_size: int, device_type: str = "cpu") -> Cfg:
    """A copy of ``cfg`` with derived sizes filled in, after validating every setting.

    ``device_type`` ("cpu" or "cuda") is where the ranks will compute: it picks the defaults of
    ``training.precision`` (bf16 on CUDA, fp32 on CPU), ``training.compile`` (on with CUDA only) and
    ``zero.overlap_comm`` (on with CUDA, where the reductions run on NCCL streams beside backward; off on CPU,
    where gloo's worker threads would only compete with backward for the same cores).

    Derives ``parallel.dp_size = world_size / (tp * cp * pp)`` when unset, the global batch (``micro * dp *
    accumulation``, accumulation 1 when unset) or the accumulation steps (``global / (micro * dp)``), and
    ``scheduler.decay_steps = train_steps`` when unset. Raises :class:`ConfigError` naming the flag (and the
    DeepSpeed key, where one maps to it) and the fix; last, features that have not landed yet are refused.
    """
    p, m, t, o, s = cfg.parallel, cfg.model, cfg.training, cfg.optimizer, cfg.scheduler
    _require(world_size >= 1, f"world size must be at least 1, got {world_size}")
    positive = (("--tp", p.tp_size), ("--pp", p.pp_size), ("--dp", p.dp_size), ("--cp", p.cp_size),
                ("--virtual-stages", p.virtual_stages), ("--num-layers", m.num_layers),
                ("--hidden-size", m.hidden_size), ("--num-heads", m.num_heads), ("--seq-len", m.seq_len),
                ("--vocab-size", m.vocab_size), ("--num-kv-heads", m.num_kv_heads),
                ("--ffn-hidden-size", m.ffn_size),
                ("--micro-batch-size (train_micro_batch_size_per_gpu)", t.micro_batch_size),
                ("--global-batch-size (train_batch_size)", t.global_batch_size),
                ("gradient_accumulation_steps", t.gradient_accumulation_steps),
                ("--train-steps", t.train_steps), ("--eval-iters", t.eval_iters),
                ("--log-interval (steps_per_print)", cfg.logging.log_interval), ("--keep-last", t.keep_last))
    for flag, value in positive:
        _require(value is None or value >= 1, f"{flag} must be a positive integer, got {value}")

    # Topology: world = tp * cp * pp * dp.
    mp = p.tp_size * p.cp_size * p.pp_size  # the ranks of one data-parallel replica
    cp = f" x --cp {p.cp_size}" if p.cp_size != 1 else ""
    dp = p.dp_size
    if dp is None:
        _require(world_size % mp == 0, f"world size {world_size} is not divisible by --tp {p.tp_size}{cp} x --pp "
                 f"{p.pp_size} = {mp}; launch a multiple of {mp} ranks or change --tp/--cp/--pp")
        dp = world_size // mp
    _require(mp * dp == world_size, f"world size {world_size} != --tp {p.tp_size}{cp} x --pp {p.pp_size} x --dp "
             f"{dp} = {mp * dp}; launch {mp * dp} ranks, or drop --dp to derive it from the world size")
    _require(p.dist_timeout_s > 0, f"--dist-timeout must be positive, got {p.dist_timeout_s}")
    _choice("--backend", p.backend, (None, *BACKENDS))

    # Model shape against TP and PP.
    _require(m.num_heads % p.tp_size == 0, f"--num-heads {m.num_heads} is not divisible by --tp {p.tp_size}; "
             f"each tensor-parallel rank needs whole attention heads, so pick a --tp that divides {m.num_heads}")
    _require(m.hidden_size % m.num_heads == 0, f"--hidden-size {m.hidden_size} is not divisible by "
             f"--num-heads {m.num_heads}; pick a head count that divides the hidden size")
    _check_family(m, p.tp_size)
    _require(0.0 <= m.dropout < 1.0, f"--dropout must be in [0, 1), got {m.dropout}")
    _choice("--pp-schedule", p.pp_schedule, PP_SCHEDULES)
    zbv = p.pp_schedule == "zbv" and p.pp_size > 1
    _require(p.pp_schedule != "zbv" or p.virtual_stages in (1, 2), f"--pp-schedule zbv runs 2 model chunks per "
             f"rank (a V), got --virtual-stages {p.virtual_stages}; leave --virtual-stages out or give 2")
    chunks = p.pp_size * (2 if p.pp_schedule == "zbv" else p.virtual_stages)
    _require(m.num_layers >= chunks, f"--num-layers {m.num_layers} is fewer than the {chunks} pipeline chunks "
             f"(--pp {p.pp_size} x {'2 (zbv)' if zbv else f'--virtual-stages {p.virtual_stages}'}); every chunk "
             f"needs a layer, so lower --pp{'' if zbv else '/--virtual-stages'} or add layers")
    if p.pp_layout is not None:
        _require(len(p.pp_layout) == chunks and sum(p.pp_layout) == m.num_layers and min(p.pp_layout) >= 1,
                 f"--pp-layout {','.join(map(str, p.pp_layout))} needs {chunks} entries (one per pipeline chunk:"
                 f" --pp x {'2 (zbv)' if zbv else '--virtual-stages'}), each >= 1, summing to --num-layers "
                 f"{m.num_layers}")
    _require(p.virtual_stages == 1 or p.pp_schedule in ("interleaved", "zbv"),
             f"--virtual-stages {p.virtual_stages} needs --pp-schedule interleaved")
    _require(p.pp_schedule != "interleaved" or p.pp_size == 1 or p.virtual_stages >= 2,
             "--pp-schedule interleaved needs --virtual-stages >= 2 (use 1f1b for one chunk per rank)")
    _require(not p.sequence_parallel or p.tp_size > 1, "--sequence-parallel needs --tp > 1")
    _require(not p.sequence_parallel or m.seq_len % p.tp_size == 0,
             f"--sequence-parallel needs --seq-len {m.seq_len} divisible by --tp {p.tp_size}")
    _check_context_parallel(cfg)

    # Batch: global = micro * accumulation * dp.
    micro, accum, glob = t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size
    names = (f"--global-batch-size (train_batch_size) {glob}", f"--micro-batch-size "
             f"(train_micro_batch_size_per_gpu) {micro}", f"dp {dp}")
    if micro is None:  # DeepSpeed: train_micro_batch_size_per_gpu = train_batch_size / (accumulation x dp)
        accum = accum or 1
        _require(glob is not None and glob % (accum * dp) == 0, f"{names[0]} is not divisible by "
                 f"gradient_accumulation_steps {accum} x {names[2]}; set --micro-batch-size")
        micro = glob // (accum * dp)
    elif glob is None:
        accum = accum or 1
        glob = micro * dp * accum
    elif accum is None:
        _require(glob % (micro * dp) == 0, f"{names[0]} is not divisible by {names[1]} x {names[2]} = "
                 f"{micro * dp}; choose a global batch that is a multiple of {micro * dp}")
        accum = glob // (micro * dp)
    else:
        hint = f"; use --micro-batch-size {glob // (accum * dp)}" if glob % (accum * dp) == 0 else ""
        _require(glob == micro * accum * dp, f"{names[0]} != {names[1]} x gradient_accumulation_steps {accum} "
                 f"x {names[2]} = {micro * accum * dp}; make them agree or leave one unset to derive it{hint}")
    _require(p.pp_schedule != "interleaved" or p.pp_size == 1 or accum % p.pp_size == 0,
             f"--pp-schedule interleaved needs the micro-batches per step ({accum}) divisible by --pp {p.pp_size}")

    # Optimizer and learning-rate schedule.
    _choice("--optimizer", o.name, OPTIMIZERS)
    _require(o.decoupled_weight_decay == (o.name == "adamw"), f"optimizer name {o.name!r} contradicts "
             f"decoupled_weight_decay={o.decoupled_weight_decay}: 'adamw' is decoupled, 'adam' is L2-style")
    _require(o.lr >= 0, f"--lr must be non-negative, got {o.lr}")
    if o.lr == 0:
        warnings.warn("--lr (optimizer.params.lr) is 0: no step will change the weights, nothing will train; give "
                      "a positive learning rate such as 1e-3", ConfigWarning, stacklevel=2)
    _require(all(0.0 <= b < 1.0 for b in o.betas), f"--adam-beta1/--adam-beta2 must be in [0, 1), got {o.betas}")
    _require(o.eps > 0, f"--adam-eps must be positive, got {o.eps}")
    _require(o.weight_decay >= 0, f"--weight-decay must be non-negative, got {o.weight_decay}")
    _require(o.clip_grad >= 0, f"--clip-grad (gradient_clipping) must be >= 0 (0 disables), got {o.clip_grad}")
    _require(o.max_skipped_steps >= 0, f"--max-skipped-steps must be >= 0 (0 never stops), got {o.max_skipped_steps}")
    _choice("--lr-schedule (scheduler.type)", s.name, SCHEDULES)
    _choice("warmup type (scheduler.params.warmup_type)", s.warmup_type, WARMUP_TYPES)
    _require(s.warmup_type == "linear" or s.name.startswith("warmup_"),
             f"the {s.name} schedule warms up linearly; warmup_type {s.warmup_type!r} needs a DeepSpeed schedule")
    _require(s.warmup_steps >= 0, f"--warmup-steps must be non-negative, got {s.warmup_steps}")
    decay_steps = t.train_steps if s.decay_steps is None else s.decay_steps
    if s.warmup_steps > t.train_steps:  # a short trial run of a long recipe: DeepSpeed trains, so do we
        warnings.warn(f"--warmup-steps (scheduler.params.warmup_num_steps) {s.warmup_steps} exceeds --train-steps "
                      f"{t.train_steps}: the whole run stays in the warm-up", ConfigWarning, stacklevel=2)
    elif decay_steps < s.warmup_steps:  # DeepSpeed's WarmupDecayLR warns about this too
        warnings.warn(f"--lr-decay-steps (scheduler.params.total_num_steps) {decay_steps} is before the end of the "
                      f"warm-up (--warmup-steps {s.warmup_steps}): the lr decays right after the warm-up",
                      ConfigWarning, stacklevel=2)
    _require(0.0 <= s.warmup_min_lr <= o.lr, f"scheduler.params.warmup_min_lr {s.warmup_min_lr} must be in "
             f"[0, --lr {o.lr}]")
    if s.name == "cosine":
        _require(s.min_lr >= 0, f"--min-lr must be non-negative, got {s.min_lr}")
        _require(s.min_lr <= o.lr, f"--min-lr {s.min_lr} exceeds --lr {o.lr}; the decay ends at --min-lr")
    for key, ratio in (("warmup_min_ratio", s.warmup_min_ratio), ("cos_min_ratio", s.min_ratio)):
        _require(0.0 <= ratio <= 1.0, f"scheduler.params.{key} must be in [0, 1], got {ratio}")

    # Precision and fp16 loss scaling; device-dependent defaults.
    _choice("device type", device_type, ("cpu", "cuda"))
    split = cfg.parallel.pp_size > 1 and cfg.parallel.pp_schedule in ("zb-h1", "zbv")  # B/W split backward
    t = replace(t, precision=t.precision or ("bf16" if device_type == "cuda" else "fp32"),
                compile=(device_type == "cuda" and cfg.zero.stage != 3 and not split) if t.compile is None
                else t.compile)
    _choice("--precision", t.precision, PRECISIONS)
    _require(t.peak_tflops is None or t.peak_tflops > 0, f"--peak-tflops must be positive, got {t.peak_tflops}")
    _require(not (t.compile and cfg.zero.stage == 3), "--compile with --zero-stage 3 is not supported yet (stage "
             "3's gather/release hooks sit inside the compiled blocks); pass --no-compile")
    _require(not (t.compile and split), f"--compile with --pp-schedule {cfg.parallel.pp_schedule} is not supported "
             "yet (the split backward's deferring linears sit inside the compiled blocks); pass --no-compile")
    ls = cfg.loss_scale
    if t.precision == "fp16":
        _require(ls.loss_scale >= 0, f"fp16.loss_scale must be >= 0 (0 is dynamic), got {ls.loss_scale}")
        _require(0 <= ls.initial_scale_power < 128, f"fp16.initial_scale_power must be in [0, 127] so that "
                 f"2**power fits in fp32, got {ls.initial_scale_power}")
        _require(ls.loss_scale_window >= 1, f"fp16.loss_scale_window must be >= 1, got {ls.loss_scale_window}")
        _require(ls.hysteresis >= 1, f"fp16.hysteresis must be >= 1, got {ls.hysteresis}")
        _require(ls.min_loss_scale > 0, f"fp16.min_loss_scale must be positive, got {ls.min_loss_scale}")
        _require(ls.loss_scale > 0 or ls.min_loss_scale <= 2.0**ls.initial_scale_power,
                 f"fp16.min_loss_scale {ls.min_loss_scale} exceeds the initial dynamic scale "
                 f"2**{ls.initial_scale_power}; lower min_loss_scale or raise initial_scale_power")

    # ZeRO, activation checkpointing, logging, checkpoints.
    z = cfg.zero
    _choice("--zero-stage (zero_optimization.stage)", z.stage, (0, 1, 2, 3))
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_max_live_parameters"):
        value = getattr(z, key)
        auto = value is None and key == "reduce_bucket_size"  # derived from the model (ZeroConfig.bucket_numel)
        _require(auto or (value is not None and value >= 1), f"zero_optimization.{key} must be positive, got {value}")
    _require(z.max_inflight_buckets >= 1, f"--max-inflight-buckets must be >= 1, got {z.max_inflight_buckets}")
    _choice("--grad-dtype (communication_data_type, data_types.grad_accum_dtype)", z.grad_dtype,
            (*GRAD_DTYPES, "bf16", "fp16"))
    _require(z.grad_dtype not in ("bf16", "fp16") or z.grad_dtype == t.precision,
             f"gradients in {z.grad_dtype} (communication_data_type / data_types.grad_accum_dtype) with --precision "
             f"{t.precision}: megazero keeps gradients in fp32 or in the model dtype; use fp32 or {t.precision}")
    _require(z.stage3_param_persistence_threshold >= 0, "zero_optimization.stage3_param_persistence_threshold "
             f"must be >= 0, got {z.stage3_param_persistence_threshold}")
    _require(z.stage3_max_reuse_distance >= 0, "zero_optimization.stage3_max_reuse_distance must be >= 0, got "
             f"{z.stage3_max_reuse_distance}")
    for key in ("offload_optimizer", "offload_param"):
        _choice(f"zero_optimization.{key}.device", getattr(z, key), (None, "cpu"))
    _require(z.offload_param is None or z.stage == 3, "zero_optimization.offload_param needs ZeRO stage 3 "
             f"(--zero-stage 3), got stage {z.stage}")
    _require(z.offload_optimizer is None or z.stage >= 1, "zero_optimization.offload_optimizer needs ZeRO "
             "stage >= 1 (--zero-stage)")
    _require(not z.offload_delayed_update or z.offload_optimizer == "cpu", "--offload-delayed-update runs the "
             "offloaded host Adam one step late: it needs --offload-optimizer (zero_optimization.offload_optimizer."
             "device cpu)")
    _require(z.offload_delayed_update_after >= 0, "--offload-delayed-update-after must be >= 0, got "
             f"{z.offload_delayed_update_after}")
    _check_zeropp(cfg, world_size)
    ac = cfg.activation_checkpointing
    _choice("--activation-checkpointing", ac.mode, CHECKPOINTING_MODES)
    _require(ac.mode != "none" or not (ac.partition_activations or ac.cpu_checkpointing),
             "activation_checkpointing.partition_activations/cpu_checkpointing need --activation-checkpointing "
             "full or selective")
    _require(not ac.partition_activations or ac.mode != "selective",
             "activation_checkpointing.partition_activations splits the TP-replicated layer inputs that "
             "--activation-checkpointing full keeps; selective recomputation keeps q, k, v, which are already "
             "split over TP ranks by head: use --activation-checkpointing full or drop partition_activations")
    _require(not ac.partition_activations or not (p.sequence_parallel and p.tp_size > 1),
             "activation_checkpointing.partition_activations has nothing to split with --sequence-parallel: the "
             "layer inputs are already sequence shards, 1/tp per rank (Megatron-LM refuses the pair too); drop "
             "partition_activations or --sequence-parallel")
    _choice("--wandb-mode", cfg.logging.wandb_mode, (None, *WANDB_MODES))
    _require(cfg.logging.sample_prompts is None or os.path.isfile(cfg.logging.sample_prompts),
             f"--sample-prompts {cfg.logging.sample_prompts}: no such file (give a text file, one prompt a line)")
    _require(cfg.logging.sample_tokens >= 1, f"--sample-tokens must be >= 1, got {cfg.logging.sample_tokens}")
    _require(t.eval_interval >= 0, f"--eval-interval must be >= 0 (0 disables), got {t.eval_interval}")
    _require(t.save_interval >= 0, f"--save-interval must be >= 0, got {t.save_interval}")
    _require(t.save_interval == 0 or t.save is not None, "--save-interval needs --save DIR")
    _require(t.keep_last is None or t.save is not None, "--keep-last needs --save DIR")
    _require(t.load != "auto" or t.save is not None,
             "--load auto resumes from the newest checkpoint under --save DIR; pass --save DIR too")
    _require(0.0 <= cfg.data.eval_fraction < 1.0, f"data eval_fraction must be in [0, 1), got "
             f"{cfg.data.eval_fraction}")

    overlap = device_type == "cuda" if z.overlap_comm is None else z.overlap_comm  # an explicit setting wins
    resolved = replace(cfg, parallel=replace(p, dp_size=dp), zero=replace(z, overlap_comm=overlap),
                       training=replace(t, micro_batch_size=micro, global_batch_size=glob,
                                        gradient_accumulation_steps=accum),
                       scheduler=replace(s, decay_steps=decay_steps))
    _check_not_yet_supported(resolved)
    return resolved


def _check_zeropp(cfg: Any, world_size: int) -> None:
    """ZeRO++ settings that cannot apply fail here, one line each naming the fix (megazero/zero/qgz.py)."""
    z, p = cfg.zero, cfg.parallel
    rpn = p.ranks_per_node
    _require(rpn is None or (rpn >= 1 and world_size % rpn == 0),
             f"--ranks-per-node {rpn} does not divide the world size {world_size}; launch whole nodes")
    _require(z.zero_hpz_partition_size >= 1, "--zero-hpz-partition-size (zero_optimization.zero_hpz_partition_size) "
             f"must be >= 1, got {z.zero_hpz_partition_size}")
    _require(z.zero_hpz_partition_size == 1 or z.stage == 3, f"--zero-hpz-partition-size "
             f"{z.zero_hpz_partition_size} (hpZ) partitions ZeRO-3's weights: use --zero-stage 3, got {z.stage}")
    _require(not z.zero_quantized_weights or z.stage == 3, "--zero-quantized-weights (qwZ) quantizes ZeRO-3's "
             f"weight all-gathers: use --zero-stage 3, got {z.stage}")
    _require(not z.zero_quantized_gradients or z.stage >= 2, "--zero-quantized-gradients (qgZ) replaces the "
             f"gradient reduce-scatter of ZeRO stages 2-3: use --zero-stage 2 or 3, got {z.stage}")
    _require(not z.zero_quantized_gradients or z.reduce_scatter, "--zero-quantized-gradients (qgZ) replaces the "
             "reduce-scatter: drop zero_optimization.reduce_scatter false")
    _choice("--zero-quantized-gradients-bits", z.zero_quantized_gradients_bits, (4, 8))
    if z.zero_hpz_partition_size > 1 or z.zero_quantized_gradients:
        local = (rpn or int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
        dp = p.dp_size or world_size // (p.tp_size * p.pp_size * p.cp_size)
        # the ZeRO (dp x cp) group of rank 0 (TP fastest, then CP, then DP): its members on the first node
        zero_per_node = sum((d * p.cp_size + c) * p.tp_size < local for d in range(dp) for c in range(p.cp_size))
        _require(z.zero_hpz_partition_size == 1 or zero_per_node % z.zero_hpz_partition_size == 0,
                 f"--zero-hpz-partition-size (zero_hpz_partition_size) {z.zero_hpz_partition_size} does not divide "
                 f"the {zero_per_node} ZeRO "
                 f"(dp x cp) ranks per node (--ranks-per-node {local} with tp {p.tp_size}); "
                 f"use a divisor of {zero_per_node}")


def _check_family(m: Any, tp: int) -> None:
    """The model family's choices (``--arch``) against each other and against ``--tp``."""
    _choice("--arch", m.arch, ARCHS)
    if m.arch == "gpt2":
        _require(m.kv_heads == m.num_heads, f"--num-kv-heads {m.num_kv_heads} needs --arch llama: GPT-2 has "
                 f"one key/value head per query head (--num-heads {m.num_heads})")
        _require(m.tied, "--no-tie-embeddings needs --arch llama: GPT-2's output layer is its token embedding")
    _require(m.num_heads % m.kv_heads == 0, f"--num-heads {m.num_heads} is not divisible by --num-kv-heads "
             f"{m.kv_heads}; grouped-query attention shares each key/value head among the same number of "
             "query heads, so pick a --num-kv-heads that divides --num-heads")
    _require(m.kv_heads % tp == 0 or tp % m.kv_heads == 0, f"--num-kv-heads {m.kv_heads} and --tp {tp} do not "
             "divide one another; each tensor-parallel rank holds whole key/value heads, or one head shared by "
             f"tp / {m.kv_heads} ranks, so pick a --tp that divides {m.kv_heads} or a multiple of it")
    _require(m.ffn_hidden_size % tp == 0, f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by --tp {tp}; "
             "each tensor-parallel rank holds an equal slice of the MLP, so pick a width that --tp divides")
    _require(m.arch != "llama" or m.head_dim % 2 == 0, f"--hidden-size {m.hidden_size} / --num-heads "
             f"{m.num_heads} = {m.head_dim}: rotary embeddings rotate pairs of features, so the head size must be "
             "even")
    _require(m.rope_theta > 0, f"--rope-theta must be positive, got {m.rope_theta}")
    _require(m.layernorm_eps > 0, f"--norm-eps must be positive, got {m.layernorm_eps}")


def _check_context_parallel(cfg: Any) -> None:
    """``--cp`` against the sequence, SP, dropout and generation: each CP rank holds chunks i and 2cp-1-i of
    2·cp equal chunks, and under SP its S/cp tokens are split again over TP."""
    p, m = cfg.parallel, cfg.model
    _choice("--cp-attention", p.cp_attention, CP_ATTENTION_MODES)
    if p.cp_size == 1:
        return
    _require(m.seq_len % (2 * p.cp_size) == 0, f"--cp {p.cp_size} needs --seq-len {m.seq_len} divisible by 2 x cp "
             f"= {2 * p.cp_size}: context parallelism cuts each sequence into 2 x cp equal chunks; pick a --seq-len "
             f"that is a multiple of {2 * p.cp_size} or another --cp")
    _require(not p.sequence_parallel or (m.seq_len // p.cp_size) % p.tp_size == 0,
             f"--sequence-parallel with --cp {p.cp_size} splits each rank's {m.seq_len // p.cp_size} tokens "
             f"(--seq-len {m.seq_len} / cp) over --tp {p.tp_size}; pick a --seq-len divisible by cp x tp = "
             f"{p.cp_size * p.tp_size} and by 2 x cp")
    _require(m.dropout == 0, f"--dropout {m.dropout} with --cp {p.cp_size}: context-parallel attention has no "
             "attention dropout; use --dropout 0 (or --cp 1)")
    _require(cfg.logging.sample_prompts is None, f"--sample-prompts with --cp {p.cp_size}: generation runs at cp 1 "
             "(decoding adds one token at a time, there is no sequence to split); drop --sample-prompts, or sample "
             "from a saved checkpoint with tools/generate.py (checkpoints do not depend on cp)")


def _check_not_yet_supported(cfg: Cfg) -> None:
    """Refuse valid settings whose implementation has not landed; each line goes when its feature lands."""
    missing: list[str] = []
    if missing:
        raise ConfigError("; ".join(f"{item} is not supported yet" for item in missing)
                          + " by megazero; drop these settings for now")
