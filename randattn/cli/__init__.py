"""The ``randattn`` command line: a thin click layer over the library.

Each command lives in its own module (``randattn/cli/<command>.py``) and exposes a
click command named ``command``; heavy imports happen inside the command body so
that ``randattn --help`` stays fast. Only this package prints (through rich).
Exit codes: 0 ok; 1 a check failed or an unexpected error; 2 bad usage or input, no space left to write an
output (the message names the file and the cause), or memory that ran out (it names the allocation); 130
interrupted by Ctrl-C (SIGINT), 141 its output's reader left (a closed pipe, ``| head``), 143 stopped by SIGTERM. A
command that keeps partial work (mse) says where it is and how to continue.
"""

from __future__ import annotations

import importlib
import warnings
from typing import NoReturn

import click

#: command name -> module under randattn.cli holding a click command called ``command``
COMMANDS: dict[str, str] = {
    "estimators": "estimators",
    "check": "check",
    "capture": "capture",
    "mse": "mse",
    "plot": "plot",
    "report": "report",
    "verify": "verify",
    "demo": "demo",
    "demo-lm": "demo_lm",
}


class _LazyGroup(click.Group):
    """A click group that imports a command's module only when it is used."""

    def make_context(self, *args, **kwargs) -> click.Context:
        # the group's own --help and --version print while it parses its arguments, before invoke: a closed pipe
        # there ends as in a command (click's own handling exits 1)
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError:
            _reader_left()

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._load(name) is not None]

    def invoke(self, ctx: click.Context):
        # click turns Ctrl-C into "Aborted!" and exit 1; the shell's convention is 128 + the signal: 130 for
        # SIGINT, 143 for SIGTERM, which raises like Ctrl-C (_common.Terminated). Commands that keep partial
        # work (mse) catch it themselves and say what was kept. A write that finds no space (a full disk, a
        # quota, a file-size limit) is an error of the environment, not a bug: exit 2 naming the file.
        from randattn.cli._common import UserError, err_console, interrupt_exit_code, no_space_message, sigterm_raises

        with sigterm_raises(), warnings.catch_warnings():
            warnings.showwarning = _show_warning
            try:
                return super().invoke(ctx)
            except KeyboardInterrupt as exc:
                err_console.print("[bold red]interrupted[/]", highlight=False)
                raise SystemExit(interrupt_exit_code(exc)) from None
            except BrokenPipeError:  # mse keeps its finished units for --resume, as after an interrupt
                _reader_left()
            except OSError as exc:
                message = no_space_message(exc)
                if message is None:
                    raise
                UserError(message).show()
                raise SystemExit(2) from None

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return self._load(name)

    @staticmethod
    def _load(name: str) -> click.Command | None:
        module_name = COMMANDS.get(name)
        if module_name is None:
            return None
        try:
            module = importlib.import_module(f"randattn.cli.{module_name}")
        except ModuleNotFoundError as exc:
            # a command whose module is not written yet is simply absent
            if exc.name == f"randattn.cli.{module_name}":
                return None
            raise
        return module.command


def _reader_left() -> NoReturn:
    """The reader of stdout or stderr left (``| head``): nothing more can be said to it, so, as a Unix tool stopped by
    SIGPIPE, exit 128 + 13 without a word, stdout and stderr pointed at the null device first, so that the
    interpreter's flush at exit does not raise again on the closed pipe (the Python documentation's note on
    SIGPIPE)."""
    import os
    import sys

    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(null, stream.fileno())
        except (OSError, ValueError):  # a stream without a file descriptor (a test's capture): nothing to flush
            pass
    raise SystemExit(141) from None


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning as the user reads it: its kind and message, not the source line that raised it."""
    from rich.markup import escape

    from randattn.cli._common import err_console

    err_console.print(f"[yellow]warning[/] ({category.__name__}): {escape(str(message))}", highlight=False,
                      soft_wrap=True)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="randattn")
def main() -> None:
    """randattn: softmax attention and its randomized estimators, measured."""
