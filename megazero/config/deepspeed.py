"""DeepSpeed-style JSON configuration (``--deepspeed-config FILE``) mapped onto megazero's dataclasses.

Every key is classified against the tables of :mod:`megazero.config.deepspeed_keys`: supported keys are mapped,
ignored ones warned about, recognised but unsupported ones refused naming the alternative (unless their value
requests nothing), unknown ones warned about at the top level and refused inside a block, as DeepSpeed does.

What DeepSpeed's own parser does with configs in the style of its documentation and of fine-tuning tutorials
is recorded in ``tests/fixtures/ds_configs`` (``*.verdict.json``); the test suite holds megazero to the same
verdicts, except where megazero refuses a key DeepSpeed honours (NVMe offload, optimizers other than Adam),
naming the key and the alternative.

``"auto"`` (as in the Hugging Face integration) means "take the value from the command line or the default".
A key that is absent from a block the file does contain takes DeepSpeed's default for that block (Adam's
betas are (0.9, 0.999) and its weight decay 0 in DeepSpeed), reported separately as ``implied`` so that an
explicit flag still wins over it. The result is a flat mapping from setting paths (``"zero.stage"``) to
values; :func:`megazero.config.cli.parse_args` merges it with the flags.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megazero.config.deepspeed_keys import (
    ADAM_TYPES,
    ALTERNATIVES,
    AUTO,
    IGNORED_KEYS,
    NOT_SUPPORTED_KEYS,
    NOT_SUPPORTED_OPTIMIZERS,
    NOT_SUPPORTED_SCHEDULERS,
    SCHEDULER_NAMES,
    SCHEDULER_PARAMS,
    SUPPORTED_KEYS,
    children,
    is_inert,
)
from megazero.config.errors import ConfigError, ConfigWarning

__all__ = ["DeepSpeedSettings", "load_deepspeed_config", "merge_with_flags"]


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config says, as megazero setting paths (``"training.global_batch_size"``).

    ``values``: settings the file states; ``sources``: for each, the JSON key and raw value, for messages;
    ``implied``: DeepSpeed's defaults for keys missing from blocks the file contains (lower priority than
    flags); ``excluded``: ``(path, value, source)`` the file rules out (``"fp16": {"enabled": false}`` rules
    out ``--precision fp16``).
    """

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    implied: dict[str, Any] = field(default_factory=dict)
    excluded: list[tuple[str, Any, str]] = field(default_factory=list)


def load_deepspeed_config(source: str | os.PathLike[str] | Mapping[str, Any]) -> DeepSpeedSettings:
    """Read a DeepSpeed JSON file (or an already-parsed dict), classify every key, map it onto settings."""
    if isinstance(source, Mapping):
        raw: Any = source
    else:
        try:
            with open(source, encoding="utf-8") as f:
                raw = json.load(f)
        except OSError as e:
            raise ConfigError(f"--deepspeed-config {source}: cannot read the file ({e.strerror})") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"--deepspeed-config {source}: not valid JSON ({e})") from e
    if not isinstance(raw, Mapping):
        raise ConfigError("--deepspeed-config: the top level must be a JSON object")
    _check_types(raw)
    _classify(raw, "")
    out = DeepSpeedSettings()
    _map(raw, out)
    return out


def merge_with_flags(ds: DeepSpeedSettings, explicit: Mapping[str, Any], flags: Mapping[str, str],
                     file: str) -> dict[str, Any]:
    """Setting values: DeepSpeed defaults < the file < explicit flags; a flag contradicting the file raises.

    ``explicit`` maps setting paths to the values the user typed, ``flags`` setting paths to flag names. A
    cosmetic key (``steps_per_print``, DeepSpeed's print cadence) yields to a flag with a warning instead. Keys
    DeepSpeed reads only from some ZeRO stage on (``offload_optimizer`` from 1, ``offload_param`` and
    ``stage3_*`` at 3) are dropped with a warning below it, as DeepSpeed accepts and ignores them there.
    """
    def contradiction(path: str, value: Any, source: str) -> ConfigError:  # a setting that changes training
        return ConfigError(f"`{flags.get(path, path)} {value}` contradicts the DeepSpeed config {file}: "
                           f'{source}. Make them agree, drop the flag, or set the key to "auto" to take the flag')

    for path, value in ds.values.items():
        if path in explicit and explicit[path] != value:
            if path not in _COSMETIC:
                raise contradiction(path, explicit[path], ds.sources[path])
            _warn(f"`{flags.get(path, path)} {explicit[path]}` takes precedence over the DeepSpeed config's "
                  f"{ds.sources[path]}, which only sets how often DeepSpeed prints")
    for path, value, source in ds.excluded:
        if path in explicit and explicit[path] == value:
            raise contradiction(path, value, source)
    merged = {**ds.implied, **ds.values, **explicit}
    stage = merged.get("zero.stage") or 0
    # DeepSpeed reads offload_optimizer from stage 1 on and offload_param and stage3_* at stage 3 only
    unused = [p for p, need in _MIN_STAGE.items() if stage < need and p in ds.values and p not in explicit]
    said = [ds.sources[p] for p in unused if ds.values[p] not in (None, False)]
    for path in unused:
        del merged[path]
    if said:
        _warn(f"{', '.join(said)} {'has' if len(said) == 1 else 'have'} no effect at ZeRO stage {stage} and "
              f"{'is' if len(said) == 1 else 'are'} ignored, as DeepSpeed ignores "
              f"{'it' if len(said) == 1 else 'them'} (offload_optimizer needs stage 1 or more, offload_param, "
              "stage3_* and ZeRO++'s zero_hpz_partition_size/zero_quantized_* need stage 3)")
    return merged


# Settings that change nothing in training: an explicit flag wins over the file's value, with a warning.
_COSMETIC = frozenset({"logging.log_interval"})
# Settings DeepSpeed reads from this ZeRO stage on: below it, a file's value is dropped with a warning.
_MIN_STAGE = {"zero.offload_optimizer": 1, "zero.offload_optimizer_pin_memory": 1, "zero.offload_param": 3,
              "zero.offload_param_pin_memory": 3, "zero.stage3_prefetch_bucket_size": 3,
              "zero.stage3_param_persistence_threshold": 3, "zero.stage3_max_live_parameters": 3,
              "zero.stage3_max_reuse_distance": 3, "zero.zero_hpz_partition_size": 3,
              "zero.zero_quantized_weights": 3, "zero.zero_quantized_gradients": 3}


def _classify(block: Mapping[str, Any], prefix: str) -> None:
    """Walk the keys of one JSON object: recurse into supported blocks, warn or raise for the rest."""
    ignored = []
    for key, value in block.items():
        path = f"{prefix}.{key}" if prefix else key
        if path in SUPPORTED_KEYS:
            if any(k.startswith(path + ".") for k in SUPPORTED_KEYS):
                if not isinstance(value, Mapping):
                    raise ConfigError(f"`{path}` must be a JSON object, got {value!r}")
                _classify(value, path)
        elif path in IGNORED_KEYS:
            _warn(f"DeepSpeed key `{path}` is accepted but ignored by megazero ({IGNORED_KEYS[path]})")
        elif path in NOT_SUPPORTED_KEYS:
            if not is_inert(value, NOT_SUPPORTED_KEYS[path]):
                instead = ALTERNATIVES.get(path, "remove it from the DeepSpeed config")
                raise ConfigError(f"`{path}` is recognised but not supported yet by megazero; {instead}")
            _warn(f"DeepSpeed key `{path}` = {value!r} requests nothing and is ignored by megazero")
        elif not prefix:  # DeepSpeed reads the top-level keys it knows and ignores the rest
            close = difflib.get_close_matches(str(key), children(""), n=1)
            ignored.append(f"`{key}`" + (f" (did you mean `{close[0]}`?)" if close else ""))
        else:
            close = difflib.get_close_matches(str(key), children(prefix), n=1)
            if close:
                hint = f"; did you mean `{prefix + '.' if prefix else ''}{close[0]}`?"
            else:
                hint = f"; megazero reads {', '.join(children(prefix, SUPPORTED_KEYS))} here"
            raise ConfigError(f"unknown DeepSpeed config key `{path}`{hint} "
                              "(all keys: megazero/config/deepspeed_keys.py)")
    if ignored:
        _warn(f"top-level DeepSpeed config keys {', '.join(ignored)} are not settings megazero knows and are "
              "ignored (DeepSpeed ignores unknown top-level keys too)")


def _warn(message: str) -> None:
    warnings.warn(message, ConfigWarning, stacklevel=2)


def _check_types(raw: Mapping[str, Any]) -> None:
    """The optimizer and scheduler types, checked before their params (whose names depend on the type)."""
    opt = raw.get("optimizer")
    if isinstance(opt, Mapping):
        if "type" not in opt:
            raise ConfigError('`optimizer.type` is missing; use "Adam" or "AdamW"')
        name = str(opt["type"])
        if name.lower() in NOT_SUPPORTED_OPTIMIZERS:
            raise ConfigError(f'`optimizer.type` "{name}" is recognised but not supported yet by megazero; '
                              'use "Adam" or "AdamW"')
        if name.lower() not in ADAM_TYPES:
            raise ConfigError(f'unknown `optimizer.type` "{name}"; megazero supports "Adam" and "AdamW"')
    sched = raw.get("scheduler")
    if isinstance(sched, Mapping):
        if "type" not in sched:
            raise ConfigError(f"`scheduler.type` is missing; use one of {', '.join(SCHEDULER_PARAMS)}")
        name = str(sched["type"])
        if name in NOT_SUPPORTED_SCHEDULERS:
            raise ConfigError(f'`scheduler.type` "{name}" is recognised but not supported yet by megazero; use '
                              f"one of {', '.join(SCHEDULER_PARAMS)}")
        if name not in SCHEDULER_PARAMS:
            close = difflib.get_close_matches(name, [*SCHEDULER_PARAMS, *NOT_SUPPORTED_SCHEDULERS], n=1)
            hint = f'; did you mean "{close[0]}"?' if close else ""
            raise ConfigError(f'unknown `scheduler.type` "{name}"{hint}')
        params = sched.get("params")
        for key in params if isinstance(params, Mapping) else ():
            if key not in SCHEDULER_PARAMS[name] and f"scheduler.params.{key}" in SUPPORTED_KEYS:
                raise ConfigError(f"`scheduler.params.{key}` is not a parameter of {name}; it takes "
                                  f"{', '.join(sorted(SCHEDULER_PARAMS[name]))}")


# ---- value readers: each names the key path on a type error -----------------------------------------------


def _int(path: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v != int(v):
        raise ConfigError(f"`{path}` must be an integer, got {v!r}")
    return int(v)


def _float(path: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"`{path}` must be a number, got {v!r}")
    return float(v)


def _bool(path: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"`{path}` must be true or false, got {v!r}")
    return v


def _str(path: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ConfigError(f"`{path}` must be one of {', '.join(choices)}, got {v!r}")
    return v


def _stage(path: str, v: Any) -> int:
    if _int(path, v) not in (0, 1, 2, 3):
        raise ConfigError(f"`{path}` must be 0, 1, 2 or 3, got {v!r}")
    return int(v)


def _offload_device(path: str, v: Any) -> str | None:
    if v == "nvme":
        raise ConfigError(f'`{path}` "nvme" is recognised but not supported yet by megazero; use "cpu"')
    return None if _str(path, v, ("none", "cpu")) == "none" else "cpu"


def _put(out: DeepSpeedSettings, block: Mapping[str, Any], prefix: str, key: str, setting: str,
         read: Callable[[str, Any], Any]) -> None:
    """Map ``block[key]`` (unless absent or "auto") onto ``setting`` after ``read(path, value)``."""
    if key in block and block[key] != AUTO:
        path = f"{prefix}{key}"
        out.values[setting] = read(path, block[key])
        out.sources[setting] = f"`{path}` = {json.dumps(block[key])}"


def _map(raw: Mapping[str, Any], out: DeepSpeedSettings) -> None:
    _put(out, raw, "", "train_batch_size", "training.global_batch_size", _int)
    _put(out, raw, "", "train_micro_batch_size_per_gpu", "training.micro_batch_size", _int)
    if "training.global_batch_size" in out.values and raw.get("train_micro_batch_size_per_gpu") is None:
        out.implied["training.micro_batch_size"] = None  # DeepSpeed derives it: global / (accumulation x dp)
    _put(out, raw, "", "gradient_accumulation_steps", "training.gradient_accumulation_steps", _int)
    _put(out, raw, "", "gradient_clipping", "optimizer.clip_grad", _float)
    _put(out, raw, "", "steps_per_print", "logging.log_interval", _int)
    _put(out, raw, "", "steps_per_print", "logging.steps_per_print", _int)
    _map_optimizer(raw.get("optimizer"), out)
    _map_scheduler(raw.get("scheduler"), out)
    _map_precision(raw, out)
    _map_grad_dtype(raw, out)
    zero = raw.get("zero_optimization") or {}
    z = "zero_optimization."
    _put(out, zero, z, "stage", "zero.stage", _stage)
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        _put(out, zero, z, key, f"zero.{key}", _int)
    for key in ("overlap_comm", "reduce_scatter", "contiguous_gradients"):
        _put(out, zero, z, key, f"zero.{key}", _bool)
    _put(out, zero, z, "zero_hpz_partition_size", "zero.zero_hpz_partition_size", _int)  # ZeRO++
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        _put(out, zero, z, key, f"zero.{key}", _bool)
    for what in ("offload_optimizer", "offload_param"):  # device "none" (DeepSpeed's default): no offload
        off = zero.get(what) or {}
        _put(out, off, f"{z}{what}.", "device", f"zero.{what}", _offload_device)
        _put(out, off, f"{z}{what}.", "pin_memory", f"zero.{what}_pin_memory", _bool)
    ac = raw.get("activation_checkpointing") or {}
    for key in ("partition_activations", "cpu_checkpointing"):
        _put(out, ac, "activation_checkpointing.", key, f"activation_checkpointing.{key}", _bool)


def _map_grad_dtype(raw: Mapping[str, Any], out: DeepSpeedSettings) -> None:
    """``communication_data_type`` and ``data_types.grad_accum_dtype``: megazero accumulates and reduces
    gradients in one dtype (``zero.grad_dtype``), so the two must agree when both are given."""
    def read(path: str, v: Any) -> str:
        return _str(path, v, ("fp32", "bf16", "fp16"))

    _put(out, raw, "", "communication_data_type", "zero.grad_dtype", read)
    first = out.values.get("zero.grad_dtype"), out.sources.get("zero.grad_dtype")
    _put(out, raw.get("data_types") or {}, "data_types.", "grad_accum_dtype", "zero.grad_dtype", read)
    if first[0] is not None and out.values["zero.grad_dtype"] != first[0]:
        raise ConfigError(f"{first[1]} and {out.sources['zero.grad_dtype']} disagree: megazero accumulates and "
                          "reduces gradients in one dtype; make them equal or drop one")


def _map_optimizer(opt: Mapping[str, Any] | None, out: DeepSpeedSettings) -> None:
    if opt is None:
        return
    params = opt.get("params") or {}
    kind = str(opt["type"]).lower()
    w_mode = params.get("adam_w_mode", True)
    w_mode = True if w_mode == AUTO else _bool("optimizer.params.adam_w_mode", w_mode)
    if kind == "adamw" and not w_mode:
        _warn("`optimizer.params.adam_w_mode` false is ignored: DeepSpeed's AdamW is always decoupled")
    name = "adamw" if kind == "adamw" or w_mode else "adam"
    out.values["optimizer.name"] = name
    meaning = "decoupled weight decay" if name == "adamw" else "L2-style weight decay"
    default = " (its default)" if "adam_w_mode" not in params else ""
    out.sources["optimizer.name"] = (f"`optimizer.type` = {json.dumps(opt['type'])} with "
                                     f"adam_w_mode {str(w_mode).lower()}{default}, i.e. {meaning}")
    p = "optimizer.params."
    _put(out, params, p, "lr", "optimizer.lr", _float)
    _put(out, params, p, "eps", "optimizer.eps", _float)
    _put(out, params, p, "weight_decay", "optimizer.weight_decay", _float)
    betas = params.get("betas")
    if betas is not None and betas != AUTO:
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"`optimizer.params.betas` must be a list of two numbers, got {betas!r}")
        for i, b in enumerate(betas):
            _put(out, {f"betas[{i}]": b}, p, f"betas[{i}]", f"optimizer.beta{i + 1}", _float)
    # DeepSpeed's (FusedAdam's) defaults for whatever the block leaves out.
    defaults = {"lr": {"optimizer.lr": 1e-3}, "betas": {"optimizer.beta1": 0.9, "optimizer.beta2": 0.999},
                "eps": {"optimizer.eps": 1e-8}, "weight_decay": {"optimizer.weight_decay": 0.0}}
    for key, settings in defaults.items():
        if key not in params:
            out.implied.update(settings)


def _map_scheduler(sched: Mapping[str, Any] | None, out: DeepSpeedSettings) -> None:
    if sched is None:
        return
    kind, params, p = sched["type"], sched.get("params") or {}, "scheduler.params."
    out.values["scheduler.name"] = SCHEDULER_NAMES[kind]
    out.sources["scheduler.name"] = f"`scheduler.type` = {json.dumps(kind)}"
    _put(out, params, p, "warmup_num_steps", "scheduler.warmup_steps", _int)
    _put(out, params, p, "warmup_type", "scheduler.warmup_type", lambda k, v: _str(k, v, ("log", "linear")))
    _put(out, params, p, "total_num_steps", "scheduler.decay_steps", _int)
    implied = {"scheduler.warmup_steps": 1000, "scheduler.warmup_type": "log"}
    if kind == "WarmupCosineLR":
        _put(out, params, p, "warmup_min_ratio", "scheduler.warmup_min_ratio", _float)
        _put(out, params, p, "cos_min_ratio", "scheduler.min_ratio", _float)
        implied.update({"scheduler.warmup_min_ratio": 0.0, "scheduler.min_ratio": 1e-4})
    else:  # WarmupLR, WarmupDecayLR: warmup_max_lr is the peak and overrides the optimizer's lr
        _put(out, params, p, "warmup_min_lr", "scheduler.warmup_min_lr", _float)
        implied["scheduler.warmup_min_lr"] = 0.0
        opt_lr = out.values.get("optimizer.lr")
        peak = params.get("warmup_max_lr", 1e-3)
        if peak != AUTO:
            peak = _float(f"{p}warmup_max_lr", peak)
            if opt_lr is not None and opt_lr != peak:
                said = "" if "warmup_max_lr" in params else " (DeepSpeed's default: the key is missing)"
                raise ConfigError(f"`optimizer.params.lr` = {opt_lr} disagrees with `{p}warmup_max_lr` = "
                                  f"{peak}{said}, and {kind} uses warmup_max_lr as the peak lr; make them "
                                  'equal or set one to "auto"')
            if "warmup_max_lr" in params:
                _put(out, params, p, "warmup_max_lr", "optimizer.lr", _float)
            else:
                out.implied["optimizer.lr"] = peak
    for setting, value in implied.items():
        out.implied.setdefault(setting, value)
    auto = {"warmup_num_steps": "scheduler.warmup_steps", "warmup_type": "scheduler.warmup_type",
            "warmup_min_lr": "scheduler.warmup_min_lr", "warmup_max_lr": "optimizer.lr",
            "warmup_min_ratio": "scheduler.warmup_min_ratio", "cos_min_ratio": "scheduler.min_ratio"}
    for setting in [*out.values, *(auto[k] for k, v in params.items() if v == AUTO and k in auto)]:
        out.implied.pop(setting, None)  # stated, or "auto": the flag or megazero's default, not DeepSpeed's


def _map_precision(raw: Mapping[str, Any], out: DeepSpeedSettings) -> None:
    enabled = []
    for block, precision in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        if not isinstance(raw.get(block), Mapping):
            continue
        flag = raw[block].get("enabled", False)  # DeepSpeed: a block without "enabled" is disabled
        if flag == AUTO:
            continue
        source = f"`{block}.enabled` = {json.dumps(flag)}"
        if _bool(f"{block}.enabled", flag):
            enabled.append(block)
            out.values["training.precision"], out.sources["training.precision"] = precision, source
        else:
            out.excluded.append(("training.precision", precision, source))
    if len(enabled) > 1:
        raise ConfigError(f"`{enabled[0]}.enabled` and `{enabled[1]}.enabled` are both true; enable one")
    fp16, p = raw.get("fp16") or {}, "fp16."
    _put(out, fp16, p, "loss_scale", "loss_scale.loss_scale", _float)
    _put(out, fp16, p, "initial_scale_power", "loss_scale.initial_scale_power", _int)
    _put(out, fp16, p, "loss_scale_window", "loss_scale.loss_scale_window", _int)
    _put(out, fp16, p, "hysteresis", "loss_scale.hysteresis", _int)
    _put(out, fp16, p, "min_loss_scale", "loss_scale.min_loss_scale", _float)
