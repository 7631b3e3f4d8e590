"""Packed token datasets and the memory-mapped ``.bin`` + ``.json`` pre-tokenized format.

Documents are tokenised, each followed by the tokenizer's eos id, concatenated and cut into samples of
``seq_len + 1`` tokens with stride ``seq_len`` (consecutive samples share one boundary token, as in nanoGPT
and Megatron): sample ``i`` is ``tokens[i*S : i*S + S + 1]``, its input is ``[:-1]`` and its target ``[1:]``.

The tokenizer is either kind: a SentencePiece ``.model`` (:class:`Tokenizer`, the built-in one) or a Hugging
Face ``tokenizer.json`` (:class:`HFTokenizer`); :func:`open_tokenizer` picks by path.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import tempfile
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from megazero.data.corpus import (
    DataError,
    corpus_fingerprint,
    expand_paths,
    read_text_documents,
    stdlib_corpus_files,
)
from megazero.data.hf_tokenizer import HF_TOKENIZER_FILE, HFTokenizer
from megazero.data.tokenizer import Tokenizer, load_or_train_tokenizer

__all__ = [
    "FORMAT_VERSION",
    "AnyTokenizer",
    "TokenDataset",
    "build_datasets",
    "check_vocab_size",
    "default_cache_dir",
    "open_token_file",
    "open_tokenizer",
    "read_token_meta",
    "resolve_tokenizer",
    "sidecar_tokenizer",
    "token_dtype",
    "tokenize_documents",
    "tokenizer_vocab_size",
    "write_token_file",
]

FORMAT_VERSION = 1
#: Either kind of tokenizer: both offer encode/encode_batch/decode, vocab_size, eos_id, fingerprint, model_path.
AnyTokenizer = Tokenizer | HFTokenizer


def default_cache_dir() -> Path:
    """Cache root: ``$MEGAZERO_CACHE`` if set, else ``~/.cache/megazero``."""
    env = os.environ.get("MEGAZERO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megazero"


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest storage type for token ids: uint16 when ``vocab_size <= 65535``, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


class TokenDataset(torch.utils.data.Dataset):
    """Map-style dataset of packed samples over a 1-D token array (in memory or memory-mapped).

    ``dataset[i]`` is a ``torch.LongTensor`` of shape ``[seq_len + 1]``; there are
    ``(num_tokens - 1) // seq_len`` samples.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError(f"--seq-len must be positive, got {seq_len}")
        if tokens.ndim != 1:
            raise ValueError(f"TokenDataset needs a 1-D token array, got shape {tokens.shape}")
        self.tokens = tokens
        self.seq_len = seq_len

    @property
    def num_tokens(self) -> int:
        """Length of the underlying token array."""
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return max(0, (self.num_tokens - 1) // self.seq_len)

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"sample index {index} out of range for a dataset of {n} samples")
        start = (i % n) * self.seq_len
        return torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))

    def __repr__(self) -> str:
        return f"TokenDataset(samples={len(self)}, seq_len={self.seq_len}, tokens={self.num_tokens})"


def _pack(tokenizer: AnyTokenizer, batch: list[str], num_threads: int = 1) -> np.ndarray:
    ids: list[int] = []
    for doc_ids in tokenizer.encode_batch(batch, num_threads=num_threads):
        ids.extend(doc_ids)
        ids.append(tokenizer.eos_id)
    return np.asarray(ids, dtype=np.int64)


def _batches(documents: Iterable[str], batch_size: int, batch_chars: int | None = None) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= batch_size or (batch_chars is not None and chars >= batch_chars):
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


_worker_tokenizer: AnyTokenizer | None = None  # set in each tokenising worker process by _init_worker


def _init_worker(tokenizer: AnyTokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _pack_in_worker(batch: list[str]) -> np.ndarray:
    assert _worker_tokenizer is not None
    return _pack(_worker_tokenizer, batch)


def tokenize_documents(
    documents: Iterable[str], tokenizer: AnyTokenizer, batch_size: int = 256, num_threads: int = 1,
    workers: int = 1, batch_chars: int | None = None,
) -> Iterator[np.ndarray]:
    """Yield one int64 array per batch of documents: each document's ids followed by ``tokenizer.eos_id``.

    A batch is ``batch_size`` documents, or fewer once it holds ``batch_chars`` characters (when given).
    ``workers > 1`` encodes the batches in that many processes (each with its own copy of the tokenizer),
    at most ``2 * workers`` batches in flight, and yields them in input order: the same arrays as
    ``workers=1``. ``num_threads`` is the tokenizer's own threading within a batch (one process).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if workers == 1:
        for batch in _batches(documents, batch_size, batch_chars):
            yield _pack(tokenizer, batch, num_threads)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with context.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
        pending: deque = deque()
        for batch in _batches(documents, batch_size, batch_chars):
            pending.append(pool.apply_async(_pack_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _prefix(path_prefix: str | os.PathLike[str]) -> Path:
    p = Path(path_prefix)
    return p.with_suffix("") if p.suffix in (".bin", ".json") else p


def _with(prefix: Path, suffix: str) -> Path:
    return prefix.parent / (prefix.name + suffix)


def write_token_file(
    path_prefix: str | os.PathLike[str], token_iter: Iterable[Sequence[int] | np.ndarray],
    dtype: np.dtype | type | str, *, vocab_size: int, tokenizer_fingerprint: str | None = None,
    tokenizer_model: str | None = None, extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Stream token chunks into ``PREFIX.bin`` (raw array) and write the ``PREFIX.json`` sidecar; return it.

    Both files are written to temporaries and renamed into place, the sidecar last, so a reader that
    finds the sidecar finds a complete ``.bin``. ``extra`` holds more sidecar keys; it is read after the
    tokens are streamed, so a caller may fill in counts (e.g. documents) while ``token_iter`` runs.

    Raises:
        ValueError: if a token id does not fit ``dtype`` or is not below ``vocab_size``.
    """
    prefix = _prefix(path_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(dtype)
    limit = min(vocab_size, np.iinfo(np_dtype).max + 1)
    num_tokens = 0
    fd, tmp_bin = tempfile.mkstemp(prefix=prefix.name + ".", suffix=".bin.tmp", dir=prefix.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in token_iter:
                arr = np.asarray(chunk, dtype=np.int64)
                if arr.size and (arr.min() < 0 or arr.max() >= limit):
                    raise ValueError(
                        f"token id out of range [0, {limit}) for vocab_size={vocab_size}, dtype={np_dtype.name}"
                    )
                f.write(arr.astype(np_dtype).tobytes())
                num_tokens += int(arr.size)
        meta: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "dtype": np_dtype.name, "num_tokens": num_tokens,
            "vocab_size": vocab_size, "tokenizer_fingerprint": tokenizer_fingerprint,
            "tokenizer_model": tokenizer_model, **(extra or {}),
        }
        _with(prefix, ".json").unlink(missing_ok=True)  # never pair an old sidecar with the new .bin
        os.chmod(tmp_bin, 0o644)
        os.replace(tmp_bin, _with(prefix, ".bin"))
    finally:
        if os.path.exists(tmp_bin):
            os.unlink(tmp_bin)
    fd, tmp_json = tempfile.mkstemp(prefix=prefix.name + ".", suffix=".json.tmp", dir=prefix.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(meta, f, indent=2)
    os.chmod(tmp_json, 0o644)
    os.replace(tmp_json, _with(prefix, ".json"))
    return meta


def read_token_meta(path_prefix: str | os.PathLike[str]) -> dict[str, Any]:
    """The sidecar of a token file (``PREFIX.json``), validated.

    Raises:
        ValueError: naming the file when the sidecar is missing, of another format version or inconsistent
            with the ``.bin`` size.
    """
    prefix = _prefix(path_prefix)
    sidecar, binary = _with(prefix, ".json"), _with(prefix, ".bin")
    if not sidecar.is_file() or not binary.is_file():
        raise DataError(
            f"token file {str(binary)!r} needs both .bin and .json sidecar; create them with "
            "tools/preprocess_data.py"
        )
    try:
        with open(sidecar) as f:
            meta = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{sidecar} is not a token-file sidecar ({e}); re-run tools/preprocess_data.py") from e
    if meta.get("format_version") != FORMAT_VERSION:
        raise DataError(
            f"{sidecar}: format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}; "
            "re-run tools/preprocess_data.py"
        )
    expected = int(meta["num_tokens"]) * np.dtype(meta["dtype"]).itemsize
    if binary.stat().st_size != expected:
        raise DataError(f"{binary}: size {binary.stat().st_size} bytes, sidecar promises {expected}; the file is "
                        "truncated or corrupt: re-run tools/preprocess_data.py")
    return meta


def open_token_file(path_prefix: str | os.PathLike[str]) -> np.ndarray:
    """Memory-map the token array of ``PREFIX.bin`` read-only (an empty array for an empty file)."""
    meta = read_token_meta(path_prefix)
    dtype = np.dtype(meta["dtype"])
    if int(meta["num_tokens"]) == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(_with(_prefix(path_prefix), ".bin"), dtype=dtype, mode="r")


def _check_bin_tokenizer(path: str, meta: dict[str, Any], tokenizer: AnyTokenizer) -> None:
    if int(meta["vocab_size"]) != tokenizer.vocab_size:
        raise DataError(
            f"{path} was tokenised with vocab_size {meta['vocab_size']} but the tokenizer has "
            f"{tokenizer.vocab_size}; pass the matching --tokenizer/--vocab-size or re-run tools/preprocess_data.py"
        )
    fp = meta.get("tokenizer_fingerprint")
    if fp and fp != tokenizer.fingerprint:
        raise DataError(
            f"{path} was tokenised with a different tokenizer ({meta.get('tokenizer_model')}, fingerprint "
            f"{fp[:16]}) than {tokenizer.model_path} ({tokenizer.fingerprint[:16]}); pass --tokenizer "
            f"{meta.get('tokenizer_model')} or re-run tools/preprocess_data.py"
        )
    if meta.get("eos_id") is not None and int(meta["eos_id"]) != tokenizer.eos_id:
        raise DataError(
            f"{path} separates documents with eos id {meta['eos_id']} but {tokenizer.model_path} has eos id "
            f"{tokenizer.eos_id} (another tokenizer_config.json?); pass the tokenizer it was made with or re-run "
            "tools/preprocess_data.py"
        )


def _check_token_ids(path: str, tokens: np.ndarray, tokenizer: AnyTokenizer, chunk: int = 1 << 24) -> None:
    """Refuse a token file holding an id the vocabulary does not have (the embedding would fail on it), naming
    the first such offset; read in chunks of ``chunk`` tokens."""
    vocab = tokenizer.vocab_size
    for start in range(0, int(tokens.shape[0]), chunk):
        part = np.asarray(tokens[start: start + chunk])
        bad = np.flatnonzero(part >= vocab)
        if bad.size:
            at = start + int(bad[0])
            raise DataError(f"{path}: token id {int(part[bad[0]])} at offset {at} (of {tokens.shape[0]} tokens) "
                            f"is beyond the vocabulary of {vocab} ({tokenizer.model_path}): the file was written "
                            "with another tokenizer or is corrupt; pass the tokenizer it was made with (--tokenizer) "
                            "or re-run tools/preprocess_data.py")


def _cached_tokens(name: str, files: list[Path], tokenizer: AnyTokenizer, cache_dir: Path) -> np.ndarray:
    key = f"{name}_{corpus_fingerprint(files)[:16]}_{tokenizer.fingerprint[:16]}"
    if isinstance(tokenizer, HFTokenizer):  # the same tokenizer.json may come with another eos (its config)
        key += f"_eos{tokenizer.eos_id}"
    prefix = cache_dir / "tokens" / key
    if not _with(prefix, ".json").is_file():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(prefix) + ".lock"):
            if not _with(prefix, ".json").is_file():
                chunks = tokenize_documents(read_text_documents(files), tokenizer, num_threads=os.cpu_count() or 1)
                write_token_file(
                    prefix, chunks, token_dtype(tokenizer.vocab_size), vocab_size=tokenizer.vocab_size,
                    tokenizer_fingerprint=tokenizer.fingerprint, tokenizer_model=str(tokenizer.model_path),
                    extra={"documents": len(files)},
                )
    return open_token_file(prefix)


def _load_tokens(paths: Sequence[str | os.PathLike[str]], tokenizer: AnyTokenizer, cache_dir: Path) -> np.ndarray:
    if not paths:
        return _cached_tokens("stdlib", stdlib_corpus_files(), tokenizer, cache_dir)
    bins = [str(p) for p in paths if str(p).endswith(".bin")]
    if bins and len(bins) != len(paths):
        raise DataError("--data: a mix of pre-tokenized .bin files and text/JSONL paths; use one kind")
    if not bins:
        files = expand_paths(paths)
        if not files:
            raise DataError(f"--data {' '.join(str(p) for p in paths)} contains no files (hidden files are skipped)")
        return _cached_tokens("text", files, tokenizer, cache_dir)
    arrays = []
    for path in bins:
        _check_bin_tokenizer(path, read_token_meta(path), tokenizer)
        arrays.append(open_token_file(path))
        _check_token_ids(path, arrays[-1], tokenizer)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def build_datasets(
    paths: Sequence[str | os.PathLike[str]], tokenizer: AnyTokenizer, seq_len: int,
    cache_dir: str | os.PathLike[str] | None = None, eval_fraction: float = 0.01,
) -> tuple[TokenDataset, TokenDataset | None]:
    """Train and eval datasets of packed ``seq_len + 1``-token samples.

    ``paths`` empty: the built-in standard-library corpus. ``.bin`` files (from tools/preprocess_data.py):
    memory-mapped directly (several are concatenated in memory). Text/JSONL files or directories: tokenised
    once and cached under ``cache_dir/tokens`` keyed by corpus fingerprint and tokenizer (file-locked,
    written atomically), so later runs and other ranks memory-map the cache. The last ``eval_fraction`` of
    the tokens (at least one sample) is the eval split; ``eval_fraction == 0`` gives no eval dataset.

    Raises:
        ValueError: for a tokenizer that does not match a ``.bin`` file, a bad ``eval_fraction`` or a corpus
            too small for one train (and one eval) sample.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if seq_len <= 0:
        raise ValueError(f"--seq-len must be positive, got {seq_len}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tokens = _load_tokens(list(paths), tokenizer, cache)
    n = int(tokens.shape[0])
    sample = seq_len + 1
    n_eval = max(math.ceil(n * eval_fraction), sample) if eval_fraction > 0 else 0
    if n - n_eval < sample:
        need = sample + (sample if eval_fraction > 0 else 0)
        raise DataError(
            f"corpus has {n} tokens, too few for --seq-len {seq_len}: need at least {need} tokens "
            f"(one train sample{' and one eval sample' if eval_fraction > 0 else ''}); "
            "use more data or a shorter --seq-len"
        )
    train = TokenDataset(tokens[: n - n_eval], seq_len)
    evaluation = TokenDataset(tokens[n - n_eval :], seq_len) if n_eval else None
    return train, evaluation


def open_tokenizer(path: str | os.PathLike[str]) -> AnyTokenizer:
    """The tokenizer at ``path``, of either kind.

    A ``.json`` file (or any file whose content is a JSON object) is a Hugging Face ``tokenizer.json``; a
    directory is read through the ``tokenizer.json`` it holds (a Hugging Face model directory), else its
    ``tokenizer.model``; any other path is a SentencePiece ``.model`` file, loaded exactly as before.

    Raises:
        ValueError: naming the path when it is missing or not a tokenizer of the kind it claims.
    """
    p = Path(path)
    if p.is_dir():
        if (p / HF_TOKENIZER_FILE).is_file():
            return HFTokenizer(p / HF_TOKENIZER_FILE)
        if (p / "tokenizer.model").is_file():
            return Tokenizer.from_file(p / "tokenizer.model")
        raise DataError(f"tokenizer directory {str(p)!r} holds neither {HF_TOKENIZER_FILE} (Hugging Face) nor "
                         "tokenizer.model (SentencePiece); pass --tokenizer FILE")
    if p.suffix.lower() == ".json" or _is_json_file(p):
        return HFTokenizer(p)
    return Tokenizer.from_file(p)


def _is_json_file(path: Path) -> bool:
    """Whether ``path`` holds a JSON object (a SentencePiece model is a binary protobuf, never ``{...``)."""
    try:
        with open(path, "rb") as f:
            return f.read(64).lstrip().startswith(b"{")
    except OSError:
        return False


def tokenizer_vocab_size(path: str | os.PathLike[str]) -> int:
    """Vocabulary size of the tokenizer at ``path`` (either kind, see :func:`open_tokenizer`): the model's
    ``vocab_size`` when the tokenizer is given and ``--vocab-size`` is not."""
    return open_tokenizer(path).vocab_size


def check_vocab_size(tokenizer: AnyTokenizer, vocab_size: int | None) -> None:
    """Refuse an explicit ``vocab_size`` that is not the tokenizer's, naming both numbers and the fix."""
    if vocab_size is not None and vocab_size != tokenizer.vocab_size:
        raise DataError(
            f"--vocab-size {vocab_size} does not match tokenizer {tokenizer.model_path} with {tokenizer.vocab_size} "
            f"tokens; drop --vocab-size (the vocabulary size follows the tokenizer) or pass --vocab-size "
            f"{tokenizer.vocab_size}"
        )


def sidecar_tokenizer(paths: Sequence[str | os.PathLike[str]]) -> str | None:
    """The tokenizer the first ``.bin`` of ``paths`` was made with (its sidecar's ``tokenizer_model``), if that
    file exists: the run's tokenizer, and so its vocabulary, when ``--tokenizer`` is not given."""
    bins = [str(p) for p in paths if str(p).endswith(".bin")]
    model = read_token_meta(bins[0]).get("tokenizer_model") if bins else None
    return model if model and Path(model).is_file() else None


def resolve_tokenizer(
    paths: Sequence[str | os.PathLike[str]], vocab_size: int | None,
    cache_dir: str | os.PathLike[str] | None = None, tokenizer_model: str | os.PathLike[str] | None = None,
    rows_beyond_ok: bool = False,
) -> AnyTokenizer:
    """The tokenizer a run should use for ``paths``.

    An explicit ``tokenizer_model`` wins (a SentencePiece ``.model``, a Hugging Face ``tokenizer.json`` or a
    directory holding one, see :func:`open_tokenizer`); for ``.bin`` inputs the tokenizer recorded in the
    sidecar is used; otherwise the cached BPE of ``vocab_size`` is loaded or trained on the text paths (the
    standard-library corpus when ``paths`` is empty). ``rows_beyond_ok``: ``vocab_size`` is a checkpoint's
    embedding rows, which may exceed the tokenizer's entries (a padded vocabulary, as Qwen2's or Pythia's).

    Raises:
        ValueError: if ``vocab_size`` contradicts the tokenizer (naming both), or no tokenizer can be determined.
    """
    bins = [str(p) for p in paths if str(p).endswith(".bin")]
    if tokenizer_model is None and bins:
        tokenizer_model = sidecar_tokenizer(bins)
        if tokenizer_model is None:
            named = read_token_meta(bins[0]).get("tokenizer_model")
            raise DataError(f"{bins[0]}: its tokenizer model {named!r} is not available; pass --tokenizer")
    if tokenizer_model is not None:
        tok = open_tokenizer(tokenizer_model)
        check_vocab_size(tok, None if rows_beyond_ok and vocab_size is not None and vocab_size > tok.vocab_size
                         else vocab_size)
        return tok
    if vocab_size is None:
        raise DataError("--vocab-size is required to train the built-in tokenizer (or pass --tokenizer MODEL)")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return load_or_train_tokenizer(list(paths) or None, vocab_size, cache)
