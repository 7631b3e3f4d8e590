"""Hugging Face ``tokenizer.json`` support in megazero.data and tools/preprocess_data.py.

The tokenizer is a tiny byte-level BPE trained at test time with the ``tokenizers`` library on a slice of the
built-in standard-library corpus: nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as LibTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from megazero.data import (
    HFTokenizer,
    Tokenizer,
    build_datasets,
    load_or_train_tokenizer,
    open_token_file,
    open_tokenizer,
    read_token_meta,
    resolve_tokenizer,
    stdlib_corpus_files,
    tokenizer_vocab_size,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
PREPROCESS = REPO_ROOT / "tools" / "preprocess_data.py"
VOCAB = 700
EOS = "<|endoftext|>"
TEXTS = ["def f(x):\n    return x + 1\n", "héllo wörld — ünïcode ✓ 日本語\n\ttabs  and   spaces\r\n",
         f"a special {EOS} inside", "", " leading space", "\u2581 sentencepiece's space mark"]


@pytest.fixture(scope="module")
def corpus_files() -> list[Path]:
    """About 60 kB of the standard-library corpus, spread over the tree."""
    picked, total = [], 0
    for path in stdlib_corpus_files()[::25]:
        if path.stat().st_size < 20_000:
            picked.append(path)
            total += path.stat().st_size
        if total > 60_000:
            break
    return picked


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, corpus_files: list[Path]) -> Path:
    """A directory holding a trained byte-level BPE ``tokenizer.json`` (no tokenizer_config.json)."""
    tok = LibTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([p.read_text() for p in corpus_files], trainer)
    out = tmp_path_factory.mktemp("hf_tok")
    tok.save(str(out / "tokenizer.json"))
    return out


def test_round_trip_and_same_ids_as_tokenizers(hf_dir: Path, corpus_files: list[Path]) -> None:
    lib = LibTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tok = open_tokenizer(hf_dir / "tokenizer.json")
    assert isinstance(tok, HFTokenizer) and isinstance(open_tokenizer(hf_dir), HFTokenizer)
    assert tok.vocab_size == lib.get_vocab_size(with_added_tokens=True) == VOCAB
    assert tok.eos_id == lib.token_to_id(EOS) and tok.bos_id == -1
    texts = TEXTS + [p.read_text() for p in corpus_files[:5]]
    for text in texts:
        ids = tok.encode(text)
        assert ids == lib.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode(f"x{EOS}")[-1] == tok.eos_id  # a literal special token is that token, as in transformers
    assert tok.encode_batch(texts) == tok.encode_batch(texts, num_threads=2) == [tok.encode(t) for t in texts]
    renamed = hf_dir.parent / "renamed_tokenizer.model"  # e.g. copied under another name: the content decides
    renamed.write_bytes((hf_dir / "tokenizer.json").read_bytes())
    assert isinstance(open_tokenizer(renamed), HFTokenizer) and open_tokenizer(renamed).fingerprint == tok.fingerprint
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(texts[1]) == tok.encode(texts[1]) and clone.fingerprint == tok.fingerprint


def test_eos_from_tokenizer_config(hf_dir: Path, tmp_path: Path) -> None:
    raw = json.loads((hf_dir / "tokenizer.json").read_text())
    raw["added_tokens"].append({"id": VOCAB, "content": "<|eot|>", "single_word": False, "lstrip": False,
                                "rstrip": False, "normalized": False, "special": True})
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|eot|>"}}))
    tok = open_tokenizer(tmp_path)
    assert tok.eos_id == VOCAB and tok.vocab_size == VOCAB + 1
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
        open_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    raw["added_tokens"] = [t for t in raw["added_tokens"] if t["content"] != EOS]
    raw["model"]["vocab"].pop(EOS)
    (tmp_path / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"no end-of-sequence \(eos\) token.*tokenizer_config.json"):
        open_tokenizer(tmp_path / "tokenizer.json")


def test_vocab_size_follows_tokenizer_and_mismatch_is_refused(hf_dir: Path, tmp_path: Path) -> None:
    path = hf_dir / "tokenizer.json"
    assert tokenizer_vocab_size(path) == tokenizer_vocab_size(hf_dir) == VOCAB
    assert resolve_tokenizer([], None, tmp_path, path).vocab_size == VOCAB
    assert resolve_tokenizer([], VOCAB, tmp_path, hf_dir).vocab_size == VOCAB
    with pytest.raises(ValueError, match=f"--vocab-size 1024 does not match .* with {VOCAB} tokens.*--vocab-size {VOCAB}"):
        resolve_tokenizer([], 1024, tmp_path, path)
    # a checkpoint's embedding may have more rows than the tokenizer has entries (Qwen2, Pythia): never fewer
    assert resolve_tokenizer([], 1024, tmp_path, path, rows_beyond_ok=True).vocab_size == VOCAB
    with pytest.raises(ValueError, match=f"--vocab-size 512 does not match .* with {VOCAB} tokens"):
        resolve_tokenizer([], 512, tmp_path, path, rows_beyond_ok=True)
    with pytest.raises(ValueError, match="does not exist"):
        open_tokenizer(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="tokenizer model .* does not exist"):  # the SentencePiece path, as before
        open_tokenizer(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="holds neither tokenizer.json"):
        open_tokenizer(tmp_path)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        open_tokenizer(tmp_path / "bad.json")


def _preprocess(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(PREPROCESS), *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300)


def test_preprocess_workers_byte_identical(hf_dir: Path, corpus_files: list[Path], tmp_path: Path) -> None:
    docs = [f"doc {i}: {TEXTS[i % len(TEXTS)]}" * (1 + i % 7) for i in range(300)]
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    texts = [p.read_text() for p in corpus_files]
    for i, text in enumerate(texts):
        (data / f"b{i:02d}.txt").write_text(text)
    outputs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}" / "corpus"
        result = _preprocess(["--input", str(data), "--output-prefix", str(out), "--tokenizer", str(hf_dir),
                              "--workers", str(workers), "--batch-size", "16", "--batch-chars", "20000"], tmp_path)
        assert result.returncode == 0, result.stderr
        assert f"{len(docs) + len(texts)} documents" in result.stdout and f"{workers} worker(s)" in result.stdout
        outputs[workers] = out
    assert Path(f"{outputs[2]}.bin").read_bytes() == Path(f"{outputs[1]}.bin").read_bytes()
    assert Path(f"{outputs[2]}.json").read_text() == Path(f"{outputs[1]}.json").read_text()
    tok = open_tokenizer(hf_dir)
    expected = [t for d in [*docs, *texts] for t in [*tok.encode(d), tok.eos_id]]
    assert open_token_file(outputs[2]).tolist() == expected
    assert read_token_meta(outputs[2])["eos_id"] == tok.eos_id

    found = resolve_tokenizer([f"{outputs[2]}.bin"], None, tmp_path)  # the sidecar names the tokenizer.json
    assert isinstance(found, HFTokenizer) and found.fingerprint == tok.fingerprint
    train, evaluation = build_datasets([f"{outputs[2]}.bin"], found, seq_len=16, cache_dir=tmp_path)
    assert train.num_tokens + evaluation.num_tokens == len(expected)
    text_train, _ = build_datasets([data], found, seq_len=16, cache_dir=tmp_path)  # tokenised and cached
    assert np.array_equal(np.asarray(text_train.tokens), np.asarray(train.tokens))


def _preprocess_main() -> Callable[[list[str]], int]:
    spec = importlib.util.spec_from_file_location("preprocess_data", PREPROCESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_clear_errors(hf_dir: Path, tmp_path: Path, workers: int, capsys) -> None:
    main = _preprocess_main()
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    cases = {
        "missing.txt": (None, "data path .*missing.txt' does not exist"),
        "latin1.txt": (b"caf\xe9\n", "latin1.txt' is not UTF-8 text"),
        "latin1.jsonl": (b'{"text": "caf\xe9"}\n', "latin1.jsonl' is not UTF-8 text"),
        "notext.jsonl": (b'{"txt": "oops"}\n', 'notext.jsonl:1: JSON line has no "text" field'),
    }
    common = ["--output-prefix", str(tmp_path / "out"), "--workers", str(workers), "--batch-size", "4"]
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        assert main(["--input", str(good), str(tmp_path / name), "--tokenizer", str(hf_dir), *common]) == 2
        err = capsys.readouterr().err
        assert "preprocess_data: error:" in err and re.search(message, err), err
        assert not (tmp_path / "out.json").exists()
    assert main(["--input", str(good), "--tokenizer", str(hf_dir), "--vocab-size", "1024", *common]) == 2
    err = capsys.readouterr().err
    assert "--vocab-size 1024 does not match" in err and f"with {VOCAB} tokens" in err
    assert main(["--input", str(good), "--tokenizer", str(tmp_path / "nope" / "tokenizer.json"), *common]) == 2
    assert re.search("tokenizer file .* does not exist", capsys.readouterr().err)
    assert main(["--input", str(good), "--tokenizer", str(hf_dir), *common]) == 0
    assert read_token_meta(tmp_path / "out")["documents"] == 50


def test_sentencepiece_directory_and_file_open_as_before(corpus_files: list[Path], tmp_path: Path) -> None:
    """A directory with only ``tokenizer.model`` (a megazero checkpoint step) and any non-.json file go to the
    SentencePiece loader, as ``Tokenizer.from_file`` did."""
    sp = load_or_train_tokenizer(corpus_files, 512, tmp_path / "cache")
    step = tmp_path / "step"
    step.mkdir()
    (step / "tokenizer.model").write_bytes(sp.model_path.read_bytes())
    for path in (step, step / "tokenizer.model", sp.model_path):
        opened = open_tokenizer(path)
        assert type(opened) is Tokenizer and opened.fingerprint == sp.fingerprint
    assert tokenizer_vocab_size(step) == 512
    with pytest.raises(ValueError, match="--vocab-size 256 does not match .* with 512 tokens"):
        resolve_tokenizer([], 256, tmp_path, step)
    (tmp_path / "x.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a SentencePiece model"):
        open_tokenizer(tmp_path / "x.model")
    # an older Llama/Mistral directory: tokenizer.model beside configs that name eos and bos
    (step / "generation_config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": [7, 2]}))
    named = open_tokenizer(step)
    assert (named.eos_id, named.bos_id) == (7, 5) and (sp.eos_id, sp.bos_id) == (2, 1)
    (step / "tokenizer_config.json").write_text(json.dumps({"eos_token": sp.id_to_piece(9)}))
    named = open_tokenizer(step)
    assert (named.eos_id, named.bos_id) == (9, 5)
    assert pickle.loads(pickle.dumps(named)).eos_id == 9  # what a preprocessing worker receives
    (step / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="tokenizer_config.json: eos_token '<nope>' is not in the vocabulary"):
        open_tokenizer(step)


def test_special_tokens_come_from_the_directory_configs(hf_dir: Path, tmp_path: Path) -> None:
    """eos/bos: tokenizer_config.json, else special_tokens_map.json, else generation_config.json (an id, the
    first of a list), else the known names (here: the BPE's only special token, id 0; no bos)."""
    (tmp_path / "tokenizer.json").write_bytes((hf_dir / "tokenizer.json").read_bytes())
    lib = LibTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    a, b, c = (lib.id_to_token(i) for i in (300, 301, 302))

    def ids() -> tuple[int, int]:
        tok = open_tokenizer(tmp_path)
        again = pickle.loads(pickle.dumps(tok))
        assert (again.eos_id, again.bos_id) == (tok.eos_id, tok.bos_id)
        return tok.eos_id, tok.bos_id

    assert ids() == (lib.token_to_id(EOS), -1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [410, 411], "bos_token_id": 400}))
    assert ids() == (410, 400)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": a}}))
    assert ids() == (300, 400)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": b, "bos_token": c}))
    assert ids() == (301, 302)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": VOCAB + 5}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="special_tokens_map.json: eos_token '<nope>' is not in the vocabulary"):
        open_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").unlink()
    with pytest.raises(ValueError, match=f"generation_config.json: eos_token {VOCAB + 5} is not in the vocabulary"):
        open_tokenizer(tmp_path)
