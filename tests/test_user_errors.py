"""What a user sees when something they can fix goes wrong: one line per rank on stderr, no traceback, a non-zero
exit (tests run the real ``pretrain/gpt.py``, several at once to keep the wall time down); a peer that died
named as such; ``--load auto`` past a damaged checkpoint; a resumed run that keeps its global batch; ``--help``
defaults of every tool."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megazero.config.cli import parse_args
from megazero.config.errors import ConfigError
from tests import launch
from tests.common import SMALL_FLAGS, train_runs
from tests.dist import run_world

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "pretrain" / "gpt.py")
FOUR = ["--micro-batch-size", "4", "--train-steps", "4", "--lr-decay-steps", "6", "--dist-timeout", "20"]


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, GPT, *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(procs: dict[str, subprocess.Popen], timeout: float = 240) -> dict[str, tuple[int, str, str]]:
    """Wait for every process (started together: the imports overlap); kill what is left of each group."""
    out = {}
    try:
        for name, p in procs.items():
            o, e = p.communicate(timeout=timeout)
            out[name] = (p.returncode, o, e)
    finally:
        for p in procs.values():
            launch.kill_group(p)
    return out


def assert_one_line(result: tuple[int, str, str], rank: int, *needles: str) -> str:
    """The whole stderr is one line ``error (rank R): ...`` holding every needle; the exit status is not 0."""
    code, out, err = result
    lines = err.splitlines()
    assert code not in (0, None) and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:], out[-1000:])
    assert lines[0].startswith(f"error (rank {rank}): "), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def saved(data_cache, tmp_path_factory):
    """A checkpoint of steps 2 and 4 saved at dp 2 (global batch 8 = micro 4 x dp 2), and each rank's losses."""
    root = tmp_path_factory.mktemp("user_errors")
    runs = [[*FOUR, "--save", str(root / "ck"), "--save-interval", "2"]]
    [[(losses, _)], _] = run_world(train_runs, 2, runs, data_cache, str(root / "logs"))
    return root, losses


def _bad_data(root: Path, cache: str) -> dict[str, Path]:
    """Data a user may bring: a missing path, an empty file, Latin-1 text, JSONL without "text", a .bin (with
    its sidecar) that holds a token id beyond its tokenizer's 512, and a good .bin of that tokenizer."""
    import numpy as np

    from megazero.data import resolve_tokenizer, write_token_file

    root.mkdir()
    out = {"no_file": root / "none.txt", "empty": root / "empty.txt", "latin1": root / "latin1.txt",
           "no_text": root / "no_text.jsonl", "beyond": root / "beyond.bin", "own": root / "own.bin"}
    out["empty"].write_text("")
    out["latin1"].write_bytes(b"caf\xe9 au lait\n" * 50)
    out["no_text"].write_text("".join(json.dumps({"body": f"document {i}"}) + "\n" for i in range(30)))
    tok = resolve_tokenizer([], 512, cache)
    write_token_file(out["beyond"], [np.arange(4000) % 500], np.uint16, vocab_size=512,
                     tokenizer_fingerprint=tok.fingerprint, tokenizer_model=str(tok.model_path))
    write_token_file(out["own"], [np.arange(4000) % 500], np.uint16, vocab_size=512,
                     tokenizer_fingerprint=tok.fingerprint, tokenizer_model=str(tok.model_path))
    ids = np.memmap(out["beyond"], dtype=np.uint16, mode="r+")
    ids[1234] = 700
    ids.flush()
    return out


def test_errors_are_one_line_per_rank_without_traceback(saved, subprocess_env, tmp_path):
    """Started together: --data of a missing path, an empty file, non-UTF-8 text, JSONL without "text", a .bin
    with a token id beyond the vocabulary, a good .bin without --vocab-size (its tokenizer's size is used); --load of a missing directory, a deleted shard, a truncated shard, another
    model size;
    the same with --debug (the traceback, then the line); two ranks under torchrun (each worker's stderr in its
    own file: one line each, none repeated); and a good resume at dp 1 of the dp-2 checkpoint, which keeps its
    global batch."""
    root, _ = saved
    for name in ("deleted", "truncated"):
        shutil.copytree(root / "ck", tmp_path / name)
    os.remove(tmp_path / "deleted" / "step_00000004" / "rank_00000.safetensors")
    shard = tmp_path / "truncated" / "step_00000004" / "rank_00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    data = _bad_data(tmp_path / "data", subprocess_env["MEGAZERO_CACHE"])
    base = [*SMALL_FLAGS, *FOUR, "--train-steps", "5", "--log-dir", str(tmp_path / "log")]
    missing = ["--load", str(tmp_path / "nonexistent")]
    cases = {**{name: ["--data", str(path)] for name, path in data.items() if name != "own"},
             "missing": missing, "debug": [*missing, "--debug"],
             "deleted": ["--load", str(tmp_path / "deleted")],
             "truncated": ["--load", str(tmp_path / "truncated")],
             "size": ["--load", str(root / "ck"), "--hidden-size", "128"],
             "resume": ["--load", str(root / "ck"), "--log-dir", str(tmp_path / "ok"), "--train-steps", "7",
                        "--log-interval", "1", "--save", str(tmp_path / "ok" / "ck"), "--warmup-steps", "100"]}
    procs = {name: _start([*base, *flags], subprocess_env) for name, flags in cases.items()}
    no_vocab = [f for i, f in enumerate(base) if "--vocab-size" not in base[max(0, i - 1): i + 1]]
    procs["own"] = _start([*no_vocab, "--data", str(data["own"]), "--train-steps", "1", "--log-dir",
                           str(tmp_path / "own")], subprocess_env)  # the preset says 1024, the .bin's tokenizer 512
    procs["torchrun-tty"] = subprocess.Popen(  # as a user sees it: both workers' stderr and torchrun's together
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", GPT, *base, "--data",
         str(data["no_file"])], env=subprocess_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True)
    logs = tmp_path / "torchrun"
    procs["torchrun"] = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--log-dir",
         str(logs), "--redirects", "3", GPT, *base, "--data", str(data["no_file"])], env=subprocess_env, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    r = _finish(procs)
    assert_one_line(r["no_file"], 0, f"data path '{data['no_file']}' does not exist")
    assert_one_line(r["empty"], 0, f"data file {data['empty']} is empty; give files with text")
    assert_one_line(r["latin1"], 0, "latin1.txt' is not UTF-8 text", "iconv")
    assert_one_line(r["no_text"], 0, 'no_text.jsonl:1: JSON line has no "text" field (its keys: body)')
    assert_one_line(r["beyond"], 0, "beyond.bin: token id 700 at offset 1234 (of 4000 tokens) is beyond the "
                    "vocabulary of 512")
    assert_one_line(r["missing"], 0, "nonexistent: no such directory", "[traceback: --debug]")
    assert_one_line(r["deleted"], 0, "rank_00000.safetensors is missing", "load another checkpoint")
    assert_one_line(r["truncated"], 0, "rank_00000.safetensors is corrupt")
    assert_one_line(r["size"], 0, "--hidden-size 128 != checkpoint's 64")
    code, _, err = r["debug"]
    assert code == 1 and "Traceback" in err and err.splitlines()[-1].startswith("error (rank 0): --load "), err
    assert r["torchrun"][0] != 0
    for rank in range(2):
        [err_file] = logs.glob(f"*/attempt_0/{rank}/stderr.log")
        assert_one_line((1, "", err_file.read_text()), rank, "does not exist")
    lines = [line for line in r["torchrun-tty"][2].splitlines() if line.strip() and not set(line) <= {"*"}
             and not line.startswith("Setting OMP_NUM_THREADS")]  # torchrun's banner, before any worker starts
    assert re.fullmatch(r"error \(rank [01]\): data path .* does not exist.*\[traceback: --debug\]", lines[0]), lines
    assert re.fullmatch(r"error \(rank [01]\): .*", lines[1]) and lines[1][:16] != lines[0][:16], lines[:2]
    assert "error (rank" not in "\n".join(lines[2:lines.index("Failures:")]), lines  # only torchrun's own lines
    summary = "\n".join(lines[lines.index("Failures:"):])  # torchrun quotes each rank's line (its error file)
    assert all(f"traceback : error (rank {q}): data path" in summary for q in (0, 1)), summary
    code, out, err = r["own"]
    assert code == 0 and err == "" and "vocab 512 (padded 512)" in out, (err[-3000:], out[-2000:])
    code, out, err = r["resume"]
    assert code == 0 and err == "", err[-3000:]  # the setting's warning is a log line, not Python's two
    assert "WARNING --warmup-steps (scheduler.params.warmup_num_steps) 100 exceeds --train-steps 7" in out, out
    assert "resuming with the checkpoint's global batch 8 = micro 4 x accumulation 2 x dp 1" in out, out
    _assert_run_says_what_it_did(out, tmp_path / "ok", first=5, last=7)


def _assert_run_says_what_it_did(out: str, log_dir: Path, first: int, last: int) -> None:
    """Console tok/s = metrics.jsonl's tokens_per_s at each step; no ETA at the first step (its warm-up would
    skew it), one after; the end names the metrics file and the checkpoint with the commands that read them."""
    records = {rec["step"]: rec for rec in map(json.loads, (log_dir / "metrics.jsonl").read_text().splitlines())}
    lines = {int(m.group(1)): m for m in re.finditer(r"step (\d+)/\d+ .* ([\d,]+) tok/s( ETA \d+s)?$", out, re.M)}
    assert sorted(lines) == sorted(records) == list(range(first, last + 1)), out
    for step, m in lines.items():
        assert m.group(2) == f"{records[step]['tokens_per_s']:,.0f}", (m.group(0), records[step]["tokens_per_s"])
        assert (m.group(3) is None) == (step == first), m.group(0)
    assert f"metrics: {log_dir / 'metrics.jsonl'}; plot them: python tools/plot_metrics.py {log_dir}" in out, out
    ck = log_dir / "ck"
    assert f"checkpoint: {ck / f'step_{last:08d}'}; generate: python tools/generate.py {ck} --prompt" in out, out
    assert f"python tools/convert_checkpoint.py {ck} --out {ck}-hf --format hf" in out, out


def test_peer_failure_names_the_rank(monkeypatch):
    """A rank whose collective broke reads the job's store: a peer that posted its own error is quoted, one that
    posted nothing is named as having stopped (unit test of megazero.distributed.failure over a HashStore)."""
    import torch.distributed as dist

    from megazero.distributed import failure

    store = dist.HashStore()
    monkeypatch.setattr(failure, "_store", lambda timeout_s: store)
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7083: Connection reset by peer")
    assert failure.is_peer_failure(gloo) and not failure.is_peer_failure(ValueError("Connection reset by peer"))
    silent = str(failure.explain_peer_failure(gloo, 0, 3, timeout_s=30, grace_s=0.2))
    assert silent.startswith("ranks 1, 2 stopped responding: one of them closed its connection"), silent
    failure.announce_failure(2, "data path 'x' does not exist")
    said = str(failure.explain_peer_failure(gloo, 0, 3, timeout_s=30, grace_s=0.2))
    assert said.startswith("rank 2 failed first (data path 'x' does not exist)"), said
    store = dist.HashStore()  # a fresh job: the lambda above reads this name
    hung = failure.explain_peer_failure(RuntimeError("Timed out waiting 5000ms for recv operation"), 1, 2, 5, 0.2)
    assert "rank 0 stopped responding: it did not answer within --dist-timeout 5 s" in str(hung), hung


def _fallback(ctx, cache: str, log_dir: str, damaged: str) -> tuple[str, list[float]]:
    """Loading the damaged step by name refuses; --load auto trains from the older checkpoint."""
    try:
        train_runs(ctx, [[*FOUR, "--load", f"{damaged}/step_00000004"]], cache, log_dir)
        refused = "loaded"
    except Exception as e:  # noqa: BLE001 - the refusal is what the test reads
        refused = f"{type(e).__name__}: {e}"
    [(losses, _)] = train_runs(ctx, [[*FOUR, "--train-steps", "6", "--load", "auto", "--save", damaged]], cache,
                               log_dir)
    return refused, losses


def test_load_auto_skips_a_damaged_checkpoint(saved, data_cache, tmp_path):
    """Step 4's shard of rank 1 is corrupt (rank 1 verifies that file, both skip it): --load auto resumes from
    step 2 with the same step-3 loss as the run that saved it, and then saves step 4 afresh. Loading a
    damaged step by name still refuses."""
    root, losses = saved
    damaged = tmp_path / "ck"
    shutil.copytree(root / "ck", damaged)
    shard = damaged / "step_00000004" / "rank_00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    results = run_world(_fallback, 2, data_cache, str(tmp_path / "logs"), str(damaged))
    for rank, (refused, resumed) in enumerate(results):
        assert len(resumed) == 4 and resumed[:2] == losses[2:], (resumed, losses)  # steps 3-6, from step 2
        assert "CheckpointError" in refused and "rank_00001.safetensors is corrupt" in refused, refused
        # printed as "error (rank R): ...": rank 0 says who found it, rank 1 names no other rank
        assert ("CheckpointError: rank 1 reports: " in refused) == (rank == 0) and "(rank" not in refused, refused
    assert (damaged / "latest").read_text() == "step_00000006\n"


def test_resume_keeps_the_checkpoint_global_batch(saved):
    """Saved at dp 2 with global batch 8: resolved at another world size without --global-batch-size, the run
    keeps 8 (the micro-batch shrinks where it must); a given, different global batch is kept and reported."""
    from megazero.train.resume import resolve_for_resume

    ck = str(saved[0] / "ck")
    flags = [*SMALL_FLAGS, "--load", ck]
    for world, micro, accum in ((1, 8, 1), (4, 2, 1)):
        cfg, said = resolve_for_resume(parse_args(flags), world)
        t = cfg.training
        assert (t.global_batch_size, t.micro_batch_size, t.gradient_accumulation_steps) == (8, micro, accum)
        assert said.startswith(f"resuming with the checkpoint's global batch 8 = micro {micro}"), said
    cfg, said = resolve_for_resume(parse_args([*flags, "--micro-batch-size", "2"]), 1, micro_given=True)
    assert (cfg.training.micro_batch_size, cfg.training.gradient_accumulation_steps) == (2, 4)
    cfg, said = resolve_for_resume(parse_args([*flags, "--global-batch-size", "16"]), 1)
    assert cfg.training.global_batch_size == 16 and said.startswith("--global-batch-size 16 differs"), said
    with pytest.raises(ConfigError, match="--micro-batch-size 16 x dp 1 does not divide"):
        resolve_for_resume(parse_args(flags), 1, micro_given=True)
    with pytest.raises(ConfigError, match="dp 3 does not divide"):
        resolve_for_resume(parse_args(flags), 3)
    cfg, said = resolve_for_resume(parse_args(SMALL_FLAGS), 2)  # no --load: resolution as ever
    assert cfg.training.global_batch_size == 32 and said is None


def _tool_parser(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"_tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    if hasattr(module, "build_parser"):
        return module.build_parser()
    captured = []  # a tool that builds its parser inside main(): caught at parse time

    def grab(self, *args, **kwargs):
        captured.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    with pytest.raises(SystemExit):
        module.main([])
    return captured[0]


def test_a_failure_line_is_one_write_and_the_help_says_what_it_should(monkeypatch, tmp_path):
    """report_failure writes "error (rank R): ...\\n" to the stderr descriptor in one write (ranks sharing a pipe
    never run together) and returns 2 for a setting, 1 for anything else; the help texts name --debug, the
    kinds of --data, and that preprocess_data needs --tokenizer or --vocab-size."""
    import io

    from megazero.config.cli import build_parser
    from megazero.data import DataError
    from megazero.observe import log

    read_fd, write_fd = os.pipe()
    stream = io.TextIOWrapper(io.FileIO(write_fd, "w"), line_buffering=True, write_through=True)
    writes: list[bytes] = []
    real_write = os.write
    monkeypatch.setattr(log.os, "write", lambda fd, data: writes.append(bytes(data)) or real_write(fd, data))
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.delenv(log.DEBUG_ENV, raising=False)
    assert log.report_failure(ConfigError("--tp 3 does not divide 4"), 3) == 2
    assert log.report_failure(DataError("data path 'x' does not exist"), 1) == 1
    stream.close()
    with os.fdopen(read_fd, "rb") as f:
        got = f.read()
    assert writes == [b"error (rank 3): --tp 3 does not divide 4\n",
                      b"error (rank 1): data path 'x' does not exist [traceback: --debug]\n"], writes
    assert got == b"".join(writes)
    monkeypatch.undo()
    text = " ".join(build_parser().format_help().split())
    assert "--debug a failure prints its traceback" in text and "exit status 2 for a setting, 1 for" in text, text
    assert ".jsonl with a \"text\" field" in text and "token files (.bin from tools/preprocess_data.py" in text
    preprocess = " ".join(_tool_parser("preprocess_data", monkeypatch).format_help().split())
    assert preprocess.count("One of --tokenizer and --vocab-size is required") == 1, preprocess
    for tool in ("generate", "convert_checkpoint"):  # one hint everywhere: every entry point takes --debug
        assert "--debug" in _tool_parser(tool, monkeypatch).format_help()


@pytest.mark.parametrize("name", ["generate", "convert_checkpoint", "estimate_memory", "plan", "plot_metrics",
                                  "mutation_check", "preprocess_data"])
def test_tool_help_shows_every_default(name, monkeypatch):
    """Every option of every tool whose default is a value says it in --help."""
    parser = _tool_parser(name, monkeypatch)
    for action in parser._actions:
        if action.default not in (None, False, "==SUPPRESS==") and action.option_strings:
            assert "default" in (action.help or ""), f"{name} {action.option_strings[0]}: {action.help!r}"
