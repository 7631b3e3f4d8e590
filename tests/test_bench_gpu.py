"""bench/gpu.py runs end to end in its CPU smoke mode (the GPU figures need a CUDA machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_bench_smoke_run_on_cpu(subprocess_env, tmp_path):
    out = tmp_path / "gpu.json"
    cmd = [sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--model", "tiny", "--steps", "2",
           "--warmup", "1", "--no-compile", "--json", str(out)]
    r = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["torch"] and res["matmul_ceiling_tflops"] > 0
    for key in ("megazero", "plain"):
        run = res[key]
        assert run["micro_batch"] == 2 and len(run["step_s"]) == 2 and len(run["losses"]) == 3
        assert run["tokens_per_s"] > 0 and run["tflops_per_gpu"] > 0 and run["mfu"] is None  # no CPU peak
        assert all(5.0 < loss < 9.0 for loss in run["losses"])  # ~ln(1024) at init: real training steps
    assert res["ratio_tokens_per_s"] > 0 and res["megazero"]["estimate_device_bytes"] > 0
    assert "megazero / plain tokens/s" in r.stdout
