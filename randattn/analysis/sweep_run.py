r"""Running a sweep: the planned units minus the stored ones, executed, stored, and read back as its tables.

:func:`run_sweep` plans (:mod:`randattn.analysis.sweep_plan`), takes the output's lock and checks its manifest
(:mod:`randattn.analysis.store`), runs the units still to do in this process or on Dask
(:mod:`randattn.analysis.executors`), writes each as a part (:mod:`randattn.results`) as it finishes, and returns
the canonical table (and the per-position table) with the run's warnings and timing in its ``attrs``.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from randattn._callers import outside_stacklevel
from randattn.analysis.execute import COLUMNS, PHASES, UnitRunner, run_recording
from randattn.analysis.plan import SweepConfig, SweepProgress, Unit, total_cells, with_threads
from randattn.analysis.records import activations_fingerprint
from randattn.analysis.store import prepare_parts_dir, sweep_lock
from randattn.analysis.sweep_plan import SweepPlan, as_activations, bind_layout, plan
from randattn.results import schema as _schema
from randattn.results.parts import (
    read_part_phases,
    read_part_warnings,
    read_parts,
    read_position_parts,
    set_aside_unreadable,
    stored_unit_ids,
    write_part,
)
from randattn.results.schema import POSITION_COLUMNS, coerce, coerce_positions, empty_positions, empty_table
from randattn.results.table import SweepTables

__all__ = [
    "consolidate",
    "consolidate_positions",
    "run_sweep",
    "run_sweep_tables",
    "summarize_warnings",
    "warning_text",
]


def consolidate(table, config: SweepConfig, acts=None):
    """The canonical table: duplicates dropped, sorted by layer, estimator, S, image, head."""
    return _schema.consolidate(table, [e.label for e in config.estimators], acts.images if acts is not None else ())


def consolidate_positions(positions, config: SweepConfig, acts=None):
    """The canonical per-position table: as :func:`consolidate`, then by position bucket."""
    return _schema.consolidate_positions(positions, [e.label for e in config.estimators],
                                        acts.images if acts is not None else ())


def _manifest(acts, config: SweepConfig) -> dict[str, Any]:
    """A run's manifest: ``{"config": config.identity(), "activations":``
    :func:`~randattn.analysis.records.activations_fingerprint` ``(acts)}``, stored in its parts folder and compared
    when it resumes (:func:`~randattn.analysis.store.check_output`)."""
    return {"config": config.identity(), "activations": activations_fingerprint(acts)}


def _phase_totals(totals: dict[tuple, dict[str, float]], unit: Unit, tokens: int, seconds: dict[str, float]) -> None:
    """Adds a unit's phase seconds to ``totals``, keyed by (label, S, tokens), with its unit and cell counts."""
    key = (unit.label, unit.num_samples, int(tokens))
    total = totals.setdefault(key, {"units": 0, "cells": 0, **dict.fromkeys(PHASES, 0.0)})
    total["units"] += 1
    total["cells"] += len(unit.heads)
    for phase, value in seconds.items():
        total[phase] += value


def _phase_records(totals: dict[tuple, dict[str, float]]) -> list[dict[str, Any]]:
    return [{"label": label, "num_samples": s, "tokens": tokens,
             **{k: (round(v, 4) if isinstance(v, float) else v) for k, v in total.items()}}
            for (label, s, tokens), total in totals.items()]


def summarize_warnings(records: Iterable[tuple[str, str, str, str]]) -> list[dict[str, Any]]:
    """One record per distinct warning, with how many units raised it and how many times in all.

    Parameters
    ----------
    records : iterable of (unit id, category, message, label)
        One per time a unit raised a warning (a unit may raise the same one several times: once per
        block, per S, ...).

    Returns
    -------
    list of dict
        ``{"category", "message", "label", "units", "count"}`` per distinct (category, message, label):
        ``units`` the number of distinct units that raised it, ``count`` the times it was raised in
        all; most units first.
    """
    counts: Counter = Counter()
    units: dict[tuple[str, str, str], set[str]] = {}
    for uid, category, message, label in records:
        key = (category, message, label)
        counts[key] += 1
        units.setdefault(key, set()).add(uid)
    return [{"category": c, "message": m, "label": label, "units": len(units[(c, m, label)]), "count": n}
            for (c, m, label), n in sorted(counts.items(), key=lambda item: (-len(units[item[0]]), -item[1], item[0]))]


def warning_text(record: Mapping[str, Any]) -> str:
    """A :func:`summarize_warnings` record in words: ``"<label>: <message> (raised by 8 units, 456 times in all)"``."""
    units, times = int(record["units"]), int(record["count"])
    return (f"{record['label']}: {record['message']} (raised by {units} unit{'s' * (units != 1)}, "
            f"{times} time{'s' * (times != 1)} in all)")


def _earlier_units(computed: Iterable[str], units: Sequence[Unit], parts: Path | None) -> dict[str, Unit]:
    """The units of ``units`` whose parts an earlier process wrote (stored, and not ``computed`` by this call),
    by unit id in order; none without a parts folder."""
    if parts is None:
        return {}
    by_uid = {u.uid: u for u in units}
    computed = set(computed)
    return {uid: by_uid[uid] for uid in sorted(stored_unit_ids(parts)) if uid in by_uid and uid not in computed}


def _run_warnings(raised: dict[str, tuple[str, list[tuple[str, str]]]], earlier: Mapping[str, Unit],
                  parts: Path | None) -> list[dict[str, Any]]:
    """The warnings of the whole run: those of the units this call computed (``raised``: unit id -> (label,
    its warnings)) and those stored with the parts of the ``earlier`` units (:func:`_earlier_units`,
    :func:`~randattn.results.read_part_warnings`), so a resumed run reports what its first part raised."""
    if earlier:
        for uid, stored in read_part_warnings(parts, earlier).items():
            raised[uid] = (earlier[uid].label, stored or [])  # a part of an older randattn: its warnings unknown
    return summarize_warnings((uid, c, m, label) for uid, (label, caught) in raised.items() for c, m in caught)


def _earlier_phases(phases: dict[tuple, dict[str, float]], earlier: Mapping[str, Unit], parts: Path | None,
                    tokens: int) -> int:
    """Adds to ``phases`` the phase seconds stored with the parts of the ``earlier`` units (:func:`_earlier_units`),
    so that a resumed run's ``timing`` is the whole run's; returns how many were added (a part of an older
    randattn, without them, is not)."""
    added = 0
    for uid, seconds in (read_part_phases(parts, earlier).items() if earlier else ()):
        if seconds is not None:
            _phase_totals(phases, earlier[uid], tokens, seconds)
            added += 1
    return added


def _check_memory(runner: UnitRunner, units: list[Unit]) -> None:
    """Calibrate every (configuration, S) before computing, so a unit that cannot fit is refused up front."""
    seen = set()
    for unit in units:
        key = (unit.label, unit.num_samples)
        if key not in seen:
            seen.add(key)
            runner.blocks(unit)


def run_sweep(
    activations: Any,
    config: SweepConfig,
    *,
    parts_dir: str | os.PathLike | None = None,
    resume: bool = False,
    progress: Callable[[SweepProgress], None] | None = None,
    lock: bool = True,
    resume_hint: str = "resume=True",
    scheduler: Any = None,
    with_positions: bool = False,
    calibrated: SweepPlan | None = None,
):
    r"""Run every cell of ``config`` over ``activations``; return the tidy table (and the per-position table).

    Parameters
    ----------
    activations : Activations, path or mapping
        See :func:`as_activations`. Arrays ``(images, heads, tokens, head_dim)`` per layer.
    config : SweepConfig
    parts_dir : path, optional
        Folder for incremental results (one Parquet part per finished unit plus
        ``manifest.json``). Without it results stay in memory.
    resume : bool
        Continue a sweep in ``parts_dir``: units already written are skipped. The manifest must
        match ``config`` (device and ``max_memory`` may differ).
    progress : callable, optional
        Called with a :class:`SweepProgress` after every unit (the CLI's progress bar; an
        exception raised here stops the sweep, keeping what is written).
    lock : bool
        Hold the lock of ``parts_dir`` while running (:func:`~randattn.analysis.store.sweep_lock`);
        pass False when the caller holds it already.
    resume_hint : str
        How the message of a refused non-resumed run tells the user to resume.
    scheduler : None, str or distributed.Client
        Where units run (:mod:`randattn.analysis.executors`): None or ``"local"`` (this process),
        ``"processes:N"`` (a local Dask cluster of N worker processes), ``"tcp://HOST:PORT"`` (a
        running Dask scheduler) or a ``distributed.Client``. With Dask, ``activations`` must be a
        path that every worker can read. The table is the same whatever the scheduler.
    with_positions : bool
        Return a :class:`SweepTables`, with the per-position table of the layers that get one
        (:meth:`SweepConfig.positions_of`; :func:`run_sweep_tables` does the same), instead of the
        table alone.
    calibrated : SweepPlan, optional
        :func:`plan_sweep`'s plan of this very sweep (same activations and config): its memory
        calibration is reused instead of measured again, and its refusal raised.

    Returns
    -------
    pandas.DataFrame or SweepTables
        The table: columns :data:`COLUMNS`, one row per (image, layer, head, estimator config, S), sorted.
        ``table.attrs["warnings"]`` lists the distinct warnings the estimators raised, with the
        number of units that raised each and the times it was raised (:func:`summarize_warnings`):
        those of every unit of the table, a resumed run's included (each part stores its unit's
        warnings, on Dask too); each is also re-issued once (:func:`warning_text`), carrying its
        record as the warning's ``record`` attribute.
        ``table.attrs["timing"]`` gives the units run by this call and the wall seconds they
        took (``execute_s``: computing and storing them, not start-up or memory calibration),
        and ``phases``: per (label, num_samples, tokens), the units and cells run and the
        seconds of each phase of :data:`~randattn.analysis.execute.PHASES`, summed (on Dask, as
        each worker measured them) over every unit of the table: a resumed run's include those an
        earlier process computed, as their parts stored them (``earlier_units`` of them). With
        ``with_positions``, :class:`SweepTables` whose
        ``positions`` is the per-position table of the layers that get one, else None; read back
        from the parts folder like the table, so a resumed run's is the same too.
        ``table.attrs["set_aside"]``: the stored parts that could not be read, each
        ``{"file", "moved_to", "reason"}`` (:func:`~randattn.results.set_aside_unreadable`);
        their units were computed again.

    Raises
    ------
    MemoryBudgetError
        One (cell, replicate) of some unit needs more than ``config.max_memory`` (raised before
        any unit is computed).
    SweepLockedError
        Another process is writing ``parts_dir``.
    OSError
        A write failed; its ``filename`` is the file meant (a part, the manifest), never a
        temporary name, and its ``errno`` says why (``ENOSPC``, ``EDQUOT``, ``EFBIG``: no space).
        Finished parts stay for a resume.

    Warns
    -----
    CorruptPartWarning
        Resuming, a stored part could not be read: it is set aside into ``parts_dir/corrupt/`` and
        its unit computed again.

    Notes
    -----
    Metrics: :func:`randattn.analysis.metrics.replicate_metrics` against exact float64 softmax
    attention; ``rel_error`` from :func:`~randattn.analysis.metrics.relative_error`;
    ``prob_mse`` from the estimator evaluated with ``v = I_M`` (all catalogue estimators are
    linear in v given the draws): the mean over replicates of the per-replicate squared error
    summed over (n, m), divided by N M (for RFA's positive maps and LARA at 16 S <= N, from the
    probabilities' rank-S factors without forming them, where a rounding bound shows the change
    below 1e-3 of the error: :mod:`randattn.analysis.probability_error`); ``ess_mean``, ``delta_var_ratio`` (delta-method variance
    / replicate variance) and ``pareto_khat`` from :mod:`randattn.analysis.diagnostics` (NaN
    where not available); ``dtype`` is the precision the estimator ran in; ``ref_max_abs_dev``
    is ``max |batched - reference|`` on the first cell and replicate of the units chosen by
    ``config.check_reference`` (NaN elsewhere); ``sink_mass`` is the cell's exact attention probability on
    key 0 averaged over its queries (float64; the attention sink of a language model's first token).
    Deterministic estimators run one replicate.

    Under a mask every estimator call, the exact reference and its probabilities apply it
    (:func:`~randattn.analysis.execute.exact_under_mask`): hidden probabilities are 0 in both
    estimate and truth, so they add nothing to ``prob_mse``, which still divides by N M; the
    importance-sampling diagnostics are NaN, with a :class:`~randattn.analysis.execute.DiagnosticsSkippedWarning`
    saying why, where the spec's weight provider takes no mask. The per-position metrics are
    those of the table's row restricted to a bucket's queries (:mod:`randattn.analysis.positions`).
    """
    tables = _run_sweep(activations, config, parts_dir=parts_dir, resume=resume, progress=progress, lock=lock,
                        resume_hint=resume_hint, scheduler=scheduler, calibrated=calibrated)
    return tables if with_positions else tables.table


def run_sweep_tables(activations: Any, config: SweepConfig, **options: Any) -> SweepTables:
    """:func:`run_sweep` with ``with_positions=True``: the table and the per-position table, as :class:`SweepTables`.

    Parameters
    ----------
    activations : Activations, path or mapping
    config : SweepConfig
    **options
        ``parts_dir``, ``resume``, ``progress``, ``lock``, ``resume_hint``, ``scheduler``, ``calibrated``: as
        :func:`run_sweep`.
    """
    return _run_sweep(activations, config, **options)


def _run_sweep(activations: Any, config: SweepConfig, *, parts_dir: str | os.PathLike | None = None,
               resume: bool = False, progress: Callable[[SweepProgress], None] | None = None, lock: bool = True,
               resume_hint: str = "resume=True", scheduler: Any = None,
               calibrated: SweepPlan | None = None) -> SweepTables:
    """:func:`run_sweep`'s work; the warnings it re-issues point at the first caller outside randattn."""
    import pandas as pd

    acts = as_activations(activations)
    config = with_threads(bind_layout(config, acts))
    if calibrated is not None and calibrated.config != config:
        raise ValueError("calibrated: that plan is of another configuration; plan_sweep this one")
    if calibrated is not None and calibrated.refused is not None:
        raise calibrated.refused  # before anything is written
    units = plan(acts, config)
    parts = Path(parts_dir) if parts_dir is not None else None
    context = sweep_lock(parts) if parts is not None and lock else nullcontext()
    with context:
        stored: set[str] = set()
        set_aside: list[dict[str, str]] = []
        if parts is not None:
            prepare_parts_dir(parts, _manifest(acts, config), resume, resume_hint)
            if resume:
                set_aside = set_aside_unreadable(parts)  # warns CorruptPartWarning for each
            stored = stored_unit_ids(parts)
        todo = [u for u in units if u.uid not in stored]
        runner = calibrated.runner if calibrated is not None else UnitRunner(acts, config)
        _check_memory(runner, todo)  # with a calibrated plan: measured already, so only the units set aside since
        total = total_cells(units)
        state = {"finished": total - total_cells(todo), "t0": time.perf_counter()}
        new_rows: list[dict[str, Any]] = []
        new_positions: list[dict[str, Any]] = []
        raised: dict[str, tuple[str, list[tuple[str, str]]]] = {}  # unit id -> (label, its warnings)
        phases: dict[tuple, dict[str, float]] = {}

        def done(unit: Unit, rows: list[dict[str, Any]], unit_warnings: list[tuple[str, str]],
                 seconds: dict[str, float], positions: list[dict[str, Any]] | None = None) -> None:
            new_rows.extend(rows)
            new_positions.extend(positions or ())
            if rows:
                _phase_totals(phases, unit, rows[0]["tokens"], seconds)
            raised[unit.uid] = (unit.label, list(unit_warnings))  # a unit computed again replaces its first run's
            state["finished"] += len(unit.heads)
            if progress is not None:
                now = time.perf_counter()
                progress(SweepProgress(state["finished"], total, unit.layer, unit.label, unit.num_samples,
                                       len(unit.heads), now - state["t0"]))
                state["t0"] = now

        started = time.perf_counter()
        _execute(runner, todo, parts, activations, config, scheduler, done)
        executed_s = time.perf_counter() - started
        if parts is not None:
            # exactly what is on disk, so a resumed run matches bit for bit; a part whose footer was whole but
            # whose data is not (found only by reading it) is set aside and its unit computed again, once
            table, positions, damaged = _read_stored(parts)
            if damaged:
                set_aside += damaged
                redo = [u for u in units if u.uid not in stored_unit_ids(parts)]
                state["finished"] -= total_cells(redo)
                started = time.perf_counter()
                _execute(runner, redo, parts, activations, config, scheduler, done)
                executed_s += time.perf_counter() - started
                table, positions = read_parts(parts), read_position_parts(parts)
                todo += redo
        else:
            table = coerce(pd.DataFrame(new_rows, columns=list(COLUMNS))) if new_rows else empty_table()
            positions = (coerce_positions(pd.DataFrame(new_positions, columns=list(POSITION_COLUMNS)))
                         if new_positions else empty_positions())
    table = consolidate(table, config, acts)
    any_positions = any(config.positions_of(layer) is not None for layer in {u.layer for u in units})
    positions = consolidate_positions(positions, config, acts) if any_positions else None
    earlier = _earlier_units(raised, units, parts)
    table.attrs["warnings"] = _run_warnings(raised, earlier, parts)
    # wall time of running the units (writing their parts included), apart from start-up and memory calibration;
    # and where it went, per (configuration, S, tokens): the seconds of each phase of execute.PHASES, summed
    table.attrs["timing"] = {"units": len(todo), "execute_s": round(executed_s, 3),
                             "earlier_units": _earlier_phases(phases, earlier, parts, int(acts.shape[2])),
                             "phases": _phase_records(phases)}
    table.attrs["set_aside"] = set_aside
    for record in table.attrs["warnings"]:
        reissued = _warning_category(record["category"])(warning_text(record))
        reissued.record = record  # a caller that catches it (the demo) can merge the counts of several sweeps
        warnings.warn(reissued, stacklevel=outside_stacklevel())
    return SweepTables(table, positions)


def _read_stored(parts: Path):
    """``(table, positions, set_aside)`` of the parts on disk; a part that cannot be read whole is set aside (then
    the tables are not read: the caller computes the units set aside again and reads once more)."""
    try:
        return read_parts(parts), read_position_parts(parts), []
    except Exception:  # pyarrow's errors for a damaged file: find which, by reading each whole
        damaged = set_aside_unreadable(parts, full=True)
        if not damaged:
            raise
        return None, None, damaged


def _execute(runner: UnitRunner, units: list[Unit], parts: Path | None, activations: Any, config: SweepConfig,
             scheduler: Any, done: Callable[..., None]) -> None:
    """Run ``units`` in this process or on Dask, calling ``done(unit, rows, warnings)`` as each finishes."""
    from randattn.analysis.executors import Scheduler, dask_client, parse_scheduler, run_units_dask

    if not units:
        return
    client = None if scheduler is None or isinstance(scheduler, (str, Scheduler)) else scheduler
    spec = None if client is not None else (scheduler if isinstance(scheduler, Scheduler) else parse_scheduler(scheduler))
    if client is None and spec.kind == "local":
        for unit in units:
            rows, unit_warnings, seconds, positions = run_recording(runner, unit)
            if parts is not None:
                write_part(parts, unit.uid, rows, positions, unit_warnings, seconds)
            done(unit, rows, unit_warnings, seconds, positions)
        return
    if not isinstance(activations, (str, os.PathLike)):
        raise ValueError("a Dask scheduler needs the activations as a file path that every worker can read")
    if client is not None:
        run_units_dask(client, activations, config, units, parts, on_done=done)
        return
    with dask_client(spec, threads=config.threads) as own:
        run_units_dask(own, activations, config, units, parts, on_done=done)


def _warning_category(name: str) -> type[Warning]:
    """The warning class called ``name`` (builtins, the SNIS skeleton's or the sweep's own), else UserWarning."""
    import builtins

    from randattn.analysis import execute
    from randattn.estimators import snis

    for where in (builtins, snis, execute):
        category = getattr(where, name, None)
        if isinstance(category, type) and issubclass(category, Warning):
            return category
    return UserWarning
