"""Data: the built-in standard-library corpus, an exactly round-tripping BPE tokenizer (or a Hugging Face
``tokenizer.json``), packed token datasets (in memory or memory-mapped ``.bin`` files) and a deterministic,
resumable distributed batch sampler."""

from megazero.data.corpus import DataError, corpus_fingerprint, read_text_documents, stdlib_corpus_files
from megazero.data.datasets import (
    AnyTokenizer,
    TokenDataset,
    build_datasets,
    check_vocab_size,
    default_cache_dir,
    open_token_file,
    open_tokenizer,
    read_token_meta,
    resolve_tokenizer,
    sidecar_tokenizer,
    token_dtype,
    tokenize_documents,
    tokenizer_vocab_size,
    write_token_file,
)
from megazero.data.hf_tokenizer import HFTokenizer
from megazero.data.sampler import DistributedBatchSampler, collate
from megazero.data.tokenizer import Tokenizer, load_or_train_tokenizer

__all__ = [
    "AnyTokenizer",
    "DataError",
    "DistributedBatchSampler",
    "HFTokenizer",
    "TokenDataset",
    "Tokenizer",
    "build_datasets",
    "check_vocab_size",
    "collate",
    "corpus_fingerprint",
    "default_cache_dir",
    "load_or_train_tokenizer",
    "open_token_file",
    "open_tokenizer",
    "read_text_documents",
    "read_token_meta",
    "resolve_tokenizer",
    "sidecar_tokenizer",
    "stdlib_corpus_files",
    "token_dtype",
    "tokenize_documents",
    "tokenizer_vocab_size",
    "write_token_file",
]
