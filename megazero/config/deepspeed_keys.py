"""The DeepSpeed config keys megazero knows, as explicit tables: every key falls in exactly one of four classes.

(a) ``SUPPORTED_KEYS``: mapped onto a megazero setting, with DeepSpeed's meaning.
(b) ``IGNORED_KEYS``: accepted with a one-line :class:`~megazero.config.errors.ConfigWarning`; only keys that
    cannot change what is trained (logging, profiling, performance knobs, NVMe/IO tuning, save formats).
(c) ``NOT_SUPPORTED_KEYS``: recognised, but megazero cannot do it yet -> :class:`ConfigError` naming the key
    and what to use instead (``ALTERNATIVES``). A value that requests nothing (DeepSpeed's default, e.g.
    ``"sparse_gradients": false`` or a block with ``"enabled": false``) is accepted with a warning instead.
(d) anything else: unknown. At the top level DeepSpeed reads the keys it knows and ignores the rest, so
    megazero does too, with one warning naming them all (with a "did you mean" where one is close). Inside a
    block DeepSpeed's pydantic models refuse unknown keys, so megazero raises ConfigError naming the path.

Nested keys are classified by their full dotted path (``zero_optimization.offload_optimizer.device``). The
optimizer and scheduler types, and each scheduler's parameters, have tables of their own. The translation that
walks a file against these tables is :mod:`megazero.config.deepspeed`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "ADAM_TYPES",
    "ALTERNATIVES",
    "AUTO",
    "IGNORED_KEYS",
    "NOT_SUPPORTED_KEYS",
    "NOT_SUPPORTED_OPTIMIZERS",
    "NOT_SUPPORTED_SCHEDULERS",
    "SCHEDULER_NAMES",
    "SCHEDULER_PARAMS",
    "SUPPORTED_KEYS",
    "children",
    "is_inert",
]

AUTO = "auto"  # as in the Hugging Face integration: take the value from the command line or the default
_DISABLED = object()  # NOT_SUPPORTED_KEYS value: inert when the block is absent-or-false "enabled"
_NEVER = object()  # NOT_SUPPORTED_KEYS value: no value is inert

# (a) Keys megazero reads. A block key (``zero_optimization``) makes its children classifiable.
SUPPORTED_KEYS: frozenset[str] = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "steps_per_print",
    "optimizer", "optimizer.type", "optimizer.params", "optimizer.params.lr", "optimizer.params.betas",
    "optimizer.params.eps", "optimizer.params.weight_decay", "optimizer.params.adam_w_mode",
    "scheduler", "scheduler.type", "scheduler.params", "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps", "scheduler.params.warmup_type",
    "scheduler.params.total_num_steps", "scheduler.params.warmup_min_ratio", "scheduler.params.cos_min_ratio",
    "fp16", "fp16.enabled", "fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window",
    "fp16.hysteresis", "fp16.min_loss_scale",
    "bf16", "bf16.enabled", "bfloat16", "bfloat16.enabled",  # bfloat16 is DeepSpeed's older spelling
    "zero_optimization", "zero_optimization.stage", "zero_optimization.reduce_bucket_size",
    "zero_optimization.allgather_bucket_size", "zero_optimization.overlap_comm",
    "zero_optimization.reduce_scatter", "zero_optimization.contiguous_gradients",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.zero_hpz_partition_size", "zero_optimization.zero_quantized_weights",
    "zero_optimization.zero_quantized_gradients",
    "zero_optimization.offload_optimizer", "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.offload_param", "zero_optimization.offload_param.device",
    "zero_optimization.offload_param.pin_memory",
    "activation_checkpointing", "activation_checkpointing.partition_activations",
    "activation_checkpointing.cpu_checkpointing",
    "communication_data_type", "data_types", "data_types.grad_accum_dtype",
})

# (b) Keys accepted and ignored, with why that is harmless. A block here is ignored whole.
IGNORED_KEYS: Mapping[str, str] = MappingProxyType({
    "wall_clock_breakdown": "timing report", "dump_state": "debug print", "memory_breakdown": "memory report",
    "flops_profiler": "profiler", "tensorboard": "logging sink", "csv_monitor": "logging sink",
    "wandb": "logging sink; use --wandb-project", "comet": "logging sink", "comms_logger": "logging",
    "zero_allow_untested_optimizer": "safety switch", "zero_force_ds_cpu_optimizer": "safety switch",
    "prescale_gradients": "only moves the 1/dp division before the reduction",
    "aio": "NVMe I/O tuning", "checkpoint": "DeepSpeed checkpoint-engine options",
    "optimizer.params.torch_adam": "kernel choice", "optimizer.params.fused": "kernel choice",
    "fp16.auto_cast": "input casting; megazero casts inside the model",
    "zero_optimization.round_robin_gradients": "offload copy order",
    "zero_optimization.sub_group_size": "optimizer step granularity",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "save format",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "save format",
    "zero_optimization.load_from_fp32_weights": "DeepSpeed checkpoint loading",
    "zero_optimization.allgather_partitions": "all-gather vs broadcasts: same result",
    "zero_optimization.elastic_checkpoint": "DeepSpeed checkpoint format",
    "zero_optimization.ignore_unused_parameters": "GPT uses every parameter",
    "zero_optimization.grad_hooks": "reduction timing", "zero_optimization.cpu_offload_use_pin_memory": "pinning",
    "zero_optimization.memory_efficient_linear": "kernel choice",
    "zero_optimization.use_multi_rank_bucket_allreduce": "reduction scheduling",
    "zero_optimization.offload_optimizer.nvme_path": "NVMe only",
    "zero_optimization.offload_optimizer.buffer_count": "NVMe only",
    "zero_optimization.offload_optimizer.fast_init": "NVMe only",
    "zero_optimization.offload_param.nvme_path": "NVMe only",
    "zero_optimization.offload_param.buffer_count": "NVMe only",
    "zero_optimization.offload_param.buffer_size": "NVMe only",
    "zero_optimization.offload_param.max_in_cpu": "NVMe only",
    "activation_checkpointing.contiguous_memory_optimization": "memory layout",
    "activation_checkpointing.number_checkpoints": "buffer sizing",
    "activation_checkpointing.synchronize_checkpoint_boundary": "CUDA sync for timing",
    "activation_checkpointing.profile": "timing report",
})

# (c) Keys recognised but not supported yet, with the value that requests nothing (accepted with a warning).
NOT_SUPPORTED_KEYS: Mapping[str, object] = MappingProxyType({
    "amp": _DISABLED, "sparse_attention": _NEVER, "pipeline": _NEVER, "curriculum_learning": _DISABLED,
    "data_efficiency": _DISABLED, "compression_training": _NEVER, "elasticity": _DISABLED,
    "autotuning": _DISABLED, "eigenvalue": _DISABLED, "progressive_layer_drop": _DISABLED,
    "quantize_training": _DISABLED, "hybrid_engine": _DISABLED, "nebula": _DISABLED,
    "seq_parallel_communication_data_type": None, "fp32_allreduce": False,
    "sparse_gradients": False, "gradient_predivide_factor": 1.0,
    "optimizer.params.amsgrad": False, "optimizer.params.bias_correction": True,
    "scheduler.params.last_batch_iteration": -1,
    "fp16.fp16_master_weights_and_grads": False, "fp16.consecutive_hysteresis": False,  # changes the scaler
    "zero_optimization.zero_quantized_nontrainable_weights": False, "zero_optimization.mics_shard_size": -1,
    "zero_optimization.mics_hierarchical_params_gather": False, "zero_optimization.cpu_offload": False,
    "zero_optimization.cpu_offload_params": False, "zero_optimization.legacy_stage1": False,
    "zero_optimization.offload_optimizer.ratio": 1.0,
})

# What to use instead of a NOT_SUPPORTED_KEYS entry (default: remove it).
ALTERNATIVES: Mapping[str, str] = MappingProxyType({
    "amp": 'use "bf16": {"enabled": true} (or "fp16") instead of Apex AMP',
    "sparse_attention": "remove the block: megazero's attention is dense (and DeepSpeed 0.19 removed it)",
    "pipeline": "use --pp N (and --pp-schedule, --virtual-stages) for pipeline parallelism",
    "curriculum_learning": "remove it; megazero samples fixed-length sequences",
    "data_efficiency": "remove it; megazero samples fixed-length sequences",
    "elasticity": "fix the world size; torchrun --max-restarts with --load auto resumes a failed job",
    "autotuning": "tools/plan.py searches topologies, micro-batch and ZeRO stage with the memory estimator",
    "fp32_allreduce": "remove it: bf16 gradients are reduced in fp32 by default",
    "zero_optimization.cpu_offload": 'use "offload_optimizer": {"device": "cpu"}',
    "zero_optimization.cpu_offload_params": 'use "offload_param": {"device": "cpu"}',
    "zero_optimization.legacy_stage1": 'remove it; "stage": 1 is the partitioned-optimizer stage',
    "zero_optimization.offload_optimizer.ratio": "remove it: the whole optimizer state is offloaded",
    "scheduler.params.last_batch_iteration": "resume with --load, which restores the step",
    "optimizer.params.amsgrad": "remove it; megazero's Adam/AdamW has no AMSGrad variant",
    "optimizer.params.bias_correction": "remove it; Adam is always bias-corrected",
    "fp16.fp16_master_weights_and_grads": "remove it; master weights stay in fp32",
})

ADAM_TYPES = ("adam", "adamw")
NOT_SUPPORTED_OPTIMIZERS = frozenset({
    "onebitadam", "zerooneadam", "onebitlamb", "lamb", "lion", "adagrad", "sgd", "muadam", "muadamw", "musgd",
    "adamax", "adadelta", "nadam", "radam", "rmsprop", "asgd", "sparseadam", "lbfgs", "adafactor",
})
# Scheduler type -> its parameters (DeepSpeed's constructor signatures).
SCHEDULER_PARAMS: Mapping[str, frozenset[str]] = MappingProxyType({
    "WarmupLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                           "last_batch_iteration"}),
    "WarmupDecayLR": frozenset({"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                "total_num_steps", "last_batch_iteration"}),
    "WarmupCosineLR": frozenset({"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                                 "warmup_type", "last_batch_iteration"}),
})
SCHEDULER_NAMES = MappingProxyType({"WarmupLR": "warmup_lr", "WarmupDecayLR": "warmup_decay_lr",
                                    "WarmupCosineLR": "warmup_cosine_lr"})
NOT_SUPPORTED_SCHEDULERS = frozenset({"OneCycle", "LRRangeTest"})


def children(prefix: str, keys: Iterable[str] | None = None) -> list[str]:
    """Names of the keys one level below ``prefix`` ("" for the top level) in the tables."""
    keys = [*SUPPORTED_KEYS, *IGNORED_KEYS, *NOT_SUPPORTED_KEYS] if keys is None else keys
    depth = prefix.count(".") + 1 if prefix else 0
    return sorted({k.split(".")[depth] for k in keys if (k.startswith(prefix + ".") or not prefix)
                   and k.count(".") >= depth})


def is_inert(value: Any, inert: object) -> bool:
    """Whether a NOT_SUPPORTED_KEYS value requests nothing ("auto" never requests anything)."""
    if value == AUTO:
        return True
    if inert is _NEVER:
        return False
    if inert is _DISABLED:
        return isinstance(value, Mapping) and value.get("enabled", False) in (False, AUTO)
    if isinstance(inert, bool) or inert is None:
        return value is inert
    return not isinstance(value, bool) and value == inert
