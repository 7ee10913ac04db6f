"""``randattn mse`` on a terminal, between its parsed options and its exit: the output's rules applied under the
lock, the plan printed, the sweep run with a progress bar (in this process or on a Dask client), and every way it
can stop mapped to a message and an exit code (README: 0, 1, 2, 130, 143).

The computation is not here: the plan and the sweep are :mod:`randattn.analysis.sweep`, the output's rules
:mod:`randattn.analysis.store`, the metadata :mod:`randattn.analysis.records`, and what is shown is built by
:mod:`randattn.reports.console`. This module calls them, prints, and maps their errors to exit codes.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator, NoReturn

import click

__all__ = ["measure", "preflight"]


def preflight(out: Path | None, scheduler: str, *, resume: bool, force: bool) -> Any:
    """The checks that need no activations: exclusive flags, the scheduler, and (``--resume``) a damaged manifest,
    said before anything is loaded. Returns the parsed scheduler."""
    from randattn.analysis import store
    from randattn.analysis.executors import parse_scheduler
    from randattn.cli._common import abort

    if resume and force:
        abort("--resume and --force exclude each other")
    if resume and out is None:
        abort("--resume needs --out (the interrupted run's output path)")
    try:
        where = parse_scheduler(scheduler)
        if resume:
            store.check_manifest(store.parts_path(out))
    except ValueError as exc:
        abort(str(exc))
    return where


def measure(source: Path, config: Any, activations: Any, where: Any, out: Path | None, *, resume: bool,
            force: bool, dry_run: bool, as_json: bool) -> None:
    """Run (or, ``dry_run``, plan) the sweep of ``config`` on ``activations`` (read from ``source``), write ``out``
    and show the summary; exits through :func:`~randattn.cli._common.abort` on a refusal."""
    from randattn.analysis import store
    from randattn.cli._common import UserError, abort, err_console, no_space_message, writable_output

    parts = None if out is None else store.parts_path(out)
    lock = contextlib.nullcontext() if out is None or dry_run else store.sweep_lock(out)
    try:
        if out is not None:
            store.check_output_path(out, look_only=dry_run)
            if not dry_run:
                writable_output(out)
        with lock:
            if out is not None and store.check_output(out, config.identity(), resume=resume, force=force,
                                                      dry_run=dry_run):
                would = "the run would do nothing" if dry_run else "nothing to do"
                err_console.print(f"{out} already holds this run, complete; {would}", highlight=False)
                if not dry_run:
                    _finish_stored(out, config, activations, as_json)
                return
            if dry_run:  # the plan with its wall time; nothing computed for the table, nothing written
                _plan(activations, config, parts, resume, where, timing=True)
                target = "" if out is None else f" (it would write {out})"
                err_console.print(f"dry run: nothing was written; the same command without --dry-run runs it{target}",
                                  highlight=False, soft_wrap=True)
                return
            plan = None
            try:
                plan = _plan(activations, config, parts, resume, where)
                _finish(_run(activations, config, parts, resume, where, source, plan), config, activations, out,
                        as_json)
            except UserError:
                if parts is not None:
                    store.drop_empty_parts(parts)  # refused before any unit finished (memory): leave nothing behind
                raise
            except KeyboardInterrupt as exc:
                _interrupted(exc, parts, plan)
            except OSError as exc:
                if parts is None or no_space_message(exc) is None:
                    raise
                abort(no_space_message(exc) + store.kept_message(parts, _resume(), then="once there is space"))
            if parts is not None:
                shutil.rmtree(parts, ignore_errors=True)
    except (store.OutputRuleError, store.SweepLockedError) as exc:  # the output's rules (store), said as they are
        abort(str(exc))


def _resume() -> str:
    """The command that continues this run (said when a run stops with finished units kept)."""
    from randattn.analysis.records import resume_command

    return resume_command(sys.argv[1:])


def _plan(activations, config, parts, resume, where, *, timing: bool = False):
    """Plan the sweep (:func:`~randattn.analysis.sweep.plan_sweep`), print it, and refuse (exit 2) one that cannot
    fit the memory budget. Writes nothing."""
    from randattn.analysis import sweep  # looked up at call time: tests replace its functions
    from randattn.cli._common import abort, err_console
    from randattn.reports.console import plan_lines
    from randattn.reports.tables import item_noun

    try:
        plan = sweep.plan_sweep(activations, config, parts_dir=parts, resume=resume, timing=timing)
    except ValueError as exc:
        abort(str(exc))
    local = where.kind == "local"
    for line in plan_lines(plan, timing, dask=not local, noun=item_noun(activations.metadata)):
        err_console.print(line, highlight=False, soft_wrap=True)
    if plan.refused is not None:
        abort(plan.refused)
    return plan


def _run(activations, config, parts, resume, where, source, plan):
    """Run the sweep with a progress bar; its :class:`~randattn.analysis.sweep.SweepTables`. Ctrl-C and SIGTERM
    propagate (the command says what was kept)."""
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from randattn.analysis import sweep  # looked up at call time: tests replace sweep.run_sweep
    from randattn.analysis.execute import MemoryBudgetError, format_bytes
    from randattn.analysis.store import CorruptPartWarning, kept_message
    from randattn.cli._common import abort, err_console
    from randattn.reports.console import warning_lines

    budget = format_bytes(config.max_memory)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=err_console) as bar:
        task = bar.add_task("mse", total=plan.cells)

        def report(p) -> None:
            s = "" if p.num_samples is None else f" S={p.num_samples}"
            bar.update(task, completed=p.done, description=f"layer {p.layer} {p.label}{s}")

        def show(message, category, *args, **kwargs) -> None:  # a part set aside is said at once
            err_console.print(f"[yellow]warning[/]: {escape(str(message))}", highlight=False, soft_wrap=True)

        try:
            with warnings.catch_warnings(), _client(where, config.threads) as client:
                warnings.simplefilter("ignore")  # run_sweep re-issues each distinct warning once; it returns them all
                warnings.simplefilter("always", CorruptPartWarning)
                warnings.showwarning = show
                tables = sweep.run_sweep(source if client is not None else activations, config, parts_dir=parts,
                                         resume=resume, progress=report, lock=False, resume_hint="--resume",
                                         scheduler=client, with_positions=True, calibrated=plan)
        except MemoryBudgetError as exc:
            abort(str(exc))
        except MemoryError as exc:
            # numpy says what did not fit ("Unable to allocate 66.4 GiB for an array with shape ...")
            what = (str(exc).splitlines() or [""])[0] or "an allocation failed"
            abort(f"out of memory ({what}); lower --max-memory (now {budget}) so that work is split into smaller "
                  "blocks, or use fewer --samples / --replicates" + kept_message(parts, _resume()))
        except RuntimeError as exc:
            if "memory" in str(exc).lower() and ("allocate" in str(exc).lower() or "out of" in str(exc).lower()):
                abort(f"out of memory ({str(exc).splitlines()[0]}); lower --max-memory (now {budget}) or use fewer "
                      "--samples / --replicates" + kept_message(parts, _resume()))
            raise
        except (FileExistsError, ValueError) as exc:  # bad input found while running (also raised by a Dask unit)
            plain = isinstance(exc, FileExistsError) or str(exc).startswith("cannot resume")
            abort(str(exc) + ("" if plain else kept_message(parts, _resume())))
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

    try:
        manager = dask_client(where, threads=threads)
        client = manager.__enter__()
    except ValueError as exc:
        abort(str(exc))
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


def _interrupted(exc: BaseException, parts, plan) -> NoReturn:
    """Say what an interrupted (Ctrl-C, SIGTERM) run kept and how to continue it; exit 128 + the signal."""
    from randattn.analysis.store import drop_empty_parts, stored_unit_ids
    from randattn.cli._common import err_console, interrupt_exit_code
    from randattn.reports.console import interrupted_text

    stored = stored_unit_ids(parts) if parts is not None else set()
    if parts is not None and not stored:
        drop_empty_parts(parts)
    # soft_wrap: the command stays on one line, whole, for copy and paste
    err_console.print(interrupted_text(parts, stored, plan, _resume()), highlight=False, soft_wrap=True)
    raise SystemExit(interrupt_exit_code(exc)) from None


def _finish_stored(out, config, activations, as_json) -> None:
    """Show the table a finished run of the same settings left in ``out`` (``--resume`` with nothing to do)."""
    from randattn.analysis.store import coerce
    from randattn.analysis.sweep import SweepTables
    from randattn.reports.tables import read_results

    _finish(SweepTables(coerce(read_results(out).table)), config, activations, None, as_json)


def _finish(tables, config, activations, out, as_json) -> None:
    """Write the table (with ``out``), then show the reference check and the summary (``--json``: on stdout)."""
    from randattn.analysis.records import reference_check_summary, table_metadata
    from randattn.analysis.sweep import aggregate, positions_path, table_records, write_tables
    from randattn.cli._common import err_console, out_console
    from randattn.reports.console import positions_table, reference_check_line, summary_table
    from randattn.reports.tables import item_noun

    table = tables.table
    summary = aggregate(table, seed=config.seed)
    if out is not None:
        write_tables(tables, out, table_metadata(config, activations, out, table))
        err_console.print(f"wrote {len(table)} rows to [bold]{out}[/] (metadata: {out.name}.meta.json)", highlight=False)
        if tables.positions is not None:
            err_console.print(f"wrote {len(tables.positions)} per-position rows to [bold]{positions_path(out)}[/]",
                              highlight=False)
    check = reference_check_summary(table)
    if check is not None:
        err_console.print(reference_check_line(check), highlight=False)
    if as_json:
        click.echo(json.dumps(table_records(summary), indent=2))
    else:
        noun = item_noun(activations.metadata)
        out_console.print(summary_table(summary, noun))
        if tables.positions is not None and len(tables.positions):
            out_console.print(positions_table(tables.positions, config.seed, noun))
