"""tools/plan.py and its model (megazero.plan.roofline, megazero.plan.search): pure arithmetic, no ranks."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from megazero.config.cli import parse_args
from megazero.config.schema import model_preset
from megazero.plan.estimate import model_state_bytes, rank_parameter_numels
from megazero.plan.roofline import GPUS, bubble_fraction, cluster, collective_seconds, group_nodes, step_time
from megazero.plan.search import Layout, dp_volume, evaluate, layouts, search, torchrun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, *path.split("/")))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plan_tool():
    spec = importlib.util.spec_from_file_location("plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_collective_and_bubble_arithmetic():
    c = cluster("h100", 8)
    # 1e9 logical elements of 2 bytes on a ring of 4 inside a node: 2e9 * 3/4 / 450e9
    assert collective_seconds(1e9, 2, 4, False, c) == pytest.approx(2e9 * 0.75 / 450e9)
    assert collective_seconds(1e9, 2, 4, True, c) == pytest.approx(2e9 * 0.75 / 50e9)
    assert collective_seconds(1e9, 2, 1, True, c) == 0.0
    assert bubble_fraction(4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction(1, 8) == 0.0
    assert group_nodes([0, 8, 16], 8) == 3 and group_nodes(list(range(8)), 8) == 1


def test_cluster_overrides_and_unknown_gpu():
    c = cluster("a100", 4, memory_bytes=40e9, efficiency=0.3, peak_tflops=100)
    assert c.gpus_per_node == 4 and c.gpu.memory_bytes == 40e9 and c.efficiency == 0.3
    assert c.gpu.peak_flops["bf16"] == 100e12
    with pytest.raises(ValueError, match="--gpu"):
        cluster("tpu-v9")
    assert set(GPUS) >= {"h100", "h100-pcie", "h200", "a100", "a100-40gb"}


# datasheet figures: dense bf16 TFLOP/s, memory GB, HBM TB/s, intra-node GB/s per direction (NVLink 4/5/3 at
# 900/1800/600 GB/s bidirectional; PCIe Gen5/Gen4 x16), inter-node GB/s per GPU (one 400/200/100 Gb/s port)
PUBLISHED = {"h100": (989.4, 80, 3.35, 450, 50), "h200": (989.4, 141, 4.8, 450, 50),
             "b200": (2250, 180, 8.0, 900, 50), "h100-pcie": (756, 80, 2.0, 64, 50), "a100": (312, 80, 2.039, 300, 25),
             "a100-40gb": (312, 40, 1.555, 300, 25), "l40s": (362, 48, 0.864, 32, 12.5)}


@pytest.mark.parametrize("gpu", sorted(PUBLISHED))
def test_gpu_table_matches_the_datasheets(gpu):
    tflops, mem_gb, hbm_tbs, intra_gbs, inter_gbs = PUBLISHED[gpu]
    spec = GPUS[gpu]
    got = (spec.peak_flops["bf16"] / 1e12, spec.memory_bytes / 1e9, spec.hbm_bytes_per_s / 1e12,
           spec.intra_node_bytes_per_s / 1e9, spec.inter_node_bytes_per_s / 1e9)
    assert got == pytest.approx((tflops, mem_gb, hbm_tbs, intra_gbs, inter_gbs), rel=0.01)


def test_step_time_parts():
    c = cluster("h100", 8, efficiency=0.5)
    t = step_time(c=c, precision="bf16", global_batch=8, seq_len=1024, num_layers=24, hidden=2048, vocab=50304,
                  checkpointing="none", tp=2, pp=2, dp=2, micro_batches=4, virtual_stages=1, tp_elements=1e8,
                  pp_elements=1e7, dp_grad_elements=1e9, dp_param_elements=0, grad_bytes=4, owned_params=1e8,
                  offload=False, tp_crosses=False, pp_crosses=False, dp_crosses=True)
    assert t.bubble == pytest.approx(t.compute * 1 / 4)
    assert t.dp_comm == pytest.approx(1e9 * 4 * 0.5 / 50e9)
    assert t.tp_comm == pytest.approx(1e8 * 2 * 0.5 / 450e9)
    assert t.pp_comm == pytest.approx(1e7 * 2 / 450e9)
    assert t.total == pytest.approx(t.compute + t.bubble + t.tp_comm + t.pp_comm + t.dp_comm + t.optimizer)


def test_dp_volume_matches_the_design_formulas():
    psi, m = 1000.0, 4
    assert sum(dp_volume(0, psi, m)) == 2 * psi
    assert sum(dp_volume(1, psi, m)) == 2 * psi
    assert sum(dp_volume(2, psi, m)) == (m + 1) * psi
    assert sum(dp_volume(3, psi, m)) == 3 * m * psi
    # a chunk's own units (here 100 elements) are gathered once per micro-batch where a rank runs one chunk
    assert sum(dp_volume(3, psi, m, 100.0)) == 3 * m * psi - m * 100


def test_evaluate_states_follow_the_estimator():
    model = model_preset("gpt2-350m")
    c = cluster("h100", 8)
    lay = Layout(tp=2, pp=1, dp=4, zero_stage=1, micro_batch_size=2)
    plan = evaluate(model, lay, 32, c, "fp32")
    numels = list(rank_parameter_numels(model, 2, 1, 0).values())
    assert plan.states_bytes == pytest.approx(model_state_bytes(numels, 1, 4, "fp32").device)
    assert plan.dp_bytes == pytest.approx(2 * sum(numels) * 4)
    assert plan.fits and plan.time.total > 0


def test_search_prunes_what_does_not_fit_and_ranks_by_time():
    big = model_preset("gpt2-1.3b", num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048)
    plans, tried = search(big, 8, 16, cluster("h100", 8), micro_batch_sizes=(1,), stages=(0,))
    assert tried > 0 and plans == []  # a 175B model cannot train on 8 GPUs without ZeRO
    small = model_preset("gpt2-124m")
    plans, tried = search(small, 16, 64, cluster("h100", 8), micro_batch_sizes=(1, 4))
    assert len(plans) == tried > 20
    times = [p.time.total for p in plans]
    assert times == sorted(times)


def test_layouts_are_valid_configs():
    """Every enumerated layout is accepted by the real configuration checks."""
    model = model_preset("gpt2-124m")
    cands = layouts(model, 16, 32, 8, micro_batch_sizes=(1, 2))
    assert any(lay.virtual_stages > 1 for lay in cands) and any(lay.offload for lay in cands)
    for lay in cands[::7]:
        cfg = parse_args(["--model", "gpt2-124m", *lay.flags(), "--global-batch-size", "32"]).resolve(16)
        assert (cfg.parallel.tp_size, cfg.parallel.pp_size, cfg.parallel.dp_size) == (lay.tp, lay.pp, lay.dp)


def test_plan_tool_prints_ten_and_a_command(capsys):
    code = _plan_tool().main(["--model", "gpt2-1.3b", "--gpus", "128", "--gpu", "h100", "--gpus-per-node", "8",
                              "--global-batch-size", "1024"])
    out = capsys.readouterr().out
    assert code == 0
    assert ("roofline assumes 50% of 989 TFLOP/s (bf16 dense peak of H100 SXM 80GB; --efficiency), NVLink 450 GB/s"
            " and network 50 GB/s per GPU and direction") in out
    table = [ln for ln in out.splitlines() if ln.strip()[:2].strip().isdigit()]
    assert len(table) == 10
    cmd = out.strip().splitlines()[-1].strip()
    assert cmd.startswith("torchrun --nnodes 16 --nproc-per-node 8")
    flags = cmd.split("pretrain/gpt.py", 1)[1].split()
    cfg = parse_args(flags).resolve(128)
    assert cfg.training.global_batch_size == 1024


def test_torchrun_command_single_node():
    plan = evaluate(model_preset("gpt2-124m"), Layout(2, 1, 4, 2, 4), 32, cluster("h100", 8))
    cmd = torchrun_command(plan, ["--model", "gpt2-124m"], 32, "bf16", 8)
    assert cmd.startswith("torchrun --nnodes 1 --nproc-per-node 8 pretrain/gpt.py") and "--rdzv" not in cmd


def test_dry_run_plans_with_the_cuda_defaults(tmp_path, capsys):
    """``--dry-run`` resolves the defaults a CUDA run gets (bf16, compiled blocks) and runs CUDA's kernels; with
    ``--device-type cpu`` those of a CPU run (fp32, no compile, the meta device's own kernels)."""
    gpt = _load("pretrain_gpt", "pretrain/gpt.py")
    flags = ["--dry-run", "--tp", "2", "--dp", "2", "--global-batch-size", "8", "--micro-batch-size", "2",
             "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "64"]
    topo, peaks = {}, {}
    for name, extra in (("cuda", []), ("cpu", ["--device-type", "cpu"]),
                        ("cpu-bf16", ["--device-type", "cpu", "--precision", "bf16"])):
        assert gpt.dry_run_main([*flags, *extra, "--log-dir", str(tmp_path / name)]) == 0
        saved = json.loads((tmp_path / name / "dryrun.json").read_text())
        topo[name] = tuple(saved["topology"][k] for k in ("precision", "compile", "device_type"))
        peaks[name] = saved["roles"][0]["peak_by_category"]
    assert topo == {"cuda": ("bf16", True, "cuda"), "cpu": ("fp32", False, "cpu"), "cpu-bf16": ("bf16", False, "cpu")}
    assert "--compile's blocks run eagerly" in capsys.readouterr().out
    assert peaks["cuda"]["params"] * 2 == peaks["cpu"]["params"]  # bf16 parameters, as the GPU run holds them
    # the same bf16 step on CUDA's kernels (fused attention: no S x S probabilities) saves less than on a CPU's
    assert peaks["cuda"]["params"] == peaks["cpu-bf16"]["params"]
    assert peaks["cuda"]["activations"] < peaks["cpu-bf16"]["activations"]


TINY_PLAN = ["--model", "gpt2-124m", "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4", "--seq-len",
             "32", "--vocab-size", "256", "--gpus", "4", "--gpus-per-node", "4", "--global-batch-size", "8",
             "--micro-batch-sizes", "2", "--zero-stages", "1,2", "--confirm", "2"]


def test_confirm_caches_dry_runs(tmp_path, capsys, monkeypatch):
    """A second identical plan does no dry run and prints the same table; a changed setting misses the cache."""
    import megazero.plan.dryrun as dryrun
    from megazero.plan.cache import cache_key, code_fingerprint

    runs = []
    real = dryrun.dry_run
    monkeypatch.setattr(dryrun, "dry_run", lambda *a, **k: runs.append(a[0]) or real(*a, **k))
    tool = _plan_tool()
    cache = ["--cache-dir", str(tmp_path)]

    def plan(extra: list[str]) -> list[str]:
        assert tool.main(TINY_PLAN + cache + extra) == 0
        out = capsys.readouterr().out
        return [ln.replace(", cached", "") for ln in out.splitlines()[1:] if not ln.startswith("cache ")]

    first = plan([])
    assert len(runs) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    assert plan([]) == first and len(runs) == 2  # nothing run again, the same table and measurements
    plan(["--vocab-size", "320"])  # another model: both layouts' dry runs miss
    assert len(runs) == 4
    # the key follows every setting of the config, the cluster and the code
    base = ["--tp", "2", "--dp", "2", "--global-batch-size", "8", "--micro-batch-size", "2"]
    cfg, other, logged = (parse_args(base + extra).resolve(4, device_type="cuda")
                          for extra in ([], ["--max-inflight-buckets", "3"], ["--log-dir", "elsewhere"]))
    c, code = cluster("h100", 8), code_fingerprint()
    key = cache_key(cfg, c, "cuda", code)
    assert key == cache_key(logged, c, "cuda", code)  # where logs go does not change a dry run
    assert len({key, cache_key(other, c, "cuda", code), cache_key(cfg, cluster("a100", 8), "cuda", code),
                cache_key(cfg, c, "cpu", code), cache_key(cfg, c, "cuda", code + "x")}) == 5
