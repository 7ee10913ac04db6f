r"""A unit's metrics and its table rows: what :class:`~randattn.analysis.execute.UnitRunner` returns.

:func:`output_metrics` reduces a unit's estimates over the replicates, whole and per query
position bucket; :func:`table_rows` and :func:`position_rows` lay them out as the sweep table's
rows (:data:`COLUMNS`) and its per-position rows
(:data:`~randattn.analysis.positions.POSITION_COLUMNS`), one per head and reported S.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from randattn.analysis.plan import EstimatorConfig, Unit
from randattn.analysis.positions import bucket_metrics, bucket_query_slices
from randattn.results.schema import COLUMNS, KEYS_USED_COLUMNS, RELATIVE_ERROR_COLUMNS  # the table's schema

__all__ = ["COLUMNS", "KEYS_USED_COLUMNS", "keys_used_columns", "output_metrics", "position_rows", "table_rows"]


def keys_used_columns(per_query_mean: np.ndarray | None, per_query_max: np.ndarray | None, *, random: bool,
                      replicates: int, visible: float) -> dict[str, np.ndarray | float]:
    r"""The keys-used columns (:data:`KEYS_USED_COLUMNS`) of each cell, NaN where the spec declares no ``keys_used``.

    Parameters
    ----------
    per_query_mean, per_query_max : (R, C) ndarray or None
        Per replicate and cell, the mean and the largest over the measured queries of the keys each reads; None
        when the spec declares no ``keys_used``.
    random : bool
        Whether the estimator is random.
    replicates : int
        R' the metrics use (1 for a deterministic estimator): the first R' rows of the arrays.
    visible : float
        The mean number of keys the measured queries see (M without a mask).

    Returns
    -------
    dict
        ``keys_used``: :math:`\bar u = \frac1{R'} \sum_r \bar u_r`, with :math:`\bar u_r` the mean over the
        measured queries of replicate r (all replicates hold the same queries, so this is the mean over queries
        and replicates); ``keys_used_se``: the standard error of :math:`\bar u` over the replicates,
        :math:`\mathrm{std}_r(\bar u_r, \text{ddof}=1) / \sqrt{R'}` (the replicates are independent, the queries
        of one replicate share its draws), 0 for a deterministic estimator and NaN for a random one with R' = 1;
        ``keys_used_max``: the largest count of any query and replicate; ``keys_fraction``:
        :math:`\bar u / \text{visible}`.
    """
    if per_query_mean is None:
        return dict.fromkeys(KEYS_USED_COLUMNS, np.nan)
    means, largest = per_query_mean[:replicates], per_query_max[:replicates]
    mean = means.mean(0)
    if replicates >= 2:
        se = means.std(0, ddof=1) / np.sqrt(replicates)
    else:
        se = np.full(mean.shape, 0.0 if not random else np.nan)
    return {"keys_used": mean, "keys_used_se": se, "keys_used_max": largest.max(0), "keys_fraction": mean / visible}


def output_metrics(out, truth, *, differences: bool, random: bool, scheme: Any = None, keys: int = 0,
                   queries: int | None = None, rows: Any = None, relative_errors: bool = False):
    """The unit's output metrics: ``(metrics, rel_error, per_bucket)``, per_bucket None without a ``scheme``; with
    ``relative_errors``, a fourth item: the per-query relative errors ``(R', C, K)``
    (:func:`~randattn.analysis.relative_error.query_relative_errors`).

    Parameters
    ----------
    out : (R, C, N, Dv)
        The estimates (a float64 ndarray), or with ``differences`` their differences from the exact output
        (a float64 tensor, overwritten by the metrics).
    truth : (C, N, Dv)
        The exact output (a tensor with ``differences``).
    differences : bool
        Whether ``out`` holds differences (the torch backend) rather than estimates (the reference backend).
    random : bool
        Whether the estimator is random.
    scheme : optional
        The layer's position buckets (:meth:`~randattn.analysis.plan.SweepConfig.positions_of`), or None.
    keys : int
        M, the number of keys (for the buckets).
    queries : int, optional
        N, the query rows of the activations (for the buckets' positions); default the rows of ``out``.
    rows : (K,) int array, optional
        The measured query rows among the N (:mod:`randattn.analysis.queries`); default every row.
    relative_errors : bool
        Also return the per-query relative errors.
    """
    from randattn.analysis.metrics import metrics_of_differences, metrics_with_relative_error
    from randattn.analysis.relative_error import query_relative_errors

    per_bucket = errors = None
    if scheme is not None:  # before the cell's metrics, which overwrite the differences on the torch backend
        buckets = bucket_query_slices(scheme, out.shape[-2] if queries is None else queries, keys, rows)
        per_bucket = bucket_metrics(out, truth, buckets, random=random, differences=differences)
    if relative_errors:  # likewise before the metrics
        errors = query_relative_errors(out, truth, differences=differences, random=random)
    if differences:
        metrics, rel = metrics_of_differences(out, truth, random=random)
    else:
        metrics, rel = metrics_with_relative_error(out, truth, random=random)
    return (metrics, rel, per_bucket, errors) if relative_errors else (metrics, rel, per_bucket)


def _identity(model: str, unit: Unit, est: EstimatorConfig, head, tokens: int, mask: str, samples) -> dict[str, Any]:
    """The columns that name a row: model, image, layer, head, tokens, mask, estimator, params, label, num_samples."""
    return {"model": model, "image": unit.image_name, "layer": int(unit.layer), "head": int(head),
            "tokens": int(tokens), "mask": mask, "estimator": est.name, "params": est.params_json,
            "label": est.label, "num_samples": int(samples)}


def table_rows(unit: Unit, est: EstimatorConfig, row_samples: Sequence[int], *, model: str, tokens: int, mask: str,
               dtype: str, metrics, rel, prob_mse, ess_mean, delta_ratio, khat, ref_check, seconds: float,
               sink, queries: str = "all", keys_used: dict | None = None,
               relative: dict | None = None) -> list[dict[str, Any]]:
    """The unit's rows (:data:`COLUMNS`), one per head and reported S, in head order.

    Parameters
    ----------
    unit : Unit
    est : EstimatorConfig
    row_samples : sequence of int
        The S the unit reports (:meth:`~randattn.analysis.plan.Unit.row_samples`).
    model, mask, dtype : str
        The model's name, the mask's label, the run's dtype name.
    tokens : int
        N.
    metrics, rel
        The unit's output metrics and relative errors per cell (:func:`output_metrics`).
    prob_mse : (C,) ndarray or None
        None: the run measured no probabilities (NaN in the table).
    ess_mean, delta_ratio, khat : (C,) ndarrays
        The IS diagnostics' columns.
    ref_check : ReferenceCheck
        The reference check (:class:`~randattn.analysis.execute.ReferenceCheck`): its deviation and the reference's
        own error against exact softmax, reported on the first head only.
    seconds : float
        The unit's wall time per cell.
    sink : (C,) ndarray
        The attention sink's mass per cell.
    queries : str
        The query selection (:mod:`randattn.analysis.queries`).
    keys_used : dict, optional
        :func:`keys_used_columns` (scalars or (C,) arrays); None: NaN.
    relative : dict, optional
        :func:`~randattn.analysis.relative_error.relative_error_columns`; None: NaN (``promise_broken`` False,
        ``violation_of`` ``"output"``).
    """
    keys_used = dict.fromkeys(KEYS_USED_COLUMNS, np.nan) if keys_used is None else keys_used
    if relative is None:
        relative = {**dict.fromkeys(RELATIVE_ERROR_COLUMNS, np.nan), "promise_broken": False, "violation_of": "output"}

    def cell(values: dict, j: int) -> dict[str, Any]:
        return {name: (value[j].item() if isinstance(value, np.ndarray) else value) for name, value in values.items()}

    return [
        {**_identity(model, unit, est, h, tokens, mask, s), "replicates": int(metrics.replicates),
         "random": bool(est.random),
         "mse": metrics.mse[j], "mse_se": metrics.mse_se[j], "variance": metrics.variance[j],
         "bias_sq": metrics.bias_sq[j], "bias_sq_naive": metrics.bias_sq_naive[j],
         "bias_sq_se": metrics.bias_sq_se[j], "rel_error": rel[j],
         "prob_mse": prob_mse[j] if prob_mse is not None else np.nan,
         "ess_mean": ess_mean[j], "delta_var_ratio": delta_ratio[j], "pareto_khat": khat[j],
         "dtype": dtype, "ref_max_abs_dev": ref_check.deviation if j == 0 else np.nan,
         "ref_max_rel_err": ref_check.reference_error if j == 0 else np.nan,
         "ref_rms_dev": ref_check.rms_deviation if j == 0 else np.nan,
         "seconds": seconds, "seed": int(unit.seeds[j]), "sink_mass": float(sink[j]), "queries": queries,
         **cell(keys_used, j), **cell(relative, j)}
        for j, h in enumerate(unit.heads) for s in row_samples
    ]


def position_rows(unit: Unit, est: EstimatorConfig, row_samples: Sequence[int], *, model: str, tokens: int,
                  mask: str, per_bucket) -> list[dict[str, Any]]:
    """The unit's per-position rows, one per head, reported S and position bucket.

    ``per_bucket``: ``(lo, hi, queries, metrics)`` per bucket (:func:`output_metrics`).
    """
    return [
        {**_identity(model, unit, est, h, tokens, mask, s), "replicates": int(m.replicates),
         "random": bool(est.random), "position_lo": lo, "position_hi": hi,
         "queries": count, "mse": m.mse[j], "mse_se": m.mse_se[j], "variance": m.variance[j],
         "bias_sq": m.bias_sq[j], "bias_sq_naive": m.bias_sq_naive[j], "bias_sq_se": m.bias_sq_se[j],
         "seed": int(unit.seeds[j])}
        for j, h in enumerate(unit.heads) for s in row_samples for lo, hi, count, m in per_bucket
    ]
