r"""Sweeps: estimators x parameter variants x sample counts x replicates over an activation set.

One **cell** is one (image, layer, head) input with one estimator configuration and one sample
count S; it yields one row of the tidy table (:data:`COLUMNS`). The sweep is planned as
**units** -- the cells of one (layer, estimator configuration, S, image) over the selected
heads -- which are executed, stored and resumed independently (ARCHITECTURE sec. 11):

- :mod:`randattn.analysis.plan`: configurations, cell seeds, units (pure);
- :mod:`randattn.analysis.execute`: ``UnitRunner.run(unit) -> rows`` (torch batched by default,
  or the float64 reference), vectorized over heads and replicates under a memory budget;
- :mod:`randattn.analysis.store`: the output's rules (force, resume), a manifest, a lock;
- :mod:`randattn.results`: the table's schema, one Parquet part per finished unit (written
  atomically), consolidation into the canonical table, the table's files and metadata;
- the sweep's own jobs: :mod:`randattn.analysis.sweep_plan` (:func:`plan`, :func:`plan_sweep`),
  :mod:`randattn.analysis.sweep_run` (:func:`run_sweep`: plan minus stored units -> executor ->
  parts), and the table's summary, :mod:`randattn.results.summary` (:func:`aggregate`).

This module is the sweep's front: it gathers their public names, so that a caller imports the
configuration, the plan, the run, the aggregation and the table's output from one place.

Masks
-----
A run may measure its layers under a causal or sliding-window mask
(:attr:`SweepConfig.mask`, :mod:`randattn.analysis.masking`): estimators, the exact reference
and the probabilities apply it, an estimator whose spec does not support a layer's mask is
refused by name when the sweep is planned, and the table's ``mask`` column records each row's.
Masked layers also get per-position metrics (:mod:`randattn.analysis.positions`), which
:func:`run_sweep_tables` returns beside the table and :func:`~randattn.results.write_tables` stores
beside it.

Reproducibility
---------------
Each cell's seed is derived from the master seed and the cell's identity alone
(:func:`cell_seed`), and replicate r of a cell draws from
``np.random.default_rng(np.random.SeedSequence(cell_seed, spawn_key=(r,)))``. A unit's rows
are therefore independent of the memory budget, the order units run in, the executor, and of
an interruption: a resumed sweep gives the same table, bit for bit, as an uninterrupted one.
"""

from __future__ import annotations

from typing import Any

from randattn.results.summary import aggregate
from randattn.analysis.execute import COLUMNS, MemoryBudgetError
from randattn.analysis.plan import (
    BACKENDS,
    DTYPES,
    EstimatorConfig,
    SweepConfig,
    SweepProgress,
    cell_seed,
    estimator_config,
    parse_estimator_list,
    replicate_rng,
)
from randattn.analysis.store import SweepLockedError
from randattn.analysis.sweep_plan import SweepPlan, as_activations, count_cells, plan, plan_sweep
from randattn.analysis.sweep_plan import bind_layout  # noqa: F401  (public, though never in __all__)
from randattn.analysis.sweep_run import (
    consolidate,
    consolidate_positions,
    run_sweep,
    run_sweep_tables,
    summarize_warnings,
    warning_text,
)
from randattn.results.parts import read_parts, read_position_parts
from randattn.results.schema import POSITION_COLUMNS
from randattn.results.table import SweepTables, positions_path, table_records, write_table, write_tables

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

#: names this module only passed on from elsewhere (not its public API): name -> the module that defines it
_PASSED_ON = {
    **dict.fromkeys(("PHASES", "UnitRunner", "run_recording"), "randattn.analysis.execute"),
    **dict.fromkeys(("Unit", "bind_token_layout", "plan_units", "select", "total_cells", "with_threads"),
                    "randattn.analysis.plan"),
    **dict.fromkeys(("prepare_parts_dir", "sweep_lock"), "randattn.analysis.store"),
    **dict.fromkeys(("OUTPUT_FORMATS", "empty_positions", "empty_table", "set_aside_unreadable", "stored_unit_ids",
                     "unreadable_parts", "write_part"), "randattn.results"),
    **dict.fromkeys(("atomic_path", "named_write_errors"), "randattn._files"),
}


def __getattr__(name: str) -> Any:
    """The names this module once passed on, still answered with a ``DeprecationWarning`` naming their home."""
    if name in _PASSED_ON:
        import warnings
        from importlib import import_module

        home = _PASSED_ON[name]
        warnings.warn(f"randattn.analysis.sweep.{name} is deprecated: import it from {home}", DeprecationWarning,
                      stacklevel=2)
        return getattr(import_module(home), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
