"""``randattn mse`` on a terminal, between its parsed options and its exit: the output's rules applied under the
lock, the plan printed, the sweep run with a progress bar (in this process or on a Dask client), and every way it
can stop mapped to a message and an exit code (README: 0, 1, 2, 130, 143).

The computation is not here: the plan and the sweep are :mod:`randattn.analysis.sweep`, the output's rules
:mod:`randattn.analysis.store`, the table, its parts and its files :mod:`randattn.results`, the metadata
:mod:`randattn.analysis.records`, and what is shown is built by
:mod:`randattn.reports.console`. This module calls them, prints, and maps their errors to exit codes; the
errors' words, with the options that act on them, are :mod:`randattn.cli._errors`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, Sequence

import click

__all__ = ["Job", "measure", "outputs", "preflight", "prepare_jobs"]


@dataclass
class Job:
    """One activation file of a run and what the run does with it: its output, its parsed options and, once
    planned, its plan. Several files make several jobs, each exactly the run of that file alone."""

    source: Path
    out: Path | None
    config: Any
    activations: Any
    done: bool = False  # --resume found this very run finished in ``out``
    plan: Any = None


def outputs(sources: Sequence[Path], out: Path | None) -> list[Path | None]:
    """Each activation file's output: ``out`` with ``{stem}`` replaced by the file's name without its suffix.

    Several files need ``{stem}`` in ``out`` and distinct outputs; a file given twice is refused. Without ``out``
    every file's output is None (the summary only)."""
    from randattn.cli._common import abort

    seen: dict[str, Path] = {}
    for source in sources:
        key = os.path.realpath(source)
        if key in seen:
            abort(f"ACTS {str(source)!r} is given twice" + ("" if str(seen[key]) == str(source)
                                                             else f" (as {str(seen[key])!r})"))
        seen[key] = source
    if out is None:
        return [None] * len(sources)
    if len(sources) > 1 and STEM not in str(out):
        abort(f"--out {str(out)!r}: with {len(sources)} activation files, --out needs {STEM} (each file's name "
              f"without its suffix), e.g. --out 'mse-{STEM}{out.suffix or '.parquet'}'")
    targets = [Path(str(out).replace(STEM, Path(source).stem)) for source in sources]
    first: dict[str, Path] = {}
    for source, target in zip(sources, targets):
        key = os.path.realpath(target)
        if key in first:
            abort(f"--out {str(out)!r}: {str(first[key])!r} and {str(source)!r} would both write {str(target)!r}; "
                  "rename one of them")
        first[key] = source
    return targets


def prepare_jobs(sources: Sequence[Path], outs: Sequence[Path | None], prepare: Callable[..., tuple[Any, Any]],
                 options: dict[str, Any]) -> list[Job]:
    """Parse the options against each file (:func:`randattn.cli._parsing.prepare`), all before any work: each
    file's own mask (``--mask file``) and scale; with several files a refusal names the file it is about."""
    from randattn.cli._common import UserError

    jobs = []
    for source, out in zip(sources, outs):
        try:
            config, activations = prepare(source, **options)
        except UserError as exc:
            if len(sources) > 1:
                exc.message = f"{source}: {exc.message}"
            raise
        jobs.append(Job(source, out, config, activations))
    return jobs


def preflight(outs: Sequence[Path | None], scheduler: str, *, resume: bool, force: bool) -> Any:
    """The checks that need no activations: exclusive flags, the scheduler, and (``--resume``) a damaged manifest,
    said before anything is loaded. Returns the parsed scheduler."""
    from randattn.analysis import store
    from randattn.analysis.executors import parse_scheduler
    from randattn.results.parts import parts_path
    from randattn.cli._common import abort
    from randattn.cli._errors import said

    if resume and force:
        abort("--resume and --force exclude each other")
    if resume and outs[0] is None:
        abort("--resume needs --out (the interrupted run's output path)")
    try:
        where = parse_scheduler(scheduler)
        if resume:
            for out in outs:
                store.check_manifest(parts_path(out))
    except ValueError as exc:
        abort(said(exc))
    return where


def measure(jobs: Sequence[Job], where: Any, *, resume: bool, force: bool, dry_run: bool, as_json: bool) -> None:
    """Run (or, ``dry_run``, plan) each job's sweep, write its output and show its summary; exits through
    :func:`~randattn.cli._common.abort` on a refusal.

    Every output is checked, locked and its rules applied, and every sweep planned (refused where it cannot fit
    the memory budget), before the first unit is computed; then the jobs run in order. The folders made for the
    outputs are taken back when the command fails and they hold nothing."""
    from randattn.cli._outputs import taken_back_on_failure

    with contextlib.ExitStack() as made:
        for job in jobs:
            if job.out is not None and not dry_run:
                made.enter_context(taken_back_on_failure(Path(job.out).parent))
        _measure(jobs, where, resume=resume, force=force, dry_run=dry_run, as_json=as_json)


def _measure(jobs: Sequence[Job], where: Any, *, resume: bool, force: bool, dry_run: bool, as_json: bool) -> None:
    from randattn.analysis import store
    from randattn.analysis.records import activations_fingerprint
    from randattn.cli._common import UserError, abort, err_console, no_space_message, writable_output
    from randattn.results.parts import parts_path
    from randattn.cli._errors import kept_message, said

    several = len(jobs) > 1
    try:
        for job in jobs:
            if job.out is not None:
                store.check_output_path(job.out, look_only=dry_run)
                if not dry_run:
                    writable_output(job.out)
                    if resume and parts_path(job.out).is_dir():  # its units are written there
                        writable_output(parts_path(job.out), "the parts folder of --resume", directory=True)
        with contextlib.ExitStack() as held:
            if not dry_run:
                for job in jobs:  # every output's lock for the whole run: none of them changes under it
                    if job.out is not None:
                        held.enter_context(store.sweep_lock(job.out))
            for job in jobs:  # a resume of other settings or activations is refused here, before any unit runs
                job.done = job.out is not None and store.check_output(
                    job.out, job.config.identity(), resume=resume, force=force, dry_run=dry_run,
                    activations=activations_fingerprint(job.activations))
                if job.done:
                    _check_finished_table_reads(job.out)
            if dry_run:  # the plans with their wall time; nothing computed for the tables, nothing written
                for job in jobs:
                    _header(job, several)
                    if job.done:
                        _said_complete(job.out, dry_run=True)
                    else:
                        _plan(job, resume, where, timing=True)
                written = [str(job.out) for job in jobs if job.out is not None and not job.done]
                target = f" (it would write {', '.join(written)})" if written else ""
                unasked = (f", and the Dask scheduler at {where.address} was not asked (the run needs it reachable)"
                           if where.kind == "address" else "")
                err_console.print(f"dry run: nothing was written{unasked}; the same command without --dry-run runs it"
                                  f"{target}",
                                  highlight=False, soft_wrap=True)
                return
            client, current = None, None
            try:
                for current in jobs:  # planned, and refused if one cannot fit the budget, before any unit is computed
                    if not current.done:
                        _header(current, several)
                        current.plan = _plan(current, resume, where)
                if any(not job.done for job in jobs):  # one Dask client (where asked for) serves every file
                    client = held.enter_context(_client(where, jobs[0].config.threads))
            except KeyboardInterrupt as exc:  # nothing computed yet; a resumed run's kept units are said
                out = None if current is None else current.out
                _interrupted(exc, None if out is None else parts_path(out), None, closing=held.close)
            summaries: dict[str, Any] = {}
            show = "table" if not as_json else "none" if several else "json"
            written: list[Path] = []
            for job in jobs:
                if several:
                    _header(job, True, to_stdout=not as_json)
                if job.done:
                    _said_complete(job.out)
                    summaries[str(job.source)] = _finish_stored(job, show)
                    continue
                parts = None if job.out is None else parts_path(job.out)
                try:
                    tables = _run(job, parts, resume, where, client, several)
                    summaries[str(job.source)] = _finish(tables, job, job.out, show, parts=parts)
                except UserError:
                    if parts is not None:
                        store.drop_empty_parts(parts)  # refused before any unit finished (memory): leave nothing
                    raise
                except KeyboardInterrupt as exc:
                    _interrupted(exc, parts, job.plan, written, closing=held.close)
                except OSError as exc:
                    if parts is not None and no_space_message(exc) is not None:
                        abort(no_space_message(exc) + kept_message(parts, _resume(), then="once there is space"))
                    if exc.filename is None:
                        raise
                    # a folder made read-only, a file taken away while the run wrote beside it
                    abort(f"cannot write {str(exc.filename)!r} ({exc.strerror or type(exc).__name__})"
                          + ("" if parts is None else kept_message(parts, _resume())))
                if parts is not None:
                    written.append(job.out)
                job.plan = job.activations = None  # its memory calibration and activations are not needed again
            if as_json and several:
                click.echo(json.dumps(summaries, indent=2))
    except (store.OutputRuleError, store.SweepLockedError) as exc:  # the output's rules (store), in the options' words
        abort(said(exc))


#: the placeholder of --out replaced by each activation file's stem
STEM = "{stem}"


def _header(job: Job, shown: bool, *, to_stdout: bool = False) -> None:
    """With several files, the line that says which file (and output) the lines below are about."""
    if not shown:
        return
    from rich.markup import escape

    from randattn.cli._common import err_console, out_console

    target = "" if job.out is None else f" -> {escape(str(job.out))}"
    console = out_console if to_stdout else err_console
    console.print(f"[bold]{escape(str(job.source))}[/]{target}", highlight=False, soft_wrap=True)


def _said_complete(out: Path, *, dry_run: bool = False) -> None:
    from randattn.cli._common import err_console

    would = "the run would do nothing" if dry_run else "nothing to do"
    err_console.print(f"{out} already holds this run, complete; {would}", highlight=False)


def _resume() -> str:
    """The command that continues this run (said when a run stops with finished units kept)."""
    from randattn.cli._errors import resume_command

    return resume_command(sys.argv[1:])


def _plan(job: Job, resume: bool, where: Any, *, timing: bool = False):
    """Plan the sweep (:func:`~randattn.analysis.sweep.plan_sweep`), print it, and refuse (exit 2) one that cannot
    fit the memory budget. Writes nothing."""
    from randattn._process import retain_freed_memory
    from randattn.analysis import sweep
    from randattn.analysis.cell_memory import format_bytes
    from randattn.analysis.memory import allocation_failure
    from randattn.cli._common import abort, err_console
    from randattn.cli._errors import out_of_memory, said
    from randattn.reports.console import plan_lines
    from randattn.reports.tables import item_noun
    from randattn.results.parts import parts_path

    parts = None if job.out is None else parts_path(job.out)
    try:
        # a unit split to fit the budget runs without kept memory, which could hold twice its forecast
        # (randattn._process): set before the dry run times anything, so that it times the run's policy
        policy = (lambda split: retain_freed_memory(split == 0)) if where.kind == "local" else None
        plan = sweep.plan_sweep(job.activations, job.config, parts_dir=parts, resume=resume, timing=timing,
                                before_timing=policy)
    except ValueError as exc:
        abort(said(exc))
    except (MemoryError, RuntimeError) as exc:  # the calibration (and a dry run's timing) runs units: as _run says
        what = allocation_failure(exc)
        if what is None:
            raise
        abort(out_of_memory(what, format_bytes(job.config.max_memory)))
    local = where.kind == "local"
    for line in plan_lines(plan, timing, dask=not local, noun=item_noun(job.activations.metadata)):
        err_console.print(line, highlight=False, soft_wrap=True)
    if plan.refused is not None:
        abort(said(plan.refused))
    return plan


def _run(job: Job, parts: Path | None, resume: bool, where: Any, client: Any, several: bool):
    """Run ``job``'s sweep with a progress bar (on ``client``, a Dask client, where not None); its
    :class:`~randattn.results.SweepTables`. Ctrl-C and SIGTERM propagate (the command says what was kept)."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from randattn.analysis import sweep
    from randattn.analysis.cell_memory import MemoryBudgetError, format_bytes
    from randattn.analysis.memory import allocation_failure
    from randattn.analysis.store import ResumeMismatchError
    from randattn.cli._common import abort, err_console
    from randattn.cli._errors import kept_message, out_of_memory, said
    from randattn.reports.console import warning_lines
    from randattn.results.parts import CorruptPartWarning

    config, plan = job.config, job.plan
    budget = format_bytes(config.max_memory)
    name = f"{job.source.stem} " if several else ""  # which file the bar is on
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=err_console) as bar:
        task = bar.add_task("mse", total=plan.cells)

        def report(p) -> None:
            s = "" if p.num_samples is None else f" S={p.num_samples}"
            bar.update(task, completed=p.done, description=f"{name}layer {p.layer} {p.label}{s}")

        def show(message, category, *args, **kwargs) -> None:  # a part set aside is said at once
            err_console.print(f"[yellow]warning[/]: {escape(str(message))}", highlight=False, soft_wrap=True)

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # run_sweep re-issues each distinct warning once; it returns them all
                warnings.simplefilter("always", CorruptPartWarning)
                warnings.showwarning = show
                tables = sweep.run_sweep(job.source if client is not None else job.activations, config,
                                         parts_dir=parts,
                                         resume=resume, progress=report, lock=False,
                                         scheduler=client, with_positions=True, calibrated=plan)
        except MemoryBudgetError as exc:
            abort(said(exc))
        except (FileExistsError, ResumeMismatchError) as exc:  # the stored run refuses this one: nothing to add
            abort(said(exc))
        except ValueError as exc:  # bad input found while running (also raised by a Dask unit)
            abort(said(exc) + kept_message(parts, _resume()))
        except (MemoryError, RuntimeError) as exc:
            what = allocation_failure(exc)  # numpy's "Unable to allocate 66.4 GiB for an array with shape ..."
            if what is None:
                raise
            abort(out_of_memory(what, budget) + kept_message(parts, _resume(), then="with a lower --max-memory"))
    for line in warning_lines(tables.table.attrs.get("warnings", [])):
        err_console.print(line, highlight=False, markup=True)
    return tables


@contextlib.contextmanager
def _client(where: Any, threads: int | None = None) -> Iterator[Any]:
    """A Dask client for a non-local scheduler (its dashboard address printed), else None."""
    if where.kind == "local":
        yield None
        return
    from randattn.analysis.executors import dask_client
    from randattn.cli._common import abort, err_console
    from randattn.cli._errors import said

    try:
        manager = dask_client(where, threads=threads)
        client = manager.__enter__()
    except ValueError as exc:
        abort(said(exc))
    try:
        workers = len(client.scheduler_info().get("workers", {}))
        link = getattr(client, "dashboard_link", None)
        err_console.print(f"Dask: {workers} workers at {client.scheduler.address}"
                          + (f"; dashboard {link}" if link else ""), highlight=False)
        yield client
    except BaseException:
        if not manager.__exit__(*sys.exc_info()):
            raise
    else:
        manager.__exit__(None, None, None)


def _interrupted(exc: BaseException, parts, plan, written: Sequence[Path] = (),
                 closing: Callable[[], Any] | None = None) -> NoReturn:
    """Say what an interrupted (Ctrl-C, SIGTERM) run kept and how to continue it; exit 128 + the signal.
    ``written``: the outputs of the files this run finished before (several files). ``closing``: what the run
    holds (a Dask cluster, the outputs' locks), closed first, so that the workers' own reports of the signal come
    before these lines and the ``--resume`` command is the last thing said."""
    from rich.markup import escape

    from randattn.analysis.store import drop_empty_parts
    from randattn.cli._common import err_console, interrupt_exit_code
    from randattn.reports.console import interrupted_text
    from randattn.results.parts import stored_unit_ids

    if closing is not None:
        closing()
    stored = stored_unit_ids(parts) if parts is not None else set()
    if parts is not None and not stored:
        drop_empty_parts(parts)
    # soft_wrap: the command stays on one line, whole, for copy and paste
    if written:
        err_console.print(f"written before the interruption: {escape(', '.join(map(str, written)))} "
                          "(--resume finds them complete)", highlight=False, soft_wrap=True)
    err_console.print(interrupted_text(parts, stored, plan, _resume()), highlight=False, soft_wrap=True)
    if written and not stored:
        err_console.print(f"continue with:\n  {escape(_resume())}", highlight=False, soft_wrap=True)
    raise SystemExit(interrupt_exit_code(exc)) from None


def _check_finished_table_reads(out: Path) -> None:
    """Exit 2 naming ``out`` where the finished table that ``--resume`` would show cannot be read (a truncated or
    damaged file), before any other file's run."""
    from randattn.cli._common import abort
    from randattn.results.table import ResultsError, read_results

    try:
        read_results(out)
    except ResultsError as exc:
        abort(f"{str(exc).rstrip('.')}; --force computes it again")


def _finish_stored(job: Job, show: str) -> list[dict[str, Any]]:
    """Show the table a finished run of the same settings left in ``job.out`` (``--resume`` with nothing to do);
    its summary records."""
    from randattn.results.schema import coerce
    from randattn.results.table import SweepTables, read_results

    return _finish(SweepTables(coerce(read_results(job.out).table)), job, None, show)


def _rows_text(table) -> str:
    """``"20 rows"``, and where configurations without S repeat their one measurement at each S, how many rows that
    is and how many measurements (the cells the plan counted): ``"20 rows (18 measurements: a configuration without
    S repeats its row at each S)"``."""
    from randattn.analysis.relative_error import MEASUREMENT_KEYS, s_free_repeats
    from randattn.reports.console import count

    repeated = int(s_free_repeats(table, MEASUREMENT_KEYS)[1].sum()) if len(table) else 0
    text = count(len(table), "row")
    if repeated:
        text += (f" ({count(len(table) - repeated, 'measurement')}: a configuration without S repeats its row at "
                 "each S)")
    return text


def _finish(tables, job: Job, out: Path | None, show: str, *, parts: Path | None = None) -> list[dict[str, Any]]:
    """Write the table (with ``out``) and remove the run's ``parts`` (its finished units, in the table now), then
    show the reference check and the summary on stdout (``show``: "table", "json", or "none" where the caller
    prints the records of several files as one JSON object); the summary's records. The table is complete before
    anything is shown, so a reader that stops reading (``| head``) leaves no unfinished run behind.

    Each record also carries the keys read, the relative error and the promise checks of its group
    (:func:`~randattn.analysis.relative_error.budget_summary`) and ``broken_promises``: a record per head whose
    promise demonstrably fails (:func:`~randattn.analysis.relative_error.broken_promises`), shown on the
    terminal as a red line each."""
    from randattn.results.summary import aggregate
    from randattn.analysis.records import reference_check_summary, table_metadata
    from randattn.analysis.relative_error import broken_promises, budget_summary
    from randattn.cli._common import err_console, out_console
    from randattn.reports.console import (
        broken_promise_lines,
        budget_table,
        positions_table,
        reference_check_line,
        summary_table,
    )
    from randattn.reports.tables import item_noun
    from randattn.results.table import positions_path, table_records, write_tables

    config, activations = job.config, job.activations
    table = tables.table
    summary = aggregate(table, seed=config.seed)
    if out is not None:
        write_tables(tables, out, table_metadata(config, activations, out, table))
        if parts is not None:
            shutil.rmtree(parts, ignore_errors=True)
        err_console.print(f"wrote {_rows_text(table)} to [bold]{out}[/] (metadata: {out.name}.meta.json)",
                          highlight=False)
        if tables.positions is not None:
            err_console.print(f"wrote {len(tables.positions)} per-position rows to [bold]{positions_path(out)}[/]",
                              highlight=False)
    check = reference_check_summary(table)  # what is measured of the table, before any of it is shown
    budget = budget_summary(table)
    broken = broken_promises(table)
    if check is not None:
        err_console.print(reference_check_line(check), highlight=False)
    keys = [c for c in ("estimator", "label", "num_samples", "tokens", "mask") if c in summary.columns]
    records = table_records(summary.merge(budget, on=keys, how="left"))
    group = ("label", "tokens", "mask")
    queries = str(config.queries)
    for record in records:  # a configuration without S (its S None) breaks its promise at each S the record repeats
        record["queries"] = queries  # the run's query selection, as each broken head's record names it
        record["broken_promises"] = [b for b in broken if all(b.get(c) == record.get(c) for c in group)
                                     and b.get("num_samples") in (None, record.get("num_samples"))]
    if show == "json":
        click.echo(json.dumps(records, indent=2))
    elif show == "table":
        noun = item_noun(activations.metadata)
        out_console.print(summary_table(summary, noun, queries))
        budget_view = budget_table(budget, noun, queries)
        if budget_view is not None:
            out_console.print(budget_view)
        for line in broken_promise_lines(broken, noun):
            out_console.print(line, highlight=False, soft_wrap=True)
        if tables.positions is not None and len(tables.positions):
            out_console.print(positions_table(tables.positions, config.seed, noun))
    return records
