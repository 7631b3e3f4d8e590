"""The GPU check's parts, run on the CPU (the GPU figures need a CUDA machine: bench/gpu_check.sh).

* bench/gpu.py end to end in its CPU smoke mode, on a Llama (megazero against bench/plain_llama.py), and its
  ZeRO-Offload run with the step split into the host calls and the rest;
* bench/gpu_profile.py end to end on the CPU (aten ops stand in for kernels), and its figures on made-up
  intervals whose answers are known;
* bench/plain_llama.py is a Llama: Hugging Face's LlamaForCausalLM with the same weights gives the same loss;
* bench/gpu_summary.py's table from made-up results; bench/gpu_check.sh parses.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ["--device", "cpu", "--steps", "2", "--warmup", "1", "--no-compile"]


def _run(script: str, args: list[str], env: dict, out: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / script), *args, "--json", str(out)]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return {"stdout": r.stdout, **json.loads(out.read_text())}


def test_gpu_bench_smoke_run_on_cpu(subprocess_env, tmp_path):
    """A Llama (llama-tiny) against the plain Llama: both train (loss ~ ln(1024) at init, falling), FLOPs by the
    Llama count (SwiGLU, GQA), the estimator's figure and the ratio reported."""
    res = _run("gpu.py", ["--model", "llama-tiny", *SMOKE], subprocess_env, tmp_path / "gpu.json")
    assert res["device"] == "cpu" and res["torch"] and res["matmul_ceiling_tflops"] > 0 and "error" not in res
    from megazero.config.schema import model_preset
    from megazero.observe.flops import flops_shape, megatron_model_flops

    m = model_preset("llama-tiny")
    flops = megatron_model_flops(2, m.seq_len, m.num_layers, m.hidden_size, 1024, **flops_shape(m))
    for key in ("megazero", "plain"):
        run = res[key]
        assert run["micro_batch"] == 2 and len(run["step_s"]) == 2 and len(run["losses"]) == 3
        assert run["tokens_per_s"] > 0 and run["mfu"] is None  # no CPU peak
        assert run["tflops_per_gpu"] == pytest.approx(flops / run["median_step_s"] / 1e12)
        assert all(5.0 < loss < 9.0 for loss in run["losses"]) and run["losses"][-1] < run["losses"][0]
    assert res["ratio_tokens_per_s"] > 0 and res["megazero"]["estimate_device_bytes"] > 0
    assert "megazero / plain tokens/s" in res["stdout"]


def test_bench_flops_follow_the_model_family():
    """llama-3.2-1b's step FLOPs by the Llama count (GQA's narrow K/V, SwiGLU's three matrices), which differs from
    GPT-2's count of the same widths by more than 5% (llama-tiny's happen to agree, so the smoke run cannot tell)."""
    from bench.gpu import _speed
    from megazero.config.schema import model_preset
    from megazero.observe.flops import flops_shape, megatron_model_flops

    m = model_preset("llama-3.2-1b")
    r = _speed({"micro_batch": 1, "step_s": [0.5, 1.0, 2.0]}, m, 1e15, 5e14)
    llama = megatron_model_flops(1, m.seq_len, m.num_layers, m.hidden_size, 128256, **flops_shape(m))
    assert r["tflops_per_gpu"] == pytest.approx(llama / 1e12) and r["mfu"] == pytest.approx(llama / 1e15)
    assert r["tokens_per_s"] == m.seq_len and r["mfu_vs_measured_ceiling"] == pytest.approx(llama / 5e14)
    gpt = megatron_model_flops(1, m.seq_len, m.num_layers, m.hidden_size, 128256)
    assert abs(llama - gpt) > 0.05 * llama


def test_gpu_bench_offload_run_splits_the_step(subprocess_env, tmp_path):
    """--offload optimizer trains (its batches' ids fit the vocabulary it passes) and splits each step into the
    gradients' copy to the host, the host Adam with the copy back, and the rest, which add up to the step."""
    res = _run("gpu.py", ["--offload", "optimizer", *SMOKE], subprocess_env, tmp_path / "offload.json")
    run, split = res["megazero"], res["megazero"]["offload_split"]
    assert len(run["losses"]) == 3 and run["losses"][-1] < run["losses"][0]
    assert set(split) == {"copy_to_host_s", "host_adam_and_copy_back_s", "device_compute_and_rest_s"}
    assert split["copy_to_host_s"] > 0 and split["host_adam_and_copy_back_s"] > 0
    assert split["device_compute_and_rest_s"] > 0  # the step is more than its two host calls
    assert sum(split.values()) == pytest.approx(run["median_step_s"], rel=0.5)  # medians of parts, not a sum


def test_gpu_profile_smoke_run_on_cpu(subprocess_env, tmp_path):
    res = _run("gpu_profile.py", ["--model", "tiny", "--micro-batch-size", "2", *SMOKE], subprocess_env,
               tmp_path / "profile.json")
    assert "error" not in res and res["steps"] == 2 and len(res["step_ms"]) == 2
    assert res["kernels_per_step"] > 100 and 0 < res["busy_fraction"] <= 1
    top = res["top_kernels"]
    assert len(top) == 10 and [k["ms_per_step"] for k in top] == sorted((k["ms_per_step"] for k in top), reverse=True)
    assert any(k["name"] == "aten::mm" for k in top)


def test_profile_figures_on_known_intervals():
    """Two 100 us steps; a kernel straddling the first step's end counts inside it only; overlapping kernels
    count once towards busy; copies are apart from kernels."""
    from bench.gpu_profile import summarize, union_length

    assert union_length([(0, 10), (5, 20), (30, 40)]) == 30 and union_length([]) == 0
    work = [("gemm", 10, 50), ("gemm", 40, 60), ("add", 90, 110),  # step 1: busy 10-60 and 90-100
            ("Memcpy HtoD", 300, 320), ("gemm", 310, 330),  # step 2 (200-300 is a gap between steps)
            ("late", 500, 510)]  # outside both steps
    s = summarize(work, [(0, 100), (300, 400)], top=2)
    assert s["kernels_per_step"] == 2.0 and s["copies_per_step"] == 0.5
    assert s["busy_fraction"] == pytest.approx((50 + 10 + 30) / 200)
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "add"]
    assert s["top_kernels"][0]["ms_per_step"] == pytest.approx((40 + 20 + 20) / 1e3 / 2)


def test_plain_llama_is_hugging_face_llama():
    """bench/plain_llama.py with Hugging Face LlamaForCausalLM's weights (q/k/v and gate/up fused) gives the same
    loss; its parameters are ModelConfig.num_parameters() (untied here); a wrong rotary layout would not match."""
    transformers = pytest.importorskip("transformers")
    from bench.plain_llama import PlainLlama
    from megazero.config.schema import model_preset

    m = model_preset("llama-tiny", num_layers=2)
    torch.manual_seed(0)
    plain = PlainLlama(m.num_layers, m.hidden_size, m.num_heads, m.kv_heads, m.ffn_hidden_size, m.seq_len,
                       m.vocab_size, tied=m.tied, rope_theta=m.rope_theta, eps=m.layernorm_eps)
    assert sum(p.numel() for p in plain.parameters()) == m.num_parameters()  # vocab 1024: no padding
    with torch.no_grad():
        for p in plain.parameters():
            if p.dim() == 2:
                p.mul_(20)  # logits far from uniform, so that the loss tells layouts apart
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads,
        max_position_embeddings=m.seq_len, rms_norm_eps=m.layernorm_eps, rope_theta=m.rope_theta,
        tie_word_embeddings=m.tied)).float()
    h, kv = m.hidden_size, m.kv_heads * m.head_dim
    state = {"model.embed_tokens.weight": plain.wte.weight, "model.norm.weight": plain.norm,
             "lm_head.weight": plain.lm_head.weight}
    for i, b in enumerate(plain.blocks):
        pre = f"model.layers.{i}."
        for name, w in zip(("q", "k", "v"), b.qkv.weight.split([h, kv, kv])):
            state[f"{pre}self_attn.{name}_proj.weight"] = w
        for name, w in zip(("gate", "up"), b.gate_up.weight.split(m.ffn_hidden_size)):
            state[f"{pre}mlp.{name}_proj.weight"] = w
        state.update({f"{pre}self_attn.o_proj.weight": b.o.weight, f"{pre}mlp.down_proj.weight": b.down.weight,
                      f"{pre}input_layernorm.weight": b.attn_norm, f"{pre}post_attention_layernorm.weight": b.mlp_norm})
    hf.load_state_dict({k: v.detach() for k, v in state.items()}, strict=True)
    ids, targets = torch.randint(0, m.vocab_size, (2, 64)), torch.randint(0, m.vocab_size, (2, 64))
    with torch.no_grad():
        ours = plain(ids, targets)
        theirs = F.cross_entropy(hf(ids).logits.flatten(0, 1).float(), targets.flatten())
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours, theirs)
        plain.cos.copy_(plain.cos.flip(-1))  # control: the rotary table in the other half's order
        assert not torch.allclose(plain(ids, targets), theirs, rtol=1e-3, atol=1e-4)


def test_gpu_summary_table_from_results(tmp_path):
    """The summary reads every figure from the files: ms/step from the medians, the ratio, MFU, peak and estimate,
    the offload split, the profile, tests passed/failed by name, and each step's status in words."""
    from bench.gpu_summary import summary

    def run(ms: float, mfu: float, peak: float) -> dict:
        return {"micro_batch": 16, "median_step_s": ms / 1e3, "mfu": mfu, "peak_device_bytes": peak * 2**30,
                "estimate_device_bytes": 2**30 * (peak - 1)}

    (tmp_path / "gpt2-124m.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "precision": "bf16", "compile": True,
        "matmul_ceiling_tflops": 760.0, "peak_tflops": 989.5, "seq_len": 1024,
        "megazero": run(73.4, 0.193, 10.5), "plain": run(38.7, 0.365, 9.0), "ratio_tokens_per_s": 38.7 / 73.4}))
    (tmp_path / "offload.json").write_text(json.dumps({
        "offload": "optimizer", "model": {"num_layers": 4, "hidden_size": 4096},
        "megazero": {"params": 1.01e9, "median_step_s": 2.5, "tflops_per_gpu": 20.0, "mfu": 0.02,
                     "offload_split": {"copy_to_host_s": 0.25, "host_adam_and_copy_back_s": 1.5,
                                       "device_compute_and_rest_s": 0.75}}}))
    (tmp_path / "profile.json").write_text(json.dumps({
        "model": "gpt2-124m", "micro_batch": 16, "steps": 3, "step_ms": [77.0, 77.0, 77.0],
        "kernels_per_step": 2500.0, "copies_per_step": 520.0, "busy_fraction": 0.8,
        "top_kernels": [{"name": "sm90_gemm", "ms_per_step": 12.5}]}))
    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a"/>'
        '<testcase classname="tests.test_gpu" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c"><skipped/></testcase></testsuite></testsuites>')
    status = tmp_path / "status"
    status.write_text("pytest 0 120\ngpt2-124m 0 60\ngpt2-1.3b 124 100\nllama-3.2-1b 1 20\noffload - 0\n")
    text = summary(str(tmp_path), str(status))
    assert "NVIDIA H100 80GB HBM3; torch 2.11.0+cu130" in text
    assert "| gpt2-124m | 16 x 1024 | 73.4 | 38.7 | 0.53x | 19.3% | 36.5% | 10.50 / 9.50 | 9.00 |" in text
    assert "| gpt2-1.3b | no result |" in text
    assert "4 x 4096 (1.01B), 2500.0 ms/step, 20.0 TFLOP/s, MFU 2.0%; per step: copy_to_host 0.250 s" in text
    assert "2500 kernels + 520 copies per step, GPU busy 80.0% of 77.0 ms; top: sm90_gemm 12.50 ms" in text
    assert "tests: 1 passed, 1 failed, 1 skipped" in text and "FAILED tests.test_gpu::test_b" in text
    assert ("steps: pytest ok 120 s; gpt2-124m ok 60 s; gpt2-1.3b TIMED OUT 100 s; llama-3.2-1b FAILED rc 1 20 s; "
            "offload skipped (no time left) 0 s") in text


def test_gpu_check_script_parses():
    r = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
