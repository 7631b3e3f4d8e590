"""Checkpoints written before the layout change still load.

``tests/fixtures/checkpoint_f8ddfa0`` was saved by commit f8ddfa0 (the tree before the packages by role):
``torchrun --nproc-per-node 4 pretrain/gpt.py --tp 2 --num-layers 2 --hidden-size 32 --num-heads 2 --seq-len 16
--vocab-size 512 --train-steps 2 --micro-batch-size 2 --global-batch-size 4 --zero-stage 1 --save ...``.
``expected.json`` holds, from the same commit, each merged parameter's shape, sum and norm
(``tools/convert_checkpoint.py``) and the loss of step 3 after resuming at tp 1, dp 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from megazero.config.cli import parse_args
from megazero.train.loop import run_training
from tests.dist import run_world

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "checkpoint_f8ddfa0"
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-heads", "2", "--seq-len", "16", "--vocab-size", "512",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--zero-stage", "1", "--eval-interval", "0",
         "--no-progress", "--load", str(FIXTURE)]


def _resume(ctx, cache: str, log_dir: str) -> tuple[dict, list[float]]:
    weights = {}
    for steps in (2, 3):  # 2: load only (the saved weights); 3: one more step on the restored optimizer
        cfg = parse_args([*FLAGS, "--train-steps", str(steps), "--cache-dir", cache, "--log-dir", f"{log_dir}/{steps}"])
        summary = run_training(cfg.resolve(ctx.world_size), ctx, keep_final_state=steps == 2)
        if steps == 2:
            weights = {k: [list(v.shape), float(v.double().sum()), float(v.double().norm())]
                       for k, v in summary.final_state.items()}
    return weights, summary.losses


def test_checkpoint_of_the_previous_layout_loads(data_cache, tmp_path):
    expected = json.loads((FIXTURE / "expected.json").read_text())
    weights, losses = run_world(_resume, 1, data_cache, str(tmp_path))[0]
    assert set(weights) == set(expected["params"])
    for name, (shape, total, norm) in expected["params"].items():
        got_shape, got_total, got_norm = weights[name]
        assert got_shape == shape, name
        assert math.isclose(got_norm, norm, rel_tol=1e-6) and math.isclose(got_total, total, rel_tol=1e-5,
                                                                          abs_tol=1e-6), name
    assert math.isclose(losses[0], expected["resumed_step3_loss_tp1"], rel_tol=1e-5)
