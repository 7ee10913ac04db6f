r"""Generic Monte Carlo primitives in numpy/scipy float64: the formulas the theory checks hold the estimators to.

They live beside the theory checks (``randattn verify``) that use them: no estimator imports them, so
the estimators' own references stay independent of these formulas and the checks can compare the two.

Importance sampling (IS), self-normalized IS (SNIS) and its diagnostics, multiple importance
sampling (MIS) with its weighting functions, and control variates, each the literal formula
of one equation in the papers, computed in log space where that keeps it finite.

Axis conventions (the same in every function, ARCHITECTURE sec. 3):

- samples are the last axis of a log density or log weight, ``(..., S)``, and the second
  last of a function value, ``f : (..., S, Dv)``; leading ``...`` dims are batch dims
  (queries, heads, replicates) and broadcast between arguments;
- for MIS with one sample per proposal (LARA eq. 8), ``omega_c ~ q_c`` for ``c = 1..C`` and
  two ``(..., C, C)`` matrices indexed *(proposal or weighting function, sample)*:
  ``log_proposals[..., c', j] = log q_{c'}(omega_j)`` and ``alpha[..., c, j] = alpha_c(omega_j)``.
  A valid weighting function sums to one down each column: ``alpha.sum(-2) == 1``;
- for control variates, replicates come first: ``g_samples : (R, ..., Dv)``.

Log densities and log weights may be ``-inf`` (a zero density or weight) but never NaN or
``+inf``; function values, weighting functions and coefficients must be finite. Degenerate
but legal input (one sample for a variance, all weights zero) gives NaN with a
``RuntimeWarning``; illegal input raises ``ValueError`` naming the argument and its shape.

References
----------
.. [LARA] L. Zheng, C. Wang, L. Kong. "Linear Complexity Randomized Self-attention
   Mechanism", ICML 2022 (``papers/lara-randomized-attention-icml2022.md``).
.. [EVA] L. Zheng, J. Yuan, C. Wang, L. Kong. "Efficient Attention via Control Variates",
   ICLR 2023 (``papers/eva-control-variates-iclr2023.md``).
.. [Owen] A. B. Owen. "Monte Carlo theory, methods and examples", 2013, ch. 8 (control
   variates) and ch. 9 (importance sampling).
.. [VG] E. Veach, L. J. Guibas. "Optimally combining sampling techniques for Monte Carlo
   rendering", SIGGRAPH 1995.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from randattn._callers import outside_stacklevel

__all__ = [
    "PARTITION_OF_UNITY_RTOL",
    "importance_sampling",
    "snis",
    "snis_weights",
    "kish_ess",
    "snis_delta_method_variance",
    "SnisControlVariate",
    "snis_as_control_variate",
    "balance_heuristic",
    "power_heuristic",
    "decoupled_heuristic",
    "check_weighting_functions",
    "mis",
    "self_normalized_mis",
    "control_variate",
    "optimal_cv_coefficient",
    "PerKeyControlVariates",
    "eva_per_key_terms",
]

FloatArray = NDArray[np.float64]

#: A weighting function must sum to one over proposals up to this tolerance, relative to
#: ``max(1, sum_c |alpha_c|)``: rounding in a softmax or a zero-sum correction is ~1e-16 per
#: term, so 1e-9 accepts every honest construction and rejects every real deviation.
PARTITION_OF_UNITY_RTOL = 1e-9


# ----------------------------------------------------------------------------------------
# validation and log-space kernels (private)
# ----------------------------------------------------------------------------------------


def _as_float64(name: str, value: Any, layout: str, *, min_ndim: int, allow_neg_inf: bool) -> FloatArray:
    """``value`` as a float64 array of at least ``min_ndim`` dims, non-empty, with legal values."""
    array = np.asarray(value)
    if array.dtype == np.bool_ or not (
        np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    ):
        raise TypeError(f"{name} must be a real numeric array of shape {layout}, got dtype {array.dtype}")
    array = array.astype(np.float64, copy=False)
    if array.ndim < min_ndim:
        raise ValueError(f"{name} must have shape {layout}, got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"{name} is empty: shape {array.shape}; expected {layout} with every size >= 1")
    if allow_neg_inf:
        bad = np.isnan(array) | (array == np.inf)
        what = "NaN or +inf (-inf, a zero density, is allowed)"
    else:
        bad = ~np.isfinite(array)
        what = "NaN or infinite values"
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} contains {what}: first at index {first} of shape {array.shape}")
    return array


def _finite_real(name: str, value: Any, *, positive: bool = False) -> float:
    """``value`` as a float if it is a finite real number (and > 0 when ``positive``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    number = float(value)
    if not math.isfinite(number) or (positive and number <= 0):
        raise ValueError(f"{name} must be a finite number{' > 0' if positive else ''}, got {value!r}")
    return number


def _batch_shape(**shapes: tuple[int, ...]) -> tuple[int, ...]:
    """Broadcast the leading (batch) shapes of several arguments, naming them on failure."""
    try:
        return tuple(np.broadcast_shapes(*shapes.values()))
    except ValueError:
        listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"leading (batch) dims do not broadcast: {listed}") from None


def _check_size(name: str, array: FloatArray, axis: int, size: int, what: str, layout: str) -> None:
    if array.shape[axis] != size:
        raise ValueError(
            f"{name} must have shape {layout} with {what}; got shape {array.shape} "
            f"(size {array.shape[axis]} on axis {axis})"
        )


def _safe_max(x: FloatArray, axis: int) -> FloatArray:
    """Max over ``axis`` (kept), with an all ``-inf`` slice mapped to 0 so ``x - max`` is ``-inf``."""
    m = np.max(x, axis=axis, keepdims=True)
    return np.where(np.isfinite(m), m, 0.0)


def _logsumexp(x: FloatArray, axis: int) -> FloatArray:
    """``log sum exp`` over ``axis`` by max subtraction; ``-inf`` for an all ``-inf`` slice."""
    m = _safe_max(x, axis)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m), axis=axis)) + np.squeeze(m, axis=axis)


def _softmax(x: FloatArray, axis: int) -> tuple[FloatArray, NDArray[np.bool_]]:
    """Softmax over ``axis`` by max subtraction; NaN (and a True flag) for an all ``-inf`` slice."""
    e = np.exp(x - _safe_max(x, axis))
    total = np.sum(e, axis=axis, keepdims=True)
    zero = total == 0.0
    with np.errstate(invalid="ignore"):
        return e / np.where(zero, np.nan, total), np.squeeze(zero, axis=axis)


def _warn(message: str) -> None:
    """Emit a ``RuntimeWarning`` attributed to the first caller outside randattn
    (:func:`randattn._callers.outside_stacklevel`), however many helpers lie in between."""
    warnings.warn(message, RuntimeWarning, stacklevel=outside_stacklevel())


# ----------------------------------------------------------------------------------------
# importance sampling
# ----------------------------------------------------------------------------------------


def _is_iv(log_target: ArrayLike, log_proposal: ArrayLike, f: ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
    log_target = _as_float64("log_target", log_target, "(..., S)", min_ndim=1, allow_neg_inf=True)
    # the proposal density at its own samples is positive: -inf there is not a valid draw
    log_proposal = _as_float64("log_proposal", log_proposal, "(..., S)", min_ndim=1, allow_neg_inf=False)
    f = _as_float64("f", f, "(..., S, Dv)", min_ndim=2, allow_neg_inf=False)
    s = log_target.shape[-1]
    _check_size("log_proposal", log_proposal, -1, s, f"S = {s} samples as log_target", "(..., S)")
    _check_size("f", f, -2, s, f"S = {s} samples as log_target", "(..., S, Dv)")
    _batch_shape(log_target=log_target.shape[:-1], log_proposal=log_proposal.shape[:-1], f=f.shape[:-2])
    return log_target, log_proposal, f


def importance_sampling(log_target: ArrayLike, log_proposal: ArrayLike, f: ArrayLike) -> FloatArray:
    r"""Plain importance sampling estimate of :math:`\mathbb{E}_p[f]` from samples of ``q``.

    Parameters
    ----------
    log_target : (..., S) array_like
        :math:`\log p(\omega_s)` of the *normalized* target density at the samples; ``-inf``
        for a zero density.
    log_proposal : (..., S) array_like
        :math:`\log q(\omega_s)` of the proposal that drew the samples; finite.
    f : (..., S, Dv) array_like
        :math:`f(\omega_s)`. A scalar function is passed as ``f[..., None]``.

    Returns
    -------
    estimate : (..., Dv) ndarray
        Leading dims are the broadcast of the arguments' leading dims.

    Notes
    -----
    With :math:`\omega_s \sim q` i.i.d. (LARA sec. 2.3),

    .. math::
        \hat\mu_{\mathrm{IS}} = \frac{1}{S} \sum_{s=1}^S \frac{p(\omega_s)}{q(\omega_s)} f(\omega_s),
        \qquad \operatorname{Var}\hat\mu_{\mathrm{IS}}
        = \frac{1}{S}\Big(\mathbb{E}_q\Big[\frac{p^2}{q^2} f^2\Big] - \mu^2\Big),

    unbiased whenever :math:`q > 0` where :math:`p f \ne 0`. The weights are exponentiated
    relative to their maximum and the maximum is restored last, so the result is finite
    whenever its true value is. A result that overflows float64 warns.

    References
    ----------
    LARA sec. 2.3 (the unnumbered IS identity before eq. 3); Owen (2013) sec. 9.1.

    Examples
    --------
    :math:`\mathbb{E}_p[\omega] = 1` for :math:`p = \mathcal{N}(1, 1)`, sampled from
    :math:`q = \mathcal{N}(0, 2^2)`:

    >>> import numpy as np
    >>> from scipy.stats import norm
    >>> from randattn.theory.montecarlo import importance_sampling
    >>> omega = np.random.default_rng(0).normal(0.0, 2.0, size=100_000)
    >>> est = importance_sampling(norm.logpdf(omega, 1.0), norm.logpdf(omega, 0.0, 2.0), omega[:, None])
    >>> bool(abs(est[0] - 1.0) < 0.05)
    True
    """
    log_target, log_proposal, f = _is_iv(log_target, log_proposal, f)
    log_ratio = log_target - log_proposal
    shift = _safe_max(log_ratio, axis=-1)  # (..., 1)
    scaled = np.exp(log_ratio - shift)  # in [0, 1]
    s = log_ratio.shape[-1]
    with np.errstate(over="ignore", invalid="ignore"):
        estimate = np.exp(shift) * (scaled[..., None, :] @ f)[..., 0, :] / s
    if not np.isfinite(estimate).all():
        _warn(
            "importance_sampling: the importance-weighted mean overflows float64 "
            f"({np.count_nonzero(~np.isfinite(estimate))} non-finite entries); "
            "use snis, or keep the result in log space"
        )
    return estimate


# ----------------------------------------------------------------------------------------
# self-normalized importance sampling and its diagnostics
# ----------------------------------------------------------------------------------------


def _snis_iv(log_weights: ArrayLike, f: ArrayLike | None = None) -> tuple[FloatArray, FloatArray | None]:
    log_weights = _as_float64("log_weights", log_weights, "(..., S)", min_ndim=1, allow_neg_inf=True)
    if f is None:
        return log_weights, None
    f = _as_float64("f", f, "(..., S, Dv)", min_ndim=2, allow_neg_inf=False)
    s = log_weights.shape[-1]
    _check_size("f", f, -2, s, f"S = {s} samples as log_weights", "(..., S, Dv)")
    _batch_shape(log_weights=log_weights.shape[:-1], f=f.shape[:-2])
    return log_weights, f


def _warn_zero_weights(function: str, zero: NDArray[np.bool_]) -> None:
    if np.any(zero):
        _warn(
            f"{function}: all weights are zero (every log weight is -inf) in "
            f"{np.count_nonzero(zero)} of {zero.size} batch positions; the result is NaN there",
        )


def snis_weights(log_weights: ArrayLike) -> FloatArray:
    r"""Normalized importance weights :math:`\bar w_s = w_s / \sum_{s'} w_{s'}`, from log weights.

    Parameters
    ----------
    log_weights : (..., S) array_like
        Unnormalized :math:`\log w_s = \log \tilde p(\omega_s) - \log q(\omega_s)`; any additive
        constant (e.g. an unknown :math:`\log Z`) cancels. ``-inf`` is a zero weight.

    Returns
    -------
    weights : (..., S) ndarray
        Non-negative, summing to one over samples. NaN (with a ``RuntimeWarning``) where every
        weight is zero.

    Notes
    -----
    .. math::
        \bar w_s = \frac{\exp(\log w_s - m)}{\sum_{s'} \exp(\log w_{s'} - m)},
        \qquad m = \max_s \log w_s,

    a softmax over samples that never overflows, whatever the magnitude of the log weights.

    References
    ----------
    LARA eq. 3; Owen (2013) sec. 9.2.

    Examples
    --------
    >>> from randattn.theory.montecarlo import snis_weights
    >>> snis_weights([1e4, 1e4 + np.log(3.0)]).round(6).tolist()
    [0.25, 0.75]
    """
    (log_weights, _) = _snis_iv(log_weights)
    weights, zero = _softmax(log_weights, axis=-1)
    _warn_zero_weights("snis_weights", zero)
    return weights


def snis(log_weights: ArrayLike, f: ArrayLike) -> FloatArray:
    r"""Self-normalized importance sampling estimate of :math:`\mathbb{E}_p[f]`, in log space.

    Parameters
    ----------
    log_weights : (..., S) array_like
        Unnormalized :math:`\log \tilde p(\omega_s) - \log q(\omega_s)` for
        :math:`\omega_s \sim q`; additive constants cancel. ``-inf`` is a zero weight.
    f : (..., S, Dv) array_like
        :math:`f(\omega_s)`. Leading dims broadcast against those of ``log_weights`` (e.g.
        RFA's per-sample value averages ``(S, Dv)`` shared by all queries ``(N, S)``).

    Returns
    -------
    estimate : (..., Dv) ndarray
        NaN (with a ``RuntimeWarning``) where every weight is zero.

    Notes
    -----
    .. math::
        \tilde\mu = \frac{\sum_s \frac{\tilde p(\omega_s)}{q(\omega_s)} f(\omega_s)}
                        {\sum_s \frac{\tilde p(\omega_s)}{q(\omega_s)}}
                  = \sum_s \bar w_s f(\omega_s),
        \qquad \bar w = \operatorname{softmax}_s(\log w),

    biased by :math:`O(1/S)` but consistent; its variance is estimated by
    :func:`snis_delta_method_variance`.

    References
    ----------
    LARA eq. 3 (and eq. 4-6: RFA is this estimator with :math:`q = \mathcal{N}(0, I)`);
    EVA sec. 2.2; Owen (2013) sec. 9.2.

    Examples
    --------
    :math:`\mathbb{E}_p[\omega] = 1` for :math:`p \propto \exp(-(\omega - 1)^2/2)`, sampled
    from :math:`\mathcal{N}(0, 2^2)` (the normalizing constants are dropped on purpose):

    >>> import numpy as np
    >>> from randattn.theory.montecarlo import snis
    >>> omega = np.random.default_rng(0).normal(0.0, 2.0, size=100_000)
    >>> log_w = -0.5 * (omega - 1.0) ** 2 + 0.5 * (omega / 2.0) ** 2
    >>> bool(abs(snis(log_w, omega[:, None])[0] - 1.0) < 0.05)
    True
    """
    log_weights, f = _snis_iv(log_weights, f)
    weights, zero = _softmax(log_weights, axis=-1)
    _warn_zero_weights("snis", zero)
    return (weights[..., None, :] @ f)[..., 0, :]


def kish_ess(log_weights: ArrayLike) -> FloatArray:
    r"""Kish's effective sample size of importance weights, from log weights.

    Parameters
    ----------
    log_weights : (..., S) array_like
        Unnormalized log importance weights; additive constants cancel.

    Returns
    -------
    ess : (...) ndarray
        In ``[1, S]``: ``S`` for equal weights, ``1`` when one weight dominates. NaN (with a
        ``RuntimeWarning``) where every weight is zero.

    Notes
    -----
    .. math::
        \mathrm{ESS} = \frac{(\sum_s w_s)^2}{\sum_s w_s^2} = \frac{1}{\sum_s \bar w_s^2},

    computed from the normalized weights :math:`\bar w_s \in [0, 1]`, so it is finite for log
    weights of any magnitude.

    References
    ----------
    Kish (1965), *Survey Sampling*; Owen (2013) sec. 9.3 (effective sample size).

    Examples
    --------
    >>> from randattn.theory.montecarlo import kish_ess
    >>> float(kish_ess([0.0, 0.0, 0.0, 0.0]))
    4.0
    >>> float(kish_ess([0.0, -1e4, -1e4]))
    1.0
    """
    (log_weights, _) = _snis_iv(log_weights)
    weights, zero = _softmax(log_weights, axis=-1)
    _warn_zero_weights("kish_ess", zero)
    return 1.0 / np.sum(weights**2, axis=-1)


def snis_delta_method_variance(log_weights: ArrayLike, f: ArrayLike) -> FloatArray:
    r"""Delta-method estimate of the variance of the SNIS estimate, per output element.

    Parameters
    ----------
    log_weights : (..., S) array_like
        Unnormalized log importance weights; additive constants cancel.
    f : (..., S, Dv) array_like
        :math:`f(\omega_s)`; leading dims broadcast as in :func:`snis`.

    Returns
    -------
    variance : (..., Dv) ndarray
        Estimated :math:`\operatorname{Var}[\tilde\mu]` of each output element. NaN (with a
        ``RuntimeWarning``) when ``S == 1`` (the formula is identically 0 there, which is
        not an estimate) or where every weight is zero.

    Notes
    -----
    Linearizing the ratio :math:`\tilde\mu = A / B` around its mean (LARA app. D, eq. 19,
    with one proposal) and plugging in the sample gives

    .. math::
        \widehat{\operatorname{Var}}[\tilde\mu]
        = \sum_{s=1}^S \bar w_s^2 \big(f(\omega_s) - \tilde\mu\big)^2,
        \qquad \tilde\mu = \sum_s \bar w_s f(\omega_s),

    elementwise over ``Dv``. It is consistent as :math:`S \to \infty` but can be badly
    optimistic when the weights are heavy-tailed (check :func:`kish_ess`).

    References
    ----------
    Owen (2013) sec. 9.2 (the delta-method variance of the self-normalized estimate);
    LARA app. D (the same linearization for self-normalized MIS, eq. 19-20).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.theory.montecarlo import snis_delta_method_variance
    >>> snis_delta_method_variance(np.zeros(4), np.array([[0.0], [1.0], [2.0], [3.0]])).tolist()
    [0.3125]
    """
    log_weights, f = _snis_iv(log_weights, f)
    weights, zero = _softmax(log_weights, axis=-1)
    _warn_zero_weights("snis_delta_method_variance", zero)
    if log_weights.shape[-1] == 1:
        _warn("snis_delta_method_variance: a variance needs S >= 2 samples, got S = 1; returning NaN")
    mean = (weights[..., None, :] @ f)[..., 0, :]  # (..., Dv)
    centred = f - mean[..., None, :]  # (..., S, Dv)
    variance = ((weights**2)[..., None, :] @ centred**2)[..., 0, :]
    if log_weights.shape[-1] == 1:
        variance = np.full_like(variance, np.nan)
    return variance


@dataclass(frozen=True)
class SnisControlVariate:
    r"""SNIS written as a control-variate estimate (EVA eq. 6); see :func:`snis_as_control_variate`.

    Attributes
    ----------
    g : (..., Dv) ndarray
        Base IS estimate :math:`g = \frac1S \sum_s W_s f(\omega_s)`.
    h : (...) ndarray
        Control variate :math:`h = \frac1S \sum_s W_s` (expectation 1 for normalized weights).
    beta : (..., Dv) ndarray
        Coefficient :math:`\hat\beta = g / h`.
    estimate : (..., Dv) ndarray
        :math:`g - \hat\beta (h - 1)`, equal to the SNIS estimate.
    """

    g: FloatArray
    h: FloatArray
    beta: FloatArray
    estimate: FloatArray


def snis_as_control_variate(log_weights: ArrayLike, f: ArrayLike) -> SnisControlVariate:
    r"""The SNIS estimate decomposed as a control variate, :math:`g - \hat\beta (h - \mathbb{E}h)`.

    Parameters
    ----------
    log_weights : (..., S) array_like
        :math:`\log W_s = \log p(\omega_s) - \log q(\omega_s)`. For :math:`h - 1` to be a
        zero-mean control variate the target must be *normalized* (:math:`\mathbb{E}_q W = 1`);
        with unnormalized weights the identity with :func:`snis` still holds exactly, but
        :math:`g` and :math:`h` are scaled by the unknown constant.
    f : (..., S, Dv) array_like
        :math:`f(\omega_s)`.

    Returns
    -------
    SnisControlVariate
        ``g``, ``h``, ``beta`` and ``estimate``; ``estimate`` equals ``snis(log_weights, f)``
        up to rounding.

    Notes
    -----
    .. math::
        \frac{\sum_s W_s f(\omega_s)}{\sum_s W_s}
        = \underbrace{\tfrac1S \textstyle\sum_s W_s f(\omega_s)}_{g}
          - \underbrace{\frac{g}{h}}_{\hat\beta}
            \big(\underbrace{\tfrac1S \textstyle\sum_s W_s}_{h} - \mathbb{E}[h]\big),
        \qquad \mathbb{E}[h] = 1.

    Unlike :func:`snis`, ``g`` and ``h`` are absolute (not shift-invariant) quantities, so
    they are computed from :math:`W_s = \exp(\log W_s)` directly; a ``RuntimeWarning`` flags
    weights that overflow float64.

    References
    ----------
    EVA eq. 6 (sec. 3.1) and app. B.2; Vlassis et al. (2021).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.theory.montecarlo import snis, snis_as_control_variate
    >>> rng = np.random.default_rng(0)
    >>> log_w, f = rng.normal(size=8), rng.normal(size=(8, 3))
    >>> cv = snis_as_control_variate(log_w, f)
    >>> bool(np.allclose(cv.estimate, snis(log_w, f), rtol=0, atol=1e-12))
    True
    """
    log_weights, f = _snis_iv(log_weights, f)
    s = log_weights.shape[-1]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        w = np.exp(log_weights)
        g = (w[..., None, :] @ f)[..., 0, :] / s
        h = np.sum(w, axis=-1) / s
        beta = g / h[..., None]
        estimate = g - beta * (h[..., None] - 1.0)
    if not (np.isfinite(w).all() and np.all(h > 0)):
        _warn(
            "snis_as_control_variate: the absolute importance weights overflow float64 or are all "
            "zero somewhere, so g, h and beta are not finite there; snis() stays finite"
        )
    return SnisControlVariate(g=g, h=h, beta=beta, estimate=estimate)


# ----------------------------------------------------------------------------------------
# multiple importance sampling: weighting functions
# ----------------------------------------------------------------------------------------


def _weighting_iv(log_proposals: ArrayLike) -> FloatArray:
    log_proposals = _as_float64("log_proposals", log_proposals, "(..., C, C)", min_ndim=2, allow_neg_inf=True)
    c = log_proposals.shape[-2]
    _check_size(
        "log_proposals", log_proposals, -1, c,
        f"as many samples as proposals (C = {c}; entry [..., c', j] is log q_c'(omega_j))", "(..., C, C)",
    )  # fmt: skip
    diagonal = np.diagonal(log_proposals, axis1=-2, axis2=-1)
    if not np.isfinite(diagonal).all():
        first = tuple(int(i) for i in np.argwhere(~np.isfinite(diagonal))[0])
        raise ValueError(
            "log_proposals[..., c, c] = log q_c(omega_c) must be finite (omega_c was drawn from q_c, "
            f"so q_c(omega_c) > 0); -inf at batch index {first[:-1]}, c = {first[-1]} of shape {log_proposals.shape}"
        )
    return log_proposals


def balance_heuristic(log_proposals: ArrayLike) -> FloatArray:
    r"""Balance-heuristic weighting functions of MIS, at every sample.

    Parameters
    ----------
    log_proposals : (..., C, C) array_like
        ``log_proposals[..., c', j]`` :math:`= \log q_{c'}(\omega_j)`, one sample
        :math:`\omega_j \sim q_j` per proposal. The diagonal must be finite; off-diagonal
        ``-inf`` (disjoint supports) is allowed.

    Returns
    -------
    alpha : (..., C, C) ndarray
        ``alpha[..., c, j]`` :math:`= \alpha_c(\omega_j)`, non-negative and summing to one
        over ``c`` (axis -2). The MIS estimate uses the diagonal :math:`\alpha_c(\omega_c)`.

    Notes
    -----
    .. math::
        \alpha_c(\omega) = \frac{q_c(\omega)}{\sum_{c'=1}^C q_{c'}(\omega)},

    a softmax over proposals of the log densities (one sample per proposal, so the sample
    counts :math:`n_c = 1` of Veach & Guibas drop out). With it, MIS equals plain IS from the
    mixture :math:`\frac1C \sum_c q_c` with stratified draws.

    References
    ----------
    LARA eq. 36 (app. G.3.2) and the first term of eq. 9; Veach & Guibas (1995).

    Examples
    --------
    >>> import numpy as np
    >>> from scipy.stats import norm
    >>> from randattn.theory.montecarlo import balance_heuristic
    >>> means = np.array([-1.0, 0.0, 2.0])
    >>> omega = np.random.default_rng(0).normal(means, 1.0)  # omega_c ~ N(means[c], 1)
    >>> alpha = balance_heuristic(norm.logpdf(omega[None, :], means[:, None]))
    >>> bool(np.allclose(alpha.sum(axis=-2), 1.0))
    True
    """
    log_proposals = _weighting_iv(log_proposals)
    alpha, _ = _softmax(log_proposals, axis=-2)  # the finite diagonal keeps every column non-zero
    return alpha


def power_heuristic(log_proposals: ArrayLike, power: float = 2.0) -> FloatArray:
    r"""Power-heuristic weighting functions of MIS (Veach & Guibas), at every sample.

    Parameters
    ----------
    log_proposals : (..., C, C) array_like
        ``log_proposals[..., c', j]`` :math:`= \log q_{c'}(\omega_j)`, as in
        :func:`balance_heuristic`.
    power : float, default 2
        The exponent :math:`\beta > 0`; 1 is the balance heuristic, :math:`\beta \to \infty`
        the maximum heuristic. Veach & Guibas recommend 2.

    Returns
    -------
    alpha : (..., C, C) ndarray
        ``alpha[..., c, j]`` :math:`= \alpha_c(\omega_j)`, summing to one over ``c``.

    Notes
    -----
    .. math::
        \alpha_c(\omega) = \frac{q_c(\omega)^\beta}{\sum_{c'=1}^C q_{c'}(\omega)^\beta},

    a softmax over proposals of :math:`\beta \log q_{c'}(\omega)`.

    References
    ----------
    Veach & Guibas (1995), the power heuristic; Owen (2013) ch. 9 (mixture and multiple importance sampling).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.theory.montecarlo import power_heuristic
    >>> power_heuristic(np.log([[1.0, 1.0], [3.0, 1.0]]), power=2.0)[:, 0].round(12).tolist()
    [0.1, 0.9]
    """
    log_proposals = _weighting_iv(log_proposals)
    power = _finite_real("power", power, positive=True)
    alpha, _ = _softmax(power * log_proposals, axis=-2)
    return alpha


def decoupled_heuristic(log_proposals: ArrayLike, query_scores: ArrayLike, beta: float = 1.0) -> FloatArray:
    r"""LARA's decoupled query-specific weighting functions: balance heuristic + a zero-sum shift.

    Parameters
    ----------
    log_proposals : (..., C, C) array_like
        ``log_proposals[..., c', j]`` :math:`= \log q_{c'}(\omega_j)`, as in
        :func:`balance_heuristic`.
    query_scores : (..., C) array_like
        :math:`r'_{nc}`, how much proposal ``c`` favours the query; any finite values (LARA
        uses the query-landmark similarity of eq. 37, normalized over queries ``n``; that
        normalization is the estimator's job). Leading dims broadcast with ``log_proposals``'.
    beta : float, default 1
        Strength of the query-specific correction (LARA uses 2 for vision).

    Returns
    -------
    alpha : (..., C, C) ndarray
        ``alpha[..., c, j]`` :math:`= \alpha_{nc}(\omega_j)`, summing to one over ``c``; it
        **can be negative** (hence the signed MIS functions).

    Notes
    -----
    .. math::
        \alpha_{nc}(\omega) = \frac{q_c(\omega)}{\sum_{c'} q_{c'}(\omega)}
          + \beta \Big(r'_{nc} - \frac1C \sum_{c'=1}^C r'_{nc'}\Big).

    The correction does not depend on :math:`\omega` and sums to zero over ``c``, so the
    weights still sum to one and MIS stays unbiased (LARA app. F).

    References
    ----------
    LARA eq. 38 (app. G.3.2, with its coefficient :math:`\beta`) and eq. 9.

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.theory.montecarlo import decoupled_heuristic
    >>> alpha = decoupled_heuristic(np.zeros((2, 2)), [0.9, 0.1], beta=2.0)
    >>> alpha.round(12).tolist()
    [[1.3, 1.3], [-0.3, -0.3]]
    """
    log_proposals = _weighting_iv(log_proposals)
    query_scores = _as_float64("query_scores", query_scores, "(..., C)", min_ndim=1, allow_neg_inf=False)
    c = log_proposals.shape[-1]
    _check_size("query_scores", query_scores, -1, c, f"C = {c} proposals as log_proposals", "(..., C)")
    _batch_shape(log_proposals=log_proposals.shape[:-2], query_scores=query_scores.shape[:-1])
    beta = _finite_real("beta", beta)
    balance, _ = _softmax(log_proposals, axis=-2)
    correction = beta * (query_scores - query_scores.mean(axis=-1, keepdims=True))
    return balance + correction[..., :, None]


def _check_partition_of_unity(alpha: FloatArray) -> None:
    """Raise unless every column of ``alpha`` (..., C, C) sums to one over axis -2."""
    deviation = np.abs(alpha.sum(axis=-2) - 1.0)
    allowed = PARTITION_OF_UNITY_RTOL * np.maximum(1.0, np.abs(alpha).sum(axis=-2))
    if np.any(deviation > allowed):
        worst = np.unravel_index(int(np.argmax(deviation - allowed)), deviation.shape)
        worst = tuple(int(i) for i in worst)
        raise ValueError(
            "alpha must sum to one over proposals c (axis -2) at every sample for MIS to be unbiased "
            f"(LARA app. F); max deviation |sum_c alpha[..., c, j] - 1| = {float(deviation.max()):.3g} "
            f"at batch index {worst[:-1]}, sample j = {worst[-1]} (alpha shape {alpha.shape}, "
            f"tolerance {PARTITION_OF_UNITY_RTOL:g} * max(1, sum_c |alpha|))"
        )


def check_weighting_functions(alpha: ArrayLike) -> FloatArray:
    r"""Validate MIS weighting functions: finite, square ``(..., C, C)``, summing to one over ``c``.

    Parameters
    ----------
    alpha : (..., C, C) array_like
        ``alpha[..., c, j]`` :math:`= \alpha_c(\omega_j)`; signed values are allowed.

    Returns
    -------
    alpha : (..., C, C) ndarray
        The same values as float64.

    Raises
    ------
    ValueError
        When the shape is wrong, a value is not finite, or some column deviates from
        :math:`\sum_c \alpha_c(\omega_j) = 1` by more than ``PARTITION_OF_UNITY_RTOL``
        times :math:`\max(1, \sum_c |\alpha_c(\omega_j)|)`; the message gives the maximum
        deviation and where it is.

    Notes
    -----
    Unbiasedness of MIS needs :math:`\sum_{c=1}^C \alpha_c(\omega) = 1` for every
    :math:`\omega` (and :math:`\alpha_c = 0` where :math:`p = 0`); only the sampled points can
    be checked.

    References
    ----------
    LARA eq. 8, 9 and app. F; Veach & Guibas (1995).

    Examples
    --------
    >>> from randattn.theory.montecarlo import check_weighting_functions
    >>> check_weighting_functions([[1.5, 0.25], [-0.5, 0.75]]).tolist()
    [[1.5, 0.25], [-0.5, 0.75]]
    """
    alpha = _as_float64("alpha", alpha, "(..., C, C)", min_ndim=2, allow_neg_inf=False)
    c = alpha.shape[-2]
    _check_size("alpha", alpha, -1, c, f"as many samples as weighting functions (C = {c})", "(..., C, C)")
    _check_partition_of_unity(alpha)
    return alpha


# ----------------------------------------------------------------------------------------
# multiple importance sampling: estimators
# ----------------------------------------------------------------------------------------


def _mis_iv(
    log_target: ArrayLike, log_proposals: ArrayLike, alpha: ArrayLike, f: ArrayLike, *, target_name: str
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    log_target = _as_float64(target_name, log_target, "(..., C)", min_ndim=1, allow_neg_inf=True)
    log_proposals = _weighting_iv(log_proposals)
    alpha = check_weighting_functions(alpha)
    f = _as_float64("f", f, "(..., C, Dv)", min_ndim=2, allow_neg_inf=False)
    c = log_target.shape[-1]
    what = f"C = {c} samples (one per proposal) as {target_name}"
    _check_size("log_proposals", log_proposals, -1, c, what, "(..., C, C)")
    _check_size("alpha", alpha, -1, c, what, "(..., C, C)")
    _check_size("f", f, -2, c, what, "(..., C, Dv)")
    _batch_shape(
        **{target_name: log_target.shape[:-1]},
        log_proposals=log_proposals.shape[:-2],
        alpha=alpha.shape[:-2],
        f=f.shape[:-2],
    )
    return log_target, log_proposals, alpha, f


def _signed_log_mis_weights(log_target: FloatArray, log_proposals: FloatArray, alpha: FloatArray) -> tuple[FloatArray, FloatArray]:
    """``log |alpha_c(omega_c)| + log p(omega_c) - log q_c(omega_c)`` and ``sign(alpha_c(omega_c))``."""
    alpha_diag = np.diagonal(alpha, axis1=-2, axis2=-1)
    log_q_diag = np.diagonal(log_proposals, axis1=-2, axis2=-1)
    with np.errstate(divide="ignore"):  # alpha_c(omega_c) = 0 is a zero weight: log 0 = -inf
        log_abs = np.log(np.abs(alpha_diag)) + log_target - log_q_diag
    return log_abs, np.sign(alpha_diag)


def mis(log_target: ArrayLike, log_proposals: ArrayLike, alpha: ArrayLike, f: ArrayLike) -> FloatArray:
    r"""Multiple importance sampling with one sample per proposal (unbiased when alpha sums to one).

    Parameters
    ----------
    log_target : (..., C) array_like
        :math:`\log p(\omega_c)` of the *normalized* target at the samples, ``-inf`` allowed.
    log_proposals : (..., C, C) array_like
        ``log_proposals[..., c', j]`` :math:`= \log q_{c'}(\omega_j)`, with
        :math:`\omega_j \sim q_j`; only the diagonal enters the estimate, the rest is for
        the weighting functions (diagonal finite, ``-inf`` allowed off it).
    alpha : (..., C, C) array_like
        ``alpha[..., c, j]`` :math:`= \alpha_c(\omega_j)`, e.g. from :func:`balance_heuristic`,
        :func:`power_heuristic` or :func:`decoupled_heuristic`; signed values allowed. Must sum
        to one over ``c`` (axis -2) at every sample, else ``ValueError`` with the maximum
        deviation.
    f : (..., C, Dv) array_like
        :math:`f(\omega_c)`.

    Returns
    -------
    estimate : (..., Dv) ndarray

    Notes
    -----
    .. math::
        \hat\mu_{\mathrm{MIS}} = \sum_{c=1}^C \alpha_c(\omega_c)
            \frac{p(\omega_c)}{q_c(\omega_c)} f(\omega_c), \qquad \omega_c \sim q_c,

    unbiased when :math:`\sum_c \alpha_c(\omega) = 1` for all :math:`\omega` (LARA app. F):
    :math:`\mathbb{E}\hat\mu = \sum_c \int \alpha_c p f = \int p f`. The weights enter as
    :math:`\operatorname{sign}\alpha \cdot \exp(\log|\alpha| + \log p - \log q_c - m)` with
    the maximum :math:`m` restored last, so negative :math:`\alpha` (LARA eq. 38) is exact.
    A per-query :math:`\alpha_{nc}` is a leading batch dim.

    References
    ----------
    LARA eq. 8 and app. F; Veach & Guibas (1995); Owen (2013) ch. 9 (multiple importance sampling).

    Examples
    --------
    :math:`\mathbb{E}_p[\omega] = 0.5` for :math:`p = \mathcal{N}(0.5, 1)` from two proposals
    :math:`\mathcal{N}(-1, 1.5^2)` and :math:`\mathcal{N}(2, 1.5^2)`, averaged over 4000
    replicates (the leading dim):

    >>> import numpy as np
    >>> from scipy.stats import norm
    >>> from randattn.theory.montecarlo import balance_heuristic, mis
    >>> means = np.array([-1.0, 2.0])
    >>> omega = np.random.default_rng(0).normal(means, 1.5, size=(4000, 2))
    >>> log_q = norm.logpdf(omega[:, None, :], means[:, None], 1.5)
    >>> est = mis(norm.logpdf(omega, 0.5), log_q, balance_heuristic(log_q), omega[..., None])
    >>> bool(abs(est.mean() - 0.5) < 0.05)
    True
    """
    log_target, log_proposals, alpha, f = _mis_iv(log_target, log_proposals, alpha, f, target_name="log_target")
    log_abs, sign = _signed_log_mis_weights(log_target, log_proposals, alpha)
    shift = _safe_max(log_abs, axis=-1)
    scaled = sign * np.exp(log_abs - shift)
    with np.errstate(over="ignore", invalid="ignore"):
        estimate = np.exp(shift) * (scaled[..., None, :] @ f)[..., 0, :]
    if not np.isfinite(estimate).all():
        _warn(
            "mis: the weighted sum overflows float64 "
            f"({np.count_nonzero(~np.isfinite(estimate))} non-finite entries); use self_normalized_mis"
        )
    return estimate


def self_normalized_mis(
    log_target_unnormalized: ArrayLike, log_proposals: ArrayLike, alpha: ArrayLike, f: ArrayLike
) -> FloatArray:
    r"""Self-normalized multiple importance sampling (the LARA combination), in signed log space.

    Parameters
    ----------
    log_target_unnormalized : (..., C) array_like
        :math:`\log \tilde p(\omega_c)`, the target up to an additive constant (which cancels);
        ``-inf`` allowed.
    log_proposals : (..., C, C) array_like
        ``log_proposals[..., c', j]`` :math:`= \log q_{c'}(\omega_j)`, as in :func:`mis`.
    alpha : (..., C, C) array_like
        ``alpha[..., c, j]`` :math:`= \alpha_c(\omega_j)`, signed allowed, summing to one over
        ``c`` at every sample (validated).
    f : (..., C, Dv) array_like
        :math:`f(\omega_c)`.

    Returns
    -------
    estimate : (..., Dv) ndarray
        NaN where the normalizer is exactly zero. A ``RuntimeWarning`` reports positions whose
        normalizer is zero or negative (possible only with negative ``alpha``); a negative one
        is kept, not hidden, so the returned ratio is what the formula gives.

    Notes
    -----
    .. math::
        \tilde\mu_{\mathrm{MIS}} = \frac{\sum_{c=1}^C \alpha_c(\omega_c)
              \frac{\tilde p(\omega_c)}{q_c(\omega_c)} f(\omega_c)}
            {\sum_{c=1}^C \alpha_c(\omega_c) \frac{\tilde p(\omega_c)}{q_c(\omega_c)}},
        \qquad \omega_c \sim q_c,

    consistent (and free of the normalizing constant of :math:`p`). The terms are
    :math:`\operatorname{sign}\alpha_c \exp(\ell_c - \max_{c'} \ell_{c'})` with
    :math:`\ell_c = \log|\alpha_c(\omega_c)| + \log\tilde p(\omega_c) - \log q_c(\omega_c)`,
    so it stays finite for log densities of any magnitude.

    References
    ----------
    LARA eq. 10 (sec. 4.2), eq. 28 (app. E) and app. D (its delta-method variance).

    Examples
    --------
    >>> import numpy as np
    >>> from scipy.stats import norm
    >>> from randattn.theory.montecarlo import balance_heuristic, self_normalized_mis
    >>> means = np.array([-1.0, 2.0])
    >>> omega = np.random.default_rng(0).normal(means, 1.5, size=(4000, 2))
    >>> log_q = norm.logpdf(omega[:, None, :], means[:, None], 1.5)
    >>> log_p_tilde = -0.5 * (omega - 0.5) ** 2 + 1e4  # unnormalized, shifted by 1e4
    >>> est = self_normalized_mis(log_p_tilde, log_q, balance_heuristic(log_q), omega[..., None])
    >>> bool(np.isfinite(est).all())
    True
    """
    log_target, log_proposals, alpha, f = _mis_iv(
        log_target_unnormalized, log_proposals, alpha, f, target_name="log_target_unnormalized"
    )
    log_abs, sign = _signed_log_mis_weights(log_target, log_proposals, alpha)
    scaled = sign * np.exp(log_abs - _safe_max(log_abs, axis=-1))
    numerator = (scaled[..., None, :] @ f)[..., 0, :]  # (..., Dv)
    normalizer = np.sum(scaled, axis=-1)  # (...); the same shift cancels in the ratio
    bad = normalizer <= 0.0
    if np.any(bad):
        _warn(
            f"self_normalized_mis: the normalizer sum_c alpha_c p~/q_c is zero in "
            f"{np.count_nonzero(normalizer == 0.0)} and negative in {np.count_nonzero(normalizer < 0.0)} "
            f"of {normalizer.size} batch positions (negative alpha); zero gives NaN, negative is kept"
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        return numerator / np.where(normalizer == 0.0, np.nan, normalizer)[..., None]


# ----------------------------------------------------------------------------------------
# control variates
# ----------------------------------------------------------------------------------------


def _cv_iv(g: ArrayLike, h: ArrayLike, h_mean: ArrayLike, beta: ArrayLike) -> tuple[FloatArray, ...]:
    g = _as_float64("g", g, "(..., Dv)", min_ndim=1, allow_neg_inf=False)
    h = _as_float64("h", h, "(...)", min_ndim=0, allow_neg_inf=False)
    h_mean = _as_float64("h_mean", h_mean, "(...)", min_ndim=0, allow_neg_inf=False)
    beta = _as_float64("beta", beta, "(..., Dv)", min_ndim=0, allow_neg_inf=False)
    try:
        np.broadcast_shapes(g.shape, h.shape + (1,), h_mean.shape + (1,), beta.shape)
    except ValueError:
        raise ValueError(
            "g (..., Dv), h (...), h_mean (...) and beta (..., Dv) must broadcast, with h and h_mean "
            f"lacking the Dv axis: got g {g.shape}, h {h.shape}, h_mean {h_mean.shape}, beta {beta.shape}"
        ) from None
    return g, h, h_mean, beta


def control_variate(g: ArrayLike, h: ArrayLike, h_mean: ArrayLike, beta: ArrayLike) -> FloatArray:
    r"""Control-variate estimate :math:`g - \beta\,(h - \mathbb{E}[h])`.

    Parameters
    ----------
    g : (..., Dv) array_like
        The base estimate :math:`g(\omega)` (vector valued).
    h : (...) array_like
        The scalar control variate :math:`h(\omega)`.
    h_mean : (...) array_like
        Its known expectation :math:`\mathbb{E}[h(\omega)]`; broadcasts against ``h``.
    beta : (..., Dv) array_like
        The coefficient :math:`\beta \in \mathbb{R}^{Dv}`; broadcasts against ``g`` (a scalar
        or a shared ``(Dv,)`` coefficient is fine).

    Returns
    -------
    estimate : (..., Dv) ndarray

    Notes
    -----
    .. math::
        \tilde g(\omega) = g(\omega) - \beta\, h(\omega) + \beta\, \mathbb{E}[h(\omega)],
        \qquad \operatorname{Tr}\operatorname{Var}\tilde g
        = \operatorname{Tr}\operatorname{Var} g - 2\beta^\top \operatorname{Cov}[h, g]
          + \|\beta\|^2 \operatorname{Var} h,

    unbiased for any fixed :math:`\beta`; the trace variance is minimized by
    :func:`optimal_cv_coefficient`.

    References
    ----------
    EVA eq. 5 (sec. 2.3) and eq. 19 (app. B.1); Owen (2013) ch. 8 (control variates).

    Examples
    --------
    >>> from randattn.theory.montecarlo import control_variate
    >>> control_variate([3.0, 1.0], 1.5, 1.0, [2.0, -2.0]).tolist()
    [2.0, 2.0]
    """
    g, h, h_mean, beta = _cv_iv(g, h, h_mean, beta)
    return g - beta * (h - h_mean)[..., None]


def _cv_coefficient_iv(g_samples: ArrayLike, h_samples: ArrayLike) -> tuple[FloatArray, FloatArray]:
    g_samples = _as_float64("g_samples", g_samples, "(R, ..., Dv)", min_ndim=2, allow_neg_inf=False)
    h_samples = _as_float64("h_samples", h_samples, "(R, ...)", min_ndim=1, allow_neg_inf=False)
    if h_samples.shape != g_samples.shape[:-1]:
        raise ValueError(
            "h_samples must have shape (R, ...) equal to g_samples' (R, ..., Dv) without the last axis; "
            f"got g_samples {g_samples.shape}, h_samples {h_samples.shape}"
        )
    return g_samples, h_samples


def optimal_cv_coefficient(g_samples: ArrayLike, h_samples: ArrayLike) -> FloatArray:
    r"""Sample estimate of the variance-minimizing control-variate coefficient.

    Parameters
    ----------
    g_samples : (R, ..., Dv) array_like
        ``R`` independent replicates of the base estimate :math:`g(\omega)`.
    h_samples : (R, ...) array_like
        The matching replicates of the scalar control variate :math:`h(\omega)`.

    Returns
    -------
    beta : (..., Dv) ndarray
        :math:`\hat\beta^* = \widehat{\operatorname{Cov}}[h, g] / \widehat{\operatorname{Var}}[h]`.
        NaN with a ``RuntimeWarning`` when ``R < 2`` or where :math:`h` does not vary.

    Notes
    -----
    Minimizing :math:`\operatorname{Tr}\operatorname{Var}[g - \beta h]` over
    :math:`\beta \in \mathbb{R}^{Dv}` decouples per output dimension:

    .. math::
        \beta^* = \arg\min_\beta \operatorname{Tr}\operatorname{Var}[\tilde g]
                = \frac{\operatorname{Cov}[h, g]}{\operatorname{Var}[h]},

    estimated with the sample covariance and variance over replicates (the ``1/(R-1)``
    factors cancel). With the same replicates it is also the exact minimizer of the
    empirical trace variance, i.e. the least-squares slope of :math:`g` on :math:`h`.

    References
    ----------
    EVA eq. 20 (app. B.1) and Proposition 1 (eq. 8); Owen (2013) ch. 8 (control variates).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.theory.montecarlo import optimal_cv_coefficient
    >>> h = np.array([1.0, 2.0, 3.0, 4.0])
    >>> g = np.stack([2 * h, [1.0, 1.0, 0.0, -2.0]], axis=-1)
    >>> optimal_cv_coefficient(g, h).round(12).tolist()
    [2.0, -1.0]
    """
    g_samples, h_samples = _cv_coefficient_iv(g_samples, h_samples)
    r = h_samples.shape[0]
    if r < 2:
        _warn(f"optimal_cv_coefficient: a covariance needs R >= 2 replicates, got R = {r}; returning NaN")
        return np.full(g_samples.shape[1:], np.nan)
    h_centred = h_samples - h_samples.mean(axis=0)
    g_centred = g_samples - g_samples.mean(axis=0)
    covariance = np.sum(h_centred[..., None] * g_centred, axis=0) / (r - 1)  # (..., Dv)
    variance = np.sum(h_centred**2, axis=0) / (r - 1)  # (...)
    constant = variance == 0.0
    if np.any(constant):
        _warn(
            f"optimal_cv_coefficient: h_samples is constant over replicates in {np.count_nonzero(constant)} "
            f"of {constant.size} batch positions (Var[h] = 0); beta is NaN there"
        )
    with np.errstate(invalid="ignore", divide="ignore"):
        return covariance / np.where(constant, np.nan, variance)[..., None]


@dataclass(frozen=True)
class PerKeyControlVariates:
    r"""EVA's per-key terms of RFA for one query; see :func:`eva_per_key_terms`.

    Attributes
    ----------
    g : (..., M, Dv) ndarray
        :math:`g_m(\omega) = h_m(\omega)\, v_m`.
    h : (..., M) ndarray
        :math:`h_m(\omega) = \sum_s \alpha(\omega_s)\, \xi(q_n, \omega_s)\, \xi(k_m, \omega_s)`.
    """

    g: FloatArray
    h: FloatArray


def _eva_iv(
    log_query_features: ArrayLike, log_key_features: ArrayLike, v: ArrayLike, log_alpha: ArrayLike
) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray]:
    lqf = _as_float64("log_query_features", log_query_features, "(..., S)", min_ndim=1, allow_neg_inf=True)
    lkf = _as_float64("log_key_features", log_key_features, "(..., M, S)", min_ndim=2, allow_neg_inf=True)
    v = _as_float64("v", v, "(..., M, Dv)", min_ndim=2, allow_neg_inf=False)
    log_alpha = _as_float64("log_alpha", log_alpha, "(..., S)", min_ndim=1, allow_neg_inf=True)
    s = lqf.shape[-1]
    _check_size("log_key_features", lkf, -1, s, f"S = {s} samples as log_query_features", "(..., M, S)")
    _check_size("log_alpha", log_alpha, -1, s, f"S = {s} samples as log_query_features", "(..., S)")
    m = lkf.shape[-2]
    _check_size("v", v, -2, m, f"M = {m} keys as log_key_features", "(..., M, Dv)")
    _batch_shape(
        log_query_features=lqf.shape[:-1], log_key_features=lkf.shape[:-2], v=v.shape[:-2], log_alpha=log_alpha.shape[:-1]
    )
    return lqf, lkf, v, log_alpha


def eva_per_key_terms(
    log_query_features: ArrayLike, log_key_features: ArrayLike, v: ArrayLike, log_alpha: ArrayLike
) -> PerKeyControlVariates:
    r"""EVA's decomposition of RFA into one control variate per key: :math:`g_m` and :math:`h_m`.

    Parameters
    ----------
    log_query_features : (..., S) array_like
        :math:`\log \xi(q_n, \omega_s)` of one query (more queries: a leading batch dim).
    log_key_features : (..., M, S) array_like
        :math:`\log \xi(k_m, \omega_s)`.
    v : (..., M, Dv) array_like
        Values :math:`v_m`.
    log_alpha : (..., S) array_like
        :math:`\log \alpha(\omega_s) = \log \mathcal{N}(\omega_s; 0, I) - \log S - \log Z
        - \log q(\omega_s)` with :math:`Z = \sum_m \exp(q_n^\top k_m)` and ``q`` the proposal
        that drew :math:`\omega_s` (:math:`-\log S - \log Z` for :math:`q = \mathcal{N}(0, I)`).

    Returns
    -------
    PerKeyControlVariates
        ``g : (..., M, Dv)`` and ``h : (..., M)``.

    Notes
    -----
    With the positive map :math:`\xi(x, \omega) = \exp(\omega^\top x - \|x\|^2/2)`,

    .. math::
        h_m(\omega) = \sum_{s=1}^S \alpha(\omega_s)\, \xi(q_n, \omega_s)\, \xi(k_m, \omega_s),
        \qquad g_m(\omega) = h_m(\omega)\, v_m,

    so that :math:`\sum_m g_m = g` and :math:`\sum_m h_m = h` of EVA eq. 6 and RFA is
    :math:`\sum_m g_m - \hat\beta (h_m - \mathbb{E}h_m)` with one shared
    :math:`\hat\beta = g/h` (eq. 7). Each :math:`h_m` has the known mean
    :math:`\mathbb{E}[h_m] = \exp(q_n^\top k_m)/Z` (eq. 22), and the per-key coefficient
    :math:`\beta_m = v_m` makes :math:`\tilde g_m = \exp(q_n^\top k_m) v_m / Z` exactly
    (eq. 8, 23): :func:`control_variate` ``(g_m, h_m, E h_m, v_m)`` recovers softmax
    attention. :math:`h_m` is a log-sum-exp over samples, exponentiated once.

    References
    ----------
    EVA sec. 3.1 (eq. 6, 7), Proposition 1 (eq. 8), app. B.3 (eq. 22) and B.4 (eq. 23).

    Examples
    --------
    >>> import numpy as np
    >>> from randattn.theory.montecarlo import control_variate, eva_per_key_terms
    >>> rng = np.random.default_rng(0)
    >>> x, y, v = 0.3 * rng.normal(size=3), 0.3 * rng.normal(size=(4, 3)), rng.normal(size=(4, 2))
    >>> omega = rng.normal(size=(64, 3))  # q = N(0, I)
    >>> log_z = np.log(np.exp(y @ x).sum())
    >>> terms = eva_per_key_terms(omega @ x - x @ x / 2, y @ omega.T - (y * y).sum(-1, keepdims=True) / 2,
    ...                           v, np.full(64, -np.log(64) - log_z))
    >>> exact = np.exp(y @ x - log_z)
    >>> cv = control_variate(terms.g, terms.h, exact, v).sum(axis=0)  # beta_m = v_m
    >>> bool(np.allclose(cv, exact @ v, rtol=0, atol=1e-12))
    True
    """
    lqf, lkf, v, log_alpha = _eva_iv(log_query_features, log_key_features, v, log_alpha)
    log_terms = (log_alpha + lqf)[..., None, :] + lkf  # (..., M, S)
    with np.errstate(over="ignore"):
        h = np.exp(_logsumexp(log_terms, axis=-1))  # (..., M)
    if not np.isfinite(h).all():
        _warn(
            "eva_per_key_terms: h_m overflows float64 in "
            f"{np.count_nonzero(~np.isfinite(h))} entries (the per-key terms are absolute, not shift-invariant)"
        )
    with np.errstate(invalid="ignore"):
        g = h[..., None] * v
    return PerKeyControlVariates(g=g, h=h)
