"""Checks that need a CUDA device: the NCCL code path at world size 1, bf16, CUDA memory figures.

Skipped cleanly on machines without a GPU (the CPU suite covers the same logic over gloo).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("stage", [0, 3])
def test_nccl_world_of_one_trains_in_bf16_and_reports_cuda_memory(stage, subprocess_env, tmp_path):
    from tests import launch

    cmd = ["--backend", "nccl", "--precision", "bf16",
           "--zero-stage", str(stage), "--train-steps", "20", "--log-interval", "10", "--eval-interval", "0",
           "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "512",
           "--log-dir", str(tmp_path)]
    r = launch.torchrun(1, cmd, subprocess_env, 600)
    assert r.returncode == 0, r.stdout + r.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]
    mem = records[-1]["memory"][0]
    assert mem["device_allocated_bytes"] > 0 and mem["device_peak_bytes"] >= mem["device_allocated_bytes"]
    assert records[-1]["mfu"] is None or 0 < records[-1]["mfu"] < 1
