"""Checks that need a CUDA device (``pytest -m gpu``; skipped cleanly on machines without one), and the CPU checks
of the harness they rely on.

* the NCCL code path at world size 1 (bf16, CUDA memory figures in metrics.jsonl);
* one process on CPU and on CUDA (TF32 off) train the same model: fp32 within 1e-5, bf16 within bf16's tolerance;
* multi-rank worlds on the one GPU (tests/dist.py ``cuda=True``: every group's device is the GPU, collectives
  over gloo, point-to-point through host copies): tp2 x pp2 x dp2 at ZeRO 0-3 and every schedule at pp 2 match
  one CUDA process;
* at most one host synchronisation per training step (stages 0-2), counted with ``set_sync_debug_mode``;
* attention runs a fused kernel (flash or cuDNN) in bf16.

On any machine: worlds started by forkserver (what a machine with CUDA uses) run, see the environment a test set
after the fork server started, and each rank's recipe keeps TF32 off under the harness's ``MEGAZERO_TF32=0``.
"""

from __future__ import annotations

import json
import os
import warnings
from multiprocessing import forkserver
from pathlib import Path

import pytest
import torch

from tests.common import SMALL_FLAGS, assert_matches_reference, merge_runs, normwise_error
from tests.dist import START_METHOD_ENV, run_world

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[1]
PP_MODEL = ["--num-layers", "8", "--train-steps", "4", "--micro-batch-size", "2", "--global-batch-size", "8"]
PROBE_ENV = "MEGAZERO_TEST_PROBE"


def _tf32_flags() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _harness_probe(ctx, cache: str) -> dict:
    """What a rank sees: its parent process, the probe variable, one all-reduce after a backward, and the TF32
    flags the recipe leaves for a config with ``--tf32`` on (its default), with and without ``MEGAZERO_TF32``."""
    from megazero.config.cli import parse_args
    from megazero.train import recipe

    w = torch.ones(3, requires_grad=True)
    (w * (ctx.rank + 1)).sum().backward()  # autograd in the rank, after the parent's
    ctx.world_group.all_reduce(w.grad)
    cfg = parse_args([*SMALL_FLAGS, "--cache-dir", cache]).resolve(ctx.world_size)
    assert cfg.training.tf32, "the probe needs a config whose --tf32 is on"
    flags = {}
    for env in (os.environ.get("MEGAZERO_TF32"), None):
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as a TF32 run leaves them
        if env is None:
            os.environ.pop("MEGAZERO_TF32", None)
        recipe.apply_compile([], cfg, torch.device("cuda"))  # sets the flags only (no chunks); no GPU needed
        flags[env] = _tf32_flags()
    return {"ppid": os.getppid(), "probe": os.environ.get(PROBE_ENV), "grad": w.grad.tolist(), "tf32": flags}


def test_worlds_start_by_forkserver_with_the_tests_environment_and_tf32_off(data_cache, monkeypatch):
    """The path a machine with CUDA takes, forced here: after a backward in this process, a forkserver world of
    2 ranks runs a backward and an all-reduce, its ranks are not children of this process, a variable set
    after the fork server started reaches them, and the recipe leaves TF32 off in each (on without the
    harness's variable). A forked world (the control, without CUDA only) is this process's children."""
    (torch.ones(2, requires_grad=True) * 2).sum().backward()
    if not torch.cuda.is_available():  # with CUDA, that backward makes a forked rank die at its own
        [forked, _] = run_world(_harness_probe, 2, data_cache, start_method="fork")
        assert forked["ppid"] == os.getpid()
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")
    forkserver.ensure_running()  # the fork server runs from now on, with this environment
    monkeypatch.setenv(PROBE_ENV, "set after the fork server started")
    for r in run_world(_harness_probe, 2, data_cache):
        assert r["ppid"] != os.getpid()
        assert r["probe"] == "set after the fork server started"
        assert r["grad"] == [3.0, 3.0, 3.0]
        assert r["tf32"] == {"0": (False, False), None: (True, True)}


def device_train_runs(ctx, runs: list[list[str]], cache: str, log_dir: str) -> list[tuple[list[float], dict | None]]:
    """:func:`tests.common.train_runs` on the world's device (the GPU in ``cuda=True`` worlds), TF32 off (the
    harness's ``MEGAZERO_TF32=0`` keeps the recipe from turning it back on; checked after each run)."""
    from megazero.config.cli import parse_args
    from megazero.train.loop import run_training

    out = []
    for i, flags in enumerate(runs):
        cfg = parse_args([*SMALL_FLAGS, *flags, "--cache-dir", cache, "--log-dir", f"{log_dir}/{ctx.world_size}-{i}"])
        s = run_training(cfg.resolve(ctx.world_size), ctx, device=ctx.world_group.device, keep_final_state=True)
        if ctx.world_group.device.type == "cuda":
            assert _tf32_flags() == (False, False), "TF32 came back on in a parity rank"
        state = {k: v.cpu() for k, v in s.final_state.items()} if ctx.tp_rank == 0 and ctx.dp_rank == 0 else None
        out.append((s.losses, state))
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("stage", [0, 3])
def test_nccl_world_of_one_trains_in_bf16_and_reports_cuda_memory(stage, subprocess_env, tmp_path):
    from tests import launch

    cmd = ["--backend", "nccl", "--precision", "bf16",
           "--zero-stage", str(stage), "--train-steps", "20", "--log-interval", "10", "--eval-interval", "10",
           "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512",
           "--log-dir", str(tmp_path)]
    r = launch.torchrun(1, cmd, subprocess_env, 600)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    mem = records[-1]["memory"][0]
    assert mem["device_allocated_bytes"] > 0 and mem["device_peak_bytes"] >= mem["device_allocated_bytes"]
    assert records[-1]["mfu"] is None or 0 < records[-1]["mfu"] < 1


@pytest.mark.gpu
@needs_cuda
def test_cpu_and_cuda_train_the_same_model(data_cache, tmp_path):
    """One process, 5 steps: fp32 on CUDA (TF32 off) within 1e-5 of the CPU on losses and weights; bf16 on
    CUDA within 2e-2 of the fp32 losses, while a bf16 run that does not update (lr 0) is not."""
    base = ["--micro-batch-size", "8", "--train-steps", "5"]
    [(cpu_losses, cpu_state)] = run_world(device_train_runs, 1, [base], data_cache, str(tmp_path / "cpu"))[0]
    runs = [base, [*base, "--precision", "bf16"], [*base, "--precision", "bf16", "--lr", "0"]]
    fp32, bf16, frozen = run_world(device_train_runs, 1, runs, data_cache, str(tmp_path / "cuda"), cuda=True)[0]
    assert_matches_reference(*fp32, (cpu_losses, cpu_state), tol=1e-5)

    def worst(losses):
        return max(abs(a - b) / abs(b) for a, b in zip(losses, cpu_losses))

    assert worst(bf16[0]) < 2e-2, (bf16[0], cpu_losses)
    assert worst(frozen[0]) > 2e-2, "negative control: a bf16 run without updates should not match"
    assert normwise_error(bf16[1], cpu_state) < 2e-2


@pytest.mark.gpu
@needs_cuda
def test_multi_rank_worlds_on_one_gpu_match_one_cuda_process(data_cache, tmp_path):
    """tp2 x pp2 x dp2 at ZeRO 0-3 (8 ranks), then GPipe, 1F1B and interleaved at pp 2 (2 ranks), fp32, every
    group on the GPU: losses and weights within 1e-5 of one CUDA process."""
    [ref] = run_world(device_train_runs, 1, [PP_MODEL], data_cache, str(tmp_path / "ref"), cuda=True)[0]
    base = [*PP_MODEL, "--pp", "2", "--tp", "2", "--dp", "2"]
    runs = [[*base, "--zero-stage", str(s)] for s in range(4)]
    for losses, state in merge_runs(run_world(device_train_runs, 8, runs, data_cache, str(tmp_path), pp=2, tp=2,
                                              cuda=True, timeout=600)):
        assert_matches_reference(losses, state, ref)
    runs = [[*PP_MODEL, "--pp", "2", "--micro-batch-size", "1", "--pp-schedule", *s]
            for s in (["gpipe"], ["1f1b"], ["interleaved", "--virtual-stages", "2"])]
    for losses, state in merge_runs(run_world(device_train_runs, 2, runs, data_cache, str(tmp_path), pp=2,
                                              cuda=True, timeout=600)):
        assert_matches_reference(losses, state, ref)


def _sync_counts(ctx, cache: str) -> dict[int, list[int]]:
    """Host synchronisations per training step at ZeRO stages 0-2, counted by torch's sync debug mode."""
    from megazero.config.cli import parse_args
    from megazero.train.engine import Engine

    out = {}
    gen = torch.Generator().manual_seed(0)
    batch = [(torch.randint(0, 512, (2, 32), generator=gen), torch.randint(0, 512, (2, 32), generator=gen))
             for _ in range(2)]
    for stage in (0, 1, 2):
        cfg = parse_args([*SMALL_FLAGS, "--zero-stage", str(stage), "--micro-batch-size", "2", "--global-batch-size",
                          "4", "--cache-dir", cache]).resolve(ctx.world_size)
        engine = Engine(cfg, ctx, ctx.world_group.device)
        engine.train_step(batch)  # warm-up: lazy initialisation may synchronise once
        torch.cuda.synchronize()
        counts = []
        for _ in range(3):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    engine.train_step(batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("called a synchronizing" in str(w.message) for w in caught))
        out[stage] = counts
    return out


@pytest.mark.gpu
@needs_cuda
def test_a_training_step_reads_from_the_device_once(data_cache):
    counts = run_world(_sync_counts, 1, data_cache, cuda=True)[0]
    for stage, per_step in counts.items():
        assert per_step == [1, 1, 1], f"ZeRO stage {stage}: host syncs per step {per_step} (want only the read of loss/norm)"


@pytest.mark.gpu
@needs_cuda
def test_attention_runs_a_fused_kernel_in_bf16():
    """Restricted to flash and cuDNN attention, SDPA raises if neither can run: the forward and backward of
    the model's attention in bf16 must succeed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megazero.config.schema import ModelConfig
    from megazero.distributed.group import Group
    from megazero.model.gpt import CausalSelfAttention

    device = torch.device("cuda", torch.cuda.current_device())
    attn = CausalSelfAttention(ModelConfig(2, 128, 4, 64, 100), Group("tp", [0], None, device=device))
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    attn = attn.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(2, 64, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        y = attn(x)
        y.float().square().mean().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]), pytest.raises(RuntimeError):
        attn.float()(x.detach().float())  # control: no fused flash/cuDNN kernel for fp32, so this must fail
