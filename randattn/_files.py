"""Atomic file writes shared by every writer (activations, sweep tables, reports), and their errors named.

A file is written under a temporary name in its destination folder and renamed over the
target only when the write finished, so an interrupted write never leaves a half file.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_path", "atomic_write_text", "named_write_errors"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` when the block succeeds.

    The temporary file gets the permissions a plain ``open`` would give (``mkstemp``
    makes it private), and it is removed if the block raises; the exception propagates.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextmanager
def named_write_errors(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block as one whose ``filename`` is ``path`` (the file the caller asked for).

    The writers are atomic (:func:`atomic_path`): their errors name a temporary file beside ``path``, or no file
    at all (pyarrow, pandas), while ``path`` itself is left as it was. The errno is kept, so a caller can tell a
    full disk (``ENOSPC``, ``EDQUOT``, ``EFBIG``) from other failures.
    """
    try:
        yield
    except OSError as exc:
        if exc.filename == str(path):
            raise
        reason = os.strerror(exc.errno) if exc.errno else (exc.strerror or str(exc))
        raise OSError(exc.errno, reason, str(path)) from exc
