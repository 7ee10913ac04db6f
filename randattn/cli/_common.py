"""Helpers shared by the CLI commands: one exit path for user errors, consoles."""

from __future__ import annotations

from typing import NoReturn

import click
from rich.console import Console

#: rich messages and progress go to stderr; data goes to stdout
err_console = Console(stderr=True)
out_console = Console()


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
