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
