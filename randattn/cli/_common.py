"""Helpers shared by the CLI commands: one exit path for user errors, consoles, signals, a full disk."""

from __future__ import annotations

import contextlib
import errno
import re
import signal
import sys
import threading
from typing import Any, Iterator, NoReturn

import click
from rich.console import Console

#: rich messages and progress go to stderr; data goes to stdout. Tables are wide: when the
#: stream is not a terminal (CI logs, pipes) rich would fall back to 80 columns and elide
#: the numbers, so a non-terminal gets a width that fits the summary tables.
_PIPE_WIDTH = 200


class _Console(Console):
    """rich's Console, but a closed pipe raises :class:`BrokenPipeError` (rich exits with 1 itself), so that the
    command line ends every such case the same way: exit 141, mse's finished units kept (``randattn.cli``)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, "the reader of randattn's output left")


err_console = _Console(stderr=True, width=None if sys.stderr.isatty() else _PIPE_WIDTH)
out_console = _Console(width=None if sys.stdout.isatty() else _PIPE_WIDTH)


class UserError(click.ClickException):
    """An error in the user's input: printed without a traceback, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: D102 - click's hook
        from rich.markup import escape

        # escaped: a path or value holding "[...]" is not rich markup; soft_wrap: paths stay whole for copy and paste
        err_console.print(f"[bold red]error:[/] {escape(self.format_message())}", highlight=False, soft_wrap=True)


def json_text(value: Any) -> str:
    """``value`` as strict JSON (indented): a float that is NaN or infinite (a check that errored, a column with no
    value) becomes ``null``, which every JSON reader takes, where ``json.dumps`` would write ``NaN``."""
    import json
    import math

    def strict(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return None
        if isinstance(item, dict):
            return {key: strict(inner) for key, inner in item.items()}
        if isinstance(item, (list, tuple)):
            return [strict(inner) for inner in item]
        return item

    return json.dumps(strict(value), indent=2, allow_nan=False)


def abort(message: str, code: int = 2) -> NoReturn:
    """Stop the command with ``message`` on stderr and exit ``code`` (2: bad input)."""
    error = UserError(message)
    error.exit_code = code
    raise error


def writable_output(path, what: str = "--out", *, directory: bool = False):
    """Check, before any computing, that ``path`` (a file, or a folder with ``directory``) can be written.

    Creates missing parent folders; a parent that is a file, a folder we cannot write or a
    path that is itself a folder where a file is expected exits 2 with a message.
    Returns ``path`` as a :class:`pathlib.Path`.
    """
    import errno
    import os
    import tempfile
    from pathlib import Path

    path = Path(path)
    folder = path if directory else path.parent
    if not directory and path.is_dir():
        abort(f"{what} {str(path)!r} is a folder; give a file name")
    if directory and path.exists() and not path.is_dir():
        abort(f"{what} {str(path)!r} is a file; give a folder")
    for parent in [folder, *folder.parents]:
        if parent.exists():
            if not parent.is_dir():
                abort(f"{what} {str(path)!r}: {str(parent)!r} is a file, not a folder")
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".randattn-write-test-"):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        if exc.errno == errno.ENOENT and folder.is_dir():  # /proc, /sys: the folder is there, a file cannot be
            reason = "the folder exists, but no file can be created in it"
        abort(f"{what} {str(path)!r}: cannot write to {str(folder)!r} ({reason})")
    if not directory and path.exists() and not os.access(path, os.W_OK):
        abort(f"{what} {str(path)!r} exists and is not writable")
    return path


# ------------------------------------------------------------------------------------------------ SIGTERM
class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, a batch scheduler's stop), raised like Ctrl-C's :class:`KeyboardInterrupt`.

    A subclass, so that every ``except KeyboardInterrupt`` that cleans up or says what was kept does
    the same for it; the exit code is 128 + 15 = 143 where Ctrl-C's is 130 (:func:`interrupt_exit_code`).
    """

    signum = signal.SIGTERM


def interrupt_exit_code(exc: BaseException) -> int:
    """128 + the signal that interrupted: 130 for Ctrl-C (SIGINT), 143 for :class:`Terminated` (SIGTERM)."""
    return 128 + int(getattr(exc, "signum", signal.SIGINT))


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """For the block, SIGTERM raises :class:`Terminated` in the main thread (elsewhere: nothing changes).

    A second SIGTERM, while the first one's cleanup runs, ends the process at once (the default action).
    """
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
        yield  # a signal handler can only be set in the main thread; an ignored SIGTERM stays ignored, as SIGINT does
        return

    def terminate(signum, frame) -> NoReturn:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


# ------------------------------------------------------------------------------------------------ a full disk
#: errno -> the cause a message names: a full disk, a quota and a file-size limit are the same failure to the user
NO_SPACE_ERRNOS: dict[int, str] = {errno.ENOSPC: "no space left on device", errno.EFBIG: "file too large",
                                   **({errno.EDQUOT: "disk quota exceeded"} if hasattr(errno, "EDQUOT") else {})}
#: a writer in Rust or C++ (safetensors, pyarrow) may carry the OS error in its text only
_ERRNO_TEXT = re.compile(r"(?:os error|errno) (\d+)", re.IGNORECASE)
#: the temporary file of :func:`randattn._files.atomic_path`: ``.<name>.<random>.tmp`` beside ``<name>``
_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.[^.]+\.tmp$")


def no_space_message(exc: BaseException) -> str | None:
    """``"no space left writing '<file>' (<cause>)"`` when ``exc`` is a write that failed for want of space
    (ENOSPC, EDQUOT, EFBIG), else None. The file is the one the write was for (an atomic write's target, not
    its temporary name), or "a file" when the error names none."""
    code = getattr(exc, "errno", None)
    if code not in NO_SPACE_ERRNOS:
        match = _ERRNO_TEXT.search(str(exc))
        code = int(match.group(1)) if match else None
    if code not in NO_SPACE_ERRNOS:
        return None
    filename = getattr(exc, "filename", None)
    if filename:
        from pathlib import Path

        path = Path(str(filename))
        temporary = _TEMPORARY.match(path.name)
        where = repr(str(path.with_name(temporary.group("name")) if temporary else path))
    else:
        where = "a file"
    return f"no space left writing {where} ({NO_SPACE_ERRNOS[code]})"
