"""Text corpora: the built-in Python standard-library corpus and user text / JSONL files.

The built-in corpus is the ``.py`` source of the running interpreter's standard library (no test suites,
no site-packages), so a fresh checkout can pretrain without downloading anything. User data is read with
:func:`read_text_documents`: plain text files are one document each, ``.jsonl`` / ``.json`` files hold one
JSON object per line with a ``text`` field.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from megazero.config.errors import UserError

__all__ = [
    "DataError",
    "EXCLUDED_DIR_NAMES",
    "JSON_SUFFIXES",
    "corpus_fingerprint",
    "expand_paths",
    "read_text_documents",
    "stdlib_corpus_files",
    "stdlib_root",
]

class DataError(UserError, ValueError):
    """A data or tokenizer file the run cannot use; the message names the file (and line or offset) and the fix."""


#: Directory names skipped when collecting the standard-library corpus (test suites and installed packages).
EXCLUDED_DIR_NAMES: frozenset[str] = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
#: File suffixes read as JSON lines (one object with a ``text`` field per line).
JSON_SUFFIXES: frozenset[str] = frozenset({".jsonl", ".json"})


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is_readable_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return True


def stdlib_corpus_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library, leaving out test suites, site-packages and unreadables.

    Any directory named ``test``, ``tests``, ``idle_test``, ``site-packages``, ``dist-packages`` or
    ``__pycache__`` is skipped (this covers ``test/``, ``idlelib/idle_test`` and ``lib2to3/tests``), as is
    any file that cannot be read or is not valid UTF-8. ``root`` defaults to :func:`stdlib_root`.
    """
    base = Path(root) if root is not None else stdlib_root()
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIR_NAMES)
        for name in filenames:
            path = Path(dirpath) / name
            if name.endswith(".py") and path.is_file() and _is_readable_utf8(path):
                files.append(path)
    return sorted(files)


def _common_root(files: Sequence[Path]) -> Path:
    if not files:
        return Path(".")
    parents = [str(p.resolve().parent) for p in files]
    return Path(os.path.commonpath(parents))


def corpus_fingerprint(files: Iterable[str | os.PathLike[str]], root: str | os.PathLike[str] | None = None) -> str:
    """SHA-256 hex digest of the files' paths (relative to ``root``), sizes and contents.

    ``root`` defaults to the files' common parent directory, so the fingerprint does not depend on where the
    corpus lives, only on its layout and bytes. Order matters: pass the files in a deterministic order.
    """
    paths = [Path(f) for f in files]
    base = Path(root).resolve() if root is not None else _common_root(paths)
    digest = hashlib.sha256()
    for path in paths:
        resolved = path.resolve()
        try:
            rel = resolved.relative_to(base).as_posix()
        except ValueError:
            rel = resolved.as_posix()
        data = resolved.read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()


def expand_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Expand directories recursively (sorted, hidden entries skipped) into files; check every path exists.

    Raises:
        DataError: naming the path when it does not exist.
    """
    out: list[Path] = []
    for item in paths:
        path = Path(item)
        if path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path):
                dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
                out.extend(Path(dirpath) / f for f in sorted(filenames) if not f.startswith("."))
        elif path.is_file():
            out.append(path)
        else:
            raise DataError(f"data path {str(path)!r} does not exist (expected a text/JSONL file or a directory)")
    return out


def _read_utf8(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start}): convert it, e.g. "
                        f"iconv -f latin1 -t utf-8, or leave it out") from e


def _json_documents(path: Path) -> Iterator[str]:
    try:
        yield from _json_lines(path)
    except UnicodeDecodeError as e:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text ({e.reason}): convert it, e.g. iconv -f latin1 "
                        "-t utf-8, or leave it out") from e


def _json_lines(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}:{lineno}: invalid JSON ({e.msg}); expected one JSON object per line "
                    'like {"text": "..."}'
                ) from e
            if not isinstance(record, dict) or "text" not in record:
                keys = f" (its keys: {', '.join(map(str, list(record)[:5]))})" if isinstance(record, dict) else ""
                raise DataError(
                    f'{path}:{lineno}: JSON line has no "text" field{keys}; each line must be an object '
                    'like {"text": "..."}: rename the field holding the text to "text"'
                )
            text = record["text"]
            if not isinstance(text, str):
                raise DataError(f'{path}:{lineno}: "text" field must be a string, got {type(text).__name__}')
            yield text


def read_text_documents(paths: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    """Yield documents from text files (one per file) and ``.jsonl``/``.json`` files (one per line).

    Directories are expanded recursively in sorted order. Documents are streamed: a large JSONL file is
    never held in memory at once. Text is read as UTF-8 with universal newlines.

    Raises:
        DataError: naming the path (and line) for a missing path, a non-UTF-8 file, an invalid JSON line
            or a JSON line without a string ``text`` field.
    """
    for path in expand_paths(paths):
        if path.suffix.lower() in JSON_SUFFIXES:
            yield from _json_documents(path)
        else:
            yield _read_utf8(path)
