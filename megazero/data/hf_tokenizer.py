"""A Hugging Face ``tokenizer.json`` (through the ``tokenizers`` library) behind megazero's tokenizer interface.

:class:`HFTokenizer` offers what :class:`megazero.data.tokenizer.Tokenizer` offers (``encode``,
``encode_batch``, ``decode``, ``vocab_size``, ``eos_id``, ``bos_id``, ``fingerprint``, ``model_path``,
``id_to_piece``, ``save_hf``, pickling), so datasets, the loop, checkpoints and generation use either kind
unchanged. Everything is read from local files; nothing is downloaded.

Ids are the library's own: ``encode`` is ``tokenizers.Tokenizer.encode(text, add_special_tokens=False).ids``
(no bos/eos added, like the SentencePiece path; a special token written literally in the text is matched as
that token, as ``transformers`` does by default) and ``decode`` keeps special tokens, so a tokenizer that
round-trips (byte-level BPE such as GPT-2's or Llama 3's) gives ``decode(encode(text)) == text``.

The end-of-sequence token (appended after each document when packing) and the beginning-of-sequence token are
the ones the tokenizer's own directory names (:func:`special_tokens`, as in a Hugging Face model directory):
``tokenizer_config.json``'s ``eos_token``/``bos_token``, else ``special_tokens_map.json``'s, else
``generation_config.json``'s ``eos_token_id``/``bos_token_id`` (the first of a list); with none of them, the first
of :data:`EOS_TOKENS` (:data:`BOS_TOKENS`) in the vocabulary. A SentencePiece ``tokenizer.model`` beside such files
(older Llama and Mistral directories) takes its eos/bos from them likewise.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from megazero.data.corpus import DataError

__all__ = ["BOS_TOKENS", "EOS_TOKENS", "HF_TOKENIZER_FILE", "SPECIAL_TOKEN_FILES", "HFTokenizer", "special_tokens"]

HF_TOKENIZER_FILE = "tokenizer.json"
_CONFIG_FILE = "tokenizer_config.json"
#: Files of a model directory that name its special tokens, in the order they are consulted.
SPECIAL_TOKEN_FILES = (_CONFIG_FILE, "special_tokens_map.json", "generation_config.json")
#: End-of-sequence tokens looked for when no ``tokenizer_config.json`` names one (GPT-2/Qwen, Llama 3, Llama 2
#: and Mistral, Gemma).
EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
#: Beginning-of-sequence tokens looked for likewise (bos is informational: packing adds only eos).
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")


def _token_content(value: Any) -> str | None:
    """A ``tokenizer_config.json`` token entry: a string or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not a JSON tokenizer config ({e})") from e
    if not isinstance(config, dict):
        raise DataError(f"{path} is not a JSON object")
    return config


def special_tokens(directory: str | os.PathLike[str]) -> dict[str, tuple[str | int, str]]:
    """The eos and bos tokens that a model directory's own files name: ``{"eos": (token or id, file), "bos": ...}``
    from the first of :data:`SPECIAL_TOKEN_FILES` naming each (``tokenizer_config.json`` and
    ``special_tokens_map.json`` name tokens, ``generation_config.json`` ids: the first of a list). A key no file
    names is absent."""
    found: dict[str, tuple[str | int, str]] = {}
    for name in SPECIAL_TOKEN_FILES:
        path = Path(directory) / name
        if not path.is_file():
            continue
        config = _read_config(path)
        for key in ("eos", "bos"):
            if key in found:
                continue
            if name == "generation_config.json":
                value = config.get(f"{key}_token_id")
                value = value[0] if isinstance(value, list) and value else value
                if isinstance(value, int) and not isinstance(value, bool):
                    found[key] = (value, str(path))
            elif (token := _token_content(config.get(f"{key}_token"))) is not None:
                found[key] = (token, str(path))
    return found


def special_id(specials: dict[str, tuple[str | int, str]], key: str, vocab: dict[str, int] | Any, vocab_size: int,
               model_path: Path, known: Sequence[str] = ()) -> int:
    """The id of special token ``key`` ("eos", "bos") named in ``specials`` (:func:`special_tokens`), looked up in
    ``vocab`` (a mapping, or a function of a token giving its id or None); else the first of ``known`` there; -1 if
    none. A named token the vocabulary lacks, or an id beyond it, is refused naming the file."""
    lookup = vocab.get if isinstance(vocab, dict) else vocab
    if key in specials:
        value, source = specials[key]
        found = value if isinstance(value, int) else lookup(value)
        if found is None or not 0 <= found < vocab_size:
            raise DataError(f"{source}: {key}_token {value!r} is not in the vocabulary of {model_path} "
                            f"({vocab_size} tokens)")
        return found
    return next((i for i in map(lookup, known) if i is not None), -1)


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local ``tokenizer.json``.

    Attributes:
        model_path: the ``tokenizer.json`` file.
        config_path: the ``tokenizer_config.json`` beside it, or None (eos/bos: :func:`special_tokens`).
        vocab_size: number of ids: one more than the largest id of the vocabulary, added tokens included.
        eos_id: end-of-sequence id, appended after each document when packing.
        bos_id: beginning-of-sequence id (-1 if none is named or known).
        fingerprint: SHA-256 hex digest of the ``tokenizer.json`` bytes; identifies the tokenizer in data
            caches and checkpoints.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        if p.is_dir():
            if not (p / HF_TOKENIZER_FILE).is_file():
                raise DataError(f"tokenizer directory {str(p)!r} has no {HF_TOKENIZER_FILE}")
            p = p / HF_TOKENIZER_FILE
        if not p.is_file():
            raise DataError(f"tokenizer file {str(p)!r} does not exist")
        self.model_path = p
        config_file = p.parent / _CONFIG_FILE
        self.config_path = config_file if config_file.is_file() else None
        config = _read_config(self.config_path) if self.config_path is not None else None
        self._load(p.read_bytes(), config, special_tokens(p.parent))

    def _load(self, raw: bytes, config: dict[str, Any] | None,
              specials: dict[str, tuple[str | int, str]]) -> None:
        from tokenizers import Tokenizer as _LibTokenizer

        try:
            self._tok = _LibTokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 - the library raises plain Exception on a malformed file
            raise DataError(f"{self.model_path} is not a Hugging Face tokenizer.json ({e})") from e
        self._raw, self._config, self._specials = raw, config, specials
        self.fingerprint = hashlib.sha256(raw).hexdigest()
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise DataError(f"tokenizer {str(self.model_path)!r} has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        self.eos_id = special_id(specials, "eos", vocab, self.vocab_size, self.model_path, EOS_TOKENS)
        if self.eos_id < 0:
            raise DataError(
                f"tokenizer {str(self.model_path)!r} names no end-of-sequence (eos) token: none of "
                f"{', '.join(EOS_TOKENS)} is in its vocabulary; put a {_CONFIG_FILE} with \"eos_token\" beside "
                f"it, as a Hugging Face model directory has"
            )
        self.bos_id = special_id(specials, "bos", vocab, self.vocab_size, self.model_path, BOS_TOKENS)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Load a ``tokenizer.json`` file (or a directory holding one)."""
        return cls(path)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no bos/eos added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts: one by one when ``num_threads <= 1``, else with the library's thread pool (its
        size is the library's: all cores, or ``RAYON_NUM_THREADS``). The ids are the same either way."""
        if num_threads <= 1:
            return [self.encode(t) for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids, special tokens kept."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary token of one id (for inspection)."""
        return self._tok.id_to_token(int(token_id))

    def __getstate__(self) -> dict[str, Any]:
        return {"model_path": str(self.model_path), "config_path": self.config_path and str(self.config_path),
                "raw": self._raw, "config": self._config, "specials": self._specials}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.model_path = Path(state["model_path"])
        self.config_path = Path(state["config_path"]) if state["config_path"] else None
        self._load(state["raw"], state["config"], state.get("specials", {}))

    def __repr__(self) -> str:
        return f"HFTokenizer(model_path={str(self.model_path)!r}, vocab_size={self.vocab_size})"

    def save_hf(self, out_dir: str | os.PathLike[str], model_max_length: int | None = None) -> None:
        """Write ``tokenizer.json`` (the same bytes) and ``tokenizer_config.json`` (the one beside it, else a
        minimal one naming eos/bos) so that ``transformers.AutoTokenizer`` loads the same tokenizer."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / HF_TOKENIZER_FILE).write_bytes(self._raw)
        config = dict(self._config or {"tokenizer_class": "PreTrainedTokenizerFast",
                                       "clean_up_tokenization_spaces": False})
        config.setdefault("eos_token", self.id_to_piece(self.eos_id))
        if self.bos_id >= 0:
            config.setdefault("bos_token", self.id_to_piece(self.bos_id))
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        (out / _CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
