"""Tests for megazero.data: corpus, tokenizer, packed datasets, token files, preprocess CLI and sampler."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megazero.data import (
    DistributedBatchSampler,
    TokenDataset,
    Tokenizer,
    build_datasets,
    collate,
    corpus_fingerprint,
    load_or_train_tokenizer,
    open_token_file,
    read_text_documents,
    read_token_meta,
    stdlib_corpus_files,
    write_token_file,
)
from megazero.data import tokenizer as tokenizer_module

REPO_ROOT = Path(__file__).resolve().parent.parent
SMALL_VOCAB = 512


@pytest.fixture(scope="module")
def stdlib_files() -> list[Path]:
    return stdlib_corpus_files()


@pytest.fixture(scope="module")
def small_corpus(stdlib_files: list[Path]) -> list[Path]:
    """About 400 kB of stdlib files spread over the tree: enough for a 512-piece BPE, fast to train."""
    picked, total = [], 0
    for path in stdlib_files[::7]:
        size = path.stat().st_size
        if size < 40_000:
            picked.append(path)
            total += size
        if total > 400_000:
            break
    return picked


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("megazero_cache")


@pytest.fixture(scope="module")
def tok(small_corpus: list[Path], cache_dir: Path) -> Tokenizer:
    return load_or_train_tokenizer(small_corpus, SMALL_VOCAB, cache_dir)


# ----------------------------------------------------------------------------------------------- corpus


def test_stdlib_corpus_files(stdlib_files: list[Path]) -> None:
    assert len(stdlib_files) > 100
    assert stdlib_files == sorted(stdlib_files)
    assert all(p.suffix == ".py" for p in stdlib_files)
    excluded = {"test", "tests", "idle_test", "site-packages", "dist-packages"}
    assert not any(excluded & set(p.parts) for p in stdlib_files)
    assert any(p.name == "os.py" for p in stdlib_files)


def test_corpus_fingerprint_stable_and_sensitive(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        (d / "sub").mkdir(parents=True)
        (d / "x.py").write_text("x = 1\n")
        (d / "sub" / "y.py").write_text("y = 2\n")
    files_a = [a / "sub" / "y.py", a / "x.py"]
    files_b = [b / "sub" / "y.py", b / "x.py"]
    assert corpus_fingerprint(files_a) == corpus_fingerprint(files_b)  # location-independent
    (b / "x.py").write_text("x = 3\n")
    assert corpus_fingerprint(files_a) != corpus_fingerprint(files_b)


def test_read_text_documents(tmp_path: Path) -> None:
    (tmp_path / "d" / "inner").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("second\n")
    (tmp_path / "d" / "a.txt").write_text("first\n")
    (tmp_path / "d" / "inner" / "c.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2\\n", "id": 3}\n')
    assert list(read_text_documents([tmp_path / "d"])) == ["first\n", "second\n", "j1", "j2\n"]

    with pytest.raises(ValueError, match="does not exist"):
        list(read_text_documents([tmp_path / "missing.txt"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"content": "no text"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{bad}:2") + r'.*no "text" field'):
        list(read_text_documents([bad]))


# -------------------------------------------------------------------------------------------- tokenizer


def _feature_samples(stdlib_files: list[Path]) -> dict[str, str]:
    """Real stdlib sources with unicode, blank lines and deep indentation, plus tab/trailing-space variants."""
    texts = {p: p.read_text(encoding="utf-8") for p in stdlib_files[:400]}
    smallest = sorted(texts, key=lambda p: p.stat().st_size)
    samples = {
        "unicode": next(texts[p] for p in smallest if any(ord(c) > 127 for c in texts[p])),
        "blank_lines": next(texts[p] for p in smallest if "\n\n\n" in texts[p] and len(texts[p]) > 1000),
        "indented": next(texts[p] for p in smallest if "\n            " in texts[p] and len(texts[p]) > 2000),
    }
    code = samples["indented"]
    samples["tabs"] = re.sub(r"(?m)^((?:    )+)", lambda m: "\t" * (len(m.group(1)) // 4), code)
    samples["trailing_spaces"] = code.replace("\n", "  \n")
    samples["tabs_and_spaces"] = code.replace("    ", " \t  ")
    return samples


SYNTHETIC = [
    "",
    "   leading spaces",
    "trailing spaces   ",
    "\tdef f(x):\n\t\treturn x  # tab\n\n\n    mixed \t \t\n",
    "unicode: héllo wörld — 日本語 😀 \u00a0nbsp \u200b zero-width\n",
    "windows\r\nline\rendings\r\n",
    "literal \u2581 lower-block and \u2581\u2581 twice",
    "digits 1234567890 and 3.14159e-10\n",
    "\x00\x01control\x7f chars\n",
]


def test_round_trip(tok: Tokenizer, stdlib_files: list[Path]) -> None:
    samples = _feature_samples(stdlib_files)
    assert "\t" in samples["tabs"] and "  \n" in samples["trailing_spaces"]
    for name, text in [*samples.items(), *((repr(s), s) for s in SYNTHETIC)]:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text, name
    texts = list(samples.values()) + SYNTHETIC
    assert tok.encode_batch(texts, num_threads=2) == [tok.encode(t) for t in texts]


def test_tokenizer_basics(tok: Tokenizer) -> None:
    assert tok.vocab_size == SMALL_VOCAB
    assert tok.eos_id == 2 and tok.id_to_piece(tok.eos_id) == "</s>"
    assert tok.model_path.name.endswith(f"_{SMALL_VOCAB}.model")
    assert tok.model_path.parent.name == "tokenizers"
    again = Tokenizer.from_file(tok.model_path)
    assert again.fingerprint == tok.fingerprint and again.encode("x = 1\n") == tok.encode("x = 1\n")
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("def f():\n    pass\n") == tok.encode("def f():\n    pass\n")


def test_tokenizer_cache_hit(tok: Tokenizer, small_corpus: list[Path], cache_dir: Path, monkeypatch) -> None:
    mtime = tok.model_path.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("cached tokenizer was retrained")

    monkeypatch.setattr(tokenizer_module, "_train", fail)
    again = load_or_train_tokenizer(small_corpus, SMALL_VOCAB, cache_dir)
    assert again.model_path == tok.model_path and again.model_path.stat().st_mtime_ns == mtime
    assert again.fingerprint == tok.fingerprint


def _train_in_child(args: tuple) -> str:
    files, cache, log = args
    train = tokenizer_module._train

    def logged_train(*a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return train(*a, **k)

    tokenizer_module._train = logged_train  # this forked child only
    return load_or_train_tokenizer(files, 400, cache).fingerprint


def test_concurrent_training_trains_once(small_corpus: list[Path], tmp_path: Path) -> None:
    log = tmp_path / "trained.log"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        prints = pool.map(_train_in_child, [(small_corpus[:10], tmp_path, log)] * 2, chunksize=1)
    assert prints[0] == prints[1]
    assert len(log.read_text().splitlines()) == 1
    assert [p.suffix for p in (tmp_path / "tokenizers").iterdir() if p.suffix != ".lock"] == [".model"]


def test_impossible_vocab_size_is_a_clear_error(tmp_path: Path) -> None:
    for vocab_size in (5000, 100):  # more merges than the text has; fewer pieces than bytes + characters
        with pytest.raises(ValueError, match=f"--vocab-size {vocab_size}"):
            load_or_train_tokenizer(lambda: ["hello world\n"] * 10, vocab_size, tmp_path, fingerprint="tiny")
    assert not list((tmp_path / "tokenizers").glob("*.model")) and not list((tmp_path / "tokenizers").glob("*.tmp"))


# ------------------------------------------------------------------------------------- datasets & files


def test_token_dataset_packing() -> None:
    ds = TokenDataset(np.arange(101, dtype=np.uint16), seq_len=10)
    assert len(ds) == 10
    for i in (0, 9, -1):
        s = ds[i]
        assert s.dtype == torch.long and s.shape == (11,)
        assert torch.equal(s, torch.arange(10 * (i % 10), 10 * (i % 10) + 11))
    with pytest.raises(IndexError):
        ds[10]
    inputs, targets = collate(ds, [3, 0, 7])
    assert inputs.shape == targets.shape == (3, 10) and inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert torch.equal(inputs[0], torch.arange(30, 40)) and torch.equal(targets[0], torch.arange(31, 41))


def test_token_file_round_trip(tmp_path: Path) -> None:
    chunks = [np.arange(5), [7, 8, 9], np.array([], dtype=np.int64), np.array([511])]
    meta = write_token_file(tmp_path / "out", chunks, np.uint16, vocab_size=512, tokenizer_fingerprint="abc")
    assert meta["num_tokens"] == 9 and meta["dtype"] == "uint16"
    arr = open_token_file(tmp_path / "out")
    assert isinstance(arr, np.memmap) and arr.dtype == np.uint16
    assert arr.tolist() == [0, 1, 2, 3, 4, 7, 8, 9, 511]
    assert open_token_file(tmp_path / "out.bin").tolist() == arr.tolist()
    sidecar = json.loads((tmp_path / "out.json").read_text())
    assert sidecar["vocab_size"] == 512 and sidecar["format_version"] == 1
    assert read_token_meta(tmp_path / "out")["tokenizer_fingerprint"] == "abc"
    big = write_token_file(tmp_path / "big", [[70000]], np.uint32, vocab_size=70001)
    assert big["dtype"] == "uint32" and open_token_file(tmp_path / "big").tolist() == [70000]
    with pytest.raises(ValueError, match="out of range"):
        write_token_file(tmp_path / "bad", [[512]], np.uint16, vocab_size=512)
    assert not (tmp_path / "bad.json").exists()


def test_build_datasets_from_jsonl(tok: Tokenizer, tmp_path: Path) -> None:
    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(60)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train, evaluation = build_datasets([str(data)], tok, seq_len=16, cache_dir=tmp_path / "c", eval_fraction=0.1)
    expected = np.concatenate([np.array(tok.encode(d) + [tok.eos_id]) for d in docs])
    assert np.array_equal(np.concatenate([train.tokens, evaluation.tokens]), expected)
    assert evaluation.num_tokens == max(int(np.ceil(0.1 * len(expected))), 17)
    assert len(train) == (train.num_tokens - 1) // 16 and len(evaluation) >= 1
    cached = list((tmp_path / "c" / "tokens").glob("*.bin"))
    assert len(cached) == 1
    mtime = cached[0].stat().st_mtime_ns
    train2, _ = build_datasets([str(data)], tok, seq_len=16, cache_dir=tmp_path / "c", eval_fraction=0.1)
    assert cached[0].stat().st_mtime_ns == mtime and torch.equal(train2[3], train[3])
    with pytest.raises(ValueError, match="too few for --seq-len 4096"):
        build_datasets([str(data)], tok, seq_len=4096, cache_dir=tmp_path / "c")


def test_build_datasets_default_stdlib(tok: Tokenizer, cache_dir: Path, stdlib_files: list[Path]) -> None:
    train, evaluation = build_datasets([], tok, seq_len=128, cache_dir=cache_dir, eval_fraction=0.01)
    total = train.num_tokens + evaluation.num_tokens
    assert total > sum(p.stat().st_size for p in stdlib_files) / 8
    assert train.tokens.dtype == np.uint16 and len(evaluation) >= 1
    assert tok.decode(train.tokens[: tok.encode("x").__len__() + 200].tolist()).startswith(
        stdlib_files[0].read_text()[:50]
    )


def test_preprocess_cli_and_bin_dataset(tok: Tokenizer, tmp_path: Path) -> None:
    data = tmp_path / "tiny.jsonl"
    docs = [f"print('hello {i}')\n\tindented\u00e9\n" for i in range(40)]
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out" / "tiny"
    cmd = [sys.executable, str(REPO_ROOT / "tools" / "preprocess_data.py"), "--input", str(data),
           "--output-prefix", str(out), "--tokenizer", str(tok.model_path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "40 documents" in result.stdout
    tokens = open_token_file(out)
    expected = [t for d in docs for t in [*tok.encode(d), tok.eos_id]]
    assert tokens.tolist() == expected
    train, evaluation = build_datasets([f"{out}.bin"], tok, seq_len=8, cache_dir=tmp_path, eval_fraction=0.1)
    assert train.num_tokens + evaluation.num_tokens == len(expected)

    write_token_file(tmp_path / "other", [[1, 2, 3]], np.uint16, vocab_size=1000)
    with pytest.raises(ValueError, match="vocab_size 1000 but the tokenizer has 512"):
        build_datasets([str(tmp_path / "other.bin")], tok, seq_len=2, cache_dir=tmp_path)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": "oops"}\n')
    cmd[cmd.index("--input") + 1] = str(bad)
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert result.returncode != 0 and 'no "text" field' in result.stderr


# ---------------------------------------------------------------------------------------------- sampler


def _global_batch(num_samples: int, gbs: int, mbs: int, dp: int, seed: int, consumed: int = 0) -> list[int]:
    """Union (in rank order) of every DP rank's micro-batches for one step."""
    out: list[int] = []
    for rank in range(dp):
        s = DistributedBatchSampler(num_samples, gbs, mbs, rank, dp, seed, consumed_samples=consumed)
        micro = s.next_global_batch()
        assert len(micro) == s.num_micro_batches == gbs // (mbs * dp)
        assert all(len(m) == mbs for m in micro)
        out.extend(i for m in micro for i in m)
    return out


def test_sampler_global_batch_independent_of_dp_and_micro() -> None:
    n, gbs, seed = 37, 8, 3
    for consumed in (0, 8, 32, 40, 96):
        reference = _global_batch(n, gbs, gbs, 1, seed, consumed)
        assert len(set(reference)) == gbs  # n > gbs: no repeats within a batch here
        for dp in (1, 2, 4):
            for mbs in (1, 2, gbs // dp):
                assert _global_batch(n, gbs, mbs, dp, seed, consumed) == reference


def test_sampler_disjoint_deterministic_and_epochs() -> None:
    n, gbs = 24, 8
    samplers = [DistributedBatchSampler(n, gbs, 2, r, 2, seed=5) for r in range(2)]
    seen: list[int] = []
    for _ in range(3):  # one full epoch
        shares = [{i for m in s.next_global_batch() for i in m} for s in samplers]
        assert not shares[0] & shares[1]
        seen.extend(shares[0] | shares[1])
    assert sorted(seen) == list(range(n))
    assert samplers[0].epoch == 1 and samplers[0].consumed_samples == n
    first = DistributedBatchSampler(n, gbs, 2, 0, 2, seed=5)
    assert first.epoch_permutation(0).tolist() == DistributedBatchSampler(n, 8, 8, seed=5).epoch_permutation(0).tolist()
    assert first.epoch_permutation(1).tolist() != first.epoch_permutation(0).tolist()
    assert sorted(first.epoch_permutation(1).tolist()) == list(range(n))
    assert DistributedBatchSampler(n, gbs, 8, seed=6).epoch_permutation(0).tolist() != first.epoch_permutation(0).tolist()
    # a global batch straddling the epoch boundary: tail of epoch 0 then head of epoch 1
    s = DistributedBatchSampler(10, 4, 4, seed=1, consumed_samples=8)
    assert s.next_global_batch() == [[*s.epoch_permutation(0)[8:].tolist(), *s.epoch_permutation(1)[:2].tolist()]]
    assert DistributedBatchSampler(5, 4, 4, shuffle=False).global_batch_indices(8) == [3, 4, 0, 1]


def test_sampler_resume_from_state_dict() -> None:
    s = DistributedBatchSampler(50, 12, 3, dp_rank=1, dp_size=2, seed=9)
    for _ in range(5):
        s.next_global_batch()
    state = s.state_dict()
    assert state["consumed_samples"] == 60
    expected = [s.next_global_batch() for _ in range(4)]
    resumed = DistributedBatchSampler(50, 12, 3, dp_rank=1, dp_size=2, seed=9)
    resumed.load_state_dict(state)
    assert [resumed.next_global_batch() for _ in range(4)] == expected
    # resuming on another topology keeps the global batches
    other = DistributedBatchSampler(50, 12, 6, dp_rank=0, dp_size=1, seed=9)
    other.load_state_dict(state)
    assert [i for m in other.next_global_batch() for i in m][6:] == [i for m in expected[0] for i in m]
    with pytest.raises(ValueError, match="seed"):
        DistributedBatchSampler(50, 12, 3, seed=10).load_state_dict(state)


def test_sampler_validation_messages() -> None:
    with pytest.raises(ValueError, match=r"global_batch_size \(10\).*micro_batch_size \(2\).*dp_size \(4\)"):
        DistributedBatchSampler(100, 10, 2, 0, 4)
    with pytest.raises(ValueError, match="dp_rank"):
        DistributedBatchSampler(100, 8, 2, 2, 2)
    with pytest.raises(ValueError, match="num_samples"):
        DistributedBatchSampler(0, 8, 2)
