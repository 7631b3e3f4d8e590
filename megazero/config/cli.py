"""The command line of ``pretrain/gpt.py``: flags (and a DeepSpeed-style JSON) into a :class:`~megazero.config.schema.Config`.

Every flag defaults to "not given", so the parser knows which settings the user typed: those override the
DeepSpeed file, contradict it only if they differ, and leave every other setting at the dataclass default.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace
from typing import Any

from megazero.config.deepspeed import load_deepspeed_config, merge_with_flags
from megazero.config.resolve import (
    ARCHS,
    BACKENDS,
    CHECKPOINTING_MODES,
    CP_ATTENTION_MODES,
    OPTIMIZERS,
    PP_SCHEDULES,
    PRECISIONS,
    SCHEDULES,
    WANDB_MODES,
)
from megazero.config.schema import PRESETS, Config, model_preset

__all__ = ["build_parser", "parse_args"]


def _get(cfg: Config, path: str) -> Any:
    """Value at a setting path such as ``"training.micro_batch_size"`` (``optimizer.beta1/2`` are virtual)."""
    if path in ("optimizer.beta1", "optimizer.beta2"):
        return cfg.optimizer.betas[int(path[-1]) - 1]
    obj: Any = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 3,3,2, got {text!r}") from None


class _OnOff(argparse.Action):
    """``--X`` stores True, ``--no-X`` False (one destination, two spellings)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, not option_string.startswith("--no-"))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``pretrain/gpt.py``.

    Every flag defaults to ``argparse.SUPPRESS``, so the parsed namespace holds only what the user typed (its
    attribute names are setting paths such as ``"zero.stage"``); the defaults shown come from the dataclasses.
    """
    defaults = Config()
    parser = argparse.ArgumentParser(
        prog="pretrain/gpt.py",
        description="Pretrain a GPT with tensor, pipeline and ZeRO data parallelism (launch with torchrun).",
        argument_default=argparse.SUPPRESS,
    )
    # a value such as -1e-3 is a (negative) number, not an unknown option: --lr -1e-3 reaches --lr's own check
    parser._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")

    def add(group: argparse._ArgumentGroup, flag: str, path: str, help: str, **kw: Any) -> None:
        if path.startswith("model."):
            shown = "from --model"
        elif kw.get("action") == "store_const":
            shown = "off"
        else:
            shown = _get(defaults, path)
        if "choices" not in kw and "action" not in kw:
            kw.setdefault("metavar", {int: "N", float: "X"}.get(kw.get("type"), "NAME"))  # type: ignore[arg-type]
        group.add_argument(flag, dest=path, help=f"{help} (default: {shown})", **kw)

    g = parser.add_argument_group("parallelism")
    add(g, "--tp", "parallel.tp_size", "tensor-parallel size", type=int)
    add(g, "--pp", "parallel.pp_size", "pipeline-parallel size (number of stages)", type=int)
    add(g, "--dp", "parallel.dp_size", "data-parallel size; None derives world/(tp*cp*pp)", type=int)
    add(g, "--cp", "parallel.cp_size", "context-parallel size: each sample's sequence split over this many ranks "
        "(2*cp load-balanced chunks; ZeRO shards over dp*cp)", type=int)
    add(g, "--cp-attention", "parallel.cp_attention", "context-parallel attention: ring (K/V passed around the CP "
        "ring, memory 1/cp) or allgather (K/V gathered per layer)", choices=CP_ATTENTION_MODES)
    add(g, "--sequence-parallel", "parallel.sequence_parallel", "shard LayerNorm/dropout activations over TP",
        action="store_const", const=True)
    add(g, "--pp-schedule", "parallel.pp_schedule", "pipeline schedule; zb-h1 and zbv split the backward into "
        "input and weight gradients (zero bubble), zbv on 2 chunks per rank in a V (rank r: stages r and 2pp-1-r); "
        "neither with --compile", choices=PP_SCHEDULES)
    add(g, "--virtual-stages", "parallel.virtual_stages", "model chunks per rank (interleaved schedule; zbv "
        "always runs 2)",
        type=int)
    add(g, "--pp-layout", "parallel.pp_layout", "layers per (virtual) pipeline stage, e.g. 3,3,2; None: balanced",
        type=_int_list, metavar="N,N,...")
    add(g, "--zero-stage", "zero.stage", "ZeRO stage: 1 optimizer states, 2 +gradients, 3 +parameters",
        type=int, choices=(0, 1, 2, 3))
    add(g, "--offload-optimizer", "zero.offload_optimizer", "keep fp32 master weights and Adam moments in host "
        "memory and step on the CPU (ZeRO-Offload; stages 1-3)", action="store_const", const="cpu")
    add(g, "--offload-param", "zero.offload_param", "keep ZeRO-3 parameter shards in host memory",
        action="store_const", const="cpu")
    add(g, "--offload-delayed-update", "zero.offload_delayed_update", "with --offload-optimizer: DeepSpeed's one-step "
        "delayed parameter update (DPU): the host Adam of step t runs in a background thread while the device "
        "computes step t+1 on the parameters of step t-1; step t's update lands at the end of step t+1",
        action="store_const", const=True)
    add(g, "--offload-delayed-update-after", "zero.offload_delayed_update_after", "with --offload-delayed-update: "
        "optimizer steps run without the delay first (DeepSpeed starts DPU after a few warm-up steps)", type=int)
    add(g, "--reduce-bucket-size", "zero.reduce_bucket_size", "ZeRO 0-2: elements per gradient bucket "
        "(zero_optimization.reduce_bucket_size; None: derived from the model, ZeroConfig.bucket_numel)", type=int)
    g.add_argument("--overlap-comm", "--no-overlap-comm", dest="zero.overlap_comm", action=_OnOff,
                   help="overlap the gradient reductions with backward (zero_optimization.overlap_comm; default: "
                   "on with CUDA, off on CPU)")
    add(g, "--max-inflight-buckets", "zero.max_inflight_buckets", "ZeRO-2: most gradient buckets being filled or "
        "reduced at once during backward; each holds one bucket (reduce_bucket_size) in --grad-dtype", type=int)
    add(g, "--grad-dtype", "zero.grad_dtype", "dtype gradients are accumulated over micro-batches and reduced over "
        "DP in (DeepSpeed: communication_data_type, data_types.grad_accum_dtype): auto is fp32 in bf16 (4 bytes per "
        "parameter, as Megatron-LM and DeepSpeed's bf16 optimizer) and the model dtype in fp16 (2 bytes, the ZeRO "
        "paper's 2Ψ); fp32; model", choices=("auto", "fp32", "model"))
    add(g, "--ranks-per-node", "parallel.ranks_per_node", "ranks per node (consecutive ranks share a node): "
        "ZeRO++'s node groups, the ledger's intra/inter-node bytes, the planner; None: torchrun's LOCAL_WORLD_SIZE "
        "(one node without it); set it to simulate nodes on one machine", type=int)
    add(g, "--zero-hpz-partition-size", "zero.zero_hpz_partition_size", "ZeRO++ hpZ (stage 3): keep a secondary "
        "16-bit copy of the weights partitioned over this many ranks of a node, so backward gathers stay inside "
        "the node (zero_optimization.zero_hpz_partition_size; 1: off)", type=int)
    add(g, "--zero-quantized-weights", "zero.zero_quantized_weights", "ZeRO++ qwZ (stage 3): all-gather weights "
        "block-quantized to INT8 (zero_optimization.zero_quantized_weights)", action="store_const", const=True)
    add(g, "--zero-quantized-gradients", "zero.zero_quantized_gradients", "ZeRO++ qgZ (stages 2-3): reduce "
        "gradients by a block-quantized intra-node then inter-node all-to-all (zero_optimization."
        "zero_quantized_gradients)", action="store_const", const=True)
    add(g, "--zero-quantized-gradients-bits", "zero.zero_quantized_gradients_bits", "qgZ's integer width",
        type=int, choices=(4, 8))
    add(g, "--activation-checkpointing", "activation_checkpointing.mode", "recompute activations in backward",
        choices=CHECKPOINTING_MODES)
    add(g, "--backend", "parallel.backend", "torch.distributed backend; None picks nccl on CUDA, else gloo",
        choices=BACKENDS)
    add(g, "--dist-timeout", "parallel.dist_timeout_s", "collective timeout", type=float, metavar="SECONDS")

    g = parser.add_argument_group("model")
    add(g, "--model", "model_preset", "architecture preset", choices=tuple(PRESETS), metavar="PRESET")
    for flag, name, typ in (("--num-layers", "num_layers", int), ("--hidden-size", "hidden_size", int),
                            ("--num-heads", "num_heads", int), ("--seq-len", "seq_len", int),
                            ("--vocab-size", "vocab_size", int), ("--dropout", "dropout", float)):
        add(g, flag, f"model.{name}", f"override the preset's {name}", type=typ)
    add(g, "--arch", "model.arch", "model family: gpt2 (LayerNorm, learned positions, GELU, biases, tied "
        "embedding) or llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases)", choices=ARCHS)
    add(g, "--num-kv-heads", "model.num_kv_heads", "key/value heads of grouped-query attention (llama); None: "
        "--num-heads", type=int)
    add(g, "--ffn-hidden-size", "model.ffn_size", "MLP width; None: 4 x hidden (gpt2), 8/3 x hidden rounded up "
        "to 256 (llama)", type=int)
    add(g, "--rope-theta", "model.rope_theta", "base of the rotary position frequencies (llama)", type=float)
    add(g, "--norm-eps", "model.layernorm_eps", "epsilon of the LayerNorm (gpt2) or RMSNorm (llama)", type=float)
    g.add_argument("--tie-embeddings", "--no-tie-embeddings", dest="model.tie_embeddings", action=_OnOff,
                   help="use the token embedding as the output layer (default: from --model; gpt2 ties, llama "
                   "does not)")

    g = parser.add_argument_group("batch and steps")
    add(g, "--micro-batch-size", "training.micro_batch_size", "sequences per rank per forward/backward",
        type=int)
    add(g, "--global-batch-size", "training.global_batch_size",
        "sequences per optimizer step over all DP ranks; None is micro*dp", type=int)
    add(g, "--train-steps", "training.train_steps", "total optimizer steps (also sets the lr schedule)",
        type=int)
    add(g, "--seed", "training.seed", "random seed", type=int)
    add(g, "--precision", "training.precision", "compute precision; None: bf16 on CUDA, fp32 on CPU",
        choices=PRECISIONS)
    g.add_argument("--compile", "--no-compile", dest="training.compile", action=_OnOff,
                   help="torch.compile each transformer block (default: on with CUDA, off on CPU and at ZeRO "
                   "stage 3)")
    add(g, "--no-tf32", "training.tf32", "on CUDA, run fp32 matmuls in full fp32 instead of TF32",
        action="store_const", const=False)
    add(g, "--peak-tflops", "training.peak_tflops", "one device's peak TFLOP/s for MFU; None: by device name and "
        "precision (megazero.observe.flops.PEAK_FLOPS)", type=float)
    add(g, "--eval-interval", "training.eval_interval", "steps between evaluations, 0 disables", type=int)
    add(g, "--eval-iters", "training.eval_iters", "batches per evaluation", type=int)

    g = parser.add_argument_group("optimizer and learning rate")
    add(g, "--optimizer", "optimizer.name", "adamw: decoupled weight decay; adam: L2 decay", choices=OPTIMIZERS)
    add(g, "--lr", "optimizer.lr", "peak learning rate", type=float)
    add(g, "--min-lr", "scheduler.min_lr", "final learning rate of the cosine decay", type=float)
    add(g, "--lr-schedule", "scheduler.name", "learning-rate schedule", choices=SCHEDULES)
    add(g, "--warmup-steps", "scheduler.warmup_steps", "linear warm-up steps", type=int)
    add(g, "--lr-decay-steps", "scheduler.decay_steps", "step at which the decay ends; None is --train-steps",
        type=int)
    add(g, "--weight-decay", "optimizer.weight_decay", "weight decay", type=float)
    add(g, "--clip-grad", "optimizer.clip_grad", "global gradient-norm clip, 0 disables", type=float)
    add(g, "--max-skipped-steps", "optimizer.max_skipped_steps", "without fp16 loss scaling, a step whose gradient "
        "norm is not finite is skipped on every rank; stop after this many in a row, 0 never stops", type=int)
    add(g, "--adam-beta1", "optimizer.beta1", "Adam beta1", type=float)
    add(g, "--adam-beta2", "optimizer.beta2", "Adam beta2", type=float)
    add(g, "--adam-eps", "optimizer.eps", "Adam epsilon", type=float)

    g = parser.add_argument_group("data")
    add(g, "--data", "data.paths", "text files (.txt, or .jsonl with a \"text\" field per line), directories of "
        "them, or token files (.bin from tools/preprocess_data.py, whose tokenizer they name); empty uses the "
        "built-in corpus", nargs="+", metavar="PATH")
    add(g, "--tokenizer", "data.tokenizer", "SentencePiece .model, Hugging Face tokenizer.json or a directory "
        "holding one; the vocabulary size follows it. None trains a SentencePiece BPE on the corpus (or takes "
        "--init-from's)", metavar="PATH")
    add(g, "--new-tokenizer", "data.new_tokenizer", "with --init-from: do not take the directory's tokenizer (one "
        "without any is refused otherwise) but pair its weights with the run's own, trained on the corpus at the "
        "model's vocabulary size (or a .bin's)", action="store_const", const=True)
    add(g, "--cache-dir", "data.cache_dir", "tokenizer/dataset cache; None is ~/.cache/megazero", metavar="DIR")

    g = parser.add_argument_group("logging")
    add(g, "--log-dir", "logging.log_dir", "metrics.jsonl and run files", metavar="DIR")
    add(g, "--log-interval", "logging.log_interval", "steps between log lines", type=int)
    add(g, "--no-progress", "logging.progress", "disable the progress bar", action="store_const", const=False)
    add(g, "--wandb-project", "logging.wandb_project", "Weights & Biases project; None disables W&B")
    add(g, "--wandb-mode", "logging.wandb_mode", "W&B mode", choices=WANDB_MODES)
    add(g, "--sample-prompts", "logging.sample_prompts", "file of prompts, one a line: greedy samples at every "
        "evaluation (console, metrics.jsonl, W&B table)", metavar="FILE")
    add(g, "--sample-tokens", "logging.sample_tokens", "tokens generated per sample prompt", type=int)
    g.add_argument("--debug", action="store_true", help="a failure prints its traceback before its one line "
                   "(MEGAZERO_DEBUG=1 does the same); exit status 2 for a setting, 1 for anything else")

    g = parser.add_argument_group("checkpointing")
    add(g, "--save", "training.save", "checkpoint directory", metavar="DIR")
    add(g, "--save-interval", "training.save_interval", "steps between checkpoints, 0 only at the end",
        type=int)
    add(g, "--load", "training.load", "resume from a --save directory (its latest checkpoint), a step_N directory, "
        "or auto: the newest checkpoint under --save if there is one (for torchrun --max-restarts)", metavar="DIR")
    add(g, "--keep-last", "training.keep_last", "keep only the newest N checkpoints", type=int)
    add(g, "--init-from", "training.init_from", "start from a local Hugging Face GPT-2 or Llama directory "
        "(config.json + safetensors, sharded or not): its config.json sets the model (flags that disagree are "
        "refused), its tokenizer (tokenizer.json or tokenizer.model; neither: refused unless --tokenizer or "
        "--new-tokenizer) the run's; embedding rows beyond the tokenizer are kept, never sampled; each rank reads "
        "only its shards. With --load and a checkpoint to resume, its weights are not read (the checkpoint's "
        "replace them)", metavar="DIR")

    g = parser.add_argument_group("DeepSpeed compatibility")
    add(g, "--deepspeed-config", "deepspeed_config",
        'DeepSpeed JSON config; "auto" values take the flag or default, contradictions with flags are errors',
        metavar="FILE")
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse ``pretrain/gpt.py`` flags (and the ``--deepspeed-config`` file) into an unresolved Config.

    Precedence: explicit flags > keys in the DeepSpeed file > DeepSpeed's own defaults for keys missing from a
    block the file contains (e.g. Adam's betas (0.9, 0.999)) > megazero's dataclass defaults. A flag that
    contradicts a key of the file raises :class:`ConfigError` naming both; ``"auto"`` keys defer to the flag.
    Call :meth:`Config.resolve` with the world size to validate.
    """
    parser = build_parser()
    explicit: dict[str, Any] = vars(parser.parse_args(argv))
    explicit.pop("debug", None)  # the entry point's, not a setting
    file = explicit.get("deepspeed_config")
    if file is None:
        return _build_config(explicit)
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    return _build_config(merge_with_flags(load_deepspeed_config(file), explicit, flags, file))


def _build_config(values: dict[str, Any]) -> Config:
    """A Config with the given setting paths replaced (``model.*`` overrides apply to ``model_preset``)."""
    cfg = Config()
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for path, value in values.items():
        section, _, name = path.partition(".")
        if name:
            sections.setdefault(section, {})[name] = value
        else:
            top[path] = value
    preset = top.pop("model_preset", cfg.model_preset)
    model = model_preset(preset, **sections.pop("model", {}))
    opt = sections.get("optimizer", {})
    if "beta1" in opt or "beta2" in opt:
        opt["betas"] = (opt.pop("beta1", cfg.optimizer.betas[0]), opt.pop("beta2", cfg.optimizer.betas[1]))
    if "name" in opt:
        opt["decoupled_weight_decay"] = opt["name"] == "adamw"
    if "paths" in sections.get("data", {}):
        sections["data"]["paths"] = list(sections["data"]["paths"])
    new = {section: replace(getattr(cfg, section), **kw) for section, kw in sections.items()}
    return replace(cfg, model=model, model_preset=preset, **top, **new, explicit=tuple(sorted(values)))
