"""Data: the built-in standard-library corpus, an exactly round-tripping BPE tokenizer, packed token datasets
(in memory or memory-mapped ``.bin`` files) and a deterministic, resumable distributed batch sampler."""

from megazero.data.corpus import corpus_fingerprint, read_text_documents, stdlib_corpus_files
from megazero.data.datasets import (
    TokenDataset,
    build_datasets,
    default_cache_dir,
    open_token_file,
    read_token_meta,
    resolve_tokenizer,
    token_dtype,
    tokenize_documents,
    write_token_file,
)
from megazero.data.sampler import DistributedBatchSampler, collate
from megazero.data.tokenizer import Tokenizer, load_or_train_tokenizer

__all__ = [
    "DistributedBatchSampler",
    "TokenDataset",
    "Tokenizer",
    "build_datasets",
    "collate",
    "corpus_fingerprint",
    "default_cache_dir",
    "load_or_train_tokenizer",
    "open_token_file",
    "read_text_documents",
    "read_token_meta",
    "resolve_tokenizer",
    "stdlib_corpus_files",
    "token_dtype",
    "tokenize_documents",
    "write_token_file",
]
