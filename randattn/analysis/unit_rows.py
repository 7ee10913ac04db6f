r"""A unit's metrics and its table rows (issue #26): what :class:`~randattn.analysis.execute.UnitRunner` returns.

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

__all__ = ["COLUMNS", "output_metrics", "position_rows", "table_rows"]

#: the sweep table's columns, in order (plotting code relies on these names)
COLUMNS: tuple[str, ...] = (
    "model", "image", "layer", "head", "tokens", "mask", "estimator", "params", "label", "num_samples", "replicates",
    "random", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error", "prob_mse",
    "ess_mean", "delta_var_ratio", "pareto_khat", "dtype", "ref_max_abs_dev", "seconds", "seed", "sink_mass",
)


def output_metrics(out, truth, *, differences: bool, random: bool, scheme: Any = None, keys: int = 0):
    """The unit's output metrics: ``(metrics, rel_error, per_bucket)``, per_bucket None without a ``scheme``.

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
    """
    from randattn.analysis.metrics import metrics_of_differences, metrics_with_relative_error

    per_bucket = None
    if scheme is not None:  # before the cell's metrics, which overwrite the differences on the torch backend
        buckets = bucket_query_slices(scheme, out.shape[-2], keys)
        per_bucket = bucket_metrics(out, truth, buckets, random=random, differences=differences)
    if differences:
        metrics, rel = metrics_of_differences(out, truth, random=random)
    else:
        metrics, rel = metrics_with_relative_error(out, truth, random=random)
    return metrics, rel, per_bucket


def _identity(model: str, unit: Unit, est: EstimatorConfig, head, tokens: int, mask: str, samples) -> dict[str, Any]:
    """The columns that name a row: model, image, layer, head, tokens, mask, estimator, params, label, num_samples."""
    return {"model": model, "image": unit.image_name, "layer": int(unit.layer), "head": int(head),
            "tokens": int(tokens), "mask": mask, "estimator": est.name, "params": est.params_json,
            "label": est.label, "num_samples": int(samples)}


def table_rows(unit: Unit, est: EstimatorConfig, row_samples: Sequence[int], *, model: str, tokens: int, mask: str,
               dtype: str, metrics, rel, prob_mse, ess_mean, delta_ratio, khat, ref_dev: float, seconds: float,
               sink) -> list[dict[str, Any]]:
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
    ref_dev : float
        The reference check's deviation, reported on the first head only.
    seconds : float
        The unit's wall time per cell.
    sink : (C,) ndarray
        The attention sink's mass per cell.
    """
    return [
        {**_identity(model, unit, est, h, tokens, mask, s), "replicates": int(metrics.replicates),
         "random": bool(est.random),
         "mse": metrics.mse[j], "mse_se": metrics.mse_se[j], "variance": metrics.variance[j],
         "bias_sq": metrics.bias_sq[j], "bias_sq_naive": metrics.bias_sq_naive[j],
         "bias_sq_se": metrics.bias_sq_se[j], "rel_error": rel[j],
         "prob_mse": prob_mse[j] if prob_mse is not None else np.nan,
         "ess_mean": ess_mean[j], "delta_var_ratio": delta_ratio[j], "pareto_khat": khat[j],
         "dtype": dtype, "ref_max_abs_dev": ref_dev if j == 0 else np.nan,
         "seconds": seconds, "seed": int(unit.seeds[j]), "sink_mass": float(sink[j])}
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
