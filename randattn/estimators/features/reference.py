"""Random-feature maps of ``exp(x·y)`` in numpy float64, as log-features (reference form).

Every map takes ``x : (..., N, D)`` and ``omega : (..., S, D)`` (leading dims broadcast)
and returns ``(log_magnitude, sign)`` of shape ``(..., N, S, L)``; ``sign`` is None for
positive maps. ``E_omega[sum_l phi_l(x, omega) phi_l(y, omega)] = exp(x·y)`` for
``omega ~ N(0, I)`` (for ``regularized``: the regularized kernel SMREG, Performer sec. 2.3).
"""

from __future__ import annotations

import numpy as np
from scipy import special

from randattn._validation import check_choice
from randattn.estimators.features import FEATURE_MAPS
from randattn.estimators.sampling import sphere_project

__all__ = [
    "positive_log_features",
    "hyperbolic_log_features",
    "trigonometric_log_features",
    "oprf_log_features",
    "oprf_optimal_a",
    "log_features",
    "kernel_estimate",
    "exact_kernel",
    "log_smreg",
]


def _projections(x: np.ndarray, omega: np.ndarray) -> np.ndarray:
    """``omega_s · x_n`` : (..., N, S)."""
    return x @ np.swapaxes(omega, -1, -2)


def _half_sq_norm(x: np.ndarray) -> np.ndarray:
    """``|x_n|^2 / 2`` : (..., N, 1)."""
    return 0.5 * (x * x).sum(-1, keepdims=True)


def positive_log_features(x: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, None]:
    r"""Positive random features (Performer eq. 7 / Lemma 1; LARA sec. 2.2).

    .. math:: \xi(x, \omega) = \exp(\omega^\top x - \|x\|^2 / 2), \quad L = 1.
    """
    return (_projections(x, omega) - _half_sq_norm(x))[..., None], None


def hyperbolic_log_features(x: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, None]:
    r"""Hyperbolic positive features (Performer Lemma 1; LARA app. C, Cor. C.1).

    .. math:: \xi(x, \omega) = \tfrac{1}{\sqrt 2} e^{-\|x\|^2/2}
              [\exp(\omega^\top x), \exp(-\omega^\top x)], \quad L = 2.
    """
    proj = _projections(x, omega)
    base = -_half_sq_norm(x) - 0.5 * np.log(2.0)
    return np.stack([base + proj, base - proj], axis=-1), None


def trigonometric_log_features(x: np.ndarray, omega: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""Trigonometric (random Fourier) features of the softmax kernel (Performer sec. 2.3).

    .. math:: \xi(x, \omega) = e^{\|x\|^2/2} [\sin(\omega^\top x), \cos(\omega^\top x)], \quad L = 2.

    Signed: returns ``log|phi|`` and ``sign(phi)``; an exact zero has log-magnitude -inf.
    """
    proj = _projections(x, omega)
    trig = np.stack([np.sin(proj), np.cos(proj)], axis=-1)
    with np.errstate(divide="ignore"):
        log_mag = np.log(np.abs(trig)) + _half_sq_norm(x)[..., None]
    return log_mag, np.sign(trig)


def oprf_optimal_a(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r"""The closed-form optimal ``A*`` of OPRF / FAVOR++ (Likhosherstov et al., NeurIPS 2022).

    .. math::
        A^* = \frac{1 - 2\rho - \sqrt{(2\rho + 1)^2 + 8\rho}}{16}, \qquad
        \rho = \frac{1}{D}\,\mathrm{mean}_{i,j} \|x_i + y_j\|^2
             = \frac{\overline{\|x\|^2} + \overline{\|y\|^2} + 2\,\bar x \cdot \bar y}{D},

    computed from the mean squared norms and the means, without forming N x M.

    Parameters
    ----------
    x : (..., N, D)
    y : (..., M, D)

    Returns
    -------
    (...,) array, one ``A*`` per batch element (always <= 0 < 1/4).
    """
    dim = x.shape[-1]
    rho = (
        (x * x).sum(-1).mean(-1)
        + (y * y).sum(-1).mean(-1)
        + 2.0 * (x.mean(-2) * y.mean(-2)).sum(-1)
    ) / dim
    return (1.0 - 2.0 * rho - np.sqrt((2.0 * rho + 1.0) ** 2 + 8.0 * rho)) / 16.0


def oprf_log_features(x: np.ndarray, omega: np.ndarray, a: np.ndarray | float) -> tuple[np.ndarray, None]:
    r"""Optimal positive random features, OPRF / FAVOR++ (Likhosherstov et al., NeurIPS 2022).

    .. math::
        f(\omega, x) = D_0 \exp(A\|\omega\|^2 + B\,\omega^\top x - \|x\|^2/2),\quad
        B = \sqrt{1 - 4A},\ D_0 = (1 - 4A)^{D/4},

    unbiased for ``exp(x·y)`` with ``omega ~ N(0, I)`` whenever ``A < 1/4``.

    Parameters
    ----------
    x : (..., N, D)
    omega : (..., S, D)
    a : (...,) array or float
        ``A``, one per batch element (see :func:`oprf_optimal_a`).
    """
    a = np.asarray(a, dtype=np.float64)
    if np.any(a >= 0.25):
        raise ValueError(f"OPRF needs A < 1/4, got max A = {float(a.max())}")
    dim = x.shape[-1]
    a_ = a[..., None, None]
    b = np.sqrt(1.0 - 4.0 * a_)
    log_d0 = 0.25 * dim * np.log1p(-4.0 * a_)
    omega_sq = (omega * omega).sum(-1)[..., None, :]  # (..., 1, S)
    log_mag = log_d0 + a_ * omega_sq + b * _projections(x, omega) - _half_sq_norm(x)
    return log_mag[..., None], None


def log_features(
    feature_map: str, x: np.ndarray, omega: np.ndarray, *, oprf_a: np.ndarray | float | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Dispatch to the named map (one of ``FEATURE_MAPS``); ``regularized`` projects omega to the sphere.

    ``oprf_a`` is required for ``feature_map="oprf"`` (the same ``A`` must be used for both
    queries and keys).
    """
    check_choice("feature_map", feature_map, FEATURE_MAPS)
    if feature_map == "positive":
        return positive_log_features(x, omega)
    if feature_map == "hyperbolic":
        return hyperbolic_log_features(x, omega)
    if feature_map == "trigonometric":
        return trigonometric_log_features(x, omega)
    if feature_map == "regularized":
        return positive_log_features(x, sphere_project(omega, omega.shape[-1]))
    if oprf_a is None:
        raise ValueError("feature_map='oprf' needs oprf_a (see oprf_optimal_a)")
    return oprf_log_features(x, omega, oprf_a)


def kernel_estimate(feature_map: str, x: np.ndarray, y: np.ndarray, omega: np.ndarray, *, oprf_a=None) -> np.ndarray:
    r"""Random-feature estimate of the kernel matrix, ``(..., N, M)`` (quadratic; for checks).

    .. math:: \hat K(x_n, y_m) = \frac{1}{S} \sum_{s, l} \phi_l(x_n, \omega_s) \phi_l(y_m, \omega_s).
    """
    if feature_map == "oprf" and oprf_a is None:
        oprf_a = oprf_optimal_a(x, y)
    lx, sx = log_features(feature_map, x, omega, oprf_a=oprf_a)
    ly, sy = log_features(feature_map, y, omega, oprf_a=oprf_a)
    num_samples = omega.shape[-2]
    terms = np.exp(lx[..., :, None, :, :] + ly[..., None, :, :, :])  # (..., N, M, S, L)
    if sx is not None:
        terms = terms * sx[..., :, None, :, :] * sy[..., None, :, :, :]
    return terms.sum((-1, -2)) / num_samples


def log_smreg(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r"""Log of the regularized softmax kernel SMREG (Performer sec. 2.3, Thm. 1), ``(..., N, M)``.

    With ``z = x + y`` and ``kappa = sqrt(D) |z|``,

    .. math::
        \mathrm{SMREG}(x, y) = e^{-(\|x\|^2 + \|y\|^2)/2}\,
            \mathbb{E}_{u \sim \mathrm{Unif}(S^{D-1})} e^{\kappa u_1}
          = e^{-(\|x\|^2 + \|y\|^2)/2}\, \Gamma(D/2) (2/\kappa)^{D/2 - 1} I_{D/2-1}(\kappa),

    evaluated in log space with the exponentially scaled Bessel function ``scipy.special.ive``.
    """
    dim = x.shape[-1]
    z = x[..., :, None, :] + y[..., None, :, :]
    kappa = np.sqrt(dim) * np.sqrt((z * z).sum(-1))
    nu = dim / 2.0 - 1.0
    safe = np.where(kappa > 0, kappa, 1.0)
    log_mean = special.gammaln(dim / 2.0) + nu * np.log(2.0 / safe) + np.log(special.ive(nu, safe)) + safe
    log_mean = np.where(kappa > 0, log_mean, 0.0)  # E[e^0] = 1
    half = 0.5 * ((x * x).sum(-1)[..., :, None] + (y * y).sum(-1)[..., None, :])
    return log_mean - half


def exact_kernel(feature_map: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The kernel a map estimates without bias: ``exp(x·y)``, or SMREG for ``regularized``."""
    check_choice("feature_map", feature_map, FEATURE_MAPS)
    if feature_map == "regularized":
        return np.exp(log_smreg(x, y))
    return np.exp(x @ np.swapaxes(y, -1, -2))
