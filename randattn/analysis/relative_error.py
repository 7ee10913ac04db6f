r"""The relative output error per query, its distribution, a checked (epsilon, delta) promise (ARCHITECTURE sec. 14).

For replicate r and query n of a cell (one image, layer and head) the relative output error is

.. math:: e_{rn} = \frac{\lVert \hat y_{rn} - y_n \rVert_2}{\lVert y_n \rVert_2},

the norm over the value dims. The sweep reports its mean, median and 95th percentile over the queries x
replicates of the cell, and -- given a tolerance :math:`\epsilon` -- the violation rate

.. math:: \hat p = \frac{\#\{(r, n) : e_{rn} > \epsilon\}}{\#\{(r, n)\}}

with its exact (Clopper-Pearson) 95% interval. An estimator that promises
:math:`P(e_n > \epsilon) \le \delta` for each query (:attr:`~randattn.estimators.base.EstimatorSpec.promise`) is
checked, not trusted, on the quantity its promise bounds (:attr:`~randattn.estimators.base.EstimatorSpec.promise_on`):
the output, :math:`e_{rn}` above, or the softmax normaliser (vAttention's verified attention, whose budget rule sizes
its sample for it), :math:`d_{rn} = |\hat Z_{rn} - Z_n| / Z_n` (:func:`denominator_relative_errors`); the table's
``violation_of`` says which the violation columns count, while ``rel_err_*`` are always the output's. The pooled
rate estimates the mean over the measured queries of their violation probabilities, so a lower confidence bound
above :math:`\delta` shows that some query's probability exceeds :math:`\delta` -- the promise demonstrably fails for
that head (``promise_broken``). Replicates are independent; the queries of one replicate share its draws, so the
interval, which treats the :math:`R K` indicators as independent trials, is exact for R independent draws of one
query and approximate across queries (the rate itself is unbiased either way).

Each head is checked alone, so among many heads that all keep the promise some are flagged by chance (a head
exactly at delta with probability up to :data:`FALSE_FLAG_RATE`). The family-wise decision holds a configuration's
heads to one error rate instead: each head's one-sided exact binomial p-value :math:`P(X \ge x)`,
:math:`X \sim \mathrm{Bin}(n, \delta)` (:func:`violation_p_values`; below :data:`FALSE_FLAG_RATE` exactly where
the head is flagged), goes through Holm's step-down procedure at :data:`FALSE_FLAG_RATE`
(:func:`holm_rejections`), which flags any head of a family whose heads all keep the promise with probability
at most that rate (:func:`familywise_broken`).

A query whose exact output is 0 has no relative error: :math:`e_{rn}` is inf where the estimate is not 0 too
(counted as a violation) and NaN where it is (left out of the trials, and the mean and quantiles are NaN, as
``rel_error`` is).

References
----------
Clopper, C. J. & Pearson, E. S. (1934), The use of confidence or fiducial limits illustrated in the case of the
binomial, Biometrika 26(4): the interval :math:`[B(\alpha/2; x, n - x + 1),\ B(1 - \alpha/2; x + 1, n - x)]`
of beta quantiles.
Desai et al. (2025), vAttention: verified sparse attention, arXiv 2510.05688 (the (epsilon, delta) guarantee).
Holm, S. (1979), A simple sequentially rejective multiple test procedure, Scandinavian Journal of Statistics 6(2):
reject the hypotheses of the ordered p-values :math:`p_{(1)} \le \dots \le p_{(H)}` while
:math:`p_{(i)} \le \alpha / (H - i + 1)`; the family-wise error rate is at most :math:`\alpha` whatever the
dependence between the tests.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from randattn.results.schema import RELATIVE_ERROR_COLUMNS  # the table's columns that relative_error_columns fills

__all__ = ["BUDGET_SUMMARY_COLUMNS", "FALSE_FLAG_RATE", "RELATIVE_ERROR_COLUMNS", "broken_promises", "budget_summary",
           "check_epsilon", "clopper_pearson", "denominator_relative_errors", "familywise_broken", "flags_by_chance",
           "holm_rejections", "query_relative_errors", "relative_error_columns", "s_free_repeats",
           "violation_p_values"]

#: the most often a head whose every query keeps the promise is flagged anyway: the 95% Clopper-Pearson interval
#: lies wholly above delta with probability at most 2.5 % when the violation probability is delta (its lower tail)
FALSE_FLAG_RATE = 0.025


#: what :func:`budget_summary` gives beside its keys
BUDGET_SUMMARY_COLUMNS = ("keys_used", "keys_fraction", "rel_err_median", "rel_err_p95", "epsilon", "delta",
                          "violation_rate", "violation_of", "heads", "promises_broken", "promises_broken_familywise")
#: a broken promise's record (:func:`broken_promises`)
_BROKEN_FIELDS = ("label", "num_samples", "tokens", "mask", "queries", "image", "layer", "head", "epsilon", "delta",
                  "violation_rate", "violation_lo", "violation_hi", "violation_of", "familywise")
#: the columns that name a configuration's family of heads (those the table has): one measurement of each head is
#: one test of the family; the heads are the rows of a group, over images, layers and heads
_FAMILY_KEYS = ("estimator", "label", "num_samples", "tokens", "mask", "queries")


def check_epsilon(value: Any) -> float:
    """``value`` as a float if it is a real number in (0, 1); ValueError/TypeError naming it otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"epsilon must be a real number in (0, 1), got {value!r}")
    try:
        epsilon = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"epsilon must be a real number in (0, 1), got {value!r}") from None
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"epsilon must be in (0, 1) (a relative output error), got {value!r}")
    return epsilon


def query_relative_errors(out: Any, truth: Any, *, differences: bool, random: bool) -> np.ndarray:
    r""":math:`e_{rn} = \lVert \hat y_{rn} - y_n \rVert / \lVert y_n \rVert`, float64 ``(R, C, N)`` on the host.

    Parameters
    ----------
    out : (R, C, N, Dv)
        The estimates (float64 ndarray), or with ``differences`` their differences from the exact output (a
        float64 torch tensor, as the sweep holds them on the device; not modified).
    truth : (C, N, Dv)
        The exact output (a tensor with ``differences``).
    differences : bool
    random : bool
        False: the first replicate only (a deterministic estimator's replicates are one).
    """
    if differences:
        import torch

        used = out if random else out[:1]
        with torch.no_grad():
            ratio = torch.linalg.vector_norm(used, dim=-1) / torch.linalg.vector_norm(truth, dim=-1)
        return ratio.cpu().numpy()
    est = np.asarray(out, dtype=np.float64)
    est = est if random else est[:1]
    exact = np.asarray(truth, dtype=np.float64)
    diff = est - exact
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero exact row: inf or NaN (module docstring)
        return np.sqrt(np.einsum("...d,...d->...", diff, diff)) / np.sqrt(np.einsum("...d,...d->...", exact, exact))


def clopper_pearson(successes: Any, trials: Any, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    r"""The exact (Clopper-Pearson) interval of a binomial proportion, elementwise.

    .. math:: \mathrm{lo} = B^{-1}(\alpha/2;\ x,\ n - x + 1), \qquad
              \mathrm{hi} = B^{-1}(1 - \alpha/2;\ x + 1,\ n - x),

    with :math:`\alpha = 1 - \text{level}`, lo = 0 at x = 0 and hi = 1 at x = n (scipy's beta quantiles; the same
    interval as ``scipy.stats.binomtest(x, n).proportion_ci(level, method="exact")``). NaN where n = 0.

    Parameters
    ----------
    successes, trials : array_like of int, same shape
    level : float in (0, 1)
    """
    from scipy.stats import beta

    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    x = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    alpha = 1.0 - float(level)
    with np.errstate(invalid="ignore", divide="ignore"):
        lo = np.where(x > 0, beta.ppf(alpha / 2, np.maximum(x, 1), n - x + 1), 0.0)
        hi = np.where(x < n, beta.ppf(1 - alpha / 2, x + 1, np.maximum(n - x, 1)), 1.0)
    empty = n <= 0
    return np.where(empty, np.nan, lo), np.where(empty, np.nan, hi)


def denominator_relative_errors(log_estimate: Any, log_exact: Any, *, random: bool) -> np.ndarray:
    r""":math:`d_{rn} = |\hat Z_{rn} - Z_n| / Z_n = |e^{\log \hat Z_{rn} - \log Z_n} - 1|`, float64 ``(R, C, N)``.

    The relative error of an estimator's softmax normaliser (a promise ``on="denominator"``,
    :attr:`~randattn.estimators.base.EstimatorSpec.promise_on`), from logs, so that normalisers beyond float64's
    range (logits above 709) compare exactly as well as small ones.

    Parameters
    ----------
    log_estimate : (R, C, N)
        :math:`\log \hat Z` (:attr:`~randattn.estimators.base.EstimatorSpec.log_denominator`) per replicate.
    log_exact : (C, N)
        :math:`\log Z_n`, the exact log-normaliser over each query's visible keys.
    random : bool
        False: the first replicate only (a deterministic estimator's replicates are one).
    """
    estimate = np.asarray(log_estimate, dtype=np.float64)
    estimate = estimate if random else estimate[:1]
    return np.abs(np.expm1(estimate - np.asarray(log_exact, dtype=np.float64)))


def relative_error_columns(errors: np.ndarray, epsilon: float | None, promise: tuple[float, float] | None, *,
                           promised: np.ndarray | None = None, promise_on: str = "output") -> dict[str, np.ndarray]:
    r"""The table's relative-error columns of each cell, from :func:`query_relative_errors`.

    Parameters
    ----------
    errors : (R, C, N) float64 ndarray
        :math:`e_{rn}` per replicate, cell and measured query: the relative output error.
    epsilon : float or None
        The run's tolerance (``--epsilon``); None for none.
    promise : (epsilon, delta) or None
        The configuration's promise (:meth:`~randattn.estimators.base.EstimatorSpec.promise_of`): its epsilon
        replaces the run's.
    promised : (R, C, N) float64 ndarray, optional
        With a promise on another quantity than the output (``promise_on``), that quantity's relative errors
        (:func:`denominator_relative_errors`): the violation columns count them.
    promise_on : str
        What the promise bounds (:meth:`~randattn.estimators.base.EstimatorSpec.promise_on_of`).

    Returns
    -------
    dict of str to (C,) ndarray (``violation_of``: a str)
        :data:`RELATIVE_ERROR_COLUMNS`: the mean, median and 95th percentile (numpy's linear interpolation) of
        :math:`e_{rn}` over the R x N values of each cell; ``epsilon`` used (NaN without one), the violation rate
        and its Clopper-Pearson 95% interval (NaN without an epsilon); ``delta`` (NaN without a promise),
        ``promise_broken`` (bool: ``violation_lo > delta``; False without a promise), ``violation_of``, the
        quantity whose relative error the violation columns count (``"output"``, or the promise's), and the counts
        behind the rate, ``violations`` and ``trials`` (float64 integers; NaN without an epsilon), which
        :func:`familywise_broken` tests.

    Raises
    ------
    ValueError
        A promise on a quantity other than the output without its errors (``promised``).
    """
    errors = np.asarray(errors, dtype=np.float64)
    cells = errors.shape[1]
    per_cell = np.moveaxis(errors, 1, 0).reshape(cells, -1)  # (C, R N)
    nan = np.full(cells, np.nan)
    columns = {"rel_err_mean": per_cell.mean(axis=1),
               "rel_err_median": np.quantile(per_cell, 0.5, axis=1),
               "rel_err_p95": np.quantile(per_cell, 0.95, axis=1)}
    quantity = "output" if promise is None else promise_on
    if quantity != "output":
        if promised is None:
            raise ValueError(f"a promise on the {quantity} needs its relative errors (promised=)")
        per_cell = np.moveaxis(np.asarray(promised, dtype=np.float64), 1, 0).reshape(cells, -1)
    columns["violation_of"] = quantity
    tolerance = promise[0] if promise is not None else epsilon
    if tolerance is None:
        columns.update(epsilon=nan, violation_rate=nan.copy(), violation_lo=nan.copy(), violation_hi=nan.copy(),
                       violations=nan.copy(), trials=nan.copy())
    else:
        defined = ~np.isnan(per_cell)  # 0 / 0 has no relative error: not a trial
        trials = defined.sum(axis=1)
        violations = (per_cell > tolerance).sum(axis=1)  # inf > epsilon: a zero exact row estimated as non-zero
        lo, hi = clopper_pearson(violations, trials)
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = np.where(trials > 0, violations / np.maximum(trials, 1), np.nan)
        columns.update(epsilon=np.full(cells, float(tolerance)), violation_rate=rate, violation_lo=lo,
                       violation_hi=hi, violations=violations.astype(np.float64), trials=trials.astype(np.float64))
    if promise is None:
        columns.update(delta=nan.copy(), promise_broken=np.zeros(cells, dtype=bool))
    else:
        delta = float(promise[1])
        broken = np.asarray(columns["violation_lo"] > delta) & np.isfinite(columns["violation_lo"])
        columns.update(delta=np.full(cells, delta), promise_broken=broken)
    return columns


def violation_p_values(violations: Any, trials: Any, delta: Any) -> np.ndarray:
    r"""Each head's one-sided exact binomial p-value against its promise,
    :math:`P(X \ge x),\ X \sim \mathrm{Bin}(n, \delta)`, elementwise (scipy's survival function at x - 1).

    Small where x violations in n trials are unlikely for a head whose violation probability is delta (or less:
    the tail grows with the probability). It is below :data:`FALSE_FLAG_RATE` exactly where the 95% Clopper-Pearson
    interval lies wholly above delta (``promise_broken``): the interval's lower end is the probability at which
    this tail is 2.5 %. NaN where n or delta is NaN, 1 at x = 0, NaN at n = 0.
    """
    from scipy.stats import binom

    x = np.asarray(violations, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        return np.where(n > 0, binom.sf(x - 1, n, np.asarray(delta, dtype=np.float64)), np.nan)


def holm_rejections(p_values: Any, level: float = FALSE_FLAG_RATE) -> np.ndarray:
    r"""Holm's step-down procedure: which of the H hypotheses to reject, family-wise error rate at most ``level``.

    With the p-values in ascending order :math:`p_{(1)} \le \dots \le p_{(H)}`, reject :math:`(1), \dots, (k)`
    for the largest k with :math:`p_{(i)} < \text{level} / (H - i + 1)` for every :math:`i \le k` (Holm 1979; the
    strict inequality of the per-head flag, so that one head alone is flagged exactly as it is alone). A NaN
    p-value (no test) is never rejected and does not count in H.

    Parameters
    ----------
    p_values : (H,) array_like of float
    level : float in (0, 1)

    Returns
    -------
    (H,) bool ndarray
    """
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    p = np.asarray(p_values, dtype=np.float64).ravel()
    tested = np.flatnonzero(~np.isnan(p))
    order = tested[np.argsort(p[tested], kind="stable")]
    below = p[order] < float(level) / (len(order) - np.arange(len(order)))
    stop = len(order) if below.all() else int(np.argmin(below))  # the first ordered p-value above its bound
    rejected = np.zeros(p.shape, dtype=bool)
    rejected[order[:stop]] = True
    return rejected


def familywise_broken(table):
    """Per row of a sweep table: whether its head's promise fails family-wise -- Holm's procedure at
    :data:`FALSE_FLAG_RATE` (:func:`holm_rejections`) over the one-sided p-values (:func:`violation_p_values`) of
    every head of its configuration (the rows that share estimator, label, S, tokens, mask and query selection:
    each image, layer and head one test).

    Where every head keeps its promise, any head of a configuration is flagged with probability at most 2.5 %,
    however many heads it has; each head checked alone (``promise_broken``) is flagged with up to that probability.
    A head flagged family-wise is flagged alone too.

    Returns
    -------
    pandas.Series
        Aligned with ``table``'s index, dtype object: True or False; False for a configuration without a promise;
        None where the table lacks the counts (``violations``, ``trials``: a table written before them).
    """
    import pandas as pd

    result = pd.Series(False, index=table.index, dtype=object)
    if "delta" not in table.columns:
        return result
    promised = table["delta"].notna()
    if not {"violations", "trials"} <= set(table.columns):
        result[promised] = None
        return result
    keys = [c for c in _FAMILY_KEYS if c in table.columns]
    for _, family in table[promised].groupby(keys, sort=False, dropna=False):
        if family[["violations", "trials"]].isna().any(axis=None):  # rows written before the counts
            result[family.index] = None
            continue
        p_values = violation_p_values(family["violations"], family["trials"], family["delta"])
        # the per-head flag is the same test at 2.5 % (an interval's end against a tail): the and keeps the two in
        # step where a p-value lies on the bound to rounding
        flagged = family["promise_broken"].eq(True).to_numpy() if "promise_broken" in family else True
        result[family.index] = (holm_rejections(p_values) & flagged).tolist()
    return result


def _summary_keys(table) -> list[str]:
    """The keys :func:`randattn.analysis.sweep.aggregate` groups a table by (``mask`` where the table has it)."""
    return ["estimator", "label", "num_samples", "tokens", *(["mask"] if "mask" in table.columns else [])]


def budget_summary(table):
    """Per (estimator, label, S, tokens[, mask]) -- the groups of :func:`~randattn.analysis.sweep.aggregate` -- the
    keys read, the relative error and the promise checks of a sweep table, for its summary.

    Parameters
    ----------
    table : pandas.DataFrame
        A sweep table; columns it lacks (a table written before them) give NaN.

    Returns
    -------
    pandas.DataFrame
        The keys and :data:`BUDGET_SUMMARY_COLUMNS`: the mean over the group's rows (every (image, layer) holds
        the same heads, so the mean over heads, then layers, then images) of ``keys_used``, ``keys_fraction``,
        ``rel_err_median``, ``rel_err_p95`` and ``violation_rate``; ``epsilon`` and ``delta`` (the group's own
        values, NaN where it has none); ``violation_of``: what the violation rate counts (``"output"``, or the
        quantity the configuration's promise bounds, e.g. ``"denominator"``); ``heads``: the group's rows;
        ``promises_broken``: its rows whose ``promise_broken`` is true (each a head of an image and layer whose
        promise demonstrably fails, :func:`broken_promises`); ``promises_broken_familywise``: those flagged by
        :func:`familywise_broken`, 0 without a promise as ``promises_broken`` (a nullable integer: ``<NA>`` where
        the table lacks the counts it tests).
    """
    import pandas as pd

    keys = _summary_keys(table)
    means = ["keys_used", "keys_fraction", "rel_err_median", "rel_err_p95", "violation_rate", "epsilon", "delta"]
    frame = table.reindex(columns=list(dict.fromkeys([*keys, *means, "promise_broken", "violation_of"]))).copy()
    frame["promise_broken"] = frame["promise_broken"].eq(True)  # absent (NaN): no promise checked
    frame["violation_of"] = frame["violation_of"].where(frame["violation_of"].notna(), "output")  # a table before it
    frame["familywise"] = familywise_broken(table)
    records = []
    for key, group in frame.groupby(keys, sort=False):
        record = dict(zip(keys, key))
        for column in means:
            values = group[column].to_numpy(dtype=np.float64)
            finite = values[np.isfinite(values)]
            if column in ("epsilon", "delta"):  # one configuration's: the value itself, not a mean that rounds it
                record[column] = float(finite[0]) if finite.size else np.nan
            else:
                record[column] = float(values.mean()) if finite.size else np.nan
        record["violation_of"] = str(group["violation_of"].iloc[0])  # one configuration: one quantity
        record["heads"] = int(len(group))
        record["promises_broken"] = int(group["promise_broken"].sum())
        familywise = group["familywise"]  # None: a head with a promise in a table without the counts
        record["promises_broken_familywise"] = int(familywise.eq(True).sum()) if familywise.notna().all() else None
        records.append(record)
    summary = pd.DataFrame.from_records(records, columns=[*keys, *BUDGET_SUMMARY_COLUMNS])
    return summary.astype({"promises_broken_familywise": "Int64"})  # a count, or <NA> where it cannot be made


def flags_by_chance(heads: int) -> float:
    """The most heads of ``heads`` checked that :data:`FALSE_FLAG_RATE` flags on average where every one keeps its
    promise: a count of flags near it is no evidence that the promise fails (each head is checked alone)."""
    return FALSE_FLAG_RATE * heads


#: the columns that name one measurement of a head (those a table has): its row is repeated at every S where its
#: configuration takes no S
MEASUREMENT_KEYS = ("label", "tokens", "mask", "queries", "image", "layer", "head")


def s_free_repeats(frame, keys: Sequence[str]):
    """``(s_free, repeated)``, boolean Series over ``frame``'s rows: whether the row's configuration takes no S
    (softmax, local, adaptive vAttention; :func:`~randattn.estimators.registry.takes_no_samples`), whose one
    measurement a table repeats at each S, and whether the row repeats an earlier one of the same ``keys`` (those
    ``frame`` has): the rows a reader is shown once."""
    from randattn.estimators.registry import takes_no_samples

    s_free = frame["label"].map(takes_no_samples).astype(bool)
    return s_free, s_free & frame.duplicated([key for key in keys if key in frame])


def broken_promises(table) -> list[dict[str, Any]]:
    """One record per row of a sweep table whose configuration's promise demonstrably fails (``promise_broken``):
    its label, S, tokens, mask, query selection, image, layer and head, and epsilon, delta, the violation rate, its
    Clopper-Pearson interval, what it counts (``violation_of``) and ``familywise``, whether the head is flagged
    family-wise too (:func:`familywise_broken`; None for a table without the counts) (plain Python values), in the
    table's order.
    A configuration that takes no S (adaptive vAttention; :func:`~randattn.estimators.registry.takes_no_samples`), whose
    one measurement the table repeats at each S, gives one record, its S None."""
    if "promise_broken" not in table.columns:
        return []
    flagged = table["promise_broken"].eq(True)
    broken = table[flagged].assign(familywise=familywise_broken(table)[flagged])
    if len(broken):  # a configuration that takes no S: one measurement, repeated at every S
        s_free, repeated = s_free_repeats(broken, MEASUREMENT_KEYS)
        broken = broken.assign(num_samples=broken["num_samples"].astype(object).where(~s_free, None))[~repeated]
    fields = [f for f in _BROKEN_FIELDS if f in broken.columns]
    return [{f: (v.item() if isinstance(v, np.generic) else v) for f, v in zip(fields, row)}
            for row in broken[fields].itertuples(index=False, name=None)]
