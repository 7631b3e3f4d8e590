"""End-to-end training: data-parallel parity with one process, the entry point, metrics.jsonl, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch
from tests.common import SMALL_FLAGS, assert_matches_reference, train_runs
from tests.dist import run_world

ROOT = Path(__file__).resolve().parents[1]


def test_data_parallel_matches_single_process(reference, data_cache, tmp_path):
    runs = [["--micro-batch-size", "4", "--global-batch-size", "8"],   # dp 2, no accumulation
            ["--micro-batch-size", "2", "--global-batch-size", "8"]]   # dp 2, 2 micro-batches per step
    results = run_world(train_runs, 2, runs, data_cache, str(tmp_path))
    for losses, state in results[0]:
        assert_matches_reference(losses, state, reference)
    ref_losses = reference[0]
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it learns


def _launch(args: list[str], env: dict[str, str], nproc: int | None = None, timeout: float = 300):
    if nproc:
        return launch.torchrun(nproc, args, env, timeout)
    return launch.run([sys.executable, str(ROOT / "pretrain" / "gpt.py"), *args], env, timeout)


def test_torchrun_dp2_writes_metrics_with_every_key(subprocess_env, tmp_path):
    r = _launch([*SMALL_FLAGS, "--dp", "2", "--micro-batch-size", "4", "--log-dir", str(tmp_path),
                 "--eval-interval", "5"], subprocess_env, nproc=2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 10/10" in r.stdout and "ETA" in r.stdout
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in records] == [1, 5, 10]
    for key in ("step", "loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "tflops_per_gpu", "mfu",
                "micro_batches", "memory", "comm"):
        assert key in records[-1], key
    assert records[-1]["eval_loss"] is not None
    mem, comm = records[-1]["memory"], records[-1]["comm"]
    assert [m["rank"] for m in mem] == [0, 1] and [m["dp_rank"] for m in mem] == [0, 1]
    for key in ("tp_rank", "pp_rank", "params_bytes", "grads_bytes", "master_params_bytes",
                "optimizer_states_bytes", "activation_peak_bytes", "device_allocated_bytes", "device_peak_bytes",
                "device_reserved_bytes", "host_rss_bytes"):
        assert key in mem[0], key
    n_params = mem[0]["params_bytes"] // 4
    assert mem[0]["optimizer_states_bytes"] == 8 * n_params  # fp32 Adam: two moments
    # plain data parallelism all-reduces the gradient once per step: 2 * Psi elements
    assert [c["volume_elements_per_step"] for c in comm] == [2 * n_params] * 2


def test_default_run_learns(subprocess_env, tmp_path):
    """The README's run command with its built-in defaults (tiny GPT, standard-library corpus)."""
    env = {**subprocess_env}
    env.pop("MEGAZERO_CACHE")  # the default vocabulary differs from the test cache's; use a fresh cache
    env["MEGAZERO_CACHE"] = str(tmp_path / "cache")
    r = _launch(["--log-dir", str(tmp_path / "run")], env, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["loss"] > 6.5 and records[-1]["loss"] < records[0]["loss"] - 2.0, records[-1]["loss"]
    assert records[-1]["eval_loss"] < 5.0
    assert "checkpoint: nothing saved; pass --save DIR to keep the model" in r.stdout, r.stdout[-2000:]
    assert "INFO training the tokenizer (first run only" in r.stdout.splitlines()[0], r.stdout[:2000]  # fresh cache


@pytest.mark.parametrize("args, message", [
    (["--global-batch-size", "10", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--zero-stage", "9"], "--zero-stage"),
])
def test_bad_flags_fail_fast_with_a_clear_message(subprocess_env, args, message):
    r = _launch(args, subprocess_env, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_heads_not_divisible_by_tp_fails_on_every_rank(subprocess_env):
    r = _launch(["--tp", "2", "--num-heads", "3", "--hidden-size", "96"], subprocess_env, nproc=2, timeout=120)
    _assert_rank_errors(r, "--num-heads 3 is not divisible by --tp 2")


def _assert_rank_errors(r: subprocess.CompletedProcess, message: str) -> None:
    """Each rank validates before any collective, so each fails alone with the same message (torchrun may stop
    a peer once the first rank has exited, before the peer prints)."""
    assert r.returncode != 0
    lines = [x for x in r.stderr.splitlines() if x.startswith("error (rank ")]
    assert lines and all(message in x for x in lines), r.stderr


def test_unknown_deepspeed_key_is_named(subprocess_env, tmp_path):
    cfg = tmp_path / "ds.json"
    # DeepSpeed ignores unknown top-level keys (megazero warns, tests/test_ds_config.py) but refuses unknown keys
    # inside zero_optimization: so does megazero, naming the key, on every rank, before any collective
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1, "stgae": 2}}))
    r = _launch(["--deepspeed-config", str(cfg)], subprocess_env, timeout=120)
    assert r.returncode == 2 and "stgae" in r.stderr and "zero_optimization" in r.stderr, r.stderr


def test_world_size_mismatch_fails_on_every_rank_without_hanging(subprocess_env):
    r = _launch(["--dp", "4"], subprocess_env, nproc=2, timeout=120)
    _assert_rank_errors(r, "world size 2")
