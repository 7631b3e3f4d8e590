"""Checkpoints: exact resume, reshard on load across topologies, merged and Hugging Face export, crash safety,
refused corrupt or mismatched checkpoints, and a killed rank ending the job instead of hanging it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megazero.checkpoint import CheckpointReader, find_checkpoint, list_checkpoints
from megazero.checkpoint.faults import FAULT_ENV
from megazero.config.cli import parse_args
from megazero.train.loop import run_training
from tests import launch
from tests.common import SMALL_FLAGS, assert_matches_reference, merge_runs, normwise_error, train_runs
from tests.dist import WorldError, run_world

ROOT = Path(__file__).resolve().parents[1]
EIGHT = ["--num-layers", "8"]
SIX = ["--train-steps", "6", "--lr-decay-steps", "6"]  # the schedule of a 6-step run, whenever it stops
TP2_PP2_DP2_Z3 = ["--tp", "2", "--pp", "2", "--zero-stage", "3", "--micro-batch-size", "2", "--global-batch-size", "8"]
TP1_PP2_DP4_Z1 = ["--pp", "2", "--zero-stage", "1", "--micro-batch-size", "2", "--global-batch-size", "8"]
DP2 = ["--zero-stage", "2", "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1"]


def _python(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return launch.run([sys.executable, *args], env, timeout)


def _records(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


# -- reshard: tp2·pp2·dp2·ZeRO-3 -> tp1·pp1·dp1·ZeRO-0 and -> tp1·pp2·dp4·ZeRO-1 -> back ----------------------
def _reshard_chain(ctx, cache: str, log_dir: str, ck: str) -> list[tuple[list[float], dict | None]]:
    """One 8-rank world, three topologies: A trains 3 steps at tp2·pp2·dp2·ZeRO-3 and saves; E loads A at
    tp1·pp2·dp4·ZeRO-1 and trains to step 6 (saving steps 4 and 6); D loads E's step 4 back at A's topology."""
    from megazero.distributed.context import ParallelContext, RankGrid

    z3 = [*TP2_PP2_DP2_Z3, "--deepspeed-config", f"{ck}/z3.json"]
    runs = [((2, 2), [*z3, "--train-steps", "3", "--lr-decay-steps", "6", "--save", f"{ck}/a"]),
            ((1, 2), [*TP1_PP2_DP4_Z1, *SIX, "--load", f"{ck}/a", "--save", f"{ck}/e", "--save-interval", "2"]),
            ((2, 2), [*z3, *SIX, "--load", f"{ck}/e/step_00000004"])]
    out = []
    for i, ((tp, pp), flags) in enumerate(runs):
        sub = ctx if (tp, pp) == (ctx.tp_size, ctx.pp_size) else ParallelContext.from_grid(
            RankGrid.from_world(ctx.world_size, tp_size=tp, pp_size=pp))
        out += train_runs(sub, [[*EIGHT, *flags]], cache, f"{log_dir}/{i}")
    return out


@pytest.fixture(scope="module")
def chain(data_cache, tmp_path_factory):
    ck = tmp_path_factory.mktemp("reshard")
    # ZeRO-3 gathers the matrices per module and keeps vectors whole (persistent): both paths get saved
    (ck / "z3.json").write_text(json.dumps({"zero_optimization": {"stage": 3,
                                                                   "stage3_param_persistence_threshold": 1000}}))
    a, e, d = merge_runs(run_world(_reshard_chain, 8, data_cache, str(ck / "logs"), str(ck), tp=2, pp=2))
    one = ["--micro-batch-size", "8"]
    ref3, ref, b = merge_runs(run_world(train_runs, 1, [
        [*EIGHT, *one, "--train-steps", "3", "--lr-decay-steps", "6"], [*EIGHT, *one, *SIX],
        [*EIGHT, *one, *SIX, "--load", str(ck / "a")]], data_cache, str(ck / "logs1")))
    return {"ck": ck, "A": a, "E": e, "D": d, "B": b, "ref3": ref3, "ref": ref}


def test_reshard_on_load_continues_the_uninterrupted_run(chain):
    ref_losses, ref_state = chain["ref"]
    assert_matches_reference(*chain["A"], (ref_losses[:3], chain["ref3"][1]))  # saved at tp2·pp2·dp2·ZeRO-3
    assert_matches_reference(*chain["B"], (ref_losses[3:], ref_state))  # -> tp1·pp1·dp1·ZeRO-0
    assert_matches_reference(*chain["E"], (ref_losses[3:], ref_state))  # -> tp1·pp2·dp4·ZeRO-1
    assert_matches_reference(*chain["D"], (ref_losses[4:], ref_state))  # and back to tp2·pp2·dp2·ZeRO-3
    assert [s for s, _ in list_checkpoints(chain["ck"] / "e")] == [4, 6]
    manifest = CheckpointReader(chain["ck"] / "a" / "step_00000003").manifest
    assert (manifest["topology"]["tp"], manifest["topology"]["pp"], manifest["topology"]["dp"]) == (2, 2, 2)
    assert manifest["zero_stage"] == 3 and manifest["consumed_samples"] == 24 and len(manifest["files"]) == 8
    qkv = manifest["tensors"]["blocks.0.attn.qkv.weight"]
    assert qkv["shape"] == [192, 64] and qkv["local_shape"] == [96, 64] and qkv["stride"] == 3
    assert {p["tp"] for p in qkv["pieces"]} == {0, 1}  # both TP shards
    # ZeRO-3 shards each transformer block's flat buffer over DP: the block's pieces come from both DP ranks
    block = [t for n, t in manifest["tensors"].items() if n.startswith("blocks.0.")]
    assert {(p["tp"], p["dp"]) for t in block for p in t["pieces"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    ln = manifest["tensors"]["blocks.0.ln_1.weight"]  # replicated over TP: saved once, by TP rank 0
    assert ln["partition_dim"] is None and {p["tp"] for p in ln["pieces"]} == {0}


# -- export ---------------------------------------------------------------------------------------------------
def test_convert_merges_every_shard_and_exports_hugging_face(chain, subprocess_env, tmp_path):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from megazero.data import Tokenizer, read_text_documents, stdlib_corpus_files
    from megazero.model import GPT
    from megazero.tensor_parallel import shard_full_tensor

    src, state = chain["ck"] / "a", chain["A"][1]
    r = _python(["tools/convert_checkpoint.py", str(src), "--out", str(tmp_path / "st")], subprocess_env)
    assert r.returncode == 0, r.stderr
    cfg = parse_args([*SMALL_FLAGS, *EIGHT]).model
    assert f"{cfg.num_parameters():,} parameters" in r.stdout and "tp=2 pp=2 dp=2 ZeRO-3" in r.stdout
    assert "step 3 " in r.stdout
    merged = load_file(str(tmp_path / "st" / "model.safetensors"))
    assert merged.keys() == state.keys() and all(torch.equal(merged[k], state[k]) for k in state)

    r = _python(["tools/convert_checkpoint.py", str(src), "--step", "3", "--out", str(tmp_path / "hf"),
                 "--format", "hf"], subprocess_env)
    assert r.returncode == 0, r.stderr
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = GPT(cfg).eval()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(shard_full_tensor(state[name], p.shard_spec, 0, 1))
        ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(hf(ids).logits, ours.full_logits(ids), rtol=1e-5, atol=1e-5)

    tok = Tokenizer(src / "step_00000003" / "tokenizer.model")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    texts = ["  two  spaces\r\n\ttab", "lit\u2581eral \u2581", "<s>x</s><unk>", "emoji \U0001f600 ünï 中文 0123"]
    texts += [doc for i, doc in enumerate(read_text_documents(stdlib_corpus_files())) if i % 25 == 0]
    for text in texts:
        assert hf_tok(text)["input_ids"] == tok.encode(text), text[:80]
    assert hf_tok.decode(tok.encode(texts[-1])) == texts[-1]


# -- exact resume ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resumed(data_cache, tmp_path_factory):
    """dp 2, ZeRO-2, fp32 and fp16 (dynamic loss scale, window 2): 6 steps saving at 3, then resumed from 3."""
    ck = tmp_path_factory.mktemp("resume")
    (ck / "ds.json").write_text(json.dumps({"fp16": {"enabled": True, "loss_scale_window": 2}}))  # a moving scale
    runs = []
    for prec in ("fp32", "fp16"):
        base = [*DP2, "--train-steps", "6", *(["--deepspeed-config", str(ck / "ds.json")] if prec == "fp16" else [])]
        runs += [[*base, "--save", f"{ck}/{prec}", "--save-interval", "3"],
                 [*base, "--load", f"{ck}/{prec}/step_00000003"]]
    runs.append([*DP2, "--train-steps", "6", "--precision", "bf16", "--load", f"{ck}/fp32/step_00000003"])
    results = merge_runs(run_world(train_runs, 2, runs, data_cache, str(ck / "logs")))
    return {"ck": ck, "runs": results}


def test_resume_is_exact_at_the_same_topology(resumed):
    runs = resumed["runs"]
    for (full_losses, full_state), (losses, state) in (runs[0:2], runs[2:4]):
        assert losses == full_losses[3:]  # bit for bit
        assert all(torch.equal(state[k], full_state[k]) for k in full_state)
    ck = resumed["ck"]
    a, b = _records(ck / "logs" / "2-2"), _records(ck / "logs" / "2-3")  # train_runs' log dirs of the fp16 runs
    assert [r["loss_scale"] for r in a[3:]] == [r["loss_scale"] for r in b]
    assert len({r["loss_scale"] for r in a}) > 1  # the loss scale moved, so its restored state mattered


def test_fp32_checkpoint_resumes_in_bf16(resumed):
    """README: resume at another precision. The fp32 step-3 checkpoint continued in bf16 tracks the fp32 run's
    steps 4-6 within bf16 tolerances (tests/test_mixed_precision.py), and is far from a restart."""
    (full_losses, full_state), (losses, state) = resumed["runs"][0], resumed["runs"][4]
    worst = max(abs(a - b) / b for a, b in zip(losses, full_losses[3:]))
    assert len(losses) == 3 and worst < 2e-3, (losses, full_losses)
    assert normwise_error(state, full_state) < 2e-2
    assert losses[0] < full_losses[0] - 0.3  # it continued from step 3, it did not start again


def _refusals(ctx, cache: str, ck: str, bad: dict[str, str]) -> dict[str, str]:
    out = {}
    for label, flags in {"corrupt": ["--load", bad["corrupt"]], "missing": ["--load", bad["missing"]],
                         "config": ["--load", ck, "--hidden-size", "128"],
                         "tokenizer": ["--load", bad["tokenizer"]]}.items():
        cfg = parse_args([*SMALL_FLAGS, *DP2, *flags, "--cache-dir", cache, "--log-dir", f"{ck}-log"])
        try:
            run_training(cfg.resolve(ctx.world_size), ctx)
            out[label] = "loaded"
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            out[label] = f"{type(e).__name__}: {e}"
    return out


def test_corrupt_missing_and_mismatched_checkpoints_are_refused_on_every_rank(resumed, data_cache, tmp_path):
    src = resumed["ck"] / "fp32" / "step_00000006"
    bad = {k: str(tmp_path / k) for k in ("corrupt", "missing", "tokenizer")}
    for path in bad.values():
        shutil.copytree(src, path)
    manifest = Path(bad["tokenizer"]) / "manifest.json"  # as if trained with another tokenizer
    meta = json.loads(manifest.read_text())
    meta["tokenizer"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(meta))
    with open(Path(bad["corrupt"]) / "rank_00001.safetensors", "r+b") as f:
        f.seek(5000)
        byte = f.read(1)
        f.seek(5000)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.remove(Path(bad["missing"]) / "rank_00000.safetensors")
    for msgs in run_world(_refusals, 2, data_cache, str(resumed["ck"] / "fp32"), bad):
        assert "CheckpointError" in msgs["corrupt"] and "corrupt/rank_00001.safetensors is corrupt" in msgs["corrupt"]
        assert "missing/rank_00000.safetensors is missing" in msgs["missing"], msgs["missing"]
        assert "--hidden-size 128 != checkpoint's 64" in msgs["config"], msgs["config"]
        assert "trained with another tokenizer" in msgs["tokenizer"] and "--tokenizer" in msgs["tokenizer"], msgs


# -- crash safety ---------------------------------------------------------------------------------------------
def test_kill_between_shards_and_manifest_keeps_the_previous_checkpoint(data_cache, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    base = [*DP2, "--train-steps", "4", "--save", str(ck)]
    monkeypatch.setenv(FAULT_ENV, "after_shards:1:4")  # rank 1 dies once every shard of step 4 is written
    with pytest.raises(WorldError):  # rank 0 then fails to gather the index from the dead rank 1
        run_world(train_runs, 2, [[*base, "--save-interval", "2"]], data_cache, str(tmp_path), dist_timeout=20)
    monkeypatch.delenv(FAULT_ENV)
    assert (ck / "latest").read_text() == "step_00000002\n"
    partial = ck / "step_00000004"
    assert (partial / "rank_00000.safetensors").is_file() and (partial / "rank_00001.safetensors").is_file()
    assert not (partial / "manifest.json").exists()
    assert find_checkpoint(ck) == ck / "step_00000002"
    runs = [[*base, "--load", str(ck), "--save-interval", "1", "--keep-last", "1"], [*DP2, "--train-steps", "4"]]
    (resumed, _), (full, _) = merge_runs(run_world(train_runs, 2, runs, data_cache, str(tmp_path)))
    assert resumed == full[2:]
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000004"]  # partial replaced, step 3 pruned
    assert (ck / "latest").read_text() == "step_00000004\n"


# -- failure handling -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_killed_or_hung_rank_makes_the_job_exit_within_the_timeout(fault, subprocess_env, tmp_path):
    """Two ranks launched by hand (no torchrun agent to clean up, as under srun): rank 1 is SIGKILLed (or
    SIGSTOPped: hung, its sockets open) after step 2; rank 0 must fail and exit within --dist-timeout, its whole
    stderr one line that names rank 1 (not gloo's text, no traceback)."""
    timeout = 5
    store, rendezvous = launch.held_store()  # held here while the ranks run: no port race
    env = {**subprocess_env, **rendezvous, "WORLD_SIZE": "2",
           FAULT_ENV: "step:1:2" + (":stop" if fault == "stop" else "")}
    args = [str(ROOT / "pretrain" / "gpt.py"), *SMALL_FLAGS, "--dp", "2", "--micro-batch-size", "4",
            "--dist-timeout", str(timeout), "--log-dir", str(tmp_path)]
    procs = [subprocess.Popen([sys.executable, *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    try:
        if fault == "kill":
            assert procs[1].wait(timeout=120) == -9
        else:
            deadline = time.monotonic() + 120
            while Path(f"/proc/{procs[1].pid}/stat").read_text().split()[2] != "T":  # state: stopped
                assert time.monotonic() < deadline and procs[1].poll() is None
                time.sleep(0.05)
        died = time.monotonic()
        try:
            code = procs[0].wait(timeout=3 * timeout)
        except subprocess.TimeoutExpired:
            code = None
        waited = time.monotonic() - died
    finally:
        for p in procs:
            launch.kill_group(p)
            p.wait()
    err = procs[0].stderr.read()
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert err.startswith("error (rank 0): rank 1 stopped responding: it "), err
    # no lower bound on wall time (shared machines); an upper bound of 3x the timeout it checks
    assert waited < 3 * timeout, f"rank 0 needed {waited:.1f}s after its peer {'died' if fault == 'kill' else 'hung'}"
    if fault == "stop":  # the collective timeout ended it
        assert f"did not answer within --dist-timeout {timeout} s" in err, err
    else:
        assert "closed its connection" in err, err


def test_torchrun_restart_resumes_from_latest(subprocess_env, tmp_path):
    """torchrun --max-restarts 1 with --load auto: rank 1 dies at step 4 (after the step-2 checkpoint); the
    restarted job resumes from step 2 and logs step 3 again with the same loss, bit for bit."""
    env = {**subprocess_env, FAULT_ENV: "step:1:4"}
    r = launch.torchrun(2, [*SMALL_FLAGS, "--dp", "2", "--micro-batch-size", "4", "--train-steps", "5", "--save",
                            str(tmp_path / "ck"), "--save-interval", "2", "--load", "auto", "--log-interval", "1",
                            "--log-dir", str(tmp_path)], env, 300, launcher_args=("--max-restarts", "1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "loaded checkpoint" in r.stdout and "step 2," in r.stdout
    records = _records(tmp_path)
    assert [rec["step"] for rec in records] == [1, 2, 3, 3, 4, 5]
    assert records[2]["loss"] == records[3]["loss"]
    assert [s for s, _ in list_checkpoints(tmp_path / "ck")] == [2, 4, 5]
