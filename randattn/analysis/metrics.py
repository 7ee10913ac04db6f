r"""Bias, variance and MSE of an estimator from R replicates (ARCHITECTURE sec. 6).

Every metric is computed **per output element** ``(n, d)`` and then averaged over the queries
``n`` and value dims ``d``; leading batch dims (images, heads, ...) are kept, so one call
measures a whole chunk of attention heads.

With replicates :math:`y_r` (:math:`r = 1..R`) and the exact output :math:`y`:

.. math::
    \bar y = \frac1R \sum_r y_r, \qquad
    s^2 = \frac{1}{R-1} \sum_r (y_r - \bar y)^2, \qquad
    \mathrm{MSE} = \frac1R \sum_r (y_r - y)^2,

    \widehat{b^2}_{\text{naive}} = (\bar y - y)^2, \qquad
    \widehat{b^2} = (\bar y - y)^2 - s^2 / R .

The naive squared bias is biased upwards by :math:`\sigma^2 / R`
(:math:`\mathbb{E}(\bar y - y)^2 = b^2 + \sigma^2/R`); the debiased one is the U-statistic
:math:`\frac{1}{R(R-1)} \sum_{r \ne r'} (y_r - y)(y_{r'} - y)`, unbiased for :math:`b^2` and
therefore sometimes negative.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from randattn._callers import outside_stacklevel

__all__ = [
    "ReplicateMetrics",
    "replicate_metrics",
    "metrics_with_relative_error",
    "metrics_of_differences",
    "relative_error",
    "probability_mse",
    "normal_ci",
    "jackknife_debiased_bias_sq",
]


def normal_ci(estimate: Any, se: Any, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    r"""Normal confidence interval :math:`\hat\theta \pm z_{(1+\text{level})/2}\,\mathrm{SE}`.

    Parameters
    ----------
    estimate, se : array_like, same shape
    level : float in (0, 1)

    Returns
    -------
    (lo, hi) : tuple of ndarray
    """
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    from scipy.stats import norm

    z = float(norm.ppf(0.5 + 0.5 * float(level)))
    estimate = np.asarray(estimate, dtype=np.float64)
    se = np.asarray(se, dtype=np.float64)
    return estimate - z * se, estimate + z * se


@dataclass(frozen=True)
class ReplicateMetrics:
    """Bias/variance/MSE of one estimator on a batch of inputs, each field of shape ``(...)``.

    Attributes
    ----------
    mean_abs : (...) ndarray
        Average over (n, d) of :math:`|\\bar y|` (a scale reference, not a metric).
    mse : (...) ndarray
        :math:`\\mathrm{avg}_{n,d}\\, \\mathrm{avg}_r (y_r - y)^2`.
    mse_se : (...) ndarray
        Standard error of ``mse`` over replicates: ``std_r(e_r, ddof=1) / sqrt(R)`` with
        ``e_r = avg_{n,d} (y_r - y)^2``; 0 for a deterministic estimator, NaN when R < 2.
    variance : (...) ndarray
        :math:`\\mathrm{avg}_{n,d}\\, s^2` (denominator R - 1); 0 when deterministic, NaN when R = 1.
    bias_sq : (...) ndarray
        Debiased :math:`\\mathrm{avg}_{n,d}[(\\bar y - y)^2 - s^2/R]`; equals ``bias_sq_naive``
        when deterministic, NaN when random with R = 1.
    bias_sq_naive : (...) ndarray
        :math:`\\mathrm{avg}_{n,d} (\\bar y - y)^2`.
    bias_sq_se : (...) ndarray
        Jackknife (leave-one-replicate-out) standard error of ``bias_sq``; 0 when
        deterministic, NaN when R < 3.
    replicates : int
        R.
    random : bool
        Whether the estimator was random (False: one replicate, zero variance by definition).
    """

    mean_abs: np.ndarray
    mse: np.ndarray
    mse_se: np.ndarray
    variance: np.ndarray
    bias_sq: np.ndarray
    bias_sq_naive: np.ndarray
    bias_sq_se: np.ndarray
    replicates: int
    random: bool

    def mse_ci(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Normal CI of the MSE over replicates."""
        return normal_ci(self.mse, self.mse_se, level)

    def bias_sq_ci(self, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Normal CI of the debiased squared bias (jackknife SE)."""
        return normal_ci(self.bias_sq, self.bias_sq_se, level)


def _metrics_iv(estimates: Any, exact: Any, random: Any) -> tuple[np.ndarray, np.ndarray, bool]:
    est = np.asarray(estimates, dtype=np.float64)
    ex = np.asarray(exact, dtype=np.float64)
    if est.ndim < 3:
        raise ValueError(f"estimates must have shape (R, ..., N, Dv), got {est.shape}")
    if est.shape[1:] != ex.shape:
        raise ValueError(
            f"estimates of shape {est.shape} do not match exact of shape {ex.shape}: expected (R, *exact.shape)"
        )
    if not isinstance(random, (bool, np.bool_)):
        raise TypeError(f"random must be a bool, got {type(random).__name__}")
    return est, ex, bool(random)


def jackknife_debiased_bias_sq(estimates: np.ndarray, exact: np.ndarray) -> np.ndarray:
    r"""Leave-one-replicate-out jackknife SE of the debiased squared bias, shape ``(...)``.

    Parameters
    ----------
    estimates : (R, ..., N, Dv) ndarray, R >= 3
    exact : (..., N, Dv) ndarray

    Returns
    -------
    (...) ndarray

    Notes
    -----
    With :math:`\hat\theta_{(-r)}` the debiased squared bias from the R - 1 replicates other
    than r (averaged over elements),

    .. math::
        \mathrm{SE}_{\text{jack}} = \sqrt{\frac{R-1}{R} \sum_r (\hat\theta_{(-r)} - \bar\theta_{(\cdot)})^2}.

    The deleted means and variances use the update formulas
    :math:`\bar y_{(-r)} = (R\bar y - y_r)/(R-1)` and
    :math:`(R-2)\, s^2_{(-r)} = (R-1) s^2 - \frac{R}{R-1}(y_r - \bar y)^2`, so no loop over r.
    The jackknife suits the debiased estimator because it is a U-statistic of degree 2;
    unlike the first-order delta method (whose leading term vanishes when the bias is 0)
    it stays informative for unbiased estimators.

    References
    ----------
    Efron & Stein (1981), The jackknife estimate of variance, Ann. Stat. 9(3).
    """
    mean = estimates.mean(0)
    dev = estimates - mean
    bias = mean - exact
    return _jackknife_from_sums(_mean_dot(dev, dev), _mean_dot(dev, bias), _mean_dot(bias, bias))


def _mean_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``(a * b).mean(axis=(-2, -1))`` in one pass, without the product array."""
    return np.einsum("...nd,...nd->...", a, b) / (a.shape[-2] * a.shape[-1])


def _jackknife_from_sums(dd: np.ndarray, bd: np.ndarray, b2: np.ndarray) -> np.ndarray:
    """The jackknife SE of :func:`jackknife_debiased_bias_sq` from avg d_r^2 ``(R, ...)``, avg b d_r ``(R, ...)``, avg b^2."""
    r = dd.shape[0]
    # with d_r = y_r - mean and b = mean - y: mean_loo_r - y = b - d_r/(R-1) and
    # s^2_(-r) = sum_r' d_r'^2 - R/(R-1) d_r^2, so theta_(-r) needs only two reductions per replicate
    theta_loo = (b2 - 2.0 / (r - 1) * bd + dd / (r - 1) ** 2
                 - (dd.sum(0) - r / (r - 1) * dd) / ((r - 2) * (r - 1)))
    centred = theta_loo - theta_loo.mean(0)
    return np.sqrt((r - 1) / r * (centred * centred).sum(0))


def replicate_metrics(estimates: Any, exact: Any, *, random: bool = True) -> ReplicateMetrics:
    r"""Mean, variance, MSE and (debiased) squared bias from R replicates.

    Parameters
    ----------
    estimates : (R, ..., N, Dv) array_like
        Replicates :math:`y_r` (independent draws of the same estimator on the same input).
    exact : (..., N, Dv) array_like
        The exact output :math:`y` (softmax attention).
    random : bool
        False for a deterministic estimator: then one replicate suffices and the variance and
        its standard errors are exactly 0 (extra replicates, if given, must be identical and
        are not used beyond the first).

    Returns
    -------
    ReplicateMetrics
        Each field of shape ``(...)`` (the batch dims), averaged over (N, Dv).

    Warns
    -----
    RuntimeWarning
        A random estimator with R = 1: variance, debiased bias² and SEs are NaN. With R = 2
        the jackknife SE of the bias² is NaN (it needs R >= 3).

    Notes
    -----
    Formulas in the module docstring. ``mse_se`` is the normal-theory SE of a mean of the R
    i.i.d. per-replicate errors; ``bias_sq_se`` is the jackknife SE
    (:func:`jackknife_debiased_bias_sq`). ``mse = bias_sq_naive + (R-1)/R variance`` holds
    exactly (the sample bias-variance decomposition).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.analysis.metrics import replicate_metrics
    >>> y = np.zeros((1, 1))
    >>> m = replicate_metrics(np.array([[[0.0]], [[3.0]], [[6.0]]]), y)  # R = 3: the jackknife SE needs 3
    >>> float(m.mse), float(m.variance), float(m.bias_sq_naive), float(m.bias_sq)
    (15.0, 9.0, 9.0, 6.0)
    """
    return _replicate_metrics(estimates, exact, random, with_relative_error=False)[0]


def metrics_with_relative_error(estimates: Any, exact: Any, *, random: bool = True) -> tuple[ReplicateMetrics, np.ndarray]:
    """``(replicate_metrics(estimates, exact), relative_error(used, exact))`` from one difference array.

    ``used`` are the replicates the metrics use (the first only, for a deterministic estimator).
    The same numbers, bit for bit, as the two calls, which would each form ``estimates - exact``.
    """
    return _replicate_metrics(estimates, exact, random, with_relative_error=True)


def _replicate_metrics(estimates: Any, exact: Any, random: Any, *,
                       with_relative_error: bool) -> tuple[ReplicateMetrics, np.ndarray | None]:
    """:func:`replicate_metrics`, and the relative error of the replicates it uses when asked."""
    est, ex, random = _metrics_iv(estimates, exact, random)
    if not random:
        est = est[:1]
        rel = _relative_error_of_diff(est - ex, ex) if with_relative_error else None
        err = ((est[0] - ex) ** 2).mean(axis=(-2, -1))
        return _deterministic_metrics(np.abs(est[0]).mean(axis=(-2, -1)), err), rel
    # one difference array; every reduction below is a one-pass dot product over (N, Dv)
    diff = est - ex  # (R, ..., N, Dv): y_r - y
    rel = _relative_error_of_diff(diff, ex) if with_relative_error else None  # before diff is overwritten below
    bias = diff.mean(0)  # mean - y
    mean_abs = np.abs(bias + ex).mean(axis=(-2, -1))
    per_rep_err = _mean_dot(diff, diff)  # (R, ...)
    naive = _mean_dot(bias, bias)
    if diff.shape[0] == 1:
        return _metrics_from_sums(mean_abs, per_rep_err, naive, None, None), rel
    dev = np.subtract(diff, bias, out=diff)  # y_r - mean, in place of diff
    return _metrics_from_sums(mean_abs, per_rep_err, naive, _mean_dot(dev, dev), _mean_dot(dev, bias)), rel


def _deterministic_metrics(mean_abs: np.ndarray, err: np.ndarray) -> ReplicateMetrics:
    """A deterministic estimator's :class:`ReplicateMetrics` from avg |y_1| and avg (y_1 - y)^2 ``(...)``: no variance."""
    zero = np.zeros(err.shape)
    return ReplicateMetrics(
        mean_abs=mean_abs, mse=err, mse_se=zero, variance=zero.copy(), bias_sq=err.copy(), bias_sq_naive=err.copy(),
        bias_sq_se=zero.copy(), replicates=1, random=False,
    )


def _metrics_from_sums(mean_abs: np.ndarray, per_rep_err: np.ndarray, naive: np.ndarray, dd: np.ndarray | None,
                       db: np.ndarray | None) -> ReplicateMetrics:
    """A random estimator's :class:`ReplicateMetrics` from its averages over (n, d), all float64 numpy.

    ``mean_abs (...)``: avg |mean|; ``per_rep_err (R, ...)``: avg (y_r - y)^2; ``naive (...)``: avg (mean - y)^2;
    ``dd (R, ...)``: avg d_r^2 and ``db (R, ...)``: avg d_r (mean - y), with d_r = y_r - mean (None when R = 1).
    The warnings point at the first caller outside randattn (:func:`randattn._callers.outside_stacklevel`).
    """
    r = per_rep_err.shape[0]
    batch = per_rep_err.shape[1:]
    mse = per_rep_err.mean(0)
    if r == 1:
        warnings.warn(
            "replicate_metrics: a random estimator needs R >= 2 replicates for a variance; got R = 1, "
            "so variance, debiased bias^2 and standard errors are NaN",
            RuntimeWarning,
            stacklevel=outside_stacklevel(),
        )
        nan = np.full(batch, np.nan)
        return ReplicateMetrics(
            mean_abs=mean_abs, mse=mse, mse_se=nan, variance=nan.copy(), bias_sq=nan.copy(),
            bias_sq_naive=naive, bias_sq_se=nan.copy(), replicates=1, random=True,
        )
    variance = dd.sum(0) / (r - 1)
    bias_sq = naive - variance / r
    mse_se = per_rep_err.std(0, ddof=1) / math.sqrt(r)
    if r >= 3:
        bias_sq_se = _jackknife_from_sums(dd, db, naive)
    else:
        warnings.warn(
            "replicate_metrics: the jackknife SE of the debiased bias^2 needs R >= 3 replicates, got R = 2; "
            "bias_sq_se is NaN",
            RuntimeWarning,
            stacklevel=outside_stacklevel(),
        )
        bias_sq_se = np.full(batch, np.nan)
    return ReplicateMetrics(
        mean_abs=mean_abs, mse=mse, mse_se=mse_se, variance=variance, bias_sq=bias_sq,
        bias_sq_naive=naive, bias_sq_se=bias_sq_se, replicates=r, random=True,
    )


#: above this many bytes, :func:`metrics_of_differences` forms its products a group of replicates at a time
PRODUCT_CHUNK_BYTES = 64 * 2**20


def metrics_of_differences(diff: Any, exact: Any, *, random: bool = True) -> tuple[ReplicateMetrics, np.ndarray]:
    r""":func:`metrics_with_relative_error` from the differences, as torch float64 tensors on any device.

    The sweep's form, ready for a GPU: the estimates never leave their device; the
    reductions over (n, d) run there, and only the per-(replicate, batch element) averages cross
    to the host, where :func:`replicate_metrics`'s formulas finish them. The same quantities as
    :func:`metrics_with_relative_error`, with torch's float64 reductions (their rounding, about
    1e-16 relative, differs from numpy's).

    Parameters
    ----------
    diff : (R, ..., N, Dv) torch.Tensor, float64
        :math:`y_r - y`; overwritten (by :math:`y_r - \bar y`) for a random estimator.
    exact : (..., N, Dv) torch.Tensor, float64, on ``diff``'s device
        :math:`y`.
    random : bool
        As :func:`replicate_metrics`: False uses the first replicate only.

    Returns
    -------
    (ReplicateMetrics, (...) ndarray)
        The metrics and the relative error of the replicates they use.
    """
    import torch

    if not isinstance(diff, torch.Tensor) or not isinstance(exact, torch.Tensor):
        raise TypeError("metrics_of_differences takes torch tensors; use metrics_with_relative_error for arrays")
    if diff.dtype != torch.float64 or exact.dtype != torch.float64:
        raise TypeError(f"metrics_of_differences needs float64 tensors, got {diff.dtype} and {exact.dtype}")
    if diff.ndim < 3 or diff.shape[1:] != exact.shape:
        raise ValueError(f"differences of shape {tuple(diff.shape)} do not match exact of shape {tuple(exact.shape)}: "
                         "expected (R, *exact.shape)")
    if not isinstance(random, (bool, np.bool_)):
        raise TypeError(f"random must be a bool, got {type(random).__name__}")
    if not random:
        diff = diff[:1]
    size = exact.shape[-2] * exact.shape[-1]

    def mean_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """The average over (n, d) of a * b on the device. vecdot forms the product before summing it, and the
        product of a long unit is as large as its store of estimates (400 MiB at 32k tokens): above
        :data:`PRODUCT_CHUNK_BYTES` it is taken a group of replicates at a time (a few groups, so a small unit keeps
        its one call, as the launch count on a GPU wants). A group is reduced as the whole was, row by row, so the
        bits do not change."""
        per_replicate = a[0].numel() * a.element_size()
        if a.ndim < 4 or a.shape[0] * per_replicate <= PRODUCT_CHUNK_BYTES:
            return torch.linalg.vecdot(a.flatten(-2), b.flatten(-2)) / size
        step = max(1, PRODUCT_CHUNK_BYTES // per_replicate)
        b = b.expand_as(a)
        return torch.cat([torch.linalg.vecdot(a[r:r + step].flatten(-2), b[r:r + step].flatten(-2))
                          for r in range(0, a.shape[0], step)]) / size

    with torch.no_grad():
        rows = torch.linalg.vector_norm(diff, dim=-1) / torch.linalg.vector_norm(exact, dim=-1)
        rel = _to_host(rows.mean(dim=(0, -1)))  # a zero exact row gives inf or NaN, as relative_error
        bias = diff.mean(0)
        mean_abs = _to_host((bias + exact).abs_().mean(dim=(-2, -1)))
        per_rep_err = mean_dot(diff, diff)
        if not random:
            return _deterministic_metrics(mean_abs, _to_host(per_rep_err[0])), rel
        naive = mean_dot(bias, bias)
        if diff.shape[0] == 1:
            return _metrics_from_sums(mean_abs, _to_host(per_rep_err), _to_host(naive), None, None), rel
        dev = diff.sub_(bias)
        return _metrics_from_sums(mean_abs, _to_host(per_rep_err), _to_host(naive), _to_host(mean_dot(dev, dev)),
                                  _to_host(mean_dot(dev, bias))), rel


def _to_host(t: Any) -> np.ndarray:
    """The one way :func:`metrics_of_differences` moves a result to the host (the tests watch what crosses)."""
    return t.cpu().numpy()


def relative_error(estimates: Any, exact: Any) -> np.ndarray:
    r"""Mean relative error per query, :math:`\mathrm{avg}_{r,n} \|\hat y_{rn} - y_n\| / \|y_n\|`.

    Parameters
    ----------
    estimates : (R, ..., N, Dv) array_like
    exact : (..., N, Dv) array_like

    Returns
    -------
    (...) ndarray
        Euclidean norms over Dv; averaged over queries n and replicates r. A query with
        :math:`y_n = 0` contributes inf (or NaN if the estimate is exactly 0 too).
    """
    est = np.asarray(estimates, dtype=np.float64)
    ex = np.asarray(exact, dtype=np.float64)
    return _relative_error_of_diff(est - ex, ex)


def _relative_error_of_diff(diff: np.ndarray, ex: np.ndarray) -> np.ndarray:
    """:func:`relative_error` from ``diff = estimates - exact``."""
    # row norms as one-pass dot products (np.linalg.norm would write the squares first)
    err = np.sqrt(np.einsum("...d,...d->...", diff, diff))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = err / np.sqrt(np.einsum("...d,...d->...", ex, ex))
    return ratio.mean(axis=(0, -1))


def probability_mse(estimated_probs: Any, exact_probs: Any) -> np.ndarray:
    r"""MSE of the attention probabilities, :math:`\mathrm{avg}_{r,n,m} (\hat P_{rnm} - P_{nm})^2`.

    Parameters
    ----------
    estimated_probs : (R, ..., N, M) array_like
        The estimator's implied attention matrix per replicate.
    exact_probs : (..., N, M) array_like
        ``softmax_m(scale q_n . k_m)``.

    Returns
    -------
    (...) ndarray

    Notes
    -----
    Every estimator in the catalogue is linear in the values given the draws,
    :math:`\hat y_n = \sum_m \hat P_{nm}(q, k, \omega)\, v_m`, so the sweep obtains
    :math:`\hat P` by evaluating it with ``v = I_M`` and the same draws
    (:func:`randattn.analysis.sweep` ``probabilities=True``).
    """
    est = np.asarray(estimated_probs, dtype=np.float64)
    ex = np.asarray(exact_probs, dtype=np.float64)
    return ((est - ex) ** 2).mean(axis=(0, -2, -1))
