"""Errors of the report writers name the file the caller asked for, not the temporary file it was written to."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def named_write_errors(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block as one whose ``filename`` is ``path``.

    The writers are atomic (:func:`randattn._files.atomic_path`): their errors name a temporary file beside
    ``path``, or no file at all (pyarrow, pandas), while ``path`` itself is left as it was.
    """
    try:
        yield
    except OSError as exc:
        if exc.filename == str(path):
            raise
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
