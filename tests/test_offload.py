"""ZeRO-Offload: optimizer states (stages 1-3) and parameter shards (stage 3) in host memory.

Parity with the run without offload, and the measured split of model states between device and host
against the estimator. On this CPU-only machine device and host are the same memory, so the split is
measured from where each tensor is held (the optimizer's host buffers vs the model's), not from a device
allocator; the code path (host copies, chunked host Adam, write-back) is the one a GPU run takes.
"""

from __future__ import annotations

import torch

from megazero.cli import parse_args
from megazero.engine import Engine
from megazero.estimate import model_state_bytes
from tests.common import assert_matches_reference, train_runs
from tests.dist import run_world

DP2 = ["--dp", "2", "--micro-batch-size", "4"]


def test_offload_matches_single_process(reference, data_cache, tmp_path):
    runs = [[*DP2, "--zero-stage", "1", "--offload-optimizer"],
            [*DP2, "--zero-stage", "2", "--offload-optimizer"],
            [*DP2, "--zero-stage", "3", "--offload-optimizer", "--offload-param"]]
    for losses, state in run_world(train_runs, 2, runs, data_cache, str(tmp_path))[0]:
        assert_matches_reference(losses, state, reference)


def test_bf16_offload_trains_exactly_like_no_offload(data_cache, tmp_path):
    base = [*DP2, "--precision", "bf16", "--zero-stage", "2"]
    (with_offload, _), (without, _) = run_world(train_runs, 2, [[*base, "--offload-optimizer"], base],
                                                data_cache, str(tmp_path))[0]
    assert with_offload == without  # the same arithmetic, only where it runs differs


def _states(ctx, cache: str):
    out = {}
    for stage, flags in ((1, ["--offload-optimizer"]), (2, ["--offload-optimizer"]), (2, []),
                         (3, ["--offload-optimizer", "--offload-param"])):
        cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32",
                          "--vocab-size", "512", "--precision", "bf16", "--zero-stage", str(stage), "--cache-dir",
                          cache, *DP2, *flags]).resolve(ctx.world_size)
        from dataclasses import replace

        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=0))
        engine = Engine(cfg, ctx)
        batch = [(torch.randint(0, 512, (4, 32)), torch.randint(0, 512, (4, 32)))]
        engine.train_step(batch)
        psi = sum(p.numel() for p in engine.model.parameters())
        out[(stage, tuple(flags))] = (engine.optimizer.model_state_bytes(), psi)
    return out


def test_measured_host_and_device_model_states_match_the_estimator(data_cache):
    for rank_result in run_world(_states, 2, data_cache):
        for (stage, flags), (measured, psi) in rank_result.items():
            est = model_state_bytes(psi, stage, 2, "bf16", offload_optimizer="--offload-optimizer" in flags,
                                    offload_param="--offload-param" in flags)
            device = sum(measured[k] for k in ("params_bytes", "grads_bytes", "master_params_bytes",
                                               "optimizer_states_bytes")) - measured["offloaded_bytes"]
            for got, want in ((measured["offloaded_bytes"], est.offloaded), (device, est.device)):
                assert abs(got - want) <= 0.01 * want + 64, (stage, flags, measured, est)
        # offloading the optimizer leaves 2Ψ + 2Ψ/Nd of a stage-2 rank's 2Ψ + 14Ψ/Nd on the device
        off, psi = rank_result[(2, ("--offload-optimizer",))]
        on, _ = rank_result[(2, ())]
        assert off["offloaded_bytes"] == on["master_params_bytes"] + on["optimizer_states_bytes"]
