r"""LARA (Zheng, Wang, Kong, ICML 2022) checks: Prop. 3.1 / app. A, Cor. C.1, Prop. 3.2, app. F, eq. 27, eq. 10, sec. 4.3.

Every function has the signature ``(rng, quick, data, *, <thing under test>=default)`` and
returns a :class:`~randattn.theory._base.CheckResult`; the keyword parameter lets
the tests inject a broken component (negative controls).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import numpy as np
from scipy.special import log_softmax, logsumexp

from randattn.theory._base import (
    MC_K_SE,
    CheckResult,
    HeadData,
    VerifyData,
    exact_attention,
    exact_result,
    heads_or_synthetic,
    mc_unbiased_result,
    rare_component_se_floor,
    z_scores,
)
from randattn.estimators import lara as lara_pkg
from randattn.estimators import ra as ra_pkg
from randattn.estimators.base import Draws
from randattn.estimators.features.reference import hyperbolic_log_features, positive_log_features
from randattn.estimators.lara import reference as lara_ref
from randattn.estimators.ra import reference as ra_ref
from randattn.estimators.rfa import reference as rfa_ref
from randattn.estimators.rfa.reference import NonPositiveDenominatorWarning
from randattn.estimators.segments import segment_means

_LOG_2PI = float(np.log(2.0 * np.pi))


def _log_std_normal(omega: np.ndarray) -> np.ndarray:
    """``log N(omega; 0, I)`` over the last axis."""
    return -0.5 * (omega * omega).sum(-1) - 0.5 * omega.shape[-1] * _LOG_2PI


def _synthetic_heads(rng: np.random.Generator, *, n: int = 6, m: int = 7, d: int = 5, dv: int = 3,
                     size: float = 0.8, count: int = 2) -> list[HeadData]:
    """``count`` Gaussian heads ``q, k ~ size * N(0, I)``, scale 1 (so ``x = q``)."""
    return [HeadData(size * rng.standard_normal((n, d)), size * rng.standard_normal((m, d)),
                     rng.standard_normal((m, dv)), 1.0, f"synthetic {i}") for i in range(count)]


def _omega_near(rng: np.random.Generator, x: np.ndarray, y: np.ndarray, per_query: int) -> np.ndarray:
    """Evaluation points ``(N, P, D)``: half from N(0, I), half near the mixture's components x_n + y_m."""
    n, d = x.shape
    half = per_query // 2
    comp = rng.integers(0, y.shape[0], size=(n, per_query - half))
    near = x[:, None, :] + y[comp] + rng.standard_normal((n, per_query - half, d))
    return np.concatenate([rng.standard_normal((n, half, d)), near], axis=1)


def _mixture_gap(x, y, omega, feature_fn, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    r"""LHS and RHS of eq. 15-16 (or Cor. C.1) in log space, ``(N, P)`` each.

    LHS: :math:`\log q(\omega) + \log \sum_m \xi(x,\omega)^\top \xi(y_m,\omega) - \log Z`.
    RHS: :math:`\log \sum_m \pi_m \mathcal N(\omega; x + y_m, I)` (+ the mirrored component, halved).
    """
    lx, _ = feature_fn(x[:, None, :], omega)  # (N, 1, P, L)
    ly, _ = feature_fn(y[None], omega)  # (N, M, P, L)
    log_kernel_sum = logsumexp(lx + ly, axis=(1, 3))  # (N, P): sum over m and the L feature slots
    log_z = logsumexp(x @ y.T, axis=-1)  # (N,)
    lhs = _log_std_normal(omega) + log_kernel_sum - log_z[:, None]
    log_pi = log_softmax(x @ y.T, axis=-1)  # (N, M)
    centres = x[:, None, :] + y[None]  # (N, M, D)
    diff = omega[:, :, None, :] - centres[:, None]  # (N, P, M, D)
    comps = log_pi[:, None, :] + _log_std_normal(diff)
    if symmetric:
        mirrored = omega[:, :, None, :] + centres[:, None]
        comps = np.concatenate([comps, log_pi[:, None, :] + _log_std_normal(mirrored)], axis=-1) - np.log(2.0)
    return lhs, logsumexp(comps, axis=-1)


def prop31_mixture(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                   feature_fn: Callable = positive_log_features) -> CheckResult:
    r"""LARA Prop. 3.1 / eq. 15-16: the SNIS target of RFA is the Gaussian mixture, pointwise.

    .. math::
        \frac{\mathcal N(\omega; 0, I) \sum_m \xi(x, \omega)\xi(y_m, \omega)}{\sum_{m'} e^{x^\top y_{m'}}}
        = \sum_m \pi_m \mathcal N(\omega; x + y_m, I), \quad \pi_m = \mathrm{softmax}_m(x^\top y_m),

    at random points (half standard normal, half near the components), compared in log space;
    the package's ``lara.reference.log_target_density`` must agree with the right side too.
    """
    heads, where = heads_or_synthetic(data, lambda: _synthetic_heads(rng))
    lhs_all, rhs_all = [], []
    for head in heads:
        x, y = head.x, head.y
        omega = _omega_near(rng, x, y, 4 if quick else 8)
        lhs, rhs = _mixture_gap(x, y, omega, feature_fn, symmetric=False)
        pkg = np.stack([lara_ref.log_target_density(x, y, omega[:, p][None])[0].diagonal() for p in range(omega.shape[1])], -1)
        lhs_all += [lhs.ravel(), pkg.ravel()]
        rhs_all += [rhs.ravel(), rhs.ravel()]
    return exact_result("lara.prop3.1.mixture", np.concatenate(lhs_all), np.concatenate(rhs_all),
                        f"log densities, formula and lara.reference.log_target_density vs mixture ({where})")


def lemma_a1_component(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                       feature_fn: Callable = positive_log_features) -> CheckResult:
    r"""LARA Lemma A.1: :math:`\mathcal N(\omega;0,I)\xi(x,\omega)\xi(y,\omega)/e^{x^\top y} = \mathcal N(\omega; x + y, I)` pointwise."""
    heads, where = heads_or_synthetic(data, lambda: _synthetic_heads(rng))
    lhs_all, rhs_all = [], []
    for head in heads:
        x, y = head.x, head.y[: min(4, head.y.shape[0])]
        for m in range(y.shape[0]):
            omega = _omega_near(rng, x, y[m : m + 1], 4 if quick else 8)
            lx, _ = feature_fn(x[:, None, :], omega)
            ly, _ = feature_fn(y[m][None, None, :], omega)
            lhs = _log_std_normal(omega) + (lx + ly)[:, 0, :, 0] - (x @ y[m])[:, None]
            rhs = _log_std_normal(omega - (x + y[m])[:, None, :])
            lhs_all.append(lhs.ravel())
            rhs_all.append(rhs.ravel())
    return exact_result("lara.lemmaA.1.component", np.concatenate(lhs_all), np.concatenate(rhs_all),
                        f"log g(omega) vs log N(omega; x + y, I) ({where})")


def corollary_c1_hyperbolic(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                            feature_fn: Callable = hyperbolic_log_features) -> CheckResult:
    r"""LARA Cor. C.1: with hyperbolic features the target is
    :math:`\tfrac12 \sum_m \pi_m [\mathcal N(\omega; x + y_m, I) + \mathcal N(\omega; -x - y_m, I)]`, pointwise."""
    heads, where = heads_or_synthetic(data, lambda: _synthetic_heads(rng))
    lhs_all, rhs_all = [], []
    for head in heads:
        x, y = head.x, head.y
        omega = _omega_near(rng, x, y, 4 if quick else 8)
        omega[:, ::3] *= -1.0  # points near the mirrored components too
        lhs, rhs = _mixture_gap(x, y, omega, feature_fn, symmetric=True)
        lhs_all.append(lhs.ravel())
        rhs_all.append(rhs.ravel())
    return exact_result("lara.corC.1.hyperbolic", np.concatenate(lhs_all), np.concatenate(rhs_all),
                        f"log densities vs the symmetric mixture ({where})")


# ---------------------------------------------------------------------------------------
# Prop. 3.2: randomized attention


def ra_paper_noise(q, k, v, scale, num_samples, replicates, rng) -> np.ndarray:
    """RA as the package implements it (``noise="paper"``): ``(R, N, Dv)``."""
    draws = ra_pkg.draw(q.shape, k.shape, num_samples=num_samples, replicates=replicates, rng=rng)
    return ra_ref.estimate(q, k, v, draws, scale=scale)


def _ra_synthetic(rng: np.random.Generator, size: float) -> list[HeadData]:
    """N = 5 queries, M = 6 keys, D = 4, Dv = 3 at the ViT temperature D^-1/2 (as tests/estimators/test_ra.py)."""
    return [HeadData(rng.standard_normal((5, 4)) * size, rng.standard_normal((6, 4)) * size,
                     rng.standard_normal((6, 3)), 0.5, "synthetic")]


#: data-mode subset of the RA check: queries and value dims tested per head
RA_DATA_QUERIES = 4
RA_DATA_VALUE_DIMS = 4


def prop32_ra_unbiased(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                       ra_estimate: Callable = ra_paper_noise) -> CheckResult:
    r"""LARA Prop. 3.2: :math:`\mathbb E_{p_n}[f_n(\omega)]` = softmax attention, so RA (omega ~ p_n) is unbiased.

    Monte Carlo: R replicates of RA with S = 2 samples; every output element within
    ``MC_K_SE`` SE of exact softmax attention. ``f_n`` is a convex combination of values, so
    its variance is finite at any norm and the check runs on user data as well (4 evenly
    spaced queries and the first 4 value dims of each head: RA is per query and per dim).

    Rare mixture components: on ViT heads one key can hold 99.97% of a
    query's mass; the other components are then drawn a handful of times in R S draws, and
    when they are drawn fewer times than expected the sample SE collapses while the mean is
    off by their mass times the value range (max |z| = 39 on a DINOv2 head although RA is
    unbiased). The SE therefore gets the closed-form floor of
    :func:`~randattn.theory._base.rare_component_se_floor` (0 on the synthetic inputs).
    """
    reps = 1000 if quick else 4000
    num_s = 2
    heads, where = heads_or_synthetic(data, lambda: _ra_synthetic(rng, 0.6))
    samples, targets, floors = [], [], []
    rare_queries = 0
    for head in heads:
        q, k, v = head.q, head.k, head.v
        if data is not None:
            q = q[np.unique(np.linspace(0, q.shape[0] - 1, RA_DATA_QUERIES).round().astype(int))]
            v = v[:, :RA_DATA_VALUE_DIMS]
        samples.append(ra_estimate(q, k, v, head.scale, num_s, reps, rng).reshape(reps, -1))
        targets.append(exact_attention(q, k, v, head.scale).ravel())
        pi = np.exp(log_softmax(head.scale * (q @ k.T), axis=-1))  # p_n's component weights (eq. 29)
        floor = rare_component_se_floor(pi, v, reps * num_s)
        rare_queries += int((floor > 0).any(-1).sum())
        floors.append(floor.ravel())
    return mc_unbiased_result("lara.prop3.2.ra-unbiased", np.concatenate(samples, 1), np.concatenate(targets),
                              f"RA (S={num_s}) vs softmax ({where}); {rare_queries} queries with rare mixture "
                              "components (expected < 30 draws) get the closed-form SE floor",
                              se_floor=np.concatenate(floors))


def ra_reference_code_noise(q, k, v, scale, num_samples, replicates, rng) -> np.ndarray:
    """RA with the official code's noise, N(0, scale I) in the papers' space."""
    draws = ra_pkg.draw(q.shape, k.shape, num_samples=num_samples, replicates=replicates, rng=rng)
    return ra_ref.estimate(q, k, v, draws, scale=scale, noise="reference-code")


#: the seed of :func:`prop32_reference_code_biased`'s fixed inputs
PROP32_INPUT_SEED = 0


def prop32_reference_code_biased(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                                 ra_estimate: Callable = ra_reference_code_noise) -> CheckResult:
    r"""ARCHITECTURE sec. 10 / LARA Prop. 3.2: RA with the official code's noise is *not* unbiased.

    The official code samples omega with N(0, I) noise in the unscaled space, i.e.
    N(0, scale I) instead of the N(0, I) components of p_n. Passes when the bias is
    *detected*: some element's |z| >= ``MC_K_SE`` (inputs of size 1.5, where the bias is large
    next to the SE; synthetic only, so that a pass always means the same thing).

    The inputs are fixed (the synthetic generator at seed :data:`PROP32_INPUT_SEED`), and only the draws follow the
    run seed: the largest quick z is then about 31 with a spread of 1.3 (least 26 over 3,000 quick runs). Inputs
    redrawn each run made the detection depend on them (largest quick z from 2.0 to over 30), and the bias fell
    short of 4.5 SE in 29 of 10,146 quick runs (0.29 %), a check failing although the package is right.
    """
    reps = 8000 if quick else 32000  # the bias is ~0.04 with SE ~0.1 / sqrt(R): >= 10 SE in quick mode
    heads, where = heads_or_synthetic(None, lambda: _ra_synthetic(np.random.default_rng(PROP32_INPUT_SEED), 1.5))
    head = heads[0]
    out = ra_estimate(head.q, head.k, head.v, head.scale, 2, reps, rng)
    exact = exact_attention(head.q, head.k, head.v, head.scale)
    z, se = z_scores(out, exact)
    worst = float(np.abs(z).max())
    details = (f"RA noise N(0, scale I) vs softmax ({where}); R={reps}, {z.size} elements; "
               f"largest |mean - exact| = {float(np.abs(out.mean(0) - exact).max()):.3g} (max SE {float(se.max()):.2g})")
    return CheckResult("lara.prop3.2.reference-code-noise-biased", worst, MC_K_SE, worst >= MC_K_SE, details,
                       comparison=">=", tested=int(z.size))


# ---------------------------------------------------------------------------------------
# app. F, eq. 27, eq. 10: multiple importance sampling


def decoupled_weighting(log_proposals: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """LARA eq. 38 with beta = 1 (the package's default weighting): ``(R, N, C, C)``."""
    return lara_ref.weighting_functions(log_proposals, scores, "decoupled", 1.0)


def balance_weighting(log_proposals: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """LARA eq. 36, the balance heuristic: ``(R, N, C, C)``."""
    return lara_ref.weighting_functions(log_proposals, scores, "balance")


def appf_mis_unbiased(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                      weightings: dict[str, Callable] | None = None) -> CheckResult:
    r"""LARA app. F: the non-self-normalized MIS of eq. 8 with the exact p_n is unbiased when
    :math:`\sum_c \alpha_{nc}(\omega) = 1`.

    .. math:: \hat g_n = \sum_c \alpha_{nc}(\omega_c) \frac{p_n(\omega_c)}{q_c(\omega_c)} f_n(\omega_c),
              \qquad \mathbb E[\hat g_n] = \mathrm{softmax\ attention}.

    LARA's eq. 34 proposals (C = 3 landmark Gaussians) with the decoupled (eq. 38, signed) and
    balance (eq. 36) weightings, via ``lara.reference.mis_estimate_eq8``. Synthetic only
    (N = M = 6, D = 3, entries of q and k of spread 0.3): p_n / q_c has heavy tails at ViT norms. At a spread of
    0.5 they were heavy enough here that 2 of 300 correct quick runs went past 4.5 SE, where normal z-scores
    would 0.07 times; at 0.3, 0 of 400 went past 4.0 (0.9 expected).
    """
    weightings = {"decoupled": decoupled_weighting, "balance": balance_weighting} if weightings is None else weightings
    reps = 1000 if quick else 4000
    q = 0.3 * rng.standard_normal((6, 3))
    k = 0.3 * rng.standard_normal((6, 3))
    v = rng.standard_normal((6, 3))
    num_c = 3
    exact = exact_attention(q, k, v, 1.0)
    draws = lara_pkg.draw(q.shape, k.shape, num_samples=num_c, replicates=reps, rng=rng)
    terms = lara_ref.lara_terms(q, k, v, draws, scale=1.0, proposal="eq34", weighting="balance")
    scores = lara_ref.query_scores(terms.x, segment_means(terms.x, num_c))
    samples, targets = [], []
    for weighting in weightings.values():
        alpha = np.diagonal(weighting(terms.log_proposals, scores), axis1=-2, axis2=-1)  # (R, N, C)
        with np.errstate(divide="ignore"):
            weighted = dataclasses.replace(terms, log_abs_alpha=np.log(np.abs(alpha)), alpha_sign=np.sign(alpha))
        samples.append(lara_ref.mis_estimate_eq8(weighted).reshape(reps, -1))
        targets.append(exact.ravel())
    return mc_unbiased_result("lara.appF.mis-unbiased", np.concatenate(samples, 1), np.concatenate(targets),
                              f"eq. 8 MIS with weightings {', '.join(weightings)} vs softmax (synthetic N=M=6, C=3)")


def eq27_optimal_weighting(log_q: np.ndarray, r: np.ndarray) -> np.ndarray:
    r"""LARA eq. 27, the optimal weighting functions, read with :math:`r_{nc'}` in the inner sum.

    .. math::
        \alpha_{nc}(\omega) = b_c(\omega) + q_c(\omega)\Big(r_{nc}(\omega) - \sum_{c'} b_{c'}(\omega)\, r_{nc'}(\omega)\Big),
        \qquad b_c = q_c / \textstyle\sum_{c'} q_{c'}.

    Printed, the inner sum runs over c' of a summand in ``r_nc``: read literally the
    correction vanishes (``alpha = b``); eq. 26 substituted into eq. 25 gives ``r_nc'``.

    Parameters
    ----------
    log_q : (B, C, J)  ``log q_c(omega_j)``
    r : (B, N, C, J)   ``r_nc(omega_j)``

    Returns
    -------
    (B, N, C, J)
    """
    b = np.exp(log_q - logsumexp(log_q, axis=-2, keepdims=True))[:, None]  # (B, 1, C, J)
    return b + np.exp(log_q)[:, None] * (r - (b * r).sum(-2, keepdims=True))


def _lara_weighting(kind: str, beta: float = 1.0) -> Callable:
    """The package's weighting functions; their r'_nc does not depend on omega (first point used)."""
    def weighting(log_q: np.ndarray, r: np.ndarray) -> np.ndarray:
        return lara_ref.weighting_functions(log_q, r[0, ..., 0], kind, beta)
    return weighting


def eq27_sums_to_one(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                     weighting_fns: dict[str, Callable] | None = None) -> CheckResult:
    r"""LARA eq. 27 (app. D) and eq. 36-38: the weighting functions sum to one over proposals at every omega.

    Closed form at random points: B = 5 sets of C = 4 Gaussian proposals N(mu_c, I) in D = 2
    (so that the raw densities ``q_c`` of the coupled correction are not negligible), one
    point omega_j ~ q_j per proposal, N = 3 queries. Checked: eq. 27 (optimal) with arbitrary
    ``r_nc(omega_j)``, and the package's coupled (eq. 37, r' independent of omega),
    decoupled (eq. 38, beta = 2) and balance (eq. 36) with r' a probability vector.
    Each function gets ``log_q : (B, C, J)`` and ``r : (B, N, C, J)`` and returns ``(B, N, C, J)``.
    """
    fns = weighting_fns if weighting_fns is not None else {
        "eq27": eq27_optimal_weighting, "coupled eq37": _lara_weighting("coupled"),
        "decoupled eq38 beta=2": _lara_weighting("decoupled", 2.0), "balance eq36": _lara_weighting("balance"),
    }
    sets, num_c, num_n, dim = 5, 4, 3, 2
    mu = 0.7 * rng.standard_normal((sets, num_c, dim))
    omega = mu + rng.standard_normal((sets, num_c, dim))  # omega_j ~ q_j
    log_q = _log_std_normal(omega[:, None, :, :] - mu[:, :, None, :])  # (B, C, J)
    r_varying = rng.standard_normal((sets, num_n, num_c, num_c))
    r_constant = np.broadcast_to(rng.dirichlet(np.ones(num_c), num_n)[None, ..., None], r_varying.shape).copy()
    worst, per = 0.0, []
    for name, fn in fns.items():
        alpha = fn(log_q, r_varying if name == "eq27" else r_constant)  # (B, N, C, J)
        dev = float((np.abs(alpha.sum(-2) - 1.0) / np.maximum(1.0, np.abs(alpha).sum(-2))).max())
        per.append(f"{name}: {dev:.1e}")
        worst = max(worst, dev)
    return CheckResult("lara.eq27.weights-sum-to-one", worst, 1e-12, worst <= 1e-12,
                       "max |sum_c alpha_nc(omega) - 1| / max(1, sum_c |alpha|): " + "; ".join(per),
                       tested=len(fns) * sets * num_n * num_c)


def lara_balance(q, k, v, scale, num_proposals, replicates, rng) -> np.ndarray:
    """The package's LARA with eq. 34 proposals and balance-heuristic weights (eq. 36): ``(R, N, Dv)``.

    The positive weighting makes eq. 10 a plain self-normalized estimator. With the signed
    decoupled weights (eq. 38, the default) the normalizer can come close to zero, and at
    C = 16 on this input a few replicates are off by orders of magnitude: the MSE is then
    dominated by them (reported by ``randattn mse``; not a consistency statement).
    """
    draws = lara_pkg.draw(q.shape, k.shape, num_samples=num_proposals, replicates=replicates, rng=rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
        return lara_ref.estimate(q, k, v, draws, scale=scale, weighting="balance")


#: the seed of :func:`eq10_consistent`'s fixed input
EQ10_INPUT_SEED = 0


def eq10_consistent(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                    lara_estimate: Callable = lara_balance) -> CheckResult:
    r"""LARA eq. 10: the self-normalized MIS estimate is consistent: its error falls as C grows.

    LARA with eq. 34 proposals and the balance heuristic (see :func:`lara_balance`).
    Monte Carlo on one fixed synthetic input (N = M = 32, D = 4, Dv = 3, |q|, |k| ~ 0.8 sqrt(D),
    scale 1/2): the mean squared error over R replicates at C = 16 proposals must be below
    that at C = 2 by more than ``MC_K_SE`` combined standard errors (one-sided). Synthetic only:
    with landmark proposals the proposals change with C, so only a fixed input says something.
    R = 1,000 quick (2,000 full): with 200 the quick z, mean 10.3 and spread 3.2 over 200 seeds, fell short of
    4.5 in 5 of them, a power failure of a correct check. The input is fixed (the generator at seed
    :data:`EQ10_INPUT_SEED`), as this docstring always said, and only the proposals follow the run seed: drawn from
    the run seed, the input made the quick z's least 4.6 over 1,147 seeds; fixed, its median is 28 with a spread
    of 3.3 (least 18 over 400 seeds).
    """
    reps = 1000 if quick else 2000
    inputs = np.random.default_rng(EQ10_INPUT_SEED)  # the one fixed input; the run seed drives the proposals alone
    q = 0.8 * inputs.standard_normal((32, 4))
    k = 0.8 * inputs.standard_normal((32, 4))
    v = inputs.standard_normal((32, 3))
    exact = exact_attention(q, k, v, 0.5)
    stats = {}
    for c in (2, 16):
        out = lara_estimate(q, k, v, 0.5, c, reps, rng)
        sq = ((out - exact) ** 2).mean((-1, -2))
        finite = np.isfinite(sq)
        sq = sq[finite]
        stats[c] = (sq.mean(), sq.std(ddof=1) / np.sqrt(sq.size), int((~finite).sum()))
    (m2, s2, bad2), (m16, s16, bad16) = stats[2], stats[16]
    z = float((m2 - m16) / np.hypot(s2, s16))
    details = (f"MSE(C=2) = {m2:.3g} +- {s2:.2g}, MSE(C=16) = {m16:.3g} +- {s16:.2g} (ratio {m2 / m16:.2f}); "
               f"R={reps}; z = (MSE_2 - MSE_16) / SE; non-finite replicates dropped: {bad2 + bad16}")
    return CheckResult("lara.eq10.consistent", z, MC_K_SE, z >= MC_K_SE and bad2 + bad16 == 0, details,
                       comparison=">=", tested=1)


# ---------------------------------------------------------------------------------------
# sec. 4.3: special cases


def sec43_lara_is_rfa(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                      lara_params: dict | None = None) -> CheckResult:
    r"""LARA sec. 4.3: with every proposal N(0, I) and constant weights, LARA is RFA with the same omega.

    ``lara(proposal="standard", weighting="constant")`` against ``rfa`` given
    ``omega = eps`` (LARA's samples are ``0 + eps``), C = 4 <= N.
    """
    params = {"proposal": "standard", "weighting": "constant"} if lara_params is None else lara_params
    heads, where = heads_or_synthetic(data, lambda: _synthetic_heads(rng))
    got, want = [], []
    for head in heads:
        draws = lara_pkg.draw(head.q.shape, head.k.shape, num_samples=4, replicates=2, rng=rng, **params)
        got.append(lara_ref.estimate(head.q, head.k, head.v, draws, scale=head.scale, **params).ravel())
        rfa_draws = Draws({"omega": draws["eps"]}, 2)
        want.append(rfa_ref.estimate(head.q, head.k, head.v, rfa_draws, scale=head.scale).ravel())
    return exact_result("lara.sec4.3.rfa", np.concatenate(got), np.concatenate(want),
                        f"LARA {params} vs RFA, same omega ({where})")


def sec43_lara_is_ra(rng: np.random.Generator, quick: bool, data: VerifyData | None, *,
                     use_self_normalization: bool = False) -> CheckResult:
    r"""LARA sec. 4.3: without self-normalization, with N proposals q_c = p_c and alpha_nc = delta_nc,
    the MIS of eq. 8 is RA with one sample per query.

    omega_n ~ p_n is built from RA's own draws (component by inverse CDF of pi_n, plus noise),
    then ``lara.reference.mis_estimate_eq8`` with ``log_proposals[c', j] = log p_c'(omega_j)``
    and ``log |alpha_nc| = 0 if n = c else -inf`` is compared with ``ra.reference.estimate``
    (S = 1) on the same draws. ``use_self_normalization=True`` uses eq. 10 instead (also equal:
    one term per query).
    """
    heads, where = heads_or_synthetic(data, lambda: _synthetic_heads(rng, m=6))
    got, want = [], []
    for head in heads:
        x, y = head.x, head.y
        draws = ra_pkg.draw(head.q.shape, head.k.shape, num_samples=1, replicates=2, rng=rng)
        cdf = np.cumsum(np.exp(log_softmax(x @ y.T, axis=-1)), axis=-1)  # (N, M)
        comp = np.minimum((cdf[None, :, None, :] < draws["u"][..., None]).sum(-1), y.shape[0] - 1)  # (R, N, 1)
        omega = x[None] + y[comp[..., 0]] + draws["eps"][:, :, 0, :]  # (R, N, D)
        num_n = x.shape[0]
        log_alpha = np.where(np.eye(num_n, dtype=bool), 0.0, -np.inf)
        terms = lara_ref.LaraTerms(x, y, head.v, omega, lara_ref.log_target_density(x, y, omega),
                                   np.broadcast_to(log_alpha, (2, num_n, num_n)).copy(), None)
        estimate = lara_ref.snis_estimate_eq10 if use_self_normalization else lara_ref.mis_estimate_eq8
        got.append(estimate(terms).ravel())
        want.append(ra_ref.estimate(head.q, head.k, head.v, draws, scale=head.scale).ravel())
    return exact_result("lara.sec4.3.ra", np.concatenate(got), np.concatenate(want),
                        f"eq. 8 with q_c = p_c, alpha = delta vs RA (S=1), same omega ({where})")
