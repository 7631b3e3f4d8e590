"""DeepSpeed configs as users bring them: on every fixture in tests/fixtures/ds_configs (DeepSpeed-docs and
fine-tuning-tutorial style), megazero's verdict equals the one DeepSpeed's own config parser gave
(``NAME.verdict.json``, recorded by record_verdicts.py with DeepSpeed installed), except the documented keys
DeepSpeed honours and megazero cannot, which are refused naming the key and what to use instead. Accepted
tutorial configs with CPU offload and a warm-up longer than the run then train."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import pytest

from megazero.config.cli import parse_args
from megazero.config.schema import ConfigError, ConfigWarning
from tests.dist import run_world

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ds_configs"
CONFIGS = sorted(p for p in FIXTURES.glob("*.json") if not p.name.endswith(".verdict.json"))
# DeepSpeed honours these and megazero cannot: refused, naming the key and the alternative (regexes)
REFUSED_BY_DESIGN = {
    "nvme_offload.json": r'`zero_optimization\.offload_(optimizer|param)\.device` "nvme".*use "cpu"',
    "lamb_optimizer.json": r'`optimizer\.type` "Lamb".*use "Adam" or "AdamW"',
}
# Configs whose settings need more ranks than one: judged at this world size. DeepSpeed's parser takes them at
# any size; its engine asserts that hpZ's partition divides the world when it starts, as megazero's check does.
WORLD_SIZE = {"zeropp_docs_zero3.json": 32}  # the ZeRO++ tutorial: hpZ over 16 ranks (one node of 16)
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512",
        "--train-steps", "2", "--eval-interval", "0", "--no-progress"]


def megazero_verdict(path: Path, world_size: int = 1) -> tuple[str, str, list[str]]:
    """(accept | refuse, error message, warnings) for ``--deepspeed-config path`` at ``world_size``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        try:
            parse_args(["--deepspeed-config", str(path)]).resolve(world_size)
            verdict, error = "accept", ""
        except ConfigError as e:
            verdict, error = "refuse", str(e)
    return verdict, error, [str(w.message) for w in record if issubclass(w.category, ConfigWarning)]


def test_fixtures_have_recorded_verdicts() -> None:
    assert len(CONFIGS) >= 12
    verdicts = {p.name: json.loads(p.with_suffix(".verdict.json").read_text()) for p in CONFIGS}
    assert {v["verdict"] for v in verdicts.values()} == {"accept", "refuse"}
    assert all(v["deepspeed"] for v in verdicts.values())
    assert all(verdicts[name]["verdict"] == "accept" for name in REFUSED_BY_DESIGN)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_verdict_matches_deepspeed(path: Path) -> None:
    deepspeed = json.loads(path.with_suffix(".verdict.json").read_text())
    verdict, error, _ = megazero_verdict(path, WORLD_SIZE.get(path.name, 1))
    if path.name in REFUSED_BY_DESIGN:
        assert verdict == "refuse", f"{path.name} is documented as refused, but megazero accepts it"
        assert re.search(REFUSED_BY_DESIGN[path.name], error), error
    else:
        assert verdict == deepspeed["verdict"], (f"{path.name}: DeepSpeed says {deepspeed['verdict']} "
                                                 f"({deepspeed.get('error', '')}), megazero {verdict}: {error}")


def test_accepted_configs_warn_as_promised() -> None:
    _, _, warned = megazero_verdict(FIXTURES / "tutorial_bf16_zero2_extra_keys.json")
    top = [w for w in warned if "top-level DeepSpeed config keys" in w]
    assert len(top) == 1 and "`_comment`" in top[0] and "`model_name`" in top[0], warned
    _, _, warned = megazero_verdict(FIXTURES / "trial_run_long_warmup.json")
    assert any("--warmup-steps (scheduler.params.warmup_num_steps) 500 exceeds --train-steps" in w for w in warned)
    # DeepSpeed's batch arithmetic: train_batch_size 16 with 2 accumulation steps -> micro-batch 8 per rank
    cfg = parse_args(["--deepspeed-config", str(FIXTURES / "ds_docs_zero1_fp16.json")]).resolve(1)
    assert (cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps) == (8, 2)
    # "auto" takes the flag, or the default
    hf = parse_args(["--deepspeed-config", str(FIXTURES / "hf_trainer_zero3.json"), "--micro-batch-size", "2",
                     "--lr", "5e-4", "--clip-grad", "0.5"]).resolve(2)
    assert (hf.training.micro_batch_size, hf.optimizer.lr, hf.optimizer.clip_grad) == (2, 5e-4, 0.5)
    assert hf.training.precision == "fp32" and hf.zero.stage3_prefetch_bucket_size > 0
    assert (hf.zero.offload_param, hf.zero.offload_param_pin_memory) == ("cpu", True)


def test_keys_without_effect_at_the_stage_are_ignored_as_deepspeed_ignores_them(tmp_path) -> None:
    """The Trainer's ZeRO-2 example with a stage-3 `offload_param` (DeepSpeed 0.19.8 accepts it, see its
    verdict): accepted, the key dropped with a warning; so are stage3_* keys at stage 2 and offload_optimizer
    at stage 0. The flag --offload-param below stage 3 still refuses (the user asked for it)."""
    path = FIXTURES / "hf_trainer_zero2_offload_param.json"
    verdict, error, warned = megazero_verdict(path)
    assert verdict == "accept", error
    said = [w for w in warned if "no effect at ZeRO stage 2" in w]
    assert len(said) == 1 and "`zero_optimization.offload_param.device` = \"cpu\"" in said[0], warned
    cfg = parse_args(["--deepspeed-config", str(path)]).resolve(1)
    assert (cfg.zero.stage, cfg.zero.offload_param, cfg.zero.offload_optimizer) == (2, None, "cpu")
    auto = json.loads(path.read_text())
    auto["zero_optimization"]["stage"] = "auto"
    (tmp_path / "auto.json").write_text(json.dumps(auto))
    with_flag = parse_args(["--deepspeed-config", str(tmp_path / "auto.json"), "--zero-stage", "3"]).resolve(1)
    assert with_flag.zero.offload_param == "cpu"  # at stage 3 it counts
    other = tmp_path / "stage0.json"
    other.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": 0, "offload_optimizer": {"device": "cpu"}, "stage3_prefetch_bucket_size": 100}}))
    verdict, error, warned = megazero_verdict(other)
    assert verdict == "accept" and any("`zero_optimization.stage3_prefetch_bucket_size` = 100 have no effect at "
                                       "ZeRO stage 0" in w for w in warned), (error, warned)
    with pytest.raises(ConfigError, match="offload_param needs ZeRO stage 3"):
        parse_args(["--offload-param", "--zero-stage", "2"]).resolve(1)


def test_zeropp_keys_take_effect_at_stage_3_and_are_ignored_below_it() -> None:
    """The ZeRO++ tutorial's block (DeepSpeed accepts it) sets hpZ, qwZ and qgZ; at stage 2 DeepSpeed reads none of
    them (accepted, recorded verdict), and megazero drops them with a warning; a negative partition size is refused
    by both."""
    cfg = parse_args(["--deepspeed-config", str(FIXTURES / "zeropp_docs_zero3.json")]).resolve(32)
    z = cfg.zero
    assert (z.stage, z.zero_hpz_partition_size, z.zero_quantized_weights, z.zero_quantized_gradients) == (
        3, 16, True, True)
    with pytest.raises(ConfigError, match=r"\(zero_hpz_partition_size\) 16 does not divide the 1 ZeRO"):
        parse_args(["--deepspeed-config", str(FIXTURES / "zeropp_docs_zero3.json")]).resolve(1)
    verdict, error, warned = megazero_verdict(FIXTURES / "zeropp_stage2_keys.json")
    assert verdict == "accept" and any("no effect at ZeRO stage 2" in w and "zero_hpz_partition_size" in w
                                       for w in warned), (error, warned)
    verdict, error, _ = megazero_verdict(FIXTURES / "zeropp_bad_hpz.json")
    assert verdict == "refuse" and "zero_hpz_partition_size" in error


def test_steps_per_print_yields_to_log_interval() -> None:
    """steps_per_print only sets how often DeepSpeed prints: without a flag it sets the log interval, beside an
    explicit --log-interval it yields with a warning (it was refused as a contradiction); a setting that
    changes training still refuses."""
    path = str(FIXTURES / "steps_per_print.json")
    assert parse_args(["--deepspeed-config", path]).resolve(1).logging.log_interval == 2000
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = parse_args(["--deepspeed-config", path, "--log-interval", "1"]).resolve(1)
    assert cfg.logging.log_interval == 1
    assert any("`--log-interval 1` takes precedence over the DeepSpeed config's `steps_per_print` = 2000" in
               str(w.message) for w in record), [str(w.message) for w in record]
    with pytest.raises(ConfigError, match="contradicts the DeepSpeed config"):
        parse_args(["--deepspeed-config", path, "--lr", "1e-3"])


def _train_fixtures(ctx, cache: str, log_dir: str) -> dict[str, list[float]]:
    from megazero.train.loop import run_training

    runs = {"hf_trainer_zero2.json": ["--micro-batch-size", "2", "--global-batch-size", "8"],
            "hf_trainer_zero3.json": ["--micro-batch-size", "2", "--global-batch-size", "8"],
            "trial_run_long_warmup.json": []}
    out = {}
    for name, flags in runs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigWarning)
            cfg = parse_args([*TINY, *flags, "--deepspeed-config", str(FIXTURES / name), "--cache-dir", cache,
                              "--log-dir", f"{log_dir}/{name}"]).resolve(ctx.world_size)
        assert cfg.zero.offload_optimizer == ("cpu" if name.startswith("hf_") else None)
        out[name] = run_training(cfg, ctx).losses
    return out


def test_tutorial_configs_train_with_cpu_offload_at_dp2(data_cache, tmp_path) -> None:
    [losses, _] = run_world(_train_fixtures, 2, data_cache, str(tmp_path))
    for name, ls in losses.items():
        assert len(ls) == 2 and all(math.isfinite(x) for x in ls), (name, ls)
