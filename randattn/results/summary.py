r"""The results table's summary: bias, variance and MSE per estimator configuration and S, with bootstrap CIs.

The summary of LARA app. H.1 (:func:`aggregate`), computed from the table alone, so that it is the same for a
table just measured and one read back from disk; the reports present it (:mod:`randattn.reports.tables`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from randattn._validation import check_positive_int

__all__ = ["aggregate", "range_coverage"]


def range_coverage(units: int) -> float:
    r"""The probability that the range of ``units`` independent draws of a continuous distribution holds its median.

    .. math:: P(\min_i X_i \le m \le \max_i X_i) = 1 - 2 \cdot 2^{-n} = 1 - 2^{1-n},

    since each draw falls below the median :math:`m` with probability 1/2 and the range misses it only when all
    :math:`n` fall on one side. A percentile bootstrap interval of the mean lies within the units' range (every
    resampled mean does), so at a level above this it cannot cover as stated: at 95 %, with 5 units or fewer
    (50 % with 2, 75 % with 3, 87.5 % with 4, 93.75 % with 5); the same holds for the mean where the units'
    distribution is symmetric.
    """
    check_positive_int("units", units)
    return 1.0 - 2.0 ** (1 - units)


def _bootstrap_mean_ci(values: np.ndarray, idx: np.ndarray, level: float) -> tuple[float, float]:
    """Percentile interval of the mean of ``values`` over the resamples ``idx (n_boot, units)``; NaN with fewer than
    two units, or where a unit is not finite (a NaN or inf cell has no interval, and is not dropped from one)."""
    if values.size < 2 or not np.isfinite(values).all():
        return math.nan, math.nan
    means = values[idx].mean(1)
    alpha = 0.5 * (1.0 - level)
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _mean_keeping_nan(values, by):
    """Group means of ``values`` by ``by`` that are NaN wherever a member is (pandas' own skip NaN): a cell that was
    not measured must not drop out of its mean, which would weigh the other cells more without a word."""
    grouped = values.groupby(by, sort=False)
    return grouped.mean().mask(values.isna().groupby(by, sort=False).any())


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
        Seed of the bootstrap: the groups that differ only in ``num_samples`` share one stream,
        ``SeedSequence(seed, spawn_key=(index,))`` with ``index`` their rank among the other keys in order of first
        appearance, so that a configuration without S, whose one measurement the table repeats at each S, gets the
        same interval at each (and the S of one configuration are resampled alike).
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
    streams: dict[tuple, int] = {}
    for key, frame in table.groupby(keys, sort=False):
        stream = streams.setdefault(tuple(v for k, v in zip(keys, key) if k != "num_samples"), len(streams))
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(stream,)))
        per_layer = _mean_keeping_nan(frame[metrics], [frame["image"], frame["layer"]])  # mean over heads
        per_image = _mean_keeping_nan(per_layer, per_layer.index.get_level_values("image"))  # mean over layers
        if len(per_image) > 1:
            units, over = per_image, "images"
        else:
            units = _mean_keeping_nan(frame[metrics], frame["head"])  # per head, mean over layers
            over = "heads"
        record = dict(zip(keys, key))
        # one set of resamples for every metric: equal columns (MSE and bias^2 of an exact estimator) get equal
        # intervals, where a stream drawn on from metric to metric gave them two
        idx = rng.integers(0, len(units), size=(n_boot, len(units)))
        for metric in metrics:
            record[metric] = float(per_image[metric].to_numpy(dtype=np.float64).mean())
            lo, hi = _bootstrap_mean_ci(units[metric].to_numpy(dtype=np.float64), idx, level)
            record[f"{metric}_lo"], record[f"{metric}_hi"] = lo, hi
        record["units"] = int(len(units))
        record["ci_over"] = over
        records.append(record)
    columns = keys + ["mse", "mse_lo", "mse_hi", "bias_sq", "bias_sq_lo", "bias_sq_hi",
                      "variance", "variance_lo", "variance_hi", "units", "ci_over"]
    return pd.DataFrame.from_records(records, columns=columns)
