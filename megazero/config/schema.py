"""Typed configuration: the dataclasses of a run, one per section, and the model presets.

A :class:`Config` is filled from command-line flags and/or a DeepSpeed-style JSON file, then resolved against
the world::

    cfg = parse_args()                    # flags (+ --deepspeed-config FILE), not yet resolved
    cfg = cfg.resolve(world_size)         # derives dp / accumulation / decay steps, validates everything

Resolution and validation live in :mod:`megazero.config.resolve`, the command line in
:mod:`megazero.config.cli`, the DeepSpeed JSON mapping in :mod:`megazero.config.deepspeed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megazero.config.errors import ConfigError, ConfigWarning
from megazero.config.resolve import ARCHS, resolve_config

__all__ = [
    "ARCHS",
    "ActivationCheckpointingConfig",
    "Config",
    "ConfigError",
    "ConfigWarning",
    "DataConfig",
    "LoggingConfig",
    "LossScaleConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PRESETS",
    "SchedulerConfig",
    "TrainingConfig",
    "ZeroConfig",
    "model_preset",
]



@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of one model family (``arch``), a small set of choices over one block:

    * ``gpt2``: pre-LayerNorm, learned positions, tanh-GELU MLP of 4H, biases, tied input/output embedding;
    * ``llama``: pre-RMSNorm, rotary positions (``rope_theta``, ``rope_scaling``), SwiGLU MLP, grouped-query attention
      (``num_kv_heads``), no biases, an untied output layer unless ``tie_embeddings``.

    Fields left None take the family's default, read through the properties (``kv_heads``,
    ``ffn_hidden_size``, ``tied``), so overriding a preset's shape re-derives them. ``layernorm_eps`` is the
    epsilon of either norm (``--norm-eps``).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int
    vocab_size: int
    dropout: float = 0.0
    layernorm_eps: float = 1e-5
    init_std: float = 0.02
    arch: str = "gpt2"
    num_kv_heads: int | None = None  # None: num_heads (multi-head attention)
    ffn_size: int | None = None  # None: 4H (gpt2), 8H/3 rounded up to a multiple of 256 (llama)
    rope_theta: float = 10000.0  # base of the rotary frequencies (llama)
    tie_embeddings: bool | None = None  # None: tied for gpt2, untied for llama
    # Llama 3.1's rope scaling (Hugging Face rope_type "llama3"), off while the factor is None; see rope_scaling
    rope_scaling_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_positions: int | None = None  # llama: the longest context the model is made for (None: seq_len)

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention shares each among num_heads / kv_heads query heads)."""
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn_hidden_size(self) -> int:
        if self.ffn_size is not None:
            return self.ffn_size
        if self.arch == "llama":  # Llama's SwiGLU width: 2/3 of 4H, rounded up to a multiple of 256
            return -(-int(8 * self.hidden_size / 3) // 256) * 256
        return 4 * self.hidden_size

    @property
    def tied(self) -> bool:
        """Whether the output layer is the token embedding (else a separate ``lm_head``)."""
        return self.arch == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rope_scaling(self) -> tuple[float, float, float, int] | None:
        """Llama 3.1's rope scaling as ``(factor, low_freq_factor, high_freq_factor, original_max_positions)``,
        None when off: rotary wavelengths above ``original / low`` tokens are stretched ``factor`` times, those
        below ``original / high`` kept, those between blended (:func:`megazero.model.layers.rotary_frequencies`).
        Set by presets and ``--init-from`` (config.json's ``rope_scaling``), not by flags; ``max_positions``
        (Hugging Face's ``max_position_embeddings``) only travels with the weights: rotary tables have no length,
        and ``seq_len`` is what a run trains at."""
        if self.rope_scaling_factor is None:
            return None
        return (self.rope_scaling_factor, self.rope_low_freq_factor, self.rope_high_freq_factor,
                self.rope_original_max_positions)

    def num_parameters(self) -> int:
        """Parameters of the unpadded model, a tied embedding counted once."""
        h, v, s, n, f = self.hidden_size, self.vocab_size, self.seq_len, self.num_layers, self.ffn_hidden_size
        kv = self.kv_heads * self.head_dim
        if self.arch == "llama":  # RMSNorm weights, q/k/v/o, gate/up/down; no biases, no position table
            per_layer = 2 * h + h * (h + 2 * kv) + h * h + 3 * h * f
            return n * per_layer + v * h * (1 if self.tied else 2) + h
        per_layer = 4 * h * h + 2 * h * f + 9 * h + f  # qkv, proj, fc, proj; their biases and two LayerNorms
        return n * per_layer + v * h * (1 if self.tied else 2) + s * h + 2 * h


PRESETS: dict[str, ModelConfig] = {
    # 4 layers x 128 wide: ~0.93M parameters with a 1024-token vocabulary, small enough for CPU tests.
    "tiny": ModelConfig(num_layers=4, hidden_size=128, num_heads=4, seq_len=128, vocab_size=1024),
    "gpt2-124m": ModelConfig(num_layers=12, hidden_size=768, num_heads=12, seq_len=1024, vocab_size=50257),
    "gpt2-350m": ModelConfig(num_layers=24, hidden_size=1024, num_heads=16, seq_len=1024, vocab_size=50257),
    "gpt2-760m": ModelConfig(num_layers=24, hidden_size=1536, num_heads=16, seq_len=1024, vocab_size=50257),
    "gpt2-1.3b": ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, seq_len=1024, vocab_size=50257),
    # tiny's size as a Llama (4 query heads on 2 KV heads, SwiGLU 384): ~1.05M parameters, the built-in
    # tokenizer's vocabulary
    "llama-tiny": ModelConfig(num_layers=4, hidden_size=128, num_heads=4, seq_len=128, vocab_size=1024,
                              arch="llama", num_kv_heads=2, ffn_size=384, rope_theta=500000.0),
    # the published config.json shapes (meta-llama on Hugging Face); seq_len is the pre-training context (Llama
    # 3.2's 131072 positions come from its rope scaling: factor 32 over the original 8192)
    "llama-3.2-1b": ModelConfig(num_layers=16, hidden_size=2048, num_heads=32, seq_len=8192, vocab_size=128256,
                                arch="llama", num_kv_heads=8, ffn_size=8192, rope_theta=500000.0,
                                tie_embeddings=True, rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                                rope_high_freq_factor=4.0, rope_original_max_positions=8192, max_positions=131072),
    "llama-3-8b": ModelConfig(num_layers=32, hidden_size=4096, num_heads=32, seq_len=8192, vocab_size=128256,
                              arch="llama", num_kv_heads=8, ffn_size=14336, rope_theta=500000.0),
    "llama-3-70b": ModelConfig(num_layers=80, hidden_size=8192, num_heads=64, seq_len=8192, vocab_size=128256,
                               arch="llama", num_kv_heads=8, ffn_size=28672, rope_theta=500000.0),
}


def model_preset(name: str, **overrides: int | float | None) -> ModelConfig:
    """A preset with the given fields replaced (``None`` values are ignored)."""
    if name not in PRESETS:
        raise ConfigError(f"--model {name!r} is not a known preset; choose one of {', '.join(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass
class ParallelConfig:
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int | None = None  # None: world_size // (tp * cp * pp)
    cp_size: int = 1  # context parallel: each sample's sequence split over cp ranks (2·cp load-balanced chunks)
    cp_attention: str = "ring"  # ring | allgather: how attention sees the whole split sequence
    sequence_parallel: bool = False
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 | zbv
    virtual_stages: int = 1
    pp_layout: list[int] | None = None  # layers per (virtual) stage; None: balanced
    backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    dist_timeout_s: float = 300.0
    ranks_per_node: int | None = None  # None: torchrun's LOCAL_WORLD_SIZE (one node without it); ZeRO++, planner


@dataclass
class ZeroConfig:
    """DeepSpeed's ``zero_optimization`` block (sizes in elements).

    ``reduce_bucket_size`` None (the default) derives the gradient bucket from the model, see
    :meth:`bucket_numel`; a value set here, by ``--reduce-bucket-size`` or in a DeepSpeed config is used as given.
    """

    stage: int = 0
    reduce_bucket_size: int | None = None  # None: auto (bucket_numel), else elements per gradient bucket
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None  # None: on with CUDA, off on CPU (resolve_config)
    reduce_scatter: bool = True
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    # keep a recomputed block gathered for its backward, and a chunk's own units from forward to backward (0: neither)
    stage3_max_reuse_distance: int = 1_000_000_000
    offload_optimizer: str | None = None  # "cpu": master weights and Adam moments in host memory
    offload_param: str | None = None  # "cpu": ZeRO-3 parameter shards in host memory
    offload_optimizer_pin_memory: bool = False  # zero_optimization.offload_optimizer.pin_memory
    offload_param_pin_memory: bool = False  # zero_optimization.offload_param.pin_memory
    # ZeRO-Offload's one-step delayed parameter update (megazero/zero/offload.py): the host Adam of step t runs in a
    # background thread while the device computes step t + 1, and lands at the next step boundary
    offload_delayed_update: bool = False
    offload_delayed_update_after: int = 0  # optimizer steps run synchronously before the delay starts
    max_inflight_buckets: int = 2  # stage 2: buckets being filled or reduced at once (staging buffers)
    grad_dtype: str = "auto"  # accumulate/reduce gradients in: auto (fp32 for bf16, else model), fp32, model
    # ZeRO++ (megazero/zero/stage3/hpz.py, megazero/zero/qgz.py)
    zero_hpz_partition_size: int = 1  # hpZ: ranks of a node over which a secondary 16-bit copy is partitioned
    zero_quantized_weights: bool = False  # qwZ: INT8 block-quantized weight all-gathers (stage 3)
    zero_quantized_gradients: bool = False  # qgZ: block-quantized hierarchical all-to-all gradients (stages 2-3)
    zero_quantized_gradients_bits: int = 4  # qgZ's INT4, or INT8

    def bucket_numel(self, psi: int, dp_size: int) -> int:
        """Elements per gradient bucket for a rank holding ``psi`` trainable parameters in a DP group of
        ``dp_size``: ``min(reduce_bucket_size, allgather_bucket_size)`` when ``reduce_bucket_size`` is set.

        Otherwise (auto) Megatron-LM's DDP bucket, ``max(40M, 1M x dp)`` elements, at stages 0-1 (the full
        gradient exists anyway; buckets only pace the reduction) and DeepSpeed's default 5e8 at stage 3. At
        stage 2 the staging pool is what the rank holds beyond the formula's ``(2 + g + 12)Ψ/Nd``: one buffer
        (each bucket's reduction completes before the next opens) or, with ``overlap_comm``,
        ``max_inflight_buckets`` of them. The bucket is Ψ/16 divided by that number (the pool at most Ψ/16
        elements: 0.25Ψ bytes in fp32, under 4% of stage 2's 7Ψ at dp 4), at least 2^20 elements (4 MB in
        fp32, so small models are not latency bound) and at most Megatron-LM's bucket.
        """
        if self.reduce_bucket_size is not None:
            return min(self.reduce_bucket_size, self.allgather_bucket_size)
        if self.stage >= 3:
            return min(500_000_000, self.allgather_bucket_size)
        largest = max(40_000_000, 1_000_000 * dp_size)
        if self.stage == 2:
            buffers = self.max_inflight_buckets if self.overlap_comm else 1
            largest = min(largest, max(1 << 20, -(-psi // (16 * buffers))))
        return min(largest, self.allgather_bucket_size)


@dataclass
class OptimizerConfig:
    """Adam family. ``decoupled_weight_decay`` True is AdamW (DeepSpeed's "Adam" default, ``adam_w_mode``).

    ``name`` and ``decoupled_weight_decay`` must agree ("adamw" <-> True, "adam" <-> False, L2-style decay);
    the flag and the DeepSpeed loader set both.
    """

    name: str = "adamw"  # adam | adamw
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    decoupled_weight_decay: bool = True
    clip_grad: float = 1.0  # 0 disables clipping
    max_skipped_steps: int = 10  # stop after this many consecutive non-finite-norm steps (no loss scaler); 0 never


@dataclass
class SchedulerConfig:
    """Learning-rate schedule. ``cosine`` is DESIGN.md's default (warm-up, cosine to min_lr, then flat).

    The peak lr is always ``OptimizerConfig.lr``. ``warmup_min_lr`` is where a warm-up starts (cosine,
    constant, warmup_lr, warmup_decay_lr; the DeepSpeed ones also decay back to it). ``warmup_min_ratio`` and
    ``min_ratio`` are DeepSpeed WarmupCosineLR's ``warmup_min_ratio`` and ``cos_min_ratio``: start and end
    of that schedule as fractions of the peak lr. See :mod:`megazero.train.lr_schedule` for the formulas.
    """

    name: str = "cosine"  # cosine | constant | warmup_lr | warmup_decay_lr | warmup_cosine_lr
    warmup_steps: int = 0
    decay_steps: int | None = None  # None: training.train_steps
    min_lr: float = 0.0
    warmup_min_lr: float = 0.0
    warmup_type: str = "linear"  # linear | log (DeepSpeed's WarmupLR default is log)
    warmup_min_ratio: float = 0.0  # warmup_cosine_lr only
    min_ratio: float = 1e-4  # warmup_cosine_lr only (DeepSpeed's cos_min_ratio default)


@dataclass
class LossScaleConfig:
    """fp16 loss scaling with DeepSpeed's semantics; ``loss_scale`` 0 means dynamic."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class ActivationCheckpointingConfig:
    """Recompute activations in backward (``--activation-checkpointing`` and DeepSpeed's block).

    ``full`` keeps each transformer layer's input only, ``selective`` recomputes the attention core;
    ``partition_activations`` stores the kept layer inputs split over the TP ranks (full only, without
    sequence parallelism) and ``cpu_checkpointing`` keeps them in host memory (with or without partitioning,
    where DeepSpeed offloads only partitioned ones).
    """

    mode: str = "none"  # none | full | selective
    partition_activations: bool = False
    cpu_checkpointing: bool = False


@dataclass
class DataConfig:
    paths: list[str] = field(default_factory=list)  # empty: the built-in standard-library corpus
    cache_dir: str | None = None  # None: ~/.cache/megazero
    tokenizer: str | None = None  # path to a SentencePiece .model; None: train/cached BPE on the corpus
    new_tokenizer: bool = False  # --init-from without its tokenizer: pair the weights with a new one (opt-in)
    eval_fraction: float = 0.01


@dataclass
class LoggingConfig:
    log_dir: str = "runs/latest"
    log_interval: int = 10
    wandb_project: str | None = None
    wandb_mode: str | None = None  # None: offline unless an account is configured
    steps_per_print: int | None = None  # DeepSpeed's steps_per_print as given (it also sets log_interval)
    progress: bool = True
    sample_prompts: str | None = None  # a file of prompts, one a line: greedy samples at every evaluation
    sample_tokens: int = 16  # tokens generated per sample prompt


@dataclass
class TrainingConfig:
    micro_batch_size: int | None = 16  # None (a DeepSpeed file without it): global / (accumulation * dp)
    global_batch_size: int | None = None  # None: micro_batch_size * dp
    gradient_accumulation_steps: int | None = None  # derived: global / (micro * dp)
    train_steps: int = 300
    seed: int = 1234
    precision: str | None = None  # fp32 | bf16 | fp16; None: bf16 on CUDA, fp32 on CPU (resolve's device_type)
    tf32: bool = True  # on CUDA, fp32 matmuls and convolutions use TF32 tensor cores (--no-tf32 turns it off)
    compile: bool | None = None  # torch.compile each transformer block; None: on CUDA, off on CPU
    peak_tflops: float | None = None  # one device's peak TFLOP/s for MFU; None: looked up by device name
    eval_interval: int = 100  # 0 disables evaluation
    eval_iters: int = 10
    save: str | None = None
    save_interval: int = 0
    load: str | None = None
    keep_last: int | None = None
    init_from: str | None = None  # a Hugging Face model directory: its config.json sets the model, its weights
    # the initial values (megazero.checkpoint.hf_import)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    model_preset: str = "tiny"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    deepspeed_config: str | None = None  # the --deepspeed-config file this was read from, for the record
    # setting paths the user gave (flags or DeepSpeed keys, e.g. "model.vocab_size"), as opposed to defaults and
    # a preset's values: what a tokenizer's vocabulary or an --init-from config.json may replace, or must match
    explicit: tuple[str, ...] = ()

    def resolve(self, world_size: int, device_type: str = "cpu") -> Config:
        """Derived sizes filled in and every setting validated; see
        :func:`~megazero.config.resolve.resolve_config`."""
        return resolve_config(self, world_size, device_type)

