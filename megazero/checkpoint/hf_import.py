"""Hugging Face weights in: ``--init-from DIR`` starts a run from a local GPT-2 or Llama directory.

``DIR`` holds ``config.json`` and safetensors weights (``model.safetensors``, or shards listed by
``model.safetensors.index.json``; a single ``pytorch_model.bin`` is read memory-mapped). Two steps:

1. **Configuration** (:func:`configure_from_inputs`, at the entry point before resolution, on every rank):
   ``config.json`` decides the architecture. Its shape replaces the preset's; a setting the user gave
   (``Config.explicit``: a flag, a DeepSpeed key, or every field of an explicit ``--model``) that disagrees is
   refused, naming the field and both values. What config.json does not decide stays the run's: dropout,
   initialisation std, and Llama's ``--seq-len`` (rotary positions have no table; ``max_position_embeddings``
   when not given, or with Llama 3.1's rope scaling its ``original_max_position_embeddings``, the context it
   was pre-trained at, as the ``llama-3.2-1b`` preset; ``max_position_embeddings`` is kept for the export).
   GPT-2's learned position table is a parameter, so its ``--seq-len`` is ``n_positions``:
   a shorter table would drop rows and the export would not give the same tensors back. Features megazero
   does not model (rope scaling other than ``llama3``, biases in Llama, an untied GPT-2, another activation)
   are refused, as is a
   directory that lacks a tensor or holds one of another shape: both are read from the safetensors headers
   alone, so a bad directory fails on every rank before any process group or tensor exists.
   A tokenizer is part of a model: ``DIR``'s (``tokenizer.json``, else the SentencePiece ``tokenizer.model`` of
   older Llama and Mistral directories, with eos/bos from the directory's own configs) becomes the run's unless
   ``--tokenizer`` names one. A directory with neither is refused unless ``--tokenizer`` is given or the user
   opts in with ``--new-tokenizer`` (pretrained embeddings paired with a new vocabulary, trained on the corpus
   at config.json's size, or a ``.bin``'s). The vocabulary is config.json's ``vocab_size``: the embedding's
   rows, which may exceed the tokenizer's entries (Qwen2 and Pythia pad them to a tidy multiple): those rows are
   kept, trained as the published model was (in the softmax; no input reaches them), never sampled
   (generation masks them) and exported back. A tokenizer with more entries than rows is refused, naming
   both. Without ``--init-from`` the same function lets ``--tokenizer`` (or, without it, the tokenizer a ``.bin``
   of ``--data`` was made with) set the vocabulary unless ``--vocab-size`` was given, which must then agree.

   With ``--load`` naming a checkpoint that exists (``--load auto`` once a restarted run has saved one), the
   weights of ``DIR`` are not read at all (:func:`configure_from_inputs` drops ``init_from`` after taking the
   model's shape and tokenizer): the checkpoint's values would replace them.
2. **Materialisation** (:func:`hf_initializer`, the recipe's materialiser): ZeRO asks for one parameter's
   initial value at a time (stages 0-2), or one gather unit's (stage 3), at this rank's TP-shard shape. The
   value is cut out of the Hugging Face tensors with ``safe_open(...).get_slice``, which reads only the
   bytes of the rows or columns asked for: each interleaved block's (fused qkv at stride 3; Llama's q, k and
   v of unequal GQA sizes; SwiGLU's gate and up) share of this TP rank, transposed where GPT-2's Conv1D
   stores ``[in, out]``, with zero rows beyond the real vocabulary (padding). A pipeline stage asks only for
   its own layers, so a rank reads its TP x PP share and never a tensor it does not hold; ZeRO then keeps
   the DP shard, as it does for a random initialisation (the DP cut is not read selectively: it slices
   the flattened gather unit across parameter boundaries, and the unit's TP shard is needed whole to fill
   it). Any floating dtype is read and converted to fp32, so bf16 weights load exactly.

Qwen2 (``model_type`` qwen2) is Llama with q/k/v biases, its own ``rope_theta`` (1e6), tied embeddings in the
small sizes, a padded vocabulary and sliding-window keys (off unless ``use_sliding_window``); megazero's Llama has
no biases, so a Qwen2 directory is refused naming them.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from megazero.checkpoint.store import resume_step_dir
from megazero.config.errors import ConfigError, ConfigWarning
from megazero.config.schema import Config, ModelConfig
from megazero.data import check_vocab_size, open_tokenizer, sidecar_tokenizer
from megazero.distributed.group import Group
from megazero.model.gpt import GPT
from megazero.model.hf import HFPart, hf_parts
from megazero.tensor_parallel.layers import tp_size_rank

__all__ = ["HFCheckpoint", "check_tensors", "configure_from_inputs", "hf_initializer", "hf_model_config"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CONFIG, INDEX, WEIGHTS, TORCH_WEIGHTS = ("config.json", "model.safetensors.index.json", "model.safetensors",
                                          "pytorch_model.bin")

# megazero's ModelConfig fields that config.json decides: (the value compared, its flag)
_DECIDED = {"arch": ("arch", "--arch"), "num_layers": ("num_layers", "--num-layers"),
            "hidden_size": ("hidden_size", "--hidden-size"), "num_heads": ("num_heads", "--num-heads"),
            "num_kv_heads": ("kv_heads", "--num-kv-heads"), "ffn_size": ("ffn_hidden_size", "--ffn-hidden-size"),
            "vocab_size": ("vocab_size", "--vocab-size"), "layernorm_eps": ("layernorm_eps", "--norm-eps"),
            "rope_theta": ("rope_theta", "--rope-theta"), "tie_embeddings": ("tied", "--tie-embeddings"),
            "seq_len": ("seq_len", "--seq-len"),  # rope scaling has no flags: only a preset can disagree
            **{f: (f, "--model") for f in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                                           "rope_original_max_positions")}}
# Llama 3.1's rope scaling: ModelConfig field <- key of config.json's rope_scaling (rope_parameters)
_ROPE_KEYS = {"rope_scaling_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
              "rope_high_freq_factor": "high_freq_factor", "rope_original_max_positions": "original_max_position_embeddings"}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {path} ({e})") from e


def hf_model_config(hf: dict[str, Any], where: str = "config.json",
                    base: ModelConfig | None = None) -> tuple[ModelConfig, dict[str, str]]:
    """The :class:`ModelConfig` a Hugging Face ``config.json`` (``hf``) describes, with ``base``'s dropout,
    init std and (Llama) sequence length, and the config.json key each decided field came from.

    Raises :class:`ConfigError` naming ``where`` and the key for a model megazero does not build.
    """
    def refuse(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where} has {key} {hf.get(key)!r}: {why}")

    kind = hf.get("model_type")
    keep = {"dropout": base.dropout, "init_std": base.init_std} if base is not None else {}
    if kind == "gpt2":
        if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise refuse("activation_function", "megazero's GPT-2 uses the tanh GELU (gelu_new)")
        if not hf.get("tie_word_embeddings", True):
            raise refuse("tie_word_embeddings", "megazero's GPT-2 ties the output layer to the token embedding")
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if hf.get(key):
                raise refuse(key, "not modelled by megazero's GPT-2")
        if hf.get("scale_attn_weights", True) is not True:
            raise refuse("scale_attn_weights", "megazero scales attention scores by 1/sqrt(head size)")
        keys = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "seq_len": "n_positions",
                "vocab_size": "vocab_size", "layernorm_eps": "layer_norm_epsilon", "ffn_size": "n_inner"}
        values = {f: hf.get(k) for f, k in keys.items()}
        values["layernorm_eps"] = hf.get("layer_norm_epsilon", 1e-5)
        return ModelConfig(arch="gpt2", tie_embeddings=True, **values, **keep), {**keys, "arch": "model_type"}
    if kind == "qwen2":
        raise refuse("model_type", "Qwen2 is Llama with biases on q, k and v, which megazero's Llama does not have "
                     "(it reads Hugging Face gpt2 and llama models)")
    if kind != "llama":
        raise refuse("model_type", "megazero reads Hugging Face gpt2 and llama models")
    rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    rope = hf.get(rope_key) or {}
    scaling = _llama3_scaling(rope, hf.get("max_position_embeddings"), lambda why: refuse(rope_key, why))
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise refuse(key, "megazero's Llama has no biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", "megazero's Llama MLP is SwiGLU (silu)")
    heads = hf.get("num_attention_heads")
    if hf.get("head_dim") not in (None, hf.get("hidden_size", 0) // (heads or 1)):
        raise refuse("head_dim", "megazero's head size is hidden_size / num_attention_heads")
    keys = {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads", "ffn_size": "intermediate_size", "vocab_size": "vocab_size",
            "layernorm_eps": "rms_norm_eps", "rope_theta": "rope_theta", "tie_embeddings": "tie_word_embeddings",
            "seq_len": "max_position_embeddings"}
    values = {f: hf.get(k) for f, k in keys.items()}
    values["num_kv_heads"] = values["num_kv_heads"] or heads
    values["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    values["layernorm_eps"] = hf.get("rms_norm_eps", 1e-6)
    values["tie_embeddings"] = bool(hf.get("tie_word_embeddings", False))
    values["max_positions"] = values["seq_len"]
    if base is not None and base.seq_len is not None:
        values["seq_len"] = base.seq_len
    elif base is not None and scaling:  # a run trains at the pre-training context unless --seq-len says otherwise
        values["seq_len"] = scaling["rope_original_max_positions"]
    for f in ("num_layers", "hidden_size", "num_heads", "vocab_size", "ffn_size", "seq_len"):
        if not isinstance(values[f], int):
            raise refuse(keys[f], "expected an integer")
    keys.update({f: f"{rope_key}.{k}" for f, k in _ROPE_KEYS.items()})
    return ModelConfig(arch="llama", **values, **scaling, **keep), {**keys, "arch": "model_type"}


def _llama3_scaling(rope: dict[str, Any], max_positions: Any, refuse: Any) -> dict[str, Any]:
    """The ModelConfig fields of config.json's rope scaling ``rope`` (empty: none); ``refuse(why)`` makes the
    error for one megazero does not build: a type other than ``llama3`` (Llama 3.1's), or llama3 without its
    factors. ``original_max_position_embeddings`` defaults to ``max_positions``, as in transformers."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind != "llama3":
        raise refuse(f"megazero's rotary embedding has no {kind!r} scaling (it reads 'default' and 'llama3')")
    try:
        out = {f: float(rope[k]) for f, k in _ROPE_KEYS.items() if f != "rope_original_max_positions"}
        out["rope_original_max_positions"] = int(rope.get("original_max_position_embeddings", max_positions))
    except (KeyError, TypeError, ValueError) as e:
        raise refuse(f"llama3 scaling needs factor, low_freq_factor and high_freq_factor ({e!r})") from e
    if not (out["rope_scaling_factor"] >= 1 and 0 < out["rope_low_freq_factor"] < out["rope_high_freq_factor"]
            and out["rope_original_max_positions"] > 0):
        raise refuse("llama3 scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and a positive "
                     "original_max_position_embeddings")
    return out


class HFCheckpoint:
    """The weights of a Hugging Face directory, opened lazily: tensor names, shapes, and slices.

    ``read`` returns rows ``[lo, hi)`` along one dimension of one tensor (fp32); every read is counted in
    ``elements_read`` (what a test can measure).
    """

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self._handles: dict[str, Any] = {}
        self.elements_read = 0
        if (self.dir / INDEX).is_file():
            self.files = dict(_read_json(self.dir / INDEX).get("weight_map", {}))
        elif (self.dir / WEIGHTS).is_file():
            self.files = dict.fromkeys(self._open(WEIGHTS).keys(), WEIGHTS)
        elif (self.dir / TORCH_WEIGHTS).is_file():
            self.files = dict.fromkeys(self._open(TORCH_WEIGHTS).keys(), TORCH_WEIGHTS)
        else:
            raise ConfigError(f"{self.dir} holds no {WEIGHTS}, {INDEX} or {TORCH_WEIGHTS}")

    def _open(self, file: str) -> Any:
        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise ConfigError(f"{path} is missing (named by {self.dir / INDEX})")
            if file.endswith(".bin"):  # memory-mapped: a slice touches only its pages
                self._handles[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            else:
                from safetensors import safe_open

                self._handles[file] = safe_open(str(path), framework="pt")
        return self._handles[file]

    def key(self, name: str) -> str | None:
        """The stored name of tensor ``name`` (GPT-2 files may lack the ``transformer.`` prefix), or None."""
        for key in (name, name.removeprefix("transformer.")):
            if key in self.files:
                return key
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._open(self.files[key])
        return tuple(handle[key].shape) if isinstance(handle, dict) else tuple(handle.get_slice(key).get_shape())

    def read(self, key: str, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` along ``dim`` (0 or 1) of tensor ``key``, as fp32; only those bytes are read."""
        handle = self._open(self.files[key])
        view = handle[key] if isinstance(handle, dict) else handle.get_slice(key)
        t = view[lo:hi] if dim == 0 else view[:, lo:hi]
        self.elements_read += t.numel()
        return t.float()

    def read_part(self, part: HFPart, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` along megazero's ``dim`` of one part, in megazero's ``[out, in]`` layout."""
        key = self.key(part.name)
        if part.transposed:
            return self.read(key, 1 - dim, lo, hi).t()
        return self.read(key, dim, lo, hi)


def _named_meta_params(model_cfg: ModelConfig) -> list[tuple[str, nn.Parameter]]:
    with torch.device("meta"):
        return list(GPT(model_cfg).named_parameters())


def check_tensors(ckpt: HFCheckpoint, model_cfg: ModelConfig) -> None:
    """Every tensor the model needs is in ``ckpt`` with the shape config.json implies (headers only)."""
    for name, p in _named_meta_params(model_cfg):
        full = p.shard_spec.full_shape
        for part in hf_parts(name, model_cfg, full[0]):
            key = ckpt.key(part.name)
            if key is None:
                raise ConfigError(f"no tensor {part.name} (megazero's {name}), which its "
                                  f"{CONFIG} implies")
            want = (part.rows, *full[1:])
            want = want[::-1] if part.transposed else want
            if ckpt.shape(key) != want:
                raise ConfigError(f"tensor {key} has shape {list(ckpt.shape(key))}, but its "
                                  f"{CONFIG} implies {list(want)}")


def _given_model_fields(cfg: Config) -> set[str]:
    """ModelConfig fields the user set: by flag or DeepSpeed key, or all of them through an explicit --model."""
    if "model_preset" in cfg.explicit:
        return {f.name for f in fields(ModelConfig)}
    return {p.split(".", 1)[1] for p in cfg.explicit if p.startswith("model.")}


def _from_hf_dir(cfg: Config) -> Config:
    path = Path(cfg.training.init_from)
    if not (path / CONFIG).is_file():
        raise ConfigError(f"--init-from {path}: no {CONFIG} there; pass a Hugging Face model directory")
    given = _given_model_fields(cfg)
    base = replace(cfg.model, seq_len=cfg.model.seq_len if "seq_len" in given else None)
    try:
        model, keys = hf_model_config(_read_json(path / CONFIG), CONFIG, base)
        check_tensors(HFCheckpoint(path), model)
    except ConfigError as e:
        raise ConfigError(f"--init-from {path}: {e}") from e
    for field_name, (attr, flag) in _DECIDED.items():
        ours, theirs = getattr(cfg.model, attr), getattr(model, attr)
        if field_name in given and ours != theirs and field_name in keys:
            what = f"--model {cfg.model_preset}" if "model_preset" in cfg.explicit else flag
            raise ConfigError(f"--init-from {path}: {CONFIG} has {keys[field_name]} {theirs}, but {what} gives "
                              f"{attr} {ours}; drop {what}: the Hugging Face config sets the model")
    data = cfg.data
    if "data.tokenizer" not in cfg.explicit and not data.new_tokenizer:
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            raise ConfigError(f"--init-from {path}: no {' or '.join(TOKENIZER_FILES)} there, and pretrained embeddings "
                              f"belong to their tokenizer; pass --tokenizer with the model's own, or --new-tokenizer "
                              f"to pair these weights with a new vocabulary of {model.vocab_size}")
        data = replace(data, tokenizer=str(path))
    return replace(cfg, model=model, model_preset=f"hf:{path.name}", data=data)


def configure_from_inputs(cfg: Config) -> Config:
    """``cfg`` with the model shape its inputs fix: ``--init-from``'s config.json, then the tokenizer's
    vocabulary (module docstring). Call before :meth:`Config.resolve`; raises :class:`ConfigError`."""
    init_from = cfg.training.init_from
    if init_from is not None:
        cfg = _from_hf_dir(cfg)
        step_dir = resume_step_dir(cfg.training.load, cfg.training.save)
        if step_dir is not None:  # its weights would be replaced: read only config.json (and the tokenizer)
            warnings.warn(ConfigWarning(f"--init-from {init_from}: its weights are not read, --load resumes "
                                        f"{step_dir} (config.json still sets the model)"), stacklevel=2)
            cfg = replace(cfg, training=replace(cfg.training, init_from=None))
    elif cfg.data.new_tokenizer:
        warnings.warn(ConfigWarning("--new-tokenizer has no effect without --init-from"), stacklevel=2)
    tokenizer = cfg.data.tokenizer or sidecar_tokenizer(cfg.data.paths)  # a .bin's: the one it was made with
    if tokenizer is None:
        return cfg
    try:
        tok = open_tokenizer(tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer: {e}") from e
    if tok.vocab_size == cfg.model.vocab_size:
        return cfg
    if init_from is not None:
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"--init-from {init_from}: its {CONFIG} has vocab_size {cfg.model.vocab_size}, but "
                              f"tokenizer {tok.model_path} has {tok.vocab_size} tokens, more than the embedding has "
                              f"rows; pass --tokenizer with the model's own tokenizer")
        if "data.tokenizer" in cfg.explicit:  # the directory's own may pad its rows; a given one is worth a line
            warnings.warn(ConfigWarning(f"--tokenizer {tokenizer} has {tok.vocab_size} tokens, the embedding of "
                                        f"--init-from {init_from} {cfg.model.vocab_size} rows: the rows beyond are "
                                        "kept and never sampled"), stacklevel=2)
        return cfg
    if "model.vocab_size" in cfg.explicit:
        try:
            check_vocab_size(tok, cfg.model.vocab_size)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    return replace(cfg, model=replace(cfg.model, vocab_size=tok.vocab_size))


def hf_initializer(chunks: list[nn.Module], model_cfg: ModelConfig, directory: str | Path, tp_group: Group | None,
                   device: torch.device) -> Callable[[nn.Parameter], torch.Tensor]:
    """The materialiser of ``--init-from``: a function giving one parameter of ``chunks`` (built on meta) its
    initial fp32 value at this rank's TP-shard shape on ``device``, read from ``directory`` (module docstring).
    The function's ``checkpoint`` attribute is the :class:`HFCheckpoint` it reads (for its counters)."""
    if torch.device(device).type == "meta":  # the dry run: shapes only
        return lambda p: torch.empty(p.shape, dtype=torch.float32, device=device)
    ckpt = HFCheckpoint(directory)
    tp_size, tp_rank = tp_size_rank(tp_group)
    names = {p: n for chunk in chunks for n, p in chunk.named_parameters()}

    def rows(parts: list[HFPart], lo: int, hi: int, full: tuple[int, ...]) -> list[torch.Tensor]:
        """Rows [lo, hi) of the parameter's dim 0 across its parts; zeros past the last (vocabulary padding)."""
        out, start = [], 0
        for part in parts:
            a, b = max(lo, start), min(hi, start + part.rows)
            if a < b:
                out.append(ckpt.read_part(part, 0, a - start, b - start))
            start += part.rows
        if hi > max(lo, start):
            out.append(torch.zeros(hi - max(lo, start), *full[1:]))
        return out

    def value(p: nn.Parameter) -> torch.Tensor:
        spec, name = p.shard_spec, names[p]
        full, dim = spec.full_shape, spec.partition_dim
        parts = hf_parts(name, model_cfg, full[0])
        if dim is None:  # replicated: every TP rank holds it whole
            pieces = rows(parts, 0, full[0], full)
        elif dim == 1:  # row-parallel: this rank's columns of each part
            pieces = [torch.cat([ckpt.read_part(q, 1, tp_rank * p.shape[1], (tp_rank + 1) * p.shape[1])
                                 for q in parts])]
        else:  # column- or vocabulary-parallel: this rank's share of each interleaved block of the padded rows
            pieces = [t for lo, hi in spec.rank_rows(tp_rank, tp_size) for t in rows(parts, lo, hi, full)]
        out = torch.cat(pieces, dim=dim or 0)
        if out.shape != p.shape:
            raise RuntimeError(f"internal error: {name} read as {list(out.shape)}, expected {list(p.shape)}")
        return out.contiguous().to(device)

    value.checkpoint = ckpt  # type: ignore[attr-defined]
    return value

