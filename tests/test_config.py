"""Configuration: flags, presets, DeepSpeed JSON, resolution/validation errors and the lr schedules (pure, fast)."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from megazero.config.cli import build_parser, parse_args
from megazero.config.deepspeed import load_deepspeed_config
from megazero.config.deepspeed_keys import IGNORED_KEYS, NOT_SUPPORTED_KEYS, SUPPORTED_KEYS
from megazero.config.resolve import resolve_config
from megazero.config.schema import (
    PRESETS,
    Config,
    ConfigError,
    ConfigWarning,
    SchedulerConfig,
)
from megazero.train.lr_schedule import lr_at


def ds_args(tmp_path: Path, ds: dict[str, Any], *argv: str) -> Config:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return parse_args(["--deepspeed-config", str(path), *argv])


# ---- command line --------------------------------------------------------------------------------------


def test_no_flags_gives_the_dataclass_defaults() -> None:
    assert parse_args([]) == Config()
    assert vars(build_parser().parse_args([])) == {}  # nothing is "explicit" unless typed


def test_flags_fill_the_dataclasses() -> None:
    cfg = parse_args([
        "--tp", "2", "--pp", "4", "--dp", "3", "--sequence-parallel", "--pp-schedule", "interleaved",
        "--virtual-stages", "2", "--zero-stage", "3", "--micro-batch-size", "8", "--global-batch-size", "96",
        "--train-steps", "1000", "--lr", "6e-4", "--min-lr", "6e-5", "--warmup-steps", "100",
        "--lr-decay-steps", "900", "--weight-decay", "0.01", "--clip-grad", "0.5", "--adam-beta1", "0.8",
        "--adam-beta2", "0.99", "--adam-eps", "1e-6", "--optimizer", "adam", "--precision", "bf16",
        "--seed", "7", "--data", "a.txt", "b.txt", "--tokenizer", "sp.model", "--cache-dir", "/c",
        "--log-dir", "runs/x", "--log-interval", "5", "--no-progress", "--eval-interval", "50",
        "--eval-iters", "3", "--save", "ck", "--save-interval", "100", "--load", "ck0", "--keep-last", "2",
        "--wandb-project", "proj", "--wandb-mode", "offline", "--activation-checkpointing", "selective",
        "--backend", "gloo", "--dist-timeout", "60", "--lr-schedule", "constant",
    ])
    p, t, o, s = cfg.parallel, cfg.training, cfg.optimizer, cfg.scheduler
    assert (p.tp_size, p.pp_size, p.dp_size, p.sequence_parallel) == (2, 4, 3, True)
    assert (p.pp_schedule, p.virtual_stages, p.backend, p.dist_timeout_s) == ("interleaved", 2, "gloo", 60.0)
    assert cfg.zero.stage == 3 and cfg.activation_checkpointing.mode == "selective"
    assert (t.micro_batch_size, t.global_batch_size, t.train_steps, t.seed, t.precision) == (8, 96, 1000, 7, "bf16")
    assert (t.eval_interval, t.eval_iters, t.save, t.save_interval, t.load, t.keep_last) == (50, 3, "ck", 100,
                                                                                              "ck0", 2)
    assert (o.name, o.decoupled_weight_decay, o.lr, o.betas, o.eps) == ("adam", False, 6e-4, (0.8, 0.99), 1e-6)
    assert (o.weight_decay, o.clip_grad) == (0.01, 0.5)
    assert (s.name, s.min_lr, s.warmup_steps, s.decay_steps) == ("constant", 6e-5, 100, 900)
    assert cfg.data.paths == ["a.txt", "b.txt"] and cfg.data.tokenizer == "sp.model" and cfg.data.cache_dir == "/c"
    lg = cfg.logging
    assert (lg.log_dir, lg.log_interval, lg.progress, lg.wandb_project, lg.wandb_mode) == ("runs/x", 5, False,
                                                                                            "proj", "offline")


def test_one_beta_flag_keeps_the_other_default() -> None:
    assert parse_args(["--adam-beta2", "0.999"]).optimizer.betas == (Config().optimizer.betas[0], 0.999)


def test_presets_and_overrides() -> None:
    cfg = parse_args(["--model", "gpt2-124m"])
    assert cfg.model == PRESETS["gpt2-124m"] and cfg.model_preset == "gpt2-124m"
    cfg = parse_args(["--model", "gpt2-350m", "--num-layers", "2", "--seq-len", "256", "--dropout", "0.1"])
    assert (cfg.model.num_layers, cfg.model.seq_len, cfg.model.dropout) == (2, 256, 0.1)
    assert cfg.model.hidden_size == PRESETS["gpt2-350m"].hidden_size
    assert parse_args(["--hidden-size", "64"]).model == PRESETS["tiny"].__class__(
        **{**PRESETS["tiny"].__dict__, "hidden_size": 64})


def test_help_shows_dataclass_defaults_and_bad_choices_exit(capsys: pytest.CaptureFixture[str]) -> None:
    text = build_parser().format_help()
    assert f"(default: {Config().training.micro_batch_size})" in text and "--deepspeed-config FILE" in text
    for argv in (["--zero-stage", "4"], ["--model", "gpt5"], ["--precision", "fp8"], ["--tp", "two"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    capsys.readouterr()


# ---- DeepSpeed JSON ------------------------------------------------------------------------------------


def test_key_tables_are_disjoint() -> None:
    assert not SUPPORTED_KEYS & set(IGNORED_KEYS) and not SUPPORTED_KEYS & set(NOT_SUPPORTED_KEYS)
    assert not set(IGNORED_KEYS) & set(NOT_SUPPORTED_KEYS)


def test_deepspeed_supported_keys_round_trip(tmp_path: Path) -> None:
    cfg = ds_args(tmp_path, {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
        "gradient_clipping": 0.5, "steps_per_print": 7,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.98], "eps": 1e-6,
                                                  "weight_decay": 0.05}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 200, "warmup_num_steps": 20,
                                                           "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05,
                                                           "warmup_type": "linear"}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "hysteresis": 3, "min_loss_scale": 2},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8,
                              "overlap_comm": True, "reduce_scatter": False, "contiguous_gradients": False,
                              "stage3_prefetch_bucket_size": 1e6, "stage3_param_persistence_threshold": 1e4,
                              "stage3_max_live_parameters": 1e8,
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "offload_param": {"device": "none"}},
        "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": False},
    })
    t, o, s, z, ls = cfg.training, cfg.optimizer, cfg.scheduler, cfg.zero, cfg.loss_scale
    assert (t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (64, 4, 8)
    assert (t.precision, cfg.logging.log_interval, cfg.logging.steps_per_print) == ("fp16", 7, 7)
    assert (o.name, o.decoupled_weight_decay, o.lr, o.betas, o.eps, o.weight_decay, o.clip_grad) == (
        "adamw", True, 3e-4, (0.8, 0.98), 1e-6, 0.05, 0.5)
    assert (s.name, s.decay_steps, s.warmup_steps, s.warmup_min_ratio, s.min_ratio, s.warmup_type) == (
        "warmup_cosine_lr", 200, 20, 0.1, 0.05, "linear")
    assert (ls.loss_scale, ls.initial_scale_power, ls.loss_scale_window, ls.hysteresis, ls.min_loss_scale) == (
        0.0, 12, 500, 3, 2.0)
    assert (z.stage, z.reduce_bucket_size, z.allgather_bucket_size, z.overlap_comm, z.reduce_scatter) == (
        3, 50_000_000, 200_000_000, True, False)
    assert (z.contiguous_gradients, z.stage3_prefetch_bucket_size, z.stage3_param_persistence_threshold) == (
        False, 1_000_000, 10_000)
    assert (z.stage3_max_live_parameters, z.offload_optimizer, z.offload_optimizer_pin_memory) == (
        100_000_000, "cpu", True)
    assert z.offload_param is None and cfg.activation_checkpointing.partition_activations
    assert isinstance(z.reduce_bucket_size, int) and cfg.deepspeed_config.endswith("ds.json")


def test_deepspeed_warmup_lr_and_decay(tmp_path: Path) -> None:
    cfg = ds_args(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 50}}})
    s = cfg.scheduler
    assert (s.name, s.warmup_min_lr, cfg.optimizer.lr, s.warmup_steps, s.warmup_type) == (
        "warmup_lr", 1e-5, 2e-3, 50, "log")  # DeepSpeed's warm-up default is log
    cfg = ds_args(tmp_path, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 300}}})
    # Missing params take DeepSpeed's defaults: warmup_max_lr 0.001, 1000 warm-up steps.
    assert (cfg.scheduler.name, cfg.scheduler.decay_steps, cfg.optimizer.lr, cfg.scheduler.warmup_steps) == (
        "warmup_decay_lr", 300, 1e-3, 1000)
    # ...but a flag beats a DeepSpeed default for a key the file does not state.
    assert ds_args(tmp_path, {"scheduler": {"type": "WarmupLR"}}, "--warmup-steps", "5").scheduler.warmup_steps == 5


def test_deepspeed_warmup_max_lr_must_agree_with_optimizer_lr(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warmup_max_lr"):
        ds_args(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                           "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3}}})
    cfg = ds_args(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                             "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    assert cfg.optimizer.lr == 1e-4


def test_deepspeed_adam_means_adamw_unless_adam_w_mode_false(tmp_path: Path) -> None:
    cfg = ds_args(tmp_path, {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    assert (cfg.optimizer.name, cfg.optimizer.decoupled_weight_decay) == ("adamw", True)
    cfg = ds_args(tmp_path, {"optimizer": {"type": "adam", "params": {"adam_w_mode": False}}})
    assert (cfg.optimizer.name, cfg.optimizer.decoupled_weight_decay) == ("adam", False)
    cfg = ds_args(tmp_path, {"optimizer": {"type": "AdamW"}})
    assert (cfg.optimizer.name, cfg.optimizer.decoupled_weight_decay) == ("adamw", True)
    # DeepSpeed's own defaults for the params the block leaves out.
    assert (cfg.optimizer.betas, cfg.optimizer.weight_decay, cfg.optimizer.lr) == ((0.9, 0.999), 0.0, 1e-3)
    with pytest.raises(ConfigError, match=r"--optimizer adam.*adam_w_mode true \(its default\)"):
        ds_args(tmp_path, {"optimizer": {"type": "Adam"}}, "--optimizer", "adam")
    cfg = ds_args(tmp_path, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "--optimizer", "adam")
    assert cfg.optimizer.decoupled_weight_decay is False


def test_deepspeed_ignored_keys_warn(tmp_path: Path) -> None:
    with pytest.warns(ConfigWarning, match="wall_clock_breakdown"):
        cfg = ds_args(tmp_path, {"wall_clock_breakdown": True, "train_micro_batch_size_per_gpu": 2})
    assert cfg.training.micro_batch_size == 2
    with pytest.warns(ConfigWarning, match=r"zero_optimization\.sub_group_size"):
        ds_args(tmp_path, {"zero_optimization": {"stage": 0, "sub_group_size": 1e9}})
    with pytest.warns(ConfigWarning) as record:  # recognised-but-unsupported keys that request nothing
        ds_args(tmp_path, {"amp": {"enabled": False}, "sparse_gradients": False})
    assert ["`amp`" in str(r.message) for r in record] == [True, False]
    assert ["`sparse_gradients`" in str(r.message) for r in record] == [False, True]


@pytest.mark.parametrize("ds, key", [
    ({"amp": {"enabled": True}}, "amp"),
    ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ({"pipeline": {"stages": 2}}, "pipeline"),
    ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
     "zero_optimization.zero_quantized_nontrainable_weights"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "zero_optimization.offload_optimizer.device"),
])
def test_deepspeed_not_supported_yet(tmp_path: Path, ds: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"`{key}`.*recognised but not supported yet by megazero; ") as err:
        ds_args(tmp_path, ds)
    assert any(w in str(err.value) for w in ("use ", "remove ")), err.value  # and what to do instead


def test_deepspeed_alternatives_name_what_to_use(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'`zero_optimization\.cpu_offload`.*use "offload_optimizer"'):
        ds_args(tmp_path, {"zero_optimization": {"stage": 2, "cpu_offload": True}})
    with pytest.raises(ConfigError, match=r"`pipeline`.*use --pp N"):
        ds_args(tmp_path, {"pipeline": {"stages": 2}})


def test_deepspeed_unknown_keys(tmp_path: Path) -> None:
    # top level: DeepSpeed ignores what it does not read, so megazero does, with one warning naming them all
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = ds_args(tmp_path, {"train_batch_sise": 8, "_comment": "x", "train_micro_batch_size_per_gpu": 2})
    assert cfg.training.micro_batch_size == 2 and cfg.training.global_batch_size is None
    [w] = [r for r in record if issubclass(r.category, ConfigWarning)]
    assert "`train_batch_sise` (did you mean `train_batch_size`?)" in str(w.message) and "`_comment`" in str(w.message)
    # inside a block DeepSpeed's pydantic models refuse unknown keys: so does megazero
    with pytest.raises(ConfigError, match=r"`zero_optimization\.stag`; did you mean `zero_optimization\.stage`"):
        ds_args(tmp_path, {"zero_optimization": {"stag": 2}})
    with pytest.raises(ConfigError, match=r"`zero_optimization\.offload_param\.frobnicate`"):
        ds_args(tmp_path, {"zero_optimization": {"offload_param": {"frobnicate": 1}}})
    with pytest.raises(ConfigError, match="unknown `optimizer.type`"):
        ds_args(tmp_path, {"optimizer": {"type": "Adamm"}})
    with pytest.raises(ConfigError, match=r"`scheduler\.params\.cos_min_ratio` is not a parameter of WarmupLR"):
        ds_args(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {"cos_min_ratio": 0.1}}})


def test_deepspeed_bad_values_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`zero_optimization\.stage` must be an integer"):
        ds_args(tmp_path, {"zero_optimization": {"stage": "3"}})
    with pytest.raises(ConfigError, match=r"`fp16\.enabled` and `bf16\.enabled` are both true"):
        ds_args(tmp_path, {"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        ds_args(tmp_path, {"zero_optimization": 2})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        parse_args(["--deepspeed-config", str(tmp_path / "bad.json")])
    with pytest.raises(ConfigError, match="cannot read"):
        parse_args(["--deepspeed-config", str(tmp_path / "missing.json")])


def test_deepspeed_auto_defers_to_flags_and_defaults(tmp_path: Path) -> None:
    ds = {"train_batch_size": "auto", "gradient_clipping": "auto", "zero_optimization": {"stage": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
          "bf16": {"enabled": "auto"}}
    cfg = ds_args(tmp_path, ds, "--global-batch-size", "64", "--zero-stage", "2", "--lr", "5e-4")
    assert (cfg.training.global_batch_size, cfg.zero.stage, cfg.optimizer.lr) == (64, 2, 5e-4)
    default = Config()
    assert (cfg.optimizer.betas, cfg.optimizer.weight_decay) == (default.optimizer.betas, default.optimizer.weight_decay)
    assert cfg.optimizer.clip_grad == default.optimizer.clip_grad and cfg.training.precision is None
    assert cfg.resolve(1).training.precision == "fp32"  # the CPU default; bf16 with device_type="cuda"
    assert load_deepspeed_config(ds).values["optimizer.name"] == "adamw"  # dicts are accepted directly


def test_deepspeed_contradicting_flag_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`--zero-stage 2`.*`zero_optimization\.stage` = 3"):
        ds_args(tmp_path, {"zero_optimization": {"stage": 3}}, "--zero-stage", "2")
    assert ds_args(tmp_path, {"zero_optimization": {"stage": 3}}, "--zero-stage", "3").zero.stage == 3
    with pytest.raises(ConfigError, match=r"--global-batch-size 32.*train_batch_size"):
        ds_args(tmp_path, {"train_batch_size": 64}, "--global-batch-size", "32")
    with pytest.raises(ConfigError, match=r"--adam-beta2 0\.95.*`optimizer\.params\.betas\[1\]` = 0\.999"):
        ds_args(tmp_path, {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}},
                "--adam-beta2", "0.95")
    assert ds_args(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}}, "--lr", "1e-3")
    with pytest.raises(ConfigError, match=r"--precision fp16.*`fp16\.enabled` = false"):
        ds_args(tmp_path, {"fp16": {"enabled": False}}, "--precision", "fp16")
    assert ds_args(tmp_path, {"fp16": {"enabled": False}}, "--precision", "bf16").training.precision == "bf16"
    with pytest.raises(ConfigError, match=r"--lr-schedule cosine.*scheduler\.type"):
        ds_args(tmp_path, {"scheduler": {"type": "WarmupLR"}}, "--lr-schedule", "cosine")


# ---- resolve -------------------------------------------------------------------------------------------


def test_resolve_derives_sizes_without_mutating() -> None:
    cfg = parse_args(["--micro-batch-size", "4", "--global-batch-size", "32", "--train-steps", "50"])
    r = cfg.resolve(4)
    assert (r.parallel.dp_size, r.training.gradient_accumulation_steps, r.scheduler.decay_steps) == (4, 2, 50)
    assert cfg.parallel.dp_size is None and cfg.training.gradient_accumulation_steps is None
    r = resolve_config(parse_args(["--micro-batch-size", "4"]), 2)
    assert (r.training.global_batch_size, r.training.gradient_accumulation_steps) == (8, 1)
    assert r.resolve(2) == r  # idempotent


def test_resolve_world_size_mismatch() -> None:
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by --tp 2 x --pp 1"):
        parse_args(["--tp", "2"]).resolve(3)
    with pytest.raises(ConfigError, match=r"world size 8 != --tp 1 x --pp 1 x --dp 4 = 4"):
        parse_args(["--dp", "4"]).resolve(8)


def test_resolve_model_shape_errors() -> None:
    with pytest.raises(ConfigError, match=r"--num-heads 4 is not divisible by --tp 3"):
        parse_args(["--tp", "3"]).resolve(3)
    with pytest.raises(ConfigError, match=r"--hidden-size 100 is not divisible by --num-heads 3"):
        parse_args(["--hidden-size", "100", "--num-heads", "3"]).resolve(1)
    with pytest.raises(ConfigError, match=r"--num-layers 4 is fewer than the 8 pipeline chunks"):
        parse_args(["--pp", "8"]).resolve(8)
    with pytest.raises(ConfigError, match=r"--num-layers 4 is fewer than the 6 pipeline chunks"):
        parse_args(["--pp", "2", "--pp-schedule", "interleaved", "--virtual-stages", "3"]).resolve(2)
    with pytest.raises(ConfigError, match="--virtual-stages 2 needs --pp-schedule interleaved"):
        parse_args(["--pp", "2", "--virtual-stages", "2"]).resolve(2)


def test_resolve_batch_size_mismatch() -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(["--global-batch-size", "30", "--micro-batch-size", "4"]).resolve(2)
    for part in ("--global-batch-size", "30", "--micro-batch-size", "4", "dp 2", "8"):
        assert part in str(err.value)

def test_resolve_batch_size_mismatch_from_deepspeed_file(tmp_path: Path) -> None:
    cfg = ds_args(tmp_path, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match=r"--global-batch-size \(train_batch_size\) 64 != --micro-batch-size "
                                          r".*4 x gradient_accumulation_steps 4 x dp 2 = 32.*--micro-batch-size 8"):
        cfg.resolve(2)
    assert cfg.resolve(4).training.gradient_accumulation_steps == 4


@pytest.mark.parametrize("argv, message", [
    (["--lr", "-1"], "--lr must be non-negative"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "--min-lr 0.001 exceeds --lr 0.0001"),
    (["--micro-batch-size", "0"], "--micro-batch-size .* must be a positive integer"),
    (["--dropout", "1.5"], r"--dropout must be in \[0, 1\)"),
    (["--save-interval", "10"], "--save-interval needs --save"),
    (["--keep-last", "2"], "--keep-last needs --save"),
    (["--load", "auto"], "--load auto .* pass --save DIR"),
    (["--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--clip-grad", "-1"], "--clip-grad"),
])
def test_resolve_rejects_bad_values(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_args(argv).resolve(1)


@pytest.mark.parametrize("argv, message", [
    (["--warmup-steps", "500", "--train-steps", "100"], "--warmup-steps .* 500 exceeds --train-steps 100"),
    (["--lr-decay-steps", "5", "--warmup-steps", "10"], "--lr-decay-steps .* 5 is before the end of the warm-up"),
])
def test_resolve_warns_about_a_warmup_longer_than_the_run(argv: list[str], message: str) -> None:
    """DeepSpeed trains a short trial of a long recipe (warm-up beyond the run): megazero warns and trains."""
    with pytest.warns(ConfigWarning, match=message):
        cfg = parse_args(argv).resolve(1)
    lrs = [lr_at(i, cfg.scheduler, cfg.optimizer.lr, cfg.training.train_steps) for i in range(12)]
    assert all(0 <= lr <= cfg.optimizer.lr for lr in lrs) and lrs[0] < lrs[4]


def test_resolve_checks_fp16_loss_scale_before_refusing_fp16(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"fp16\.hysteresis must be >= 1"):
        ds_args(tmp_path, {"fp16": {"enabled": True, "hysteresis": 0}}).resolve(1)
    with pytest.raises(ConfigError, match=r"fp16\.min_loss_scale 1024.0 exceeds the initial dynamic scale"):
        ds_args(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 1024}}).resolve(1)


def test_resolve_optimizer_name_must_match_decoupling() -> None:
    from dataclasses import replace

    cfg = Config()
    bad = replace(cfg, optimizer=replace(cfg.optimizer, name="adam"))
    with pytest.raises(ConfigError, match="'adam' is L2-style"):
        bad.resolve(1)


def test_zero3_with_the_interleaved_schedule_resolves() -> None:
    """ZeRO-3 with several model chunks per rank is supported (no longer refused)."""
    cfg = parse_args(["--pp", "2", "--zero-stage", "3", "--pp-schedule", "interleaved", "--virtual-stages", "2",
                      "--num-layers", "4", "--global-batch-size", "32"]).resolve(2)
    assert cfg.zero.stage == 3 and cfg.parallel.virtual_stages == 2


def test_stage3_max_reuse_distance_is_read_and_checked(tmp_path) -> None:
    cfg = ds_args(tmp_path, {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0}}).resolve(1)
    assert cfg.zero.stage3_max_reuse_distance == 0
    with pytest.raises(ConfigError, match="stage3_max_reuse_distance must be >= 0"):
        ds_args(tmp_path, {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": -1}}).resolve(1)


def test_overlap_comm_is_on_with_cuda_and_a_flag_or_the_deepspeed_key_decides() -> None:
    """overlap_comm resolves to on for CUDA and off for the CPU unless set; --overlap-comm/--no-overlap-comm set it
    either way, the DeepSpeed key still does, and a flag contradicting the key is refused like any other flag."""
    assert parse_args([]).resolve(1, "cuda").zero.overlap_comm is True
    assert parse_args([]).resolve(1).zero.overlap_comm is False
    assert parse_args(["--no-overlap-comm"]).resolve(1, "cuda").zero.overlap_comm is False
    assert parse_args(["--overlap-comm"]).resolve(1).zero.overlap_comm is True


def test_overlap_comm_from_the_deepspeed_key(tmp_path) -> None:
    ds = {"zero_optimization": {"stage": 2, "overlap_comm": False}}
    assert ds_args(tmp_path, ds).resolve(1, "cuda").zero.overlap_comm is False
    assert ds_args(tmp_path, ds, "--no-overlap-comm").resolve(1, "cuda").zero.overlap_comm is False
    with pytest.raises(ConfigError, match="--overlap-comm"):
        ds_args(tmp_path, ds, "--overlap-comm")


def test_supported_settings_resolve_cleanly() -> None:
    cfg = parse_args(["--precision", "bf16", "--pp-schedule", "gpipe", "--optimizer", "adam",
                      "--lr-schedule", "warmup_cosine_lr", "--global-batch-size", "64"]).resolve(2)
    assert cfg.training.gradient_accumulation_steps == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config().resolve(1)


# ---- learning-rate schedules ---------------------------------------------------------------------------


def sched(**kw: Any) -> SchedulerConfig:
    return SchedulerConfig(**kw)


def test_cosine_schedule_hand_values() -> None:
    s = sched(name="cosine", warmup_steps=10, decay_steps=110, min_lr=0.1)
    expected = {0: 0.1, 4: 0.5, 9: 1.0, 10: 1.0, 35: 0.1 + 0.45 * (1 + math.cos(math.pi / 4)), 60: 0.55,
                109: 0.1 + 0.45 * (1 + math.cos(math.pi * 0.99)), 110: 0.1, 500: 0.1}
    for step, lr in expected.items():
        assert lr_at(step, s, 1.0, 1000) == pytest.approx(lr), step
    s = sched(name="cosine", min_lr=0.1)  # decay_steps defaults to train_steps, no warm-up
    assert [lr_at(i, s, 1.0, 100) for i in (0, 50, 100)] == pytest.approx([1.0, 0.55, 0.1])


def test_constant_schedule() -> None:
    s = sched(name="constant", warmup_steps=4)
    assert [lr_at(i, s, 2.0, 10) for i in (0, 1, 3, 4, 9, 1000)] == pytest.approx([0.5, 1.0, 2.0, 2.0, 2.0, 2.0])


def test_deepspeed_warmup_lr_hand_values() -> None:
    s = sched(name="warmup_lr", warmup_steps=100, warmup_type="log")
    assert [lr_at(i, s, 1e-3, 10) for i in (0, 9, 99, 100, 5000)] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3, 1e-3])
    s = sched(name="warmup_lr", warmup_steps=100, warmup_type="linear", warmup_min_lr=1e-4)
    assert lr_at(50, s, 1e-3, 10) == pytest.approx(5.5e-4)
    s = sched(name="warmup_lr", warmup_steps=0, warmup_type="linear")  # DeepSpeed warms up >= 2 steps
    assert [lr_at(i, s, 1.0, 10) for i in (0, 1, 2)] == pytest.approx([0.0, 0.5, 1.0])


def test_deepspeed_warmup_decay_lr_hand_values() -> None:
    s = sched(name="warmup_decay_lr", warmup_steps=10, decay_steps=110, warmup_type="linear")
    assert [lr_at(i, s, 1.0, 0) for i in (5, 10, 60, 110, 200)] == pytest.approx([0.5, 1.0, 0.5, 0.0, 0.0])
    s = sched(name="warmup_decay_lr", warmup_steps=10, decay_steps=110, warmup_type="linear", warmup_min_lr=0.2)
    assert [lr_at(i, s, 1.0, 0) for i in (0, 60, 110)] == pytest.approx([0.2, 0.6, 0.2])


def test_deepspeed_warmup_cosine_lr_hand_values() -> None:
    s = sched(name="warmup_cosine_lr", warmup_steps=10, decay_steps=110, warmup_type="linear",
              warmup_min_ratio=0.1, min_ratio=0.01)
    expected = {0: 0.2, 5: 1.1, 9: 1.82, 10: 2 * (0.01 + 0.99 * (1 + math.cos(math.pi / 100)) / 2),
                59: 1.01, 109: 0.02, 500: 0.02}
    for step, lr in expected.items():
        assert lr_at(step, s, 2.0, 0) == pytest.approx(lr), step


def test_lr_at_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        lr_at(-1, sched(), 1.0, 10)
    with pytest.raises(ConfigError, match="unknown learning-rate schedule"):
        lr_at(5, sched(name="linear"), 1.0, 10)


def test_lr_zero_warns_and_a_negative_lr_reaches_its_own_check() -> None:
    """--lr 0 trains nothing: a warning says so. --lr -1e-3 is a number to argparse (it was taken for a missing
    value: "expected one argument"), so --lr's own check names it."""
    with pytest.warns(ConfigWarning, match=r"--lr \(optimizer.params.lr\) is 0: no step will change the weights"):
        parse_args(["--lr", "0"]).resolve(1)
    with pytest.raises(ConfigError, match="--lr must be non-negative, got -0.001"):
        parse_args(["--lr", "-1e-3"]).resolve(1)
    assert parse_args(["--seed", "-3", "--lr", "2e-4"]).training.seed == -3
