"""SentencePiece BPE tokenizer that round-trips text exactly, trained once and cached per corpus.

Training options (see :func:`train_options`) make ``decode(encode(text)) == text`` for any text: identity
normalisation, no whitespace folding, no dummy prefix, newline as its own symbol and byte fallback for
characters outside the vocabulary. SentencePiece writes spaces as ``"▁"`` (U+2581); a literal U+2581 in the
input is therefore encoded through its UTF-8 byte pieces so that it is not decoded as a space.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm
from filelock import FileLock

from megazero.data.corpus import DataError, corpus_fingerprint, expand_paths, read_text_documents
from megazero.data.hf_tokenizer import special_id, special_tokens
from megazero.observe.log import get_logger

__all__ = [
    "DEFAULT_INPUT_SENTENCE_SIZE",
    "DEFAULT_MAX_TRAIN_BYTES",
    "DEFAULT_TRAIN_THREADS",
    "Tokenizer",
    "load_or_train_tokenizer",
    "text_to_sentences",
    "tokenizer_cache_path",
    "train_options",
]

DEFAULT_INPUT_SENTENCE_SIZE = 300_000
DEFAULT_MAX_TRAIN_BYTES = 256 * 1024 * 1024
DEFAULT_TRAIN_THREADS = 4
_SENTENCE_BYTES = 2000
_SPACE_PIECE = "\u2581"


class Tokenizer:
    """A SentencePiece model with exact round-trip encode/decode.

    A ``tokenizer.model`` of a Hugging Face model directory (older Llama and Mistral ones) takes its eos and bos
    from the files beside it that name them (:func:`megazero.data.hf_tokenizer.special_tokens`), else the model's.

    Attributes:
        model_path: the ``.model`` file this tokenizer was loaded from.
    """

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        self.model_path = Path(model_path)
        if not self.model_path.is_file():
            raise DataError(f"tokenizer model {str(self.model_path)!r} does not exist")
        specials = special_tokens(self.model_path.parent) if self.model_path.name == "tokenizer.model" else {}
        self._load(self.model_path.read_bytes(), specials)

    def _piece_id(self, piece: str) -> int | None:
        i = self._sp.piece_to_id(piece)
        return i if self._sp.id_to_piece(i) == piece else None  # an unknown piece maps to unk

    def _load(self, proto: bytes, specials: dict[str, tuple[str | int, str]] | None = None) -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{self.model_path} is not a SentencePiece model ({e})") from e
        self._fingerprint = hashlib.sha256(proto).hexdigest()
        self._specials = specials or {}
        size = self._sp.get_piece_size()
        self._eos = special_id(self._specials, "eos", self._piece_id, size, self.model_path) if "eos" in \
            self._specials else self._sp.eos_id()
        self._bos = special_id(self._specials, "bos", self._piece_id, size, self.model_path) if "bos" in \
            self._specials else self._sp.bos_id()
        if self._eos < 0:
            raise DataError(f"tokenizer model {str(self.model_path)!r} has no end-of-sequence (eos) token")
        space_bytes = [self._sp.piece_to_id(f"<0x{b:02X}>") for b in _SPACE_PIECE.encode()]
        self._space_ids = space_bytes if self._sp.unk_id() not in space_bytes else None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a user-supplied SentencePiece ``.model`` file."""
        return cls(path)

    @property
    def vocab_size(self) -> int:
        """Number of pieces, including the special and byte-fallback pieces."""
        return self._sp.get_piece_size()

    @property
    def eos_id(self) -> int:
        """End-of-sequence id, appended after each document when packing."""
        return self._eos

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id (-1 if the model has none)."""
        return self._bos

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of the serialized model; identifies the tokenizer in data caches."""
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        if _SPACE_PIECE not in text or self._space_ids is None:
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(_SPACE_PIECE)):
            if i:
                ids.extend(self._space_ids)
            ids.extend(self._sp.encode(part))
        return ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts at once (SentencePiece's C++ threads when ``num_threads > 1``)."""
        plain = [t for t in texts if _SPACE_PIECE not in t]
        encoded = iter(self._sp.encode(plain, num_threads=num_threads)) if plain else iter(())
        return [next(encoded) if _SPACE_PIECE not in t else self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; the exact inverse of :meth:`encode`."""
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary piece of one id (for inspection)."""
        return self._sp.id_to_piece(int(token_id))

    def __getstate__(self) -> dict[str, Any]:
        return {"model_path": str(self.model_path), "proto": self._sp.serialized_model_proto(),
                "specials": self._specials}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_path = Path(state["model_path"])
        self._load(state["proto"], state.get("specials"))

    def __repr__(self) -> str:
        return f"Tokenizer(model_path={str(self.model_path)!r}, vocab_size={self.vocab_size})"

    def save_hf(self, out_dir: str | os.PathLike[str], model_max_length: int | None = None) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` so that ``transformers.AutoTokenizer``
        loads a fast tokenizer that encodes every text to the same ids as :meth:`encode`.

        The SentencePiece BPE becomes a ``tokenizers`` BPE with byte fallback whose vocabulary spells spaces
        as spaces (SentencePiece's ``"▁"`` rewritten), with no normalizer and no pre-tokenizer: the model
        has no dummy prefix and identity normalisation, so raw text maps straight to pieces, and a literal
        ``"▁"`` in the text is in no piece and falls back to its UTF-8 bytes, as :meth:`encode` does. Merges
        are every split of each piece into two pieces, ranked by the piece's score (SentencePiece merges the
        best-scoring adjacent pair first, leftmost on ties, as the ranked merges do). The newline is an added
        token, matched before BPE like SentencePiece's user-defined symbol; ``<unk>``, ``<s>`` and ``</s>``
        are special tokens. Needs the ``tokenizers`` package (installed with ``transformers``).
        """
        from sentencepiece import sentencepiece_model_pb2
        from tokenizers import AddedToken, decoders
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers.models import BPE

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._sp.serialized_model_proto())
        normal, user, vocab = sentencepiece_model_pb2.ModelProto.SentencePiece.NORMAL, [], {}
        scored = []
        for i, piece in enumerate(proto.pieces):
            text = piece.piece.replace(_SPACE_PIECE, " ") if piece.type == normal else piece.piece
            vocab[text] = i
            if piece.type == normal:
                scored.append((-piece.score, i, text))
            elif piece.type == sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED:
                user.append(text)
        merges = [(text[:k], text[k:]) for _, _, text in sorted(scored) for k in range(1, len(text))
                  if text[:k] in vocab and text[k:] in vocab]
        unk = self._sp.id_to_piece(self._sp.unk_id())
        hf = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=True))
        hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        specials = [self._sp.id_to_piece(i) for i in (self._sp.unk_id(), self.bos_id, self.eos_id) if i >= 0]
        hf.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        hf.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        hf.save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": unk, "eos_token": specials[-1],
                  "bos_token": self._sp.id_to_piece(self.bos_id) if self.bos_id >= 0 else None,
                  "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                  "split_special_tokens": True,
                  "model_max_length": model_max_length or 1_000_000_000_000}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def train_options(vocab_size: int, input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE) -> dict[str, Any]:
    """SentencePiece trainer options for an exactly round-tripping BPE model of ``vocab_size`` pieces."""
    return dict(
        model_type="bpe",
        vocab_size=vocab_size,
        hard_vocab_limit=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        byte_fallback=True,
        user_defined_symbols=["\n"],
        split_digits=True,
        allow_whitespace_only_pieces=True,
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=4 * _SENTENCE_BYTES + 64,
    )


def text_to_sentences(text: str, max_bytes: int = _SENTENCE_BYTES) -> Iterator[str]:
    """Split a document into SentencePiece training "sentences" of whole lines up to ``max_bytes`` UTF-8 bytes.

    Newlines stay inside the chunks so the trainer learns them; a single line longer than ``max_bytes`` is
    cut into pieces of at most ``max_bytes // 4`` characters (so at most ``max_bytes`` bytes).
    """
    buf: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        nbytes = len(line.encode("utf-8"))
        if nbytes > max_bytes:
            step = max(1, max_bytes // 4)
            pieces = [line[i : i + step] for i in range(0, len(line), step)]
        else:
            pieces = [line]
        for piece in pieces:
            nbytes = len(piece.encode("utf-8"))
            if buf and size + nbytes > max_bytes:
                yield "".join(buf)
                buf, size = [], 0
            buf.append(piece)
            size += nbytes
    if buf:
        yield "".join(buf)


def tokenizer_cache_path(cache_dir: str | os.PathLike[str], fingerprint: str, vocab_size: int) -> Path:
    """Where the model for (corpus fingerprint, vocab size) is cached: ``tokenizers/spm_{fp[:16]}_{V}.model``."""
    return Path(cache_dir) / "tokenizers" / f"spm_{fingerprint[:16]}_{vocab_size}.model"


def _train(
    documents: Iterable[str], vocab_size: int, out_path: Path, input_sentence_size: int, max_train_bytes: int,
    num_threads: int, seed: int,
) -> None:
    read = [0]  # bytes of text handed to the trainer

    def sentences() -> Iterator[str]:
        for doc in documents:
            for sentence in text_to_sentences(doc):
                yield sentence
                read[0] += len(sentence.encode("utf-8"))
                if read[0] >= max_train_bytes:
                    return

    spm.set_random_generator_seed(seed)
    fd, tmp_name = tempfile.mkstemp(prefix=out_path.name + ".", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        with open(tmp_name, "wb") as writer:
            spm.SentencePieceTrainer.train(
                sentence_iterator=sentences(), model_writer=writer, num_threads=num_threads, minloglevel=2,
                **train_options(vocab_size, input_sentence_size),
            )
        os.chmod(tmp_name, 0o644)
        actual = spm.SentencePieceProcessor(model_file=tmp_name).get_piece_size()
        if actual != vocab_size:
            raise DataError(f"the trained tokenizer has {actual} pieces, not the requested --vocab-size {vocab_size}: "
                            "the corpus is too small for that vocabulary; lower --vocab-size or add data")
        os.replace(tmp_name, out_path)
    except RuntimeError as e:
        if read[0] == 0:
            raise DataError("the corpus holds no text (its files are empty, or its JSONL \"text\" fields are): "
                            "give data files with text") from e
        raise DataError(
            f"cannot train a SentencePiece BPE tokenizer with --vocab-size {vocab_size} on this corpus: {e}. "
            "The vocabulary needs room for 256 byte pieces, 4 special pieces and every distinct character "
            "of the corpus (raise --vocab-size if it is below that), and enough text to learn the remaining "
            "merges (lower --vocab-size or add data if the corpus runs out of merges)."
        ) from e
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def load_or_train_tokenizer(
    source: Sequence[str | os.PathLike[str]] | Callable[[], Iterable[str]] | None,
    vocab_size: int,
    cache_dir: str | os.PathLike[str],
    fingerprint: str | None = None,
    *,
    input_sentence_size: int = DEFAULT_INPUT_SENTENCE_SIZE,
    max_train_bytes: int = DEFAULT_MAX_TRAIN_BYTES,
    num_threads: int = DEFAULT_TRAIN_THREADS,
    seed: int = 0,
) -> Tokenizer:
    """Load the cached BPE tokenizer for (corpus, vocab size), training it first if it is missing.

    Safe to call from every rank at once: training runs in one process under a file lock on the cache
    path while the others wait, then all load the same file (written atomically).

    Args:
        source: the training corpus: a list of text/JSONL files or directories, a zero-argument callable
            returning an iterable of documents, or ``None`` for the built-in standard-library corpus.
        vocab_size: exact number of pieces of the trained model.
        cache_dir: cache root; the model lives at :func:`tokenizer_cache_path` with ``fingerprint`` = the
            SHA-256 of (corpus fingerprint, input_sentence_size, max_train_bytes, num_threads, seed), so a
            change of corpus, vocab size or training caps trains a new model.
        fingerprint: corpus hash for the cache key; computed from the files when ``source`` is a list or
            ``None``, required when ``source`` is a callable.
        input_sentence_size: SentencePiece's cap on (shuffled) training sentences of <= 2000 bytes.
        max_train_bytes: stop reading the corpus after this many bytes (a prefix of the documents).
        num_threads: trainer threads. The trained model depends on it, so the default is a constant (not
            the CPU count) and every machine trains the identical model; it is part of the cache key.
        seed: SentencePiece's random seed (sentence shuffling).

    Raises:
        DataError: if the corpus cannot support ``vocab_size`` or the source is unusable.
    """
    if vocab_size <= 0:
        raise ValueError(f"--vocab-size must be positive, got {vocab_size}")
    if callable(source):
        if fingerprint is None:
            raise ValueError("load_or_train_tokenizer: pass fingerprint= when source is a documents callable")
        documents_factory = source
    else:
        if source is None:
            from megazero.data.corpus import stdlib_corpus_files

            files = stdlib_corpus_files()
        else:
            files = expand_paths(source)
        if not files:
            raise DataError("the tokenizer's training corpus has no files: give data files with text")
        if all(f.stat().st_size == 0 for f in files):
            raise DataError(f"data {'file' if len(files) == 1 else 'files'} {', '.join(map(str, files[:3]))}"
                            f"{' ...' if len(files) > 3 else ''} {'is' if len(files) == 1 else 'are all'} empty; give "
                            "files with text")
        if fingerprint is None:
            fingerprint = corpus_fingerprint(files)

        def documents_factory() -> Iterable[str]:
            return read_text_documents(files)

    recipe = json.dumps([fingerprint, input_sentence_size, max_train_bytes, num_threads, seed])
    key = hashlib.sha256(recipe.encode()).hexdigest()
    path = tokenizer_cache_path(cache_dir, key, vocab_size)
    if path.is_file():
        return Tokenizer(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # said by every rank (rank 0 shows it) before the lock: one of them trains, the others wait for it
    get_logger().info("training the tokenizer (first run only: a %d-piece SentencePiece BPE, cached in %s)...",
                      vocab_size, path.parent)
    with FileLock(str(path) + ".lock"):
        if not path.is_file():
            _train(
                documents_factory(), vocab_size, path, input_sentence_size, max_train_bytes,
                num_threads, seed,
            )
    return Tokenizer(path)
