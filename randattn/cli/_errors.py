"""The library's refusals in the command line's words: the facts an error carries, with the options that act on them.

The library raises typed errors whose attributes say what happened (a path, the bytes needed, the budget) and whose
messages speak to a Python caller (``force=True``, ``max_memory``); :func:`said` chooses the words of ``randattn``'s
options by the error's type, never by its text. What a stopped run kept (:func:`kept_message`) and the command that
continues it (:func:`resume_command`) are the command line's too.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import click

from randattn._validation import ParameterError
from randattn.analysis.cell_memory import MemoryBudgetError
from randattn.analysis.executors import SchedulerError
from randattn.analysis.queries import QueryPlacementError
from randattn.analysis.store import (
    FinishedRunMismatchError,
    ManifestError,
    OutputExistsError,
    OutputPathError,
    PartsExistError,
    SweepLockedError,
)
from randattn.estimators.base import UnknownParameterError
from randattn.results.parts import stored_unit_ids
from randattn.results.table import PositionsTableError

__all__ = ["kept_message", "option_of", "out_of_memory", "resume_command", "said"]


@functools.singledispatch
def said(exc: BaseException) -> str:
    """``exc`` as ``randattn`` says it: its message, in the options' words where its type has facts to word."""
    return str(exc)


@said.register
def _(exc: ParameterError) -> str:
    option = option_of(exc.parameter)
    return str(exc) if option is None else exc.naming(option, " ")


@said.register
def _(exc: PositionsTableError) -> str:
    # the running command (report, plot) takes the run's main table, which brings the per-position table along
    context = click.get_current_context(silent=True)
    command = "randattn" + ("" if context is None else f" {context.info_name}")
    main = "the run's main table"
    if exc.main_path is not None:
        found = "" if exc.main_path.is_file() else " (not found there)"
        main += f", {str(exc.main_path)!r}{found}"
    return (f"{str(exc.path)!r} is the per-position table of a run (one row per head, S and query-position bucket), "
            f"not a results table; {command} takes {main}, and reads the per-position table beside it")


@said.register
def _(exc: UnknownParameterError) -> str:
    # the running command's option for S (mse's --samples); a command without one (check: each check picks its S)
    # gives no hint where S goes
    return exc.naming(option_of("samples"))


def option_of(parameter: str) -> str | None:
    """The running command's option for the library's ``parameter`` (``check_reference`` -> ``--check-reference``),
    read from its click definition; None where it has none."""
    context = click.get_current_context(silent=True)
    for option in context.command.params if context is not None else ():
        if option.name == parameter and isinstance(option, click.Option):
            return option.opts[0]
    return None


@said.register
def _(exc: OutputPathError) -> str:
    return exc.naming(f"--out {str(exc.out)!r}")


@said.register
def _(exc: OutputExistsError) -> str:
    if exc.unfinished:
        return f"{exc.what}; add --resume to continue it, or --force to start afresh"
    if exc.path != exc.out:  # a file a run writes beside its table, found without the table: nothing to resume
        return f"{exc.what}; pass --force to replace it"
    return f"{exc.what}; pass --force to replace it (or --resume to check it is complete)"


@said.register
def _(exc: FinishedRunMismatchError) -> str:
    return f"{exc.what}; use --force or another --out"


@said.register
def _(exc: ManifestError) -> str:
    return f"{exc}; --force starts afresh (its finished units are lost)"


@said.register
def _(exc: PartsExistError) -> str:
    return f"{str(exc.parts)!r} already holds a sweep; pass --resume to continue it or remove the folder"


@said.register
def _(exc: SweepLockedError) -> str:
    return exc.what if exc.holder is None else f"{exc.what}; wait for it to finish, or write to another --out"


@said.register
def _(exc: QueryPlacementError) -> str:
    if exc.sampled:
        return f"{exc.what}; use last:K, or --queries all"
    return f"{exc.what}; measure it with --queries all" + (", or under --mask causal with last:K" if exc.causal else "")


@said.register
def _(exc: SchedulerError) -> str:
    return exc.naming("--scheduler")


@said.register
def _(exc: MemoryBudgetError) -> str:
    if exc.store:
        return f"{exc.what}; use fewer --replicates, select fewer --heads, or raise --max-memory"
    samples = " (fewer --samples helps only where the estimator's memory grows with S)" if exc.num_samples else ""
    return f"{exc.what}; raise --max-memory or measure fewer queries (--queries last:K){samples}"


def out_of_memory(what: str, budget: str) -> str:
    """A failed allocation (``what``: the allocator's words) under ``--max-memory`` ``budget``, with what helps."""
    return (f"out of memory ({what}); lower --max-memory (now {budget}) so that work is split into smaller blocks, "
            "or use fewer --samples / --replicates")


def resume_command(argv: Sequence[str]) -> str:
    """The command that continues the run of ``argv``: without --force/--overwrite/--dry-run, with --resume.

    Parameters
    ----------
    argv : sequence of str
        The interrupted run's arguments after the program name (``sys.argv[1:]``).
    """
    from randattn.analysis.records import command_line

    kept = [a for a in argv if a not in ("--overwrite", "--force", "--dry-run")]
    if "--resume" not in kept:
        kept.append("--resume")
    return command_line(kept)


def kept_message(parts: str | Path | None, resume: str, then: str | None = None) -> str:
    """What a failed run kept, to end its message; an empty parts folder is removed.

    Parameters
    ----------
    parts : path or None
        The run's parts folder (None: the run had no ``--out``).
    resume : str
        The command that continues the run (:func:`resume_command`), named after ``then``.
    then : str, optional
        When to continue (``"once there is space"``): adds ``"; <then>, continue with: <resume>"``.

    Returns
    -------
    str
        ``"; finished units are kept in <parts> for --resume..."`` when a unit finished, else
        ``"; nothing was kept (...)"``.
    """
    from randattn.analysis.store import drop_empty_parts

    if parts is None:
        return "; nothing was kept (no --out)"
    if stored_unit_ids(parts):
        how = "" if then is None else f"; {then}, continue with: {resume}"
        return f"; finished units are kept in {parts} for --resume{how}"
    drop_empty_parts(parts)
    return "; nothing was kept (no unit had finished)"
