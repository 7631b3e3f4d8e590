"""Observability: measured per-rank memory vs the estimator, W&B offline series, plots, MFU arithmetic.

One gloo world per topology trains a small GPT at every ZeRO stage (2 steps each, 2 micro-batches per step)
and its metrics.jsonl records are checked against :mod:`megazero.plan.estimate`: model states per rank within
padding (1%), activations against the saved-tensor counter. The same runs feed the W&B and plot checks.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from megazero.config.cli import parse_args
from megazero.config.schema import ModelConfig, model_preset
from megazero.observe.flops import peak_flops_per_device, throughput
from megazero.plan.estimate import (
    activation_bytes,
    in_flight_micro_batches,
    korthikanti_layer_bytes,
    model_state_bytes,
    rank_parameter_numels,
    stage_layers,
)
from tests.common import SMALL_FLAGS
from tests.dist import run_world

ROOT = Path(__file__).resolve().parents[1]

# world size and grid per topology (one gloo world each)
TOPOLOGIES = {
    "tp1-dp2": {"world": 2, "tp": 1, "pp": 1},
    "tp2-dp2": {"world": 4, "tp": 2, "pp": 1},
}
if importlib.util.find_spec("megazero.pipeline.executor") is not None:  # pipeline parallelism has landed
    TOPOLOGIES["pp2-dp2"] = {"world": 4, "tp": 1, "pp": 2}
# (run name, ZeRO stage, precision): every stage in bf16 (with an fp32 master), two in fp32 (no master copy)
RUNS = [("s0-bf16", 0, "bf16"), ("s1-bf16", 1, "bf16"), ("s2-bf16", 2, "bf16"), ("s3-bf16", 3, "bf16"),
        ("s1-fp32", 1, "fp32"), ("s3-fp32", 3, "fp32")]
PERSISTENCE = 1000  # stage 3: LayerNorms and most biases stay whole, weight matrices are sharded
WANDB_RUN = ("tp1-dp2", "s3-bf16")  # the run that also logs to W&B (offline) and evaluates


def _flags(topology: str, name: str, precision: str) -> list[str]:
    flags = [*SMALL_FLAGS, "--train-steps", "2", "--log-interval", "1", "--micro-batch-size", "2",
             "--global-batch-size", "8", "--precision", precision, "--tp", str(TOPOLOGIES[topology]["tp"]),
             "--pp", str(TOPOLOGIES[topology]["pp"])]
    if TOPOLOGIES[topology]["tp"] > 1 and precision == "fp32":
        flags.append("--sequence-parallel")
    if (topology, name) == WANDB_RUN:
        flags += ["--wandb-project", "megazero-tests", "--wandb-mode", "offline", "--eval-interval", "1",
                  "--eval-iters", "1"]
    return flags


def _train_every_stage(ctx, topology: str, cache: str, log_dir: str) -> dict[str, object]:
    """Rank function: one short run per entry of RUNS; rank 0 returns the resolved configs (or, for a
    combination config.py refuses as not supported yet, its message) by run name."""
    from megazero.config.schema import ConfigError
    from megazero.train.loop import run_training

    out: dict[str, object] = {}
    for name, stage, precision in RUNS:
        flags = [*_flags(topology, name, precision), "--zero-stage", str(stage), "--cache-dir", cache,
                 "--log-dir", f"{log_dir}/{name}"]
        try:
            cfg = parse_args(flags).resolve(ctx.world_size)
        except ConfigError as e:
            if "not supported yet" not in str(e):
                raise
            out[name] = str(e)
            continue
        cfg = replace(cfg, zero=replace(cfg.zero, stage3_param_persistence_threshold=PERSISTENCE))
        run_training(cfg, ctx)
        out[name] = cfg
    return out if ctx.rank == 0 else {}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def world(request, data_cache, tmp_path_factory):
    """(topology, {run name: (config, metrics.jsonl records, log dir)}) after training every run."""
    topology = request.param
    log_dir = tmp_path_factory.mktemp(f"obs-{topology}")
    grid = TOPOLOGIES[topology]
    cfgs = run_world(_train_every_stage, grid["world"], topology, data_cache, str(log_dir), tp=grid["tp"],
                     pp=grid["pp"], timeout=300)[0]
    out = {}
    for name, cfg in cfgs.items():
        if isinstance(cfg, str):  # e.g. ZeRO-2/3 with pp > 1 until the pipeline supports it
            assert grid["pp"] > 1, f"{topology} {name}: {cfg}"
            print(f"\n{topology} {name} skipped: {cfg}")
            continue
        path = log_dir / name / "metrics.jsonl"
        out[name] = (cfg, [json.loads(line) for line in path.read_text().splitlines()], log_dir / name)
    return topology, out


def _stage_of(cfg, pp_rank: int) -> tuple[range, bool, bool]:
    p = cfg.parallel.pp_size
    return stage_layers(cfg.model.num_layers, p)[pp_rank], pp_rank == 0, pp_rank == p - 1


def _in_flight(cfg, pp_rank: int) -> int:
    p = cfg.parallel
    return in_flight_micro_batches(p.pp_size, pp_rank, p.pp_schedule, cfg.training.gradient_accumulation_steps)


def test_estimated_model_states_equal_measured_bytes(world):
    """Per rank and per category, the estimator's figure equals the bytes the ZeRO optimizer holds (1%)."""
    topology, runs = world
    worst = 0.0
    for name, (cfg, records, _) in runs.items():
        mem = records[-1]["memory"]
        assert len(mem) == TOPOLOGIES[topology]["world"]
        for rec in mem:
            numels = rank_parameter_numels(cfg.model, cfg.parallel.tp_size, cfg.parallel.pp_size, rec["pp_rank"])
            est = model_state_bytes(list(numels.values()), cfg.zero.stage, cfg.parallel.dp_size,
                                    cfg.training.precision, cfg.zero.stage3_param_persistence_threshold,
                                    grad_dtype=cfg.zero.grad_dtype)
            for key, expected in est.as_record().items():
                measured = rec[key]
                assert abs(measured - expected) <= 0.01 * expected, (topology, name, rec["rank"], key, measured,
                                                                     expected)
                if expected:
                    worst = max(worst, abs(measured - expected) / expected)
            if cfg.training.precision == "fp32":
                assert rec["master_params_bytes"] == 0  # the parameters are their own master copy
    print(f"\n{topology}: model states, worst relative difference estimator vs measured {worst:.2e}")


def test_estimated_activations_match_the_saved_tensor_counter(world):
    """The activation estimate (per micro-batch x micro-batches in flight) equals what the saved-tensor
    counter measured (dropout 0, fused SDPA)."""
    topology, runs = world
    lines = []
    for name, (cfg, records, _) in runs.items():
        m, t = cfg.model, cfg.parallel.tp_size
        sp = cfg.parallel.sequence_parallel
        for rec in records[-1]["memory"]:
            layers, first, last = _stage_of(cfg, rec["pp_rank"])
            est = _in_flight(cfg, rec["pp_rank"]) * activation_bytes(
                m, cfg.training.micro_batch_size, tp_size=t, sequence_parallel=sp, precision=cfg.training.precision,
                layers=len(layers), first_stage=first, last_stage=last)
            measured = rec["activation_peak_bytes"]
            # tolerance 2%: exact on CPU today; room for kernels that save an extra small statistic
            assert abs(measured - est) <= 0.02 * est, (topology, name, rec["rank"], measured, est)
        paper = len(layers) * korthikanti_layer_bytes(m.seq_len, cfg.training.micro_batch_size, m.hidden_size,
                                                      m.num_heads, t, sp)
        lines.append(f"  {name:8s} sp={sp!s:5s} measured {measured:>9,d} B  estimate {est:>11,.0f} B  "
                     f"Korthikanti layers only (16-bit, dropout, unfused) {paper:>9,.0f} B")
    print(f"\n{topology}: activation bytes per micro-batch (last rank)\n" + "\n".join(lines))


def test_records_have_every_key_and_measure_on_cpu(world):
    """Every logged step has DESIGN.md's keys; each rank's coordinates, RSS and activations are filled."""
    topology, runs = world
    grid = TOPOLOGIES[topology]
    cfg, records, _ = runs["s1-bf16"]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "tflops_per_gpu", "mfu", "hfu",
                    "micro_batches", "memory", "comm"):
            assert key in r, key
        assert r["micro_batches"] == 2 and r["tokens_per_s"] > 0 and r["tflops_per_gpu"] > 0
        assert r["mfu"] is None and r["hfu"] is None  # CPU: no known peak FLOP/s
        coords = {(m["tp_rank"], m["pp_rank"], m["dp_rank"]) for m in r["memory"]}
        assert len(coords) == grid["world"] and [m["rank"] for m in r["memory"]] == list(range(grid["world"]))
        for m in r["memory"]:
            assert m["host_rss_bytes"] > 0 and m["activation_peak_bytes"] > 0
            assert m["device_allocated_bytes"] is None  # no CUDA here


def _wandb_records(run_file: Path):
    """The protobuf records of a W&B ``.wandb`` file (LevelDB log format after a 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block tail too short for a header is zero padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST fragment: a whole record
            rec = pb.Record()
            rec.ParseFromString(pending)
            pending = b""
            yield rec


@pytest.mark.parametrize("world", [WANDB_RUN[0]], indirect=True)
def test_wandb_offline_run_holds_per_rank_memory_series(world):
    """The offline run directory holds one history row per logged step with every rank's memory series,
    and the run config holds the topology and the full configuration."""
    topology, runs = world
    cfg, records, log_dir = runs[WANDB_RUN[1]]
    [run_file] = list((log_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    history, config, names = [], {}, set()
    for rec in _wandb_records(run_file):
        if rec.HasField("run"):
            names.add(rec.run.display_name)
        if rec.HasField("history"):
            history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                            for item in rec.history.item})
        for update in (rec.run.config.update if rec.HasField("run") else
                       rec.config.update if rec.HasField("config") else []):
            config[update.key] = json.loads(update.value_json)
    assert len(history) == len(records) == 2
    last = history[-1]
    gib = 2**30
    for r in range(TOPOLOGIES[topology]["world"]):
        [mem] = [m for m in records[-1]["memory"] if m["rank"] == r]
        states = ("params_bytes", "grads_bytes", "master_params_bytes", "optimizer_states_bytes")
        expected = {  # written out from metrics.jsonl's record, not from the function under test
            "allocated_gib": (mem["device_allocated_bytes"] or mem["host_rss_bytes"]) / gib,  # CPU: the RSS
            "host_rss_gib": mem["host_rss_bytes"] / gib, "params_gib": mem["params_bytes"] / gib,
            "grads_gib": mem["grads_bytes"] / gib, "master_params_gib": mem["master_params_bytes"] / gib,
            "optimizer_states_gib": mem["optimizer_states_bytes"] / gib,
            "model_states_gib": sum(mem[k] for k in states) / gib, "activations_gib": mem["activation_peak_bytes"] / gib}
        for series, value in expected.items():
            key = f"memory/rank{r}/{series}"
            assert key in last, (key, sorted(last))
            assert last[key] == pytest.approx(value) and last[key] > 0, (key, last[key], value)
    assert last["loss"] == pytest.approx(records[-1]["loss"]) and "tokens_per_s" in last
    assert config["topology"]["dp"] == 2 and config["zero"]["stage"] == 3 and config["model"]["hidden_size"] == 64
    assert names == {"tiny-tp1-pp1-dp2-zero3-bf16"}, names  # the run is named (the log line said "None")


@pytest.mark.parametrize("world", ["tp2-dp2"], indirect=True)
def test_plot_metrics_writes_non_empty_pngs(world, tmp_path):
    topology, runs = world
    _, _, log_dir = runs["s3-bf16"]
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(log_dir), "--out",
                        str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("loss.png", "memory.png", "throughput.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, (name, len(data))


def test_megatron_flops_mfu_and_hfu_by_hand(monkeypatch):
    # GPT-2 124M shapes, one step of B = 8 sequences of s = 1024 tokens, l = 12, h = 768, V = 50304:
    #   72·B·s·l·h² = 4,174,708,211,712;  ·s/(6h) -> 12·B·s²·l·h = 927,712,935,936;
    #   ·V/(12·l·h) -> 6·B·s·h·V = 1,898,912,415,744;  model FLOPs = 7,001,333,563,392
    # full recomputation: 96·B·s·l·h² = 5,566,277,615,616 + 16·B·s²·l·h = 1,236,950,581,248 + 6·B·s·h·V
    #   = 8,702,140,612,608.  In 0.025 s on one H100 SXM (989.4 TFLOP/s bf16 dense):
    #   280.0533 TFLOP/s, MFU 0.283054, HFU 0.351815.
    peak = peak_flops_per_device("bf16", device_name="NVIDIA H100 80GB HBM3")
    assert peak == 989.4e12
    t = throughput(8 * 1024, 1024, 0.025, 1, 12, 768, 50304, "full", peak)
    assert t["tokens_per_s"] == pytest.approx(327_680)
    assert t["tflops_per_gpu"] == pytest.approx(280.05334253568, rel=1e-12)
    assert t["mfu"] == pytest.approx(0.2830537118816252, rel=1e-12)
    assert t["hfu"] == pytest.approx(0.3518148620419648, rel=1e-12)
    # without recomputation the hardware does the model's FLOPs; per GPU divides by the world
    t8 = throughput(8 * 1024, 1024, 0.025, 8, 12, 768, 50304, "none", peak)
    assert t8["hfu"] == t8["mfu"] == pytest.approx(0.2830537118816252 / 8, rel=1e-12)
    assert peak_flops_per_device("bf16", device_name="NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_per_device("bf16", device_name="NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_device("bf16", device="cpu") is None
    monkeypatch.setenv("MEGAZERO_PEAK_TFLOPS", "100")
    assert peak_flops_per_device("fp32", device="cpu") == 100e12


def test_flops_count_gqa_swiglu_and_the_untied_head():
    """Llama 3 8B: every matmul weight (all parameters but the embedding lookup and the RMSNorm weights) costs
    6 FLOPs per token in training, attention's QKᵀ and AV 12·l·h·s more (Megatron-LM's full-square count)."""
    from megazero.observe.flops import flops_shape, megatron_hardware_flops, megatron_model_flops

    m = model_preset("llama-3-8b")
    s, n, h, v = m.seq_len, m.num_layers, m.hidden_size, m.vocab_size
    matmul = m.num_parameters() - v * h - (2 * n + 1) * h
    want = 6 * matmul * s + 12 * n * h * s * s
    assert megatron_model_flops(1, s, n, h, v, **flops_shape(m)) == pytest.approx(want, rel=1e-12)
    full = megatron_hardware_flops(1, s, n, h, v, "full", **flops_shape(m))
    assert full == pytest.approx(want + 2 * (matmul - v * h) * s + 4 * n * h * s * s, rel=1e-12)  # + 1 forward


def test_zero_paper_figures():
    """7.5B parameters, Nd = 64, mixed precision with Adam and 16-bit gradients: 120 / 31.4 / 16.6 / 1.9 GB (ZeRO
    paper, Fig. 1); bf16's default fp32 gradients: 18Ψ = 135 GB at stage 0, 2Ψ + 16Ψ/Nd = 16.9 GB at stage 2."""
    totals = [model_state_bytes(7.5e9, s, 64, "bf16", grad_dtype="model").total / 1e9 for s in range(4)]
    assert model_state_bytes(7.5e9, 0, 64, "fp16").total / 1e9 == pytest.approx(120.0)
    fp32_grads = [model_state_bytes(7.5e9, s, 64, "bf16").total / 1e9 for s in range(3)]
    assert fp32_grads == pytest.approx([135.0, 46.40625, 16.875])
    assert totals == pytest.approx([120.0, 31.40625, 16.640625, 1.875])
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "estimate_memory.py"), "--params", "7.5e9", "--dp",
                        "64", "--grad-dtype", "model"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line[:1] in (" ", "*") and line.split()[0] in "0123"]
    header = next(line.split("  ") for line in r.stdout.splitlines() if line.startswith("ZeRO"))
    col = [h.strip() for h in header if h.strip()].index("model states")
    assert [row[col] for row in rows] == ["120.0", "31.4", "16.6", "1.9"], r.stdout


@pytest.mark.parametrize("arch, kv_heads, tied", [("gpt2", None, None), ("llama", 4, False), ("llama", 4, True)])
def test_estimator_parameters_per_rank_match_the_model(arch, kv_heads, tied):
    """Ψ_r per (tp rank, pipeline stage) is exactly what GPT builds: TP shards, replicated pieces, tied copies
    (Llama: GQA's q/k/v rows, SwiGLU's gate and up, no biases, an untied lm_head on the last stage)."""
    from megazero.model.gpt import GPT

    cfg = ModelConfig(num_layers=3, hidden_size=64, num_heads=8, seq_len=32, vocab_size=500, arch=arch,
                      num_kv_heads=kv_heads, tie_embeddings=tied) if arch == "llama" else \
        ModelConfig(num_layers=3, hidden_size=64, num_heads=4, seq_len=32, vocab_size=500)
    for tp in (1, 2, 4):
        group = SimpleNamespace(size=tp, rank=tp - 1) if tp > 1 else None
        for pp in (1, 2, 3):
            for r, layers in enumerate(stage_layers(cfg.num_layers, pp)):
                model = GPT(cfg, group, layers=layers, pre_process=r == 0, post_process=r == pp - 1)
                built = {n: p.numel() for n, p in model.named_parameters()}
                assert list(rank_parameter_numels(cfg, tp, pp, r).items()) == list(built.items()), (tp, pp, r)


def test_estimate_cli_splits_pipeline_stages():
    model = model_preset("gpt2-350m")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "estimate_memory.py"), "--model", "gpt2-350m", "--tp",
                        "2", "--pp", "4", "--dp", "2", "--zero-stage", "3", "--micro-batch-size", "2",
                        "--offload-optimizer"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    rows = [line.split() for line in r.stdout.splitlines() if line[:2] in (" 0", " 1", " 2", "*3")]
    assert len(rows) == 16  # the stages differ (embeddings first, LM head last, micro-batches in flight)
    assert [row[1] for row in rows[:4]] == ["0", "1", "2", "3"] and rows[12][0] == "*3"
    psi0 = sum(rank_parameter_numels(model, 2, 4, 0).values())
    assert rows[0][3] == f"{psi0 / 1e6:.4g}M" and "host" in r.stdout


def test_estimate_cli_follows_the_chunks_of_zbv_and_interleaved():
    """``--pp-schedule zbv`` and ``interleaved --virtual-stages 2``: one row per rank with its chunks' layers,
    Ψ_r equal to the parameters of the chunks GPT builds there (on meta; zbv's rank 0 carries the embeddings and
    the final norm and the tied head copy, rank p - 1 blocks only), and a step peak per rank. A schedule the
    tool cannot place (interleaved without --virtual-stages) is a usage error naming the flag."""
    import torch

    from megazero.model.gpt import GPT
    from megazero.pipeline.partition import stage_specs

    model = ModelConfig(num_layers=8, hidden_size=64, num_heads=4, seq_len=32, vocab_size=500)
    shape = ["--num-layers", "8", "--hidden-size", "64", "--num-heads", "4", "--seq-len", "32", "--vocab-size", "500"]
    for schedule, extra, layers in (("zbv", [], ["0,7", "1,6", "2,5", "3,4"]),
                                    ("interleaved", ["--virtual-stages", "2"], ["0,4", "1,5", "2,6", "3,7"])):
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "estimate_memory.py"), *shape, "--pp", "4",
                            "--pp-schedule", schedule, *extra, "--micro-batches", "8", "--units", "MB"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        rows = [line.split() for line in r.stdout.splitlines() if line[:2] in (" 0", " 1", " 2", " 3")]
        assert len(rows) == 16 and [row[1] for row in rows[:4]] == ["0", "1", "2", "3"], r.stdout
        assert [row[2] for row in rows[:4]] == layers, r.stdout
        for rank in range(4):
            with torch.device("meta"):
                built = [GPT(model, layers=s.layers, pre_process=s.pre_process, post_process=s.post_process)
                         for s in stage_specs(8, 4, rank, 2, schedule=schedule)]
            names = {n for chunk in built for n, _ in chunk.named_parameters()}
            psi = sum(p.numel() for chunk in built for p in chunk.parameters())
            assert rows[rank][3] == (f"{psi / 1e3:.4g}K" if psi < 1e6 else f"{psi / 1e6:.4g}M"), (schedule, rank)
            if schedule == "zbv":
                assert ({"wte.weight", "wpe.weight", "ln_f.weight"} <= names) == (rank == 0), (rank, names)
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "estimate_memory.py"), *shape, "--pp", "4",
                          "--pp-schedule", "interleaved"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--virtual-stages" in bad.stderr, bad.stderr
