"""torch.compile of the transformer blocks: one parity world per parallel dimension (dp 2, tp 2 with sequence
parallelism, pp 2) trains with compiled blocks and matches the same run without compile.

Inductor compiles too slowly on two shared CPU cores, so these worlds use the ``aot_eager`` backend
(``MEGAZERO_COMPILE_BACKEND``): Dynamo's capture, graph breaks at the TP collectives, AOTAutograd's joint
forward/backward graphs and guards/recompilation are all exercised; only Inductor's kernel generation is not
(the GPU benchmark, bench/gpu.py, runs Inductor).
"""

from __future__ import annotations

import pytest

from megazero.config.cli import parse_args
from megazero.config.schema import ConfigError
from tests.common import assert_matches_reference, normwise_error, train_runs
from tests.dist import run_world

STEPS = ["--train-steps", "3", "--warmup-steps", "1"]


def _train_and_count(ctx, runs, cache, log_dir):
    """train_runs, plus how many graphs Dynamo captured in this rank (0 if nothing was compiled)."""
    from torch._dynamo.utils import counters

    out = train_runs(ctx, runs, cache, log_dir)
    return out, counters["stats"]["unique_graphs"]


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv("MEGAZERO_COMPILE_BACKEND", "aot_eager")  # forked ranks inherit it


@pytest.mark.parametrize("world, flags, grid", [
    (2, ["--dp", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--zero-stage", "2"], {}),
    (2, ["--tp", "2", "--sequence-parallel", "--micro-batch-size", "8"], {"tp": 2}),
    (2, ["--pp", "2", "--micro-batch-size", "4", "--global-batch-size", "8"], {"pp": 2}),
], ids=["dp2", "tp2-sp", "pp2"])
def test_compiled_blocks_match_eager(aot_eager, data_cache, tmp_path, world, flags, grid):
    runs = [[*flags, *STEPS, "--no-compile"], [*flags, *STEPS, "--compile"]]
    results = run_world(_train_and_count, world, runs, data_cache, str(tmp_path), timeout=600, **grid)
    assert all(graphs > 0 for _, graphs in results)  # the blocks really ran compiled
    results = [r for r, _ in results]
    for rank_result in results:
        (eager_losses, eager_state), (losses, state) = rank_result
        if eager_state is not None:
            assert normwise_error(state, eager_state) < 1e-5
        assert_matches_reference(losses, None, (eager_losses, None))
    assert len(results[0][1][0]) == 3


def test_compile_defaults_and_refusal():
    assert parse_args([]).resolve(1).training.compile is False  # CPU: off
    assert parse_args([]).resolve(1, device_type="cuda").training.compile is True
    assert parse_args(["--no-compile"]).resolve(1, device_type="cuda").training.compile is False
    assert parse_args(["--zero-stage", "3"]).resolve(1, device_type="cuda").training.compile is False
    with pytest.raises(ConfigError, match="--compile with --zero-stage 3 is not supported yet"):
        parse_args(["--compile", "--zero-stage", "3"]).resolve(1, device_type="cuda")
    t = parse_args([]).resolve(1, device_type="cuda").training
    assert (t.precision, t.tf32) == ("bf16", True)
    assert parse_args(["--no-tf32"]).resolve(1).training.tf32 is False


def _graphs_and_timeouts(ctx, cache: str, log_dir: str) -> dict:
    """Per layer count (Dynamo reset in between): unique graphs, graph breaks, the collective timeouts the loop
    set, and the TP group's timeout after the run."""
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    import megazero.train.loop as loop
    from tests.common import SMALL_FLAGS

    set_timeout = loop.set_collective_timeout
    out = {}
    for layers in (2, 4):
        torch._dynamo.reset()
        counters.clear()
        timeouts: list[float] = []
        loop.set_collective_timeout = lambda s, groups, log=timeouts: log.append(s) or set_timeout(s, groups)
        flags = [*SMALL_FLAGS, "--num-layers", str(layers), "--tp", "2", "--sequence-parallel", "--dropout", "0.1",
                 "--micro-batch-size", "8", "--train-steps", "1", "--compile", "--dist-timeout", "100",
                 "--cache-dir", cache, "--log-dir", f"{log_dir}/{layers}"]
        loop.run_training(parse_args(flags).resolve(ctx.world_size), ctx)
        backend = ctx.tp_group.process_group._get_backend(torch.device("cpu"))
        out[layers] = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), timeouts,
                       backend.options._timeout.total_seconds())
    loop.set_collective_timeout = set_timeout
    return out


def test_graphs_do_not_grow_with_layers_and_the_first_step_waits_longer(aot_eager, data_cache, tmp_path):
    """tp 2 + SP with dropout, 2 vs 4 compiled blocks: the same unique graphs and graph breaks (each block reuses
    the first block's graphs; a block breaks at its TP collectives and forked-RNG regions, a bounded number); the
    first step runs under the long collective timeout, every later one under --dist-timeout."""
    from megazero.distributed.timeouts import FIRST_STEP_TIMEOUT_S

    got = run_world(_graphs_and_timeouts, 2, data_cache, str(tmp_path), tp=2, timeout=600)[0]
    (graphs2, breaks2, timeouts2, after2), (graphs4, breaks4, _, after4) = got[2], got[4]
    assert 0 < graphs2 == graphs4 <= 10, got
    assert breaks2 == breaks4 <= 20, got  # break sites in the frames of one block, traced once for all blocks
    assert timeouts2[0] == timeouts2[1] == FIRST_STEP_TIMEOUT_S and timeouts2[-1] == 100, got
    assert after2 == after4 == 100, got


def test_first_step_timeout_policy_and_fallback(monkeypatch):
    import torch.distributed as dist

    from megazero.distributed.timeouts import first_step_timeout_s, set_collective_timeout

    assert first_step_timeout_s(300, compile=True, device_type="cpu") == 1800
    assert first_step_timeout_s(300, compile=False, device_type="cuda") == 1800
    assert first_step_timeout_s(3600, compile=True, device_type="cuda") == 3600  # never shorter than configured
    assert first_step_timeout_s(300, compile=False, device_type="cpu") == 300  # gloo, eager: nothing to wait for
    monkeypatch.delattr(dist.distributed_c10d, "_set_pg_timeout")
    assert set_collective_timeout(1800, []) is False  # a torch without the private setter: nothing changes
