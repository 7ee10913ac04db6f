r"""SDERF / FAVOR# (Likhosherstov et al., "Dense-Exponential Random Features", NeurIPS 2023) checks.

The features, their unbiasedness constraints, closed-form variance and optimal parameters are
derived in :func:`randattn.estimators.features.reference.sderf_optimal_params` (the paper's text
was not available to the project). These checks test that derivation independently:

- ``sderf.unbiased``: :math:`\mathbb E[f(\omega,x) f(\omega,y)] = e^{x^\top y}` (Monte Carlo) at the
  optimal A of anisotropic inputs and at an arbitrary symmetric A with eigenvalues < 1/8;
- ``sderf.variance-closed-form``: the Monte Carlo variance of one product equals
  :func:`~randattn.estimators.features.reference.sderf_variance`;
- ``sderf.scalar-a-reduction``: with :math:`A = aI` the features and the variance are OPRF's, and
  with an isotropic pair moment the optimal A is OPRF's :math:`A^* I` (exact identities);
- ``sderf.optimal-a``: the closed-form A minimizes the mean over pairs of the log second moment,
  against a numerical minimization over all symmetric A (dense matrices, no eigenbasis).

Every function has the signature ``(rng, quick, data, *, <thing under test>=default)`` so that
tests can inject a broken implementation (negative controls).
"""

from __future__ import annotations

import warnings
from typing import Callable

import numpy as np
from scipy import optimize

from randattn.theory._base import (
    EXACT_RTOL,
    MC_K_SE,
    CheckResult,
    VerifyData,
    heads_or_synthetic,
    mc_unbiased_result,
    second_moment_z_scores,
)
from randattn.estimators.features.reference import (
    SderfParams,
    oprf_log_features,
    oprf_optimal_a,
    sderf_log_features,
    sderf_optimal_params,
    sderf_variance,
)

#: the anisotropic synthetic inputs' per-axis scales (D = 4): SDERF differs from OPRF only when M is not isotropic
_STRETCH = np.array([0.9, 0.15, 0.45, 0.3])


def _anisotropic(rng: np.random.Generator, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """``x : (n, 4)``, ``y : (m, 4)`` with unequal spreads per axis, |x + y|^2 small (moderate moments)."""
    return rng.standard_normal((n, 4)) * _STRETCH * 0.4, rng.standard_normal((m, 4)) * _STRETCH * 0.4 + 0.05


def _random_params(rng: np.random.Generator, dim: int) -> SderfParams:
    r"""An arbitrary symmetric A (not the optimum): Haar basis, eigenvalues in [-0.3, -0.05].

    Negative definite, so that the product of two features, an exponential of
    :math:`2\omega^\top A \omega` plus a linear term, is bounded in omega and every moment is finite.
    With eigenvalues up to 0.03 (the eighth moment barely finite) 10 of this part's z-scores went
    beyond 4.5 SE in 3,000 correct quick runs of the variance check, where normal ones would 0.12 times.
    """
    basis = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    return SderfParams(basis, rng.uniform(-0.3, -0.05, dim))


def _one_sample_products(feature_fn: Callable, x: np.ndarray, y: np.ndarray, params: SderfParams,
                         rng: np.random.Generator, reps: int) -> np.ndarray:
    """``f(w, x_i) f(w, y_j)`` with one omega per replicate: ``(R, n m)``."""
    omega = rng.standard_normal((reps, 1, x.shape[-1]))
    lx = feature_fn(x, omega, params)[0][..., 0, 0]  # (R, n)
    ly = feature_fn(y, omega, params)[0][..., 0, 0]  # (R, m)
    return np.exp(lx[:, :, None] + ly[:, None, :]).reshape(reps, -1)


def sderf_unbiased(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                   feature_fn: Callable = sderf_log_features) -> CheckResult:
    r"""SDERF: :math:`\mathbb E_\omega[f(\omega,x) f(\omega,y)] = e^{x^\top y}` for every symmetric A with
    :math:`I - 4A \succ 0`, :math:`B = (I - 4A)^{1/2}`, :math:`D_0 = \det(I - 4A)^{1/4}` (derived in
    ``features.reference.sderf_optimal_params``).

    Monte Carlo, one feature per replicate, 2 x 3 anisotropic pairs (D = 4) at the optimal A and at a
    random symmetric A with eigenvalues in [-0.3, 0.03]: 12 elements.
    """
    reps = 5000 if quick else 20000
    x, y = _anisotropic(rng, 2, 3)
    samples, targets = [], []
    for params in (sderf_optimal_params(x, y), _random_params(rng, 4)):
        samples.append(_one_sample_products(feature_fn, x, y, params, rng, reps))
        targets.append(np.exp(x @ y.T).ravel())
    return mc_unbiased_result("sderf.unbiased", np.concatenate(samples, 1), np.concatenate(targets),
                              "one-sample SDERF estimate at the optimal A and a random symmetric A vs exp(x.y) "
                              "(synthetic, 6 anisotropic pairs, D = 4)")


def sderf_variance_closed_form(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                               variance_fn: Callable = sderf_variance) -> CheckResult:
    r"""SDERF: the closed-form variance
    :math:`\det(I-4A)\det(I-8A)^{-1/2} e^{2 z^\top (I-4A)(I-8A)^{-1} z - |x|^2 - |y|^2} - e^{2x^\top y}`
    equals the Monte Carlo variance of one product.

    The variance is the mean of the product's squared deviation from :math:`e^{x^\top y}` (the product is
    unbiased: ``sderf.unbiased``), and z that mean's against the closed form, corrected for the squares'
    skewness (:func:`~randattn.theory._base.second_moment_z_scores`); the optimal A and a random symmetric A,
    6 pairs each: 12 elements.
    """
    reps = 5000 if quick else 20000
    x, y = _anisotropic(rng, 2, 3)
    zs, details = [], []
    for label, params in (("A*", sderf_optimal_params(x, y)), ("random A", _random_params(rng, 4))):
        est = _one_sample_products(sderf_log_features, x, y, params, rng, reps)
        xs, ys = np.repeat(x, len(y), 0), np.tile(y, (len(x), 1))  # the pairs in est's (i, j) order
        squares = (est - np.exp((xs * ys).sum(-1))) ** 2
        var = squares.mean(0)
        closed = variance_fn(xs, ys, params)
        zs.append(second_moment_z_scores(squares, closed)[0])
        details.append(f"{label}: var {np.array2string(var[:2], precision=4)} vs {np.array2string(closed[:2], precision=4)}")
    z = np.concatenate(zs)
    worst = float(np.abs(z).max())
    return CheckResult("sderf.variance-closed-form", worst, MC_K_SE, worst <= MC_K_SE,
                       "; ".join(details) + f" (first 2 of 6 pairs); R={reps}, {z.size} elements",
                       tested=int(z.size))


def _oprf_variance(x: np.ndarray, y: np.ndarray, a: float) -> np.ndarray:
    """OPRF's closed-form variance with scalar A (Likhosherstov et al. 2022), written out for the pairs."""
    d = x.shape[-1]
    zz = ((x + y) ** 2).sum(-1)
    log_m2 = (d * np.log1p(-4 * a) - 0.5 * d * np.log1p(-8 * a) + 2 * (1 - 4 * a) * zz / (1 - 8 * a)
              - (x * x).sum(-1) - (y * y).sum(-1))
    return np.exp(log_m2) - np.exp(2 * (x * y).sum(-1))


def sderf_oprf_reduction(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                         params_fn: Callable = sderf_optimal_params,
                         feature_fn: Callable = sderf_log_features) -> CheckResult:
    r"""SDERF contains OPRF: with :math:`A = aI` (any orthonormal basis) its features equal OPRF's
    :math:`(1-4a)^{d/4} e^{a|\omega|^2 + \sqrt{1-4a}\,\omega^\top x - |x|^2/2}` and its variance OPRF's;
    and when the pair moment M is isotropic (:math:`M = \rho I`) the optimal A is OPRF's :math:`A^* I`.

    Exact identities (float64, relative to max(1, |value|)): features at a = A*, -0.2 and 0.1 on 5 x 6
    inputs (D = 6) with 7 directions; variances of 5 pairs; the eigenvalues of the optimal A on
    mean-zero data whose rows are ±(orthogonal rows) (M = rho I), or on the user's heads made
    isotropic the same way.
    """
    dim = 6
    x = rng.standard_normal((5, dim)) * 0.5
    y = rng.standard_normal((5, dim)) * 0.5
    omega = rng.standard_normal((7, dim))
    basis = np.linalg.qr(rng.standard_normal((dim, dim)))[0]
    actual, expected = [], []
    for a in (float(oprf_optimal_a(x, y)), -0.2, 0.1):
        params = SderfParams(basis, np.full(dim, a))
        actual.append(feature_fn(x, omega, params)[0].ravel())
        expected.append(oprf_log_features(x, omega, a)[0].ravel())
        actual.append(sderf_variance(x, y, params))
        expected.append(_oprf_variance(x, y, a))
    heads, where = heads_or_synthetic(data, lambda: [])
    rows = [h.x for h in heads] if heads else [np.linalg.qr(rng.standard_normal((dim, dim)))[0] * 0.7]
    for r in rows:
        # rows ±u_k of an orthonormal-up-to-scale set: mean 0, second moment proportional to I
        u = np.linalg.qr(r.T, mode="complete")[0].T * float(np.sqrt((r * r).sum(-1).mean()))  # (D, D), orthogonal rows
        iso = np.concatenate([u, -u])
        opt = params_fn(iso, iso)
        actual.append(np.asarray(opt.lam))
        expected.append(np.full(u.shape[-1], float(oprf_optimal_a(iso, iso))))
    a_all, e_all = np.concatenate(actual), np.concatenate(expected)
    rel = np.abs(a_all - e_all) / np.maximum(1.0, np.abs(e_all))
    worst = float(rel.max()) if np.isfinite(rel).all() else float("nan")
    return CheckResult("sderf.scalar-a-reduction", worst, EXACT_RTOL, bool(worst <= EXACT_RTOL),
                       f"A = aI features and variances vs OPRF (a = A*, -0.2, 0.1), isotropic-M optimum vs OPRF's A* "
                       f"({len(rows)} sets, {where}); {a_all.size} values, max relative difference",
                       tested=int(a_all.size))


def _mean_log_second_moment(a_matrix: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    """Mean over all pairs (i, j) of log E[f^2 f^2] with dense A (no eigenbasis); inf outside I - 8A > 0."""
    eye = np.eye(x.shape[-1])
    if np.linalg.eigvalsh(eye - 8 * a_matrix).min() <= 0:
        return np.inf
    g = (eye - 4 * a_matrix) @ np.linalg.inv(eye - 8 * a_matrix)
    z = x[:, None, :] + y[None, :, :]
    quad = np.einsum("ijd,de,ije->ij", z, g, z)
    norms = (x * x).sum(-1)[:, None] + (y * y).sum(-1)[None, :]
    return float(np.linalg.slogdet(eye - 4 * a_matrix)[1] - 0.5 * np.linalg.slogdet(eye - 8 * a_matrix)[1]
                 + (2 * quad - norms).mean())


def _symmetric(theta: np.ndarray, dim: int) -> np.ndarray:
    a = np.zeros((dim, dim))
    a[np.triu_indices(dim)] = theta
    return a + np.triu(a, 1).T


def sderf_optimal_a_minimizes(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                              params_fn: Callable = sderf_optimal_params) -> CheckResult:
    r"""SDERF: :math:`A^* = Q\,\mathrm{diag}(\lambda^*) Q^\top`, Q the eigenvectors of the pair moment
    :math:`M = \mathrm{mean}_{ij} z z^\top` and :math:`\lambda^*_k` OPRF's formula at :math:`\rho = \mu_k(M)`,
    minimizes the mean over all pairs of the log second moment over *all* symmetric A.

    Closed form vs ``scipy.optimize.minimize`` (BFGS over the D(D+1)/2 entries, started at 0) of the
    brute-force dense objective, on synthetic anisotropic sets (D = 3, 4); on the user's heads
    (D = 64, too many entries for BFGS) against OPRF's :math:`A^* I` and 20 random symmetric
    perturbations of size 1e-3. Measured: the largest relative excess of the closed form's
    objective over the best competitor.
    """
    heads, where = heads_or_synthetic(data, lambda: [])
    worst, per = -np.inf, []
    for dim in (3, 4):
        x = rng.standard_normal((7, dim)) * _STRETCH[:dim] * 1.2
        y = rng.standard_normal((9, dim)) * _STRETCH[:dim] * 1.2 + 0.1
        p = params_fn(x, y)
        closed = _mean_log_second_moment(p.basis @ np.diag(p.lam) @ p.basis.T, x, y)
        with warnings.catch_warnings():  # finite differences that step outside I - 8A > 0 see inf
            warnings.simplefilter("ignore", RuntimeWarning)
            res = optimize.minimize(lambda t: _mean_log_second_moment(_symmetric(t, dim), x, y),
                                    np.zeros(dim * (dim + 1) // 2), method="BFGS", options={"gtol": 1e-10})
        best = min(res.fun, _mean_log_second_moment(oprf_optimal_a(x, y) * np.eye(dim), x, y))
        excess = (closed - best) / max(1.0, abs(best))
        worst = max(worst, excess)
        per.append(f"D={dim}: {closed:.6g} vs numerical {res.fun:.6g}")
    for head in heads:
        x, y = head.x, head.y
        dim = x.shape[-1]
        p = params_fn(x, y)
        a_star = p.basis @ np.diag(p.lam) @ p.basis.T
        closed = _mean_log_second_moment(a_star, x, y)
        competitors = [_mean_log_second_moment(oprf_optimal_a(x, y) * np.eye(dim), x, y)]
        for _ in range(20):
            e = rng.standard_normal((dim, dim))
            competitors.append(_mean_log_second_moment(a_star + 1e-3 * (e + e.T) / 2, x, y))
        excess = (closed - min(competitors)) / max(1.0, abs(min(competitors)))
        worst = max(worst, excess)
    per.append(f"{len(heads)} heads vs OPRF and perturbations ({where})" if heads else where)
    worst = float(max(worst, 0.0)) if np.isfinite(worst) else float("nan")
    return CheckResult("sderf.optimal-a", worst, 1e-6, bool(worst <= 1e-6), "; ".join(per),
                       tested=2 + len(heads))
