"""What the commands that write files share: no output is replaced without ``--force``, an output
folder the command created is taken back when the command fails, and a full disk is reported as the file that
could not be written and why, never as a traceback.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable, Iterator

from randattn.cli._common import abort, no_space_message, writable_output

#: the resolutions --dpi accepts: a 6.4 x 4.8 in figure at 1200 dpi is already 44 megapixels
MIN_DPI, MAX_DPI = 20, 1200


@contextlib.contextmanager
def space_errors(default: Path | str) -> Iterator[None]:
    """Turn a write that failed for want of space (ENOSPC, EDQUOT, EFBIG) into exit 2 naming the file and the
    cause (:func:`~randattn.cli._common.no_space_message`); ``default`` is the file named when the error names
    none. The writers are atomic, so the file named was left as it was."""
    try:
        yield
    except OSError as exc:
        named = exc if exc.filename else OSError(exc.errno, exc.strerror or str(exc), str(default))
        message = no_space_message(named)
        if message is None:
            raise
        abort(message)


def refuse_to_replace(folder: Path, names: Iterable[str], force: bool) -> None:
    """Exit 2 when ``folder`` holds any of the files ``names`` and ``force`` is not set."""
    existing = [name for name in dict.fromkeys(names) if (Path(folder) / name).exists()]
    if existing and not force:
        shown = ", ".join(existing[:6]) + (f" and {len(existing) - 6} more" if len(existing) > 6 else "")
        them = "it" if len(existing) == 1 else "them"
        abort(f"--out {str(folder)!r} already holds {shown}; pass --force to replace {them}")


def refuse_to_replace_file(path: Path, force: bool) -> None:
    """Exit 2 when the output file ``path`` exists and ``force`` is not set."""
    if path.exists() and not path.is_dir() and not force:
        abort(f"--out {str(path)!r} exists; pass --force to replace it")


@contextlib.contextmanager
def taken_back_on_failure(folder: Path | str) -> Iterator[None]:
    """Remove the folders of ``folder``'s path that the block creates, when the block fails and they are still
    empty. A folder that existed before, or that holds anything, is never removed."""
    folder = Path(folder)
    created = []  # missing now, deepest first
    for ancestor in [folder, *folder.parents]:
        if ancestor.exists() or ancestor.is_symlink():
            break
        created.append(ancestor)
    try:
        yield
    except BaseException:
        for ancestor in created:
            try:
                ancestor.rmdir()  # only an empty folder: whatever the command wrote before failing stays
            except OSError:
                break
        raise


@contextlib.contextmanager
def output_folder(path: Path | str, what: str = "--out") -> Iterator[Path]:
    """Create the output folder ``path`` for the block, checked as :func:`~randattn.cli._common.writable_output`
    does, and take it back (:func:`taken_back_on_failure`) when the block fails."""
    with taken_back_on_failure(path):
        yield writable_output(path, what, directory=True)
