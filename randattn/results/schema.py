"""The results table's schema: its columns, their dtypes, coercion, and the canonical order of its rows.

A sweep writes two tables: the table (:data:`COLUMNS`, one row per (image, layer, head, estimator configuration,
S)) and, for masked layers, the per-position table (:data:`POSITION_COLUMNS`, one row per cell and position
bucket). Both are defined here once; the measurement (:mod:`randattn.analysis.unit_rows`,
:mod:`randattn.analysis.positions`) fills them, the reports read them.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "COLUMNS",
    "KEYS_USED_COLUMNS",
    "RELATIVE_ERROR_COLUMNS",
    "POSITION_COLUMNS",
    "coerce",
    "coerce_positions",
    "consolidate",
    "consolidate_positions",
    "empty_table",
    "empty_positions",
]

#: what the keys-used columns hold: the mean over the measured queries and the replicates of the distinct keys each
#: query's estimate reads (:attr:`~randattn.estimators.base.EstimatorSpec.keys_used`), its standard error over the
#: replicates, its largest value, and the mean divided by the mean number of keys the measured queries see
KEYS_USED_COLUMNS: tuple[str, ...] = ("keys_used", "keys_used_se", "keys_used_max", "keys_fraction")

#: the per-query relative error and promise columns (:func:`randattn.analysis.relative_error.relative_error_columns`),
#: in the sweep table's order
RELATIVE_ERROR_COLUMNS = ("rel_err_mean", "rel_err_median", "rel_err_p95", "epsilon", "violation_rate",
                          "violation_lo", "violation_hi", "delta", "promise_broken", "violation_of", "violations",
                          "trials")

#: the sweep table's columns, in order (plotting code relies on these names); the columns after ``sink_mass`` were
#: appended later, so that a table's earlier columns keep their places
COLUMNS: tuple[str, ...] = (
    "model", "image", "layer", "head", "tokens", "mask", "estimator", "params", "label", "num_samples", "replicates",
    "random", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error", "prob_mse",
    "ess_mean", "delta_var_ratio", "pareto_khat", "dtype", "ref_max_abs_dev", "seconds", "seed", "sink_mass",
    "queries", *KEYS_USED_COLUMNS, *RELATIVE_ERROR_COLUMNS, "ref_max_rel_err", "ref_rms_dev",
)

#: the per-position table's columns, in order: the cell's identity, the bucket, the bucket's metrics
POSITION_COLUMNS: tuple[str, ...] = (
    "model", "image", "layer", "head", "tokens", "mask", "estimator", "params", "label", "num_samples", "replicates",
    "random", "position_lo", "position_hi", "queries", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive",
    "bias_sq_se", "seed",
)

_STR_COLUMNS = ("model", "image", "mask", "estimator", "params", "label", "dtype", "violation_of")
_INT_COLUMNS = ("layer", "head", "tokens", "num_samples", "replicates", "seed", "position_lo", "position_hi", "queries")
_BOOL_COLUMNS = ("random", "promise_broken")
#: the sweep table's columns whose dtype differs from the per-position table's column of the same name: the table's
#: ``queries`` is the query selection (``"all"``, ``"last:64"``), the per-position table's the count in a bucket
_TABLE_STR_COLUMNS = ("queries",)
#: what a table written before a column existed holds in it: every query was measured, no promise was checked, and
#: the violation columns counted the output's relative error
_ABSENT = {"queries": "all", "promise_broken": False, "violation_of": "output"}


def column_kind(name: str, columns: Sequence[str]) -> str:
    """``"str"``, ``"int64"``, ``"bool"`` or ``"float64"``: the dtype of column ``name`` of a table of ``columns``."""
    if name in _STR_COLUMNS or (name in _TABLE_STR_COLUMNS and tuple(columns) == tuple(COLUMNS)):
        return "str"
    return "int64" if name in _INT_COLUMNS else "bool" if name in _BOOL_COLUMNS else "float64"


def typed_column(name: str, values: list, columns: Sequence[str] = COLUMNS):
    """One column with the dtype :func:`coerce` gives it, built directly (coerce costs 6 ms a part)."""
    import numpy as np

    kind = column_kind(name, columns)
    if kind == "str":
        return np.array([str(x) for x in values], dtype=object)
    return np.array(values, dtype=bool if kind == "bool" else kind)


def empty_table():
    """A table with :data:`COLUMNS` and no rows."""
    import pandas as pd

    return coerce(pd.DataFrame({c: [] for c in COLUMNS}))


def empty_positions():
    """A per-position table with :data:`POSITION_COLUMNS` and no rows."""
    import pandas as pd

    return coerce_positions(pd.DataFrame({c: [] for c in POSITION_COLUMNS}))


def coerce(frame):
    """Column dtypes of the sweep table (the same whether built in memory or read from parts).

    A table written before masks existed has no ``mask`` column: its rows were bidirectional (``"none"``).
    """
    return _coerce(frame, COLUMNS)


def coerce_positions(frame):
    """Column dtypes of the per-position table (:data:`POSITION_COLUMNS`)."""
    return _coerce(frame, POSITION_COLUMNS)


def _coerce(frame, columns: Sequence[str]):
    frame = frame.reindex(columns=list(columns)).copy()
    frame["mask"] = frame["mask"].fillna("none")  # rows written before masks existed were bidirectional
    for c, value in _ABSENT.items():  # rows written before the column existed
        if tuple(columns) == tuple(COLUMNS):
            frame[c] = frame[c].astype(object).where(frame[c].notna(), value)
    for c in columns:
        kind = column_kind(c, columns)
        frame[c] = frame[c].astype(kind if kind != "str" else str)
    return frame


def consolidate(table, estimator_labels: Sequence[str], image_names: Sequence[str] = ()):
    """The canonical table: duplicates dropped, sorted by layer, estimator, S, image, head."""
    return _consolidate(coerce(table), [], estimator_labels, image_names)


def consolidate_positions(positions, estimator_labels: Sequence[str], image_names: Sequence[str] = ()):
    """The canonical per-position table: as :func:`consolidate`, then by bucket."""
    return _consolidate(coerce_positions(positions), ["position_lo"], estimator_labels, image_names)


def _consolidate(table, extra: list[str], estimator_labels: Sequence[str], image_names: Sequence[str]):
    keys = ["layer", "label", "num_samples", "image", "head", *extra]
    table = table.drop_duplicates(subset=keys, keep="first")
    est_order = {label: i for i, label in enumerate(estimator_labels)}
    image_order = {name: i for i, name in enumerate(image_names)}
    order = table.assign(
        _est=table["label"].map(est_order),
        _img=table["image"].map(image_order) if image_order else 0,
    ).sort_values(["layer", "_est", "num_samples", "_img", "head", *extra], kind="stable")
    return order.drop(columns=["_est", "_img"]).reset_index(drop=True)
