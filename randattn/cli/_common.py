"""Helpers shared by the CLI commands: one exit path for user errors, consoles."""

from __future__ import annotations

import sys
from typing import NoReturn

import click
from rich.console import Console

#: rich messages and progress go to stderr; data goes to stdout. Tables are wide: when the
#: stream is not a terminal (CI logs, pipes) rich would fall back to 80 columns and elide
#: the numbers, so a non-terminal gets a width that fits the summary tables.
_PIPE_WIDTH = 200
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else _PIPE_WIDTH)
out_console = Console(width=None if sys.stdout.isatty() else _PIPE_WIDTH)


class UserError(click.ClickException):
    """An error in the user's input: printed without a traceback, exit code 2."""

    exit_code = 2

    def show(self, file=None) -> None:  # noqa: D102 - click's hook
        from rich.markup import escape

        # escaped: a path or value holding "[...]" is not rich markup; soft_wrap: paths stay whole for copy and paste
        err_console.print(f"[bold red]error:[/] {escape(self.format_message())}", highlight=False, soft_wrap=True)


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
        abort(f"{what} {str(path)!r}: cannot write to {str(folder)!r} ({reason})")
    if not directory and path.exists() and not os.access(path, os.W_OK):
        abort(f"{what} {str(path)!r} exists and is not writable")
    return path
