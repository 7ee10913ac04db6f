r"""Sweeps: estimators x parameter variants x sample counts x replicates over an activation set.

One **cell** is one (image, layer, head) input with one estimator configuration and one sample
count S; it yields one row of the tidy table (:data:`COLUMNS`). The sweep is planned as
**units** -- the cells of one (layer, estimator configuration, S, image) over the selected
heads -- which are executed, stored and resumed independently (ARCHITECTURE sec. 11):

- :mod:`randattn.analysis.plan`: configurations, cell seeds, units (pure);
- :mod:`randattn.analysis.execute`: ``UnitRunner.run(unit) -> rows`` (torch batched by default,
  or the float64 reference), vectorized over heads and replicates under a memory budget;
- :mod:`randattn.analysis.store`: one Parquet part per finished unit, written atomically,
  a manifest, a lock, consolidation into the canonical table;
- this module: :func:`run_sweep` (plan minus stored units -> executor -> store), aggregation
  and output.

Masks
-----
A run may measure its layers under a causal or sliding-window mask
(:attr:`SweepConfig.mask`, :mod:`randattn.analysis.masking`): estimators, the exact reference
and the probabilities apply it, an estimator whose spec does not support a layer's mask is
refused by name when the sweep is planned, and the table's ``mask`` column records each row's.
Masked layers also get per-position metrics (:mod:`randattn.analysis.positions`), which
:func:`run_sweep_tables` returns beside the table and :func:`write_tables` stores beside it.

Reproducibility
---------------
Each cell's seed is derived from the master seed and the cell's identity alone
(:func:`cell_seed`), and replicate r of a cell draws from
``np.random.default_rng(np.random.SeedSequence(cell_seed, spawn_key=(r,)))``. A unit's rows
are therefore independent of the memory budget, the order units run in, the executor, and of
an interruption: a resumed sweep gives the same table, bit for bit, as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from randattn._callers import outside_stacklevel
from randattn._files import atomic_path
from randattn._validation import check_positive_int
from randattn.analysis.execute import (
    COLUMNS,
    PHASES,
    MemoryBudgetError,
    UnitRunner,
    run_recording,
)
from randattn.analysis.plan import (
    BACKENDS,
    DTYPES,
    EstimatorConfig,
    SweepConfig,
    SweepProgress,
    Unit,
    bind_token_layout,
    cell_seed,
    with_threads,
    estimator_config,
    parse_estimator_list,
    plan_units,
    replicate_rng,
    select,
    total_cells,
)
from randattn.analysis.positions import POSITION_COLUMNS
from randattn.analysis.store import (
    OUTPUT_FORMATS,
    SweepLockedError,
    empty_positions,
    empty_table,
    named_write_errors,
    prepare_parts_dir,
    read_parts,
    read_position_parts,
    set_aside_unreadable,
    stored_unit_ids,
    sweep_lock,
    unreadable_parts,
    write_part,
)
from randattn.analysis import store as _store

__all__ = [
    "COLUMNS",
    "BACKENDS",
    "DTYPES",
    "EstimatorConfig",
    "SweepConfig",
    "SweepProgress",
    "MemoryBudgetError",
    "SweepLockedError",
    "estimator_config",
    "parse_estimator_list",
    "cell_seed",
    "replicate_rng",
    "POSITION_COLUMNS",
    "SweepTables",
    "SweepPlan",
    "plan",
    "plan_sweep",
    "run_sweep",
    "run_sweep_tables",
    "read_parts",
    "read_position_parts",
    "consolidate",
    "consolidate_positions",
    "aggregate",
    "as_activations",
    "count_cells",
    "write_table",
    "write_tables",
    "positions_path",
    "table_records",
    "summarize_warnings",
    "warning_text",
]


# ------------------------------------------------------------------------------------------------------ activations
def as_activations(source: Any, *, scale: float | None = None):
    """Adapter: an :class:`~randattn.activations.Activations`, a path, or ``{layer: (q, k, v)}`` arrays.

    Plain arrays are ``(images, heads, tokens, head_dim)`` per layer; ``scale`` is then required.
    """
    from randattn.activations import Activations, load_activations, make_activations

    if isinstance(source, Activations):
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_activations(source)
    if isinstance(source, Mapping):
        if scale is None:
            raise ValueError("scale is required with plain arrays (the softmax temperature, e.g. head_dim ** -0.5)")
        return make_activations(source, {"scale": float(scale)})
    raise TypeError(f"expected Activations, a path or a mapping of arrays, got {type(source).__name__}")



# ------------------------------------------------------------------------------------------------------- the engine
def plan(activations: Any, config: SweepConfig) -> list[Unit]:
    """Every unit of ``config`` over ``activations``, in canonical order; validates the selection and the masks.

    Raises
    ------
    ValueError
        A selected layer, head or image the activations do not hold; a layer without a mask in a
        per-layer mask; an estimator that does not support a selected layer's mask (named, with
        its spec's reason: :func:`~randattn.analysis.masking.check_estimator_masks`); a query selection
        the run cannot measure (:func:`~randattn.analysis.queries.check_query_selection`: K > N, a
        sample under a mask, a token layout on a subset without a mask).
    """
    from randattn.analysis.queries import check_query_selection

    acts = as_activations(activations)
    if not isinstance(config, SweepConfig):
        raise TypeError(f"config must be a SweepConfig, got {type(config).__name__}")
    units = plan_units(acts.layers, acts.shape[1], acts.images, config)
    kinds = {layer: config.mask_of(layer) for layer in select("layers", config.layers, list(acts.layers))}
    check_query_selection(config.queries, int(acts.shape[2]), kinds, config.estimators, config.seed)
    _check_masks(acts, bind_layout(config, acts))  # with the patch grid the run will use (windows under a mask)
    return units


def _check_masks(acts, config: SweepConfig) -> None:
    """Refuse, before anything runs, every estimator configuration that cannot run under a selected layer's mask.

    Beyond the spec's declared masks, each configuration draws once for one head under each mask
    (a few arrays, no estimate): a parameter with no masked form (e.g. a feature map fitted from
    every key) is refused there, by the estimator's own message.
    """
    from randattn.analysis.masking import check_estimator_masks
    from randattn.estimators.masks import Mask
    from randattn.estimators.registry import get_spec

    kinds = {layer: config.mask_of(layer) for layer in select("layers", config.layers, list(acts.layers))}
    if all(kind is None for kind in kinds.values()):
        return
    _, _, n, d = acts.shape
    rows = config.query_rows(n)
    queries = n if rows is None else len(rows)  # the estimators see the measured queries and every key
    for est in config.estimators:
        spec = get_spec(est.name)
        samples = min(config.num_samples) if est.needs_samples else None  # the smallest draw says as much

        def probe(kind: str, spec=spec, est=est, samples=samples) -> None:
            spec.draw((1, queries, d), (1, n, d), num_samples=samples, replicates=1, rng=np.random.default_rng(0),
                      **est.params, **Mask.parse(kind).estimator_kwargs)

        check_estimator_masks(spec, est.label, kinds, isinstance(config.mask, tuple), probe)


def bind_layout(config: SweepConfig, acts) -> SweepConfig:
    """``config`` with every estimator bound to the activations' patch grid (:func:`~randattn.analysis.plan.bind_token_layout`)."""
    from dataclasses import replace

    grid = getattr(acts, "grid", None)
    prefix = int(getattr(acts, "prefix_tokens", 0) or 0)
    bound = tuple(bind_token_layout(e, grid, prefix) for e in config.estimators)
    return config if bound == config.estimators and all(
        a.params_json == b.params_json for a, b in zip(bound, config.estimators)) else replace(config, estimators=bound)


def count_cells(activations: Any, config: SweepConfig) -> int:
    """Number of (image, layer, head, estimator config, S-group) cells ``config`` runs; validates the selection.

    Raises
    ------
    ValueError
        A selected layer, head or image that the activations do not hold.
    """
    return total_cells(plan(activations, config))


def consolidate(table, config: SweepConfig, acts=None):
    """The canonical table: duplicates dropped, sorted by layer, estimator, S, image, head."""
    return _store.consolidate(table, [e.label for e in config.estimators], acts.images if acts is not None else ())


def consolidate_positions(positions, config: SweepConfig, acts=None):
    """The canonical per-position table: as :func:`consolidate`, then by position bucket."""
    return _store.consolidate_positions(positions, [e.label for e in config.estimators],
                                        acts.images if acts is not None else ())


def _fingerprint(acts) -> dict[str, Any]:
    return {"shape": list(acts.shape), "layers": list(acts.layers), "images": list(acts.images),
            "model": acts.metadata.get("model"), "scale": acts.scale}


def _manifest(acts, config: SweepConfig) -> dict[str, Any]:
    return {"config": config.identity(), "activations": _fingerprint(acts)}


def _phase_totals(totals: dict[tuple, dict[str, float]], unit: Unit, rows: list[dict[str, Any]],
                  seconds: dict[str, float]) -> None:
    """Adds a unit's phase seconds to ``totals``, keyed by (label, S, tokens), with its unit and cell counts."""
    if not rows:
        return
    key = (unit.label, unit.num_samples, int(rows[0]["tokens"]))
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


def _run_warnings(raised: dict[str, tuple[str, list[tuple[str, str]]]], units: Sequence[Unit],
                  parts: Path | None) -> list[dict[str, Any]]:
    """The warnings of the whole run: those of the units this call computed (``raised``: unit id -> (label,
    its warnings)) and, with a parts folder, those stored with the parts of units an earlier process computed
    (:func:`~randattn.analysis.store.read_part_warnings`), so a resumed run reports what its first part raised."""
    if parts is not None:
        by_uid = {u.uid: u for u in units}
        earlier = sorted(uid for uid in stored_unit_ids(parts) if uid in by_uid and uid not in raised)
        for uid, stored in _store.read_part_warnings(parts, earlier).items():
            raised[uid] = (by_uid[uid].label, stored or [])  # a part of an older randattn: its warnings unknown
    return summarize_warnings((uid, c, m, label) for uid, (label, caught) in raised.items() for c, m in caught)


def _check_memory(runner: UnitRunner, units: list[Unit]) -> None:
    """Calibrate every (configuration, S) before computing, so a unit that cannot fit is refused up front."""
    seen = set()
    for unit in units:
        key = (unit.label, unit.num_samples)
        if key not in seen:
            seen.add(key)
            runner.blocks(unit)


@dataclass(frozen=True)
class SweepPlan:
    """What a sweep will do, worked out before it does it (:func:`plan_sweep`).

    Attributes
    ----------
    config : SweepConfig
        The configuration, bound to the activations (token layout, threads).
    units : tuple of Unit
        Every unit, in canonical order.
    todo : tuple of Unit
        The units still to compute (all of them, unless resuming).
    unreadable : tuple of str
        Stored parts that cannot be read: the sweep sets them aside and computes their units again
        (they are in ``todo``).
    layers, heads : tuple of int
    images : tuple of str
        The selection.
    peak_bytes : int
        The memory model's estimate of the largest block of estimator work among ``todo``
        (:meth:`~randattn.analysis.execute.UnitRunner.block_bytes`; the activations and the
        interpreter come on top).
    split_units : int
        Units of ``todo`` that the budget splits below the canonical block of every head x every
        replicate (their rows may then differ by rounding from a larger budget's:
        :data:`~randattn.analysis.cell_memory.SPLIT_ROUNDING`).
    refused : MemoryBudgetError or None
        Why the sweep will be refused before computing (a unit cannot fit ``max_memory``): the error that
        :func:`run_sweep` raises with this plan, else None.
    seconds : float or None
        Estimated wall seconds of computing ``todo`` in this process (``timing=True``), else None.
    timed_heads : tuple of int
        The head counts that were timed for ``seconds``: one, and two where a unit has more heads.
    """

    config: SweepConfig
    units: tuple
    todo: tuple
    unreadable: tuple
    layers: tuple
    heads: tuple
    images: tuple
    peak_bytes: int
    split_units: int
    refused: MemoryBudgetError | None
    seconds: float | None = None
    timed_heads: tuple = ()
    runner: Any = field(default=None, repr=False, compare=False)  # calibrated; run_sweep reuses it

    @property
    def cells(self) -> int:
        """Cells of the whole sweep (one per unit and head)."""
        return total_cells(self.units)

    @property
    def todo_cells(self) -> int:
        """Cells still to compute."""
        return total_cells(self.todo)


@contextmanager
def _pinned_threads(runner: UnitRunner):
    """For the block, torch computes with the sweep's intra-op threads (as :meth:`UnitRunner.run_timed` does)."""
    torch, threads = runner.torch, runner.config.threads
    if torch is None or threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def plan_sweep(activations: Any, config: SweepConfig, *, parts_dir: str | os.PathLike | None = None,
               resume: bool = False, timing: bool = False) -> SweepPlan:
    """Plan a sweep without running it or writing anything: its units, memory and (``timing``) wall time.

    Parameters
    ----------
    activations : Activations, path or mapping
        See :func:`as_activations`.
    config : SweepConfig
    parts_dir : path, optional
        With ``resume``: the parts folder whose finished units are not computed again (read only).
    resume : bool
    timing : bool
        Estimate the wall time: for each (configuration, S, mask) still to compute, one head of its
        first unit is computed (and two heads, where units have more), timed, and the time of a unit
        taken as linear in its heads; one head is computed untimed first (first calls, lazy imports).
        Those results are dropped. Costs about 4 / (heads x layers x images) of the sweep.

    Returns
    -------
    SweepPlan
        Its ``runner`` holds the memory calibration, which :func:`run_sweep` reuses when given the
        plan (``calibrated=``).

    Raises
    ------
    ValueError
        A selection or mask the activations refuse (as :func:`plan`). A unit that cannot fit the
        budget is not raised but reported in ``refused``.
    """
    from dataclasses import replace

    acts = as_activations(activations)
    config = with_threads(bind_layout(config, acts))
    units = plan(acts, config)
    unreadable: dict = {}
    stored: set[str] = set()
    if parts_dir is not None and resume:
        unreadable = unreadable_parts(parts_dir)
        stored = stored_unit_ids(parts_dir)
        stored -= {_store.unit_id_of(path) for path in unreadable}  # a per-position part takes its unit along
    todo = tuple(u for u in units if u.uid not in stored)
    runner = UnitRunner(acts, config)
    peak, split, refused = 0, 0, None
    first_of: dict[tuple, Unit] = {}
    for unit in todo:
        first_of.setdefault((unit.label, unit.num_samples, config.mask_of(unit.layer)), unit)
    layout: dict[tuple, tuple[int, bool]] = {}
    with _pinned_threads(runner):  # calibrated as it runs: with the run's threads (a small machine's cores are few)
        for key, unit in first_of.items():
            try:
                blocks = runner.blocks(unit)
            except MemoryBudgetError as exc:
                refused = refused or exc
                peak = max(peak, runner.cell_bytes(unit))
                continue
            cells, reps = blocks[0]
            canonical = (cells.stop - cells.start == len(unit.heads)
                         and reps.stop - reps.start == runner.replicates(config.estimators[unit.est_index]))
            layout[key] = (runner.block_bytes(unit, cells.stop - cells.start, reps.stop - reps.start), canonical)
    for unit in todo:
        bytes_, canonical = layout.get((unit.label, unit.num_samples, config.mask_of(unit.layer)), (0, True))
        peak = max(peak, bytes_)
        split += not canonical
    seconds, timed = None, ()
    if timing and refused is None and todo:
        seconds, timed = 0.0, (1, 2) if len(todo[0].heads) > 1 else (1,)
        per_unit = {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the run reports warnings; a timing run says nothing
            first = todo[0]  # untimed: what a run does once (lazy imports, first calls) is not a unit's time
            runner.run(replace(first, heads=first.heads[:1], seeds=first.seeds[:1], check_reference=False))
            for key, unit in first_of.items():
                times = []
                for h in timed:
                    sub = replace(unit, heads=unit.heads[:h], seeds=unit.seeds[:h], check_reference=False)
                    start = time.perf_counter()
                    runner.run(sub)
                    times.append(time.perf_counter() - start)
                slope = max(times[-1] - times[0], 0.0) if len(times) > 1 else times[0]
                per_unit[key] = times[0] + slope * (len(unit.heads) - 1)
        for unit in todo:
            seconds += per_unit[(unit.label, unit.num_samples, config.mask_of(unit.layer))]
    acts_layers = select("layers", config.layers, list(acts.layers))
    heads = select("heads", config.heads, range(acts.shape[1]))
    images = tuple(acts.images[i] for i in select("images", config.images, range(len(acts.images))))
    return SweepPlan(config, tuple(units), todo, tuple(str(p) for p in unreadable), tuple(acts_layers),
                     tuple(heads), images, int(peak), int(split), refused, seconds, timed, runner)


@dataclass(frozen=True)
class SweepTables:
    """What a sweep returns: its table and, where it measured any, its per-position table.

    Attributes
    ----------
    table : pandas.DataFrame
        :func:`run_sweep`'s table (:data:`COLUMNS`).
    positions : pandas.DataFrame or None
        One row per (cell, position bucket) (:data:`POSITION_COLUMNS`), sorted like the table and then
        by bucket; None when no layer of the run gets per-position metrics
        (:meth:`SweepConfig.positions_of`).
    """

    table: Any
    positions: Any = None


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
        each worker measured them). With ``with_positions``, :class:`SweepTables` whose
        ``positions`` is the per-position table of the layers that get one, else None; read back
        from the parts folder like the table, so a resumed run's is the same too.
        ``table.attrs["set_aside"]``: the stored parts that could not be read, each
        ``{"file", "moved_to", "reason"}`` (:func:`~randattn.analysis.store.set_aside_unreadable`);
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
            _phase_totals(phases, unit, rows, seconds)
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
            table = _store.coerce(pd.DataFrame(new_rows, columns=list(COLUMNS))) if new_rows else empty_table()
            positions = (_store.coerce_positions(pd.DataFrame(new_positions, columns=list(POSITION_COLUMNS)))
                         if new_positions else empty_positions())
    table = consolidate(table, config, acts)
    any_positions = any(config.positions_of(layer) is not None for layer in {u.layer for u in units})
    positions = consolidate_positions(positions, config, acts) if any_positions else None
    table.attrs["warnings"] = _run_warnings(raised, units, parts)
    # wall time of running the units (writing their parts included), apart from start-up and memory calibration;
    # and where it went, per (configuration, S, tokens): the seconds of each phase of execute.PHASES, summed
    table.attrs["timing"] = {"units": len(todo), "execute_s": round(executed_s, 3), "phases": _phase_records(phases)}
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
                write_part(parts, unit.uid, rows, positions, unit_warnings)
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


# ------------------------------------------------------------------------------------------------------ aggregation
def _bootstrap_mean_ci(values: np.ndarray, rng: np.random.Generator, n_boot: int, level: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size < 2:
        return math.nan, math.nan
    idx = rng.integers(0, values.size, size=(n_boot, values.size))
    means = values[idx].mean(1)
    alpha = 0.5 * (1.0 - level)
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def aggregate(table, *, level: float = 0.95, n_boot: int = 2000, seed: int = 0, by: Sequence[str] = ()):
    r"""Summarize a sweep table like LARA app. H.1, with bootstrap confidence intervals.

    Per (layer, head, image) row -> mean over heads, then over layers, per image -> mean over
    images. The CI is a percentile bootstrap over images (resampling the per-image means), or
    over heads (the per-head means over layers) when the table holds a single image.

    Parameters
    ----------
    table : pandas.DataFrame
        A sweep table (:data:`COLUMNS`).
    level : float
        CI level.
    n_boot : int
        Bootstrap resamples.
    seed : int
        Seed of the bootstrap (each group gets ``SeedSequence(seed, spawn_key=(group index,))``).
    by : sequence of str
        More grouping columns (e.g. ``("position_lo", "position_hi")`` for a per-position table).

    Returns
    -------
    pandas.DataFrame
        One row per (estimator, label, num_samples, tokens[, mask][, *by]) -- ``mask`` when the table
        has that column, so that rows of differently masked runs are never averaged together -- with
        ``mse, mse_lo, mse_hi,
        bias_sq, bias_sq_lo, bias_sq_hi, variance, variance_lo, variance_hi, units, ci_over``
        (``units``: the number of images, or heads, bootstrapped; CIs are NaN with one unit).
    """
    import pandas as pd

    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    check_positive_int("n_boot", n_boot)
    metrics = ["mse", "bias_sq", "variance"]
    keys = ["estimator", "label", "num_samples", "tokens", *(["mask"] if "mask" in table.columns else []), *by]
    missing = [c for c in dict.fromkeys(keys + metrics + ["image", "layer", "head"]) if c not in table.columns]
    if missing:
        raise ValueError(f"table lacks column(s) {missing}; expected a sweep table")
    records = []
    for gi, (key, frame) in enumerate(table.groupby(keys, sort=False)):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(gi,)))
        per_layer = frame.groupby(["image", "layer"], sort=False)[metrics].mean()  # mean over heads
        per_image = per_layer.groupby(level="image", sort=False).mean()  # mean over layers
        if len(per_image) > 1:
            units, over = per_image, "images"
        else:
            units = frame.groupby("head", sort=False)[metrics].mean()  # per head, mean over layers
            over = "heads"
        record = dict(zip(keys, key))
        for metric in metrics:
            record[metric] = float(per_image[metric].mean())
            lo, hi = _bootstrap_mean_ci(units[metric].to_numpy(dtype=np.float64), rng, n_boot, level)
            record[f"{metric}_lo"], record[f"{metric}_hi"] = lo, hi
        record["units"] = int(len(units))
        record["ci_over"] = over
        records.append(record)
    columns = keys + ["mse", "mse_lo", "mse_hi", "bias_sq", "bias_sq_lo", "bias_sq_hi",
                      "variance", "variance_lo", "variance_hi", "units", "ci_over"]
    return pd.DataFrame.from_records(records, columns=columns)


# ------------------------------------------------------------------------------------------------------------ output
def table_records(table) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts: numpy scalars become Python ones, NaN and inf become None (exact floats)."""
    records = []
    for record in table.to_dict(orient="records"):
        clean = {}
        for key, value in record.items():
            if isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            clean[key] = value
        records.append(clean)
    return records


def positions_path(path: str | os.PathLike) -> Path:
    """Where the per-position table of the table at ``path`` lives: ``mse.parquet`` -> ``mse.positions.parquet``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.positions{path.suffix}")


def write_tables(tables: SweepTables, path: str | os.PathLike, metadata: Mapping[str, Any]) -> list[Path]:
    """Write a sweep's table to ``path`` and its per-position table beside it (:func:`positions_path`).

    Both in ``path``'s format, each with its metadata (:func:`write_table`); the per-position table's
    metadata adds ``"positions_of"``: the table it belongs to. A run without per-position metrics
    removes a per-position table left at that path by an earlier run, so that a report never pairs a
    table with another run's positions. Every file is first written under a temporary name and all
    are renamed into place only once all are written: a failed write (a full disk) leaves each output
    as it was, never a table without its metadata or its per-position table.

    Returns
    -------
    list of Path
        The files written (tables and sidecars).

    Raises
    ------
    OSError
        A write failed; its ``filename`` is the output file meant (not a temporary name).
    """
    path = Path(path)
    beside = positions_path(path)
    outputs = [(tables.table, path, metadata)]
    if tables.positions is not None:
        outputs.append((tables.positions, beside, {**dict(metadata), "positions_of": path.name}))
    written = _write_together(outputs)
    if tables.positions is None:
        for stale in (beside, beside.with_name(beside.name + ".meta.json")):
            stale.unlink(missing_ok=True)
    return written


def write_table(table, path: str | os.PathLike, metadata: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``table`` to ``path`` (``.parquet``, ``.csv`` or ``.json`` records) and ``metadata`` beside it.

    The metadata (master seed, command line, randattn version, config, ...) goes to the sidecar
    ``<path>.meta.json`` for every format, and for parquet also into the file's schema metadata
    under the key ``randattn``. Both are written under temporary names and renamed into place
    together, once both are written.

    Returns
    -------
    (table path, sidecar path)

    Raises
    ------
    OSError
        A write failed; its ``filename`` is the output file meant (not a temporary name).
    """
    table_path, sidecar = _write_together([(table, Path(path), metadata)])
    return table_path, sidecar


def _write_together(outputs: Sequence[tuple[Any, Path, Mapping[str, Any]]]) -> list[Path]:
    """Write each ``(table, path, metadata)`` and its sidecar; rename them all into place only when all are written."""
    from contextlib import ExitStack

    for _, path, _ in outputs:
        if path.suffix.lower() not in OUTPUT_FORMATS:
            raise ValueError(f"output {str(path)!r}: unknown suffix {path.suffix!r}; use one of {list(OUTPUT_FORMATS)}")
    written: list[Path] = []
    with ExitStack() as renames:  # on leaving, each atomic_path renames its file into place (or, failing, removes it)
        for table, path, metadata in outputs:
            text = json.dumps(dict(metadata), indent=2, sort_keys=True, default=str)
            with named_write_errors(path):
                _write_format(table, renames.enter_context(atomic_path(path)), path.suffix.lower(), text)
            sidecar = path.with_name(path.name + ".meta.json")
            with named_write_errors(sidecar):
                renames.enter_context(atomic_path(sidecar)).write_text(text, encoding="utf-8")
            written += [path, sidecar]
    return written


def _write_format(table, tmp: Path, suffix: str, text: str) -> None:
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrow = pa.Table.from_pandas(table, preserve_index=False)
        arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}), b"randattn": text.encode()})
        pq.write_table(arrow, tmp)
    elif suffix == ".csv":
        table.to_csv(tmp, index=False)
    else:
        with open(tmp, "w") as fh:
            json.dump(table_records(table), fh, indent=1)
