"""Random-feature maps of ``exp(x·y)`` in numpy float64, as log-features (reference form).

Every map takes ``x : (..., N, D)`` and ``omega : (..., S, D)`` (leading dims broadcast)
and returns ``(log_magnitude, sign)`` of shape ``(..., N, S, L)``; ``sign`` is None for
positive maps. ``E_omega[sum_l phi_l(x, omega) phi_l(y, omega)] = exp(x·y)`` for
``omega ~ N(0, I)`` (for ``regularized``: the regularized kernel SMREG, Performer sec. 2.3).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import numpy as np
from scipy import special

from randattn._validation import check_choice
from randattn.estimators.features import FEATURE_MAPS, select_data_params, select_log_features

__all__ = [
    "positive_log_features",
    "hyperbolic_log_features",
    "trigonometric_log_features",
    "oprf_log_features",
    "oprf_optimal_a",
    "SderfParams",
    "sderf_pair_moment",
    "sderf_optimal_params",
    "sderf_log_features",
    "sderf_log_second_moment",
    "sderf_variance",
    "data_params",
    "paired_log_features",
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
    x, y : array_like
        Queries (..., N, D) and keys (..., M, D), in the paper's variables.

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


class SderfParams(NamedTuple):
    r"""The symmetric matrix ``A = Q diag(lam) Q^T`` of SDERF, by its eigendecomposition.

    Attributes
    ----------
    basis : (..., D, D)
        ``Q``, orthonormal columns (the eigenvectors of the pair moment ``M``).
    lam : (..., D)
        Eigenvalues of ``A``; every one ``< 1/8`` (finite variance), the optimum's are ``<= 0``.
    """

    basis: Any
    lam: Any


def sderf_pair_moment(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r"""Mean over all pairs of :math:`z z^\top`, :math:`z = x_i + y_j`, from second moments: ``(..., D, D)``.

    .. math::
        M = \frac{1}{NM}\sum_{i,j} (x_i + y_j)(x_i + y_j)^\top
          = \overline{x x^\top} + \overline{y y^\top} + \bar x \bar y^\top + \bar y \bar x^\top,

    ``O((N + M) D^2)``; never an N x M matrix. ``tr M / D`` is OPRF's :math:`\rho`.
    """
    mx, my = x.mean(-2), y.mean(-2)
    cross = mx[..., :, None] * my[..., None, :]
    return (
        np.swapaxes(x, -1, -2) @ x / x.shape[-2]
        + np.swapaxes(y, -1, -2) @ y / y.shape[-2]
        + cross
        + np.swapaxes(cross, -1, -2)
    )


def _optimal_eigenvalue(mu):
    """The per-direction minimizer: OPRF's A* formula at rho = mu (numpy or torch)."""
    root = ((2.0 * mu + 1.0) ** 2 + 8.0 * mu) ** 0.5
    return (1.0 - 2.0 * mu - root) / 16.0


def sderf_optimal_params(x: np.ndarray, y: np.ndarray) -> SderfParams:
    r"""Closed-form variance-minimizing SDERF parameters from the data's second moments.

    SDERF = the simplified (symmetric) dense-exponential random features of Likhosherstov et
    al., "Dense-Exponential Random Features: Sharp Positive Estimators of the Gaussian Kernel"
    (NeurIPS 2023, FAVOR#). The paper's text was not available to this project; the family,
    its unbiasedness constraints and the optimum are derived here (and checked by
    ``randattn verify``, ``sderf.*``).

    **Family.** :math:`f(\omega, x) = D_0 \exp(\omega^\top A \omega + \omega^\top B x + x^\top C x)`,
    :math:`\omega \sim N(0, I_d)`, :math:`A, C` symmetric, the same map for queries and keys.
    With :math:`\mathbb E\, e^{\omega^\top P \omega + b^\top \omega} =
    \det(I - 2P)^{-1/2} \exp(\tfrac12 b^\top (I - 2P)^{-1} b)` (for :math:`I - 2P \succ 0`),

    .. math::
        \mathbb E[f(\omega,x) f(\omega,y)] = D_0^2 \det(I - 4A)^{-1/2}
          \exp\big(x^\top C x + y^\top C y + \tfrac12 z^\top B^\top (I - 4A)^{-1} B z\big),
        \quad z = x + y.

    This equals :math:`e^{x^\top y}` for all x, y iff :math:`B^\top (I - 4A)^{-1} B = I`,
    :math:`C = -\tfrac12 I` and :math:`D_0 = \det(I - 4A)^{1/4}`. The constraint leaves
    :math:`B = (I - 4A)^{1/2} U` with U orthogonal; the symmetric (simplified) family takes
    U = I, :math:`B = (I - 4A)^{1/2}`, which commutes with A.

    **Variance.** Second moment with :math:`P = 4A` needs :math:`I - 8A \succ 0`:

    .. math::
        \mathbb E[f(\omega,x)^2 f(\omega,y)^2] = \det(I - 4A)\,\det(I - 8A)^{-1/2}
          \exp\big(2 z^\top (I - 4A)(I - 8A)^{-1} z - \|x\|^2 - \|y\|^2\big)

    (``sderf_log_second_moment``; :math:`B` commutes with :math:`A`), and
    :math:`\mathrm{Var} = \text{that} - e^{2x^\top y}`. For :math:`A = aI` this is OPRF's.

    **Optimum.** Minimize the mean over all pairs (x_i, y_j) of the log second moment (OPRF's
    criterion). With :math:`A = Q\,\mathrm{diag}(\lambda) Q^\top` it is, up to constants,

    .. math::
        \sum_k \Big[\log(1 - 4\lambda_k) - \tfrac12 \log(1 - 8\lambda_k)
            + 2\,\frac{1 - 4\lambda_k}{1 - 8\lambda_k}\, q_k^\top M q_k\Big],
        \qquad M = \mathrm{mean}_{i,j}\, z_{ij} z_{ij}^\top

    (:func:`sderf_pair_moment`). ``g(lam) = (1 - 4 lam)/(1 - 8 lam)`` is increasing, so for fixed
    :math:`\lambda` the trace term is smallest when Q diagonalizes M (von Neumann's trace
    inequality); then each direction is OPRF's one-dimensional problem with
    :math:`\rho = \mu_k`, the k-th eigenvalue of M: setting the derivative
    :math:`-4/(1-4\lambda) + 4/(1-8\lambda) + 8\mu/(1-8\lambda)^2` to zero gives
    :math:`16\lambda^2 + (4\mu - 2)\lambda - \mu = 0`, whose root below 1/8 is

    .. math:: \lambda_k^* = \frac{1 - 2\mu_k - \sqrt{(2\mu_k + 1)^2 + 8\mu_k}}{16} \le 0.

    **OPRF reduction.** Restricted to :math:`A = aI` the criterion depends on M only through
    :math:`\mathrm{tr} M / D = \rho`, giving OPRF's :math:`A^*`; when M is isotropic
    (:math:`M = \rho I`), :math:`A^*_{\mathrm{SDERF}} = A^*_{\mathrm{OPRF}} I`.

    Parameters
    ----------
    x, y : array_like
        As :func:`oprf_optimal_a`: queries (..., N, D) and keys (..., M, D).

    Returns
    -------
    SderfParams
        ``basis : (..., D, D)``, ``lam : (..., D)``. Cost ``O((N + M) D^2 + D^3)``.
    """
    mu, basis = np.linalg.eigh(sderf_pair_moment(x, y))
    mu = np.maximum(mu, 0.0)  # M is PSD; rounding can leave -1e-16
    return SderfParams(basis, _optimal_eigenvalue(mu))


def _check_sderf(params: SderfParams) -> None:
    if not isinstance(params, SderfParams):
        raise TypeError(f"sderf params must be SderfParams (see sderf_optimal_params), got {type(params).__name__}")
    if np.any(np.asarray(params.lam) >= 0.125):
        raise ValueError(f"SDERF needs every eigenvalue of A < 1/8 (finite variance), got max {float(np.max(params.lam))}")


def sderf_log_features(x: np.ndarray, omega: np.ndarray, params: SderfParams) -> tuple[np.ndarray, None]:
    r"""Symmetric dense-exponential random features, SDERF / FAVOR# (see :func:`sderf_optimal_params`).

    .. math::
        f(\omega, x) = \det(I - 4A)^{1/4} \exp\big(\omega^\top A \omega
            + \omega^\top (I - 4A)^{1/2} x - \|x\|^2 / 2\big),

    in log space: with :math:`\tilde\omega = Q^\top \omega`,
    :math:`\omega^\top A\omega = \sum_k \lambda_k \tilde\omega_k^2` and
    :math:`\omega^\top B x = x \cdot (Q\,(\sqrt{1 - 4\lambda} \odot \tilde\omega))`.

    Parameters
    ----------
    x : (..., N, D)
    omega : (..., S, D)
    params : SderfParams
        ``basis : (..., D, D)``, ``lam : (..., D)``, broadcasting with x's leading dims.

    Returns
    -------
    (log_magnitude (..., N, S, 1), None)
    """
    _check_sderf(params)
    basis, lam = params
    rotated = omega @ basis  # (..., S, D): omega in A's eigenbasis
    b_omega = (rotated * np.sqrt(1.0 - 4.0 * lam)[..., None, :]) @ np.swapaxes(basis, -1, -2)  # (B omega)^T
    log_d0 = 0.25 * np.log1p(-4.0 * lam).sum(-1)[..., None, None]
    quad = ((rotated * rotated) @ lam[..., :, None])[..., 0][..., None, :]  # (..., 1, S)
    log_mag = log_d0 + quad + _projections(x, b_omega) - _half_sq_norm(x)
    return log_mag[..., None], None


def sderf_log_second_moment(x: np.ndarray, y: np.ndarray, params: SderfParams) -> np.ndarray:
    r""":math:`\log \mathbb E[f(\omega,x)^2 f(\omega,y)^2]` of SDERF for the rows of x and y (pairs), ``(..., P)``.

    .. math::
        \log\det(I - 4A) - \tfrac12\log\det(I - 8A)
          + 2 z^\top (I - 4A)(I - 8A)^{-1} z - \|x\|^2 - \|y\|^2, \quad z = x + y.
    """
    basis, lam = params
    z = (x + y) @ basis  # pair sums in the eigenbasis
    g = (1.0 - 4.0 * lam) / (1.0 - 8.0 * lam)
    const = np.log1p(-4.0 * lam).sum(-1) - 0.5 * np.log1p(-8.0 * lam).sum(-1)
    return const[..., None] + 2.0 * (z * z * g[..., None, :]).sum(-1) - (x * x).sum(-1) - (y * y).sum(-1)


def sderf_variance(x: np.ndarray, y: np.ndarray, params: SderfParams) -> np.ndarray:
    """Closed-form variance of one SDERF product ``f(w,x) f(w,y)`` for the row pairs, ``(..., P)``."""
    return np.exp(sderf_log_second_moment(x, y, params)) - np.exp(2.0 * (x * y).sum(-1))


def data_params(feature_map: str, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """The data-dependent parameters of a map as ``log_features`` keywords (``{}`` for fixed maps).

    ``oprf``: ``{"oprf_a": A*}`` (:func:`oprf_optimal_a`); ``sderf``: ``{"sderf": ...}``
    (:func:`sderf_optimal_params`); both from queries and keys together, ``O((N + M) D^2)``.
    """
    return select_data_params(sys.modules[__name__], feature_map, x, y)


def paired_log_features(
    feature_map: str, x: np.ndarray, y: np.ndarray, omega: np.ndarray
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
    """Query and key log-features of one map with its data-dependent parameters fitted on both sides.

    ``x : (..., N, D)``, ``y : (..., M, D)``, ``omega : (R, ..., S, D)`` ->
    ``(log_qf, q_sign, log_kf, k_sign)`` of shapes ``(R, ..., N, S, L)`` / ``(R, ..., M, S, L)``
    (signs None for positive maps). What RFA and its diagnostics feed the SNIS.
    """
    fitted = {
        key: type(val)(*(part[None] for part in val)) if isinstance(val, tuple) else val[None]
        for key, val in data_params(feature_map, x, y).items()
    }
    lx, sx = log_features(feature_map, x[None], omega, **fitted)
    ly, sy = log_features(feature_map, y[None], omega, **fitted)
    return lx, sx, ly, sy


def log_features(
    feature_map: str,
    x: np.ndarray,
    omega: np.ndarray,
    *,
    oprf_a: np.ndarray | float | None = None,
    sderf: SderfParams | None = None,
) -> tuple[np.ndarray, np.ndarray | None]:
    """Dispatch to the named map (one of ``FEATURE_MAPS``); ``regularized`` projects omega to the sphere.

    ``oprf_a`` is required for ``feature_map="oprf"`` (the same ``A`` must be used for both
    queries and keys).
    """
    return select_log_features(sys.modules[__name__], feature_map, x, omega, oprf_a=oprf_a, sderf=sderf)


def kernel_estimate(
    feature_map: str, x: np.ndarray, y: np.ndarray, omega: np.ndarray, *, oprf_a=None, sderf=None
) -> np.ndarray:
    r"""Random-feature estimate of the kernel matrix, ``(..., N, M)`` (quadratic; for checks).

    .. math:: \hat K(x_n, y_m) = \frac{1}{S} \sum_{s, l} \phi_l(x_n, \omega_s) \phi_l(y_m, \omega_s).
    """
    if feature_map == "oprf" and oprf_a is None:
        oprf_a = oprf_optimal_a(x, y)
    if feature_map == "sderf" and sderf is None:
        sderf = sderf_optimal_params(x, y)
    lx, sx = log_features(feature_map, x, omega, oprf_a=oprf_a, sderf=sderf)
    ly, sy = log_features(feature_map, y, omega, oprf_a=oprf_a, sderf=sderf)
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
