#!/usr/bin/env python
"""Tokenise text / JSONL files into a memory-mapped ``OUT.bin`` + ``OUT.json`` for pretraining.

Examples::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --vocab-size 8192
    python tools/preprocess_data.py --input docs/ --output-prefix data/docs --tokenizer my.model
    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \
        --tokenizer path/to/hf-model-dir --workers 8

Documents are streamed (never all in memory): text files are one document each, ``.jsonl``/``.json`` files
one ``{"text": ...}`` object per line; directories are expanded recursively. Each document is followed by
the tokenizer's eos id. ``--tokenizer`` takes a SentencePiece ``.model``, a Hugging Face ``tokenizer.json`` or
a directory holding one (all local files); without it the built-in BPE of ``--vocab-size`` is trained on the
input files (or loaded from the cache). ``--workers N`` encodes batches of documents in N processes; the
output is the same, byte for byte, as with one. Pass the ``.bin`` to pretraining as the data path.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

try:
    import megazero.data  # noqa: F401
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm

from megazero.data.corpus import expand_paths, read_text_documents
from megazero.data.datasets import (
    check_vocab_size,
    default_cache_dir,
    open_tokenizer,
    token_dtype,
    tokenize_documents,
    write_token_file,
)
from megazero.data.tokenizer import load_or_train_tokenizer

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " One of --tokenizer and "
                                     "--vocab-size is required.")
    parser.add_argument("--input", nargs="+", required=True, help="text/JSONL files or directories")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and OUTPUT_PREFIX.json")
    parser.add_argument("--vocab-size", type=int, help="train (or load the cached) built-in BPE of this size; "
                        "with --tokenizer, must equal its vocabulary size (one of --vocab-size and --tokenizer is "
                        "required)")
    parser.add_argument("--tokenizer", metavar="PATH", help="an existing SentencePiece .model, Hugging Face "
                        "tokenizer.json, or a directory holding one (one of --tokenizer and --vocab-size is "
                        "required)")
    parser.add_argument("--cache-dir", default=None, help="tokenizer cache root (default: $MEGAZERO_CACHE or "
                        "~/.cache/megazero)")
    parser.add_argument("--batch-size", type=int, default=256, help="documents encoded per batch (a batch also "
                        "ends once it holds --batch-chars characters; default: %(default)s)")
    parser.add_argument("--batch-chars", type=int, default=1 << 20, help="characters per batch at most, "
                        "give or take one document (keeps the workers evenly loaded on long documents; default: "
                        "%(default)s)")
    parser.add_argument("--num-threads", type=int, default=1, help="the tokenizer's own threads within one "
                        "process (SentencePiece's, or the tokenizers library's pool when > 1; default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1, help="processes encoding batches of documents in "
                        "parallel (the output does not depend on it; default: %(default)s)")
    args = parser.parse_args(argv)
    if args.tokenizer is None and args.vocab_size is None:
        parser.error("one of --tokenizer PATH or --vocab-size N is required")
    for flag, value in (("--workers", args.workers), ("--batch-size", args.batch_size),
                        ("--batch-chars", args.batch_chars), ("--num-threads", args.num_threads)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the tool; returns the process exit code."""
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        files = expand_paths(args.input)
        if not files:
            raise ValueError(f"--input {args.input} contains no files")
        if args.tokenizer:
            tokenizer = open_tokenizer(args.tokenizer)
            check_vocab_size(tokenizer, args.vocab_size)
        else:
            cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
            tokenizer = load_or_train_tokenizer(files, args.vocab_size, cache_dir)
        counts: dict = {"documents": 0, "inputs": [str(p) for p in args.input],  # read after streaming
                        "eos_id": tokenizer.eos_id}
        progress = tqdm(unit="tok", unit_scale=True, desc="tokenising", file=sys.stderr, disable=None)

        def counted_documents() -> Iterator[str]:
            for doc in read_text_documents(files):
                counts["documents"] += 1
                yield doc

        def counted_chunks() -> Iterator[np.ndarray]:
            for chunk in tokenize_documents(counted_documents(), tokenizer, batch_size=args.batch_size,
                                            num_threads=args.num_threads, workers=args.workers,
                                            batch_chars=args.batch_chars):
                progress.update(chunk.size)
                progress.set_postfix(docs=counts["documents"], refresh=False)
                yield chunk

        tokenise_start = time.perf_counter()
        meta = write_token_file(
            args.output_prefix, counted_chunks(), token_dtype(tokenizer.vocab_size), vocab_size=tokenizer.vocab_size,
            tokenizer_fingerprint=tokenizer.fingerprint, tokenizer_model=str(tokenizer.model_path.resolve()),
            extra=counts,
        )
        tokenise_seconds = time.perf_counter() - tokenise_start
        progress.close()
    except ValueError as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(
        f"wrote {args.output_prefix}.bin: {meta['documents']} documents, {meta['num_tokens']} tokens "
        f"({meta['dtype']}, vocab {meta['vocab_size']}, tokenizer {tokenizer.model_path}) in {seconds:.1f} s; "
        f"{meta['num_tokens'] / max(tokenise_seconds, 1e-9):.0f} tokens/s with {args.workers} worker(s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
