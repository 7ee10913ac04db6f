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
        err_console.print(f"[bold red]error:[/] {self.format_message()}", highlight=False)


def abort(message: str, code: int = 2) -> NoReturn:
    """Stop the command with ``message`` on stderr and exit ``code`` (2: bad input)."""
    error = UserError(message)
    error.exit_code = code
    raise error
