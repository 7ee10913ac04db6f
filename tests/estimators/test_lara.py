"""Tests for the LARA estimator: identities with the same draws, consistency, layout, bad input.

Identities (exact to ``EXACT`` in float64, reference and batched): LARA with N(0, I)
proposals and constant weights is RFA (LARA sec. 4.3); the non-self-normalized MIS with
``C = N`` proposals ``q_c = p_c`` and ``alpha = delta`` is RA with one sample (sec. 4.3);
the literal SNIS of eq. 10 equals the eq. 28 form the estimator computes (app. E); the
official code's formula equals our ``alpha_clamp`` + ``reference-code`` variant.

Monte Carlo comparisons use ``N_SE`` standard errors of the estimators' own replicates:
under normality a correct estimator fails one comparison with probability ~3e-5 (one-sided)
or ~6e-5 (two-sided); seeds are fixed, so a pass is reproducible.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import numpy as np
import pytest
import torch
from scipy.special import logsumexp, softmax

import randattn
from randattn.estimators import lara, ra, rfa
from randattn.estimators.base import Draws
from randattn.estimators.lara import batched as lara_b
from randattn.estimators.lara import reference as lara_r
from randattn.estimators.rfa.reference import NonPositiveDenominatorWarning
from randattn.estimators.grid import TokenLayout
from randattn.estimators.segments import segment_means
from randattn.testing import TOLERANCES, assert_close

EXACT = 1e-10  # the float64 identity tolerance (observed differences ~1e-14)
SUM_TO_ONE = 1e-12  # partition of unity, O(1) weights in float64
N_SE = 4.0

ignore_negative_normalizer = pytest.mark.filterwarnings(
    "ignore::randattn.estimators.rfa.reference.NonPositiveDenominatorWarning"
)
BACKENDS = ("reference", "torch")


def _qkv(rng, batch=(2, 3), n=13, m=11, d=8, dv=5):
    q = rng.standard_normal((*batch, n, d))
    k = rng.standard_normal((*batch, m, d))
    v = rng.standard_normal((*batch, m, dv))
    return q, k, v


def _draw(q, k, num_samples, *, seed=0, replicates=3, **params):
    spec = lara.SPEC
    resolved = spec.resolve_params(params)
    return lara.draw(q.shape, k.shape, num_samples=num_samples, replicates=replicates,
                     rng=np.random.default_rng(seed), **resolved)


def _estimate(backend, q, k, v, draws, **params):
    """LARA by one backend, as float64 numpy."""
    if backend == "reference":
        return lara_r.estimate(q, k, v, draws, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    return lara_b.estimate(t(q), t(k), t(v), draws.to_torch(), **params).numpy()


def _terms(backend, q, k, v, draws, **params):
    if backend == "reference":
        return lara_r.lara_terms(q, k, v, draws, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    return lara_b.lara_terms(t(q), t(k), t(v), draws.to_torch(), **params)


def _fit_grid(params, n):
    """A grid variant refit to ``n`` tokens: its prefix kept (at most n - 1), the patches as the
    most nearly square h x w grid (h the largest divisor <= sqrt); other variants unchanged."""
    if params.get("grid") is None:
        return params
    prefix = min(params.get("prefix_tokens", 0), n - 1)
    patches = n - prefix
    h = max(d for d in range(1, math.isqrt(patches) + 1) if patches % d == 0)
    return {**params, "grid": (h, patches // h), "prefix_tokens": prefix}


def _module(backend):
    return lara_r if backend == "reference" else lara_b


def _np(a):
    return a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


def _softmax_attention(q, k, v, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return softmax(scale * q @ np.swapaxes(k, -1, -2), axis=-1) @ v


# ---------------------------------------------------------------------------------------
# identities with the same draws


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighting", ["constant", "balance"])
@pytest.mark.parametrize("num_samples", [1, 6, 20], ids=lambda c: f"C{c}")
def test_standard_proposals_with_constant_weights_are_rfa(backend, weighting, num_samples, rng):
    """LARA sec. 4.3: all proposals N(0, I) and constant alpha give RFA with omega_c = eps_c.

    With identical proposals the balance heuristic is 1/C as well. C = 20 > N = 13 uses the
    first C_eff = 13 rows of the draws.
    """
    q, k, v = _qkv(rng)
    draws = _draw(q, k, num_samples, proposal="standard")
    out = _estimate(backend, q, k, v, draws, proposal="standard", weighting=weighting)
    c_eff = min(num_samples, q.shape[-2])
    rfa_draws = Draws({"omega": draws["eps"][..., :c_eff, :]}, draws.replicates)
    if backend == "reference":
        expected = rfa.reference.estimate(q, k, v, rfa_draws)
    else:
        t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
        expected = rfa.batched.estimate(t(q), t(k), t(v), rfa_draws.to_torch()).numpy()
    assert_close(out, expected, atol=EXACT, rtol=EXACT, what=f"LARA(standard, {weighting}) vs RFA")


def _ra_omegas(x, y, u, eps):
    """RA's samples omega_n = x_n + y_{z_n} + eps_n (eq. 30), z_n by inverse CDF of pi_n, one per query."""
    pi = softmax(x @ np.swapaxes(y, -1, -2), axis=-1)  # (..., N, M)
    z = (np.cumsum(pi, axis=-1)[None] < u[..., 0, None]).sum(-1)  # (R, ..., N)
    z = np.minimum(z, y.shape[-2] - 1)
    picked = np.take_along_axis(np.broadcast_to(y, (u.shape[0], *y.shape)), z[..., None], axis=-2)
    return x[None] + picked + eps[..., 0, :]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mis_with_ra_proposals_and_delta_weights_is_ra(backend, rng):
    """LARA sec. 4.3: C = N proposals q_c = p_c (eq. 29), alpha_nc = delta_nc, eq. 8 without
    self-normalization, is unbiased RA with S = 1 and the same component index and noise."""
    q, k, v = _qkv(rng, batch=(2,), n=9, m=9, d=4, dv=3)
    ra_draws = ra.draw(q.shape, k.shape, num_samples=1, replicates=4, rng=np.random.default_rng(3))
    scale = q.shape[-1] ** -0.5
    x, y = q * scale**0.5, k * scale**0.5
    omega = _ra_omegas(x, y, ra_draws["u"], ra_draws["eps"])  # (R, ..., C = N, D)
    log_q = lara_r.log_target_density(x, y, omega)  # [..., c', j] = log p_c'(omega_j): q_c = p_c
    delta = np.broadcast_to(np.where(np.eye(q.shape[-2], dtype=bool), 0.0, -np.inf), log_q.shape).copy()
    terms = lara_r.LaraTerms(x, y, v, omega, log_q, delta, None)
    if backend == "reference":
        out = lara_r.mis_estimate_eq8(terms)
        expected = ra.reference.estimate(q, k, v, ra_draws)
    else:
        t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
        log_q_t = lara_b.log_target_density(t(x), t(y), t(omega))
        terms = lara_r.LaraTerms(t(x), t(y), t(v), t(omega), log_q_t, t(delta), None)
        out = lara_b.mis_estimate_eq8(terms).numpy()
        expected = ra.batched.estimate(t(q), t(k), t(v), ra_draws.to_torch()).numpy()
    assert_close(out, expected, atol=EXACT, rtol=EXACT, what="MIS(q_c = p_c, delta) vs RA")


@ignore_negative_normalizer
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", sorted(lara.SPEC.variants))
def test_literal_eq10_equals_eq28_form(backend, variant, rng):
    """App. E: the SNIS of eq. 10 (p~_n, f_n, alpha) equals the alpha' form of eq. 28 that
    ``estimate`` computes through the linear SNIS skeleton."""
    params = _fit_grid(lara.SPEC.variants[variant], 10)
    q, k, v = _qkv(rng, batch=(2,), n=10, m=10 if "grid" in params else 7, d=4, dv=3)  # a grid is of N = M tokens
    draws = _draw(q, k, 5, **params)
    out = _estimate(backend, q, k, v, draws, **params)
    literal = _np(_module(backend).snis_estimate_eq10(_terms(backend, q, k, v, draws, **params)))
    assert_close(out, literal, atol=EXACT, rtol=EXACT, what=f"eq. 28 vs eq. 10, {variant}")


def test_mixture_density_equals_normalized_p_tilde(rng):
    """Sec. 4.2: p_n = p~_n / sum_m exp(x_n.y_m), the mixture of eq. 29 in the form of eq. 15."""
    q, k, v = _qkv(rng, batch=(2,), n=6, m=5, d=3, dv=2)
    x, y = q * 3**-0.25, k * 3**-0.25
    omega = rng.standard_normal((4, 2, 7, 3)) * 2.0
    log_z = logsumexp(x @ np.swapaxes(y, -1, -2), axis=-1)[None, ..., None]  # (1, ..., N, 1)
    assert_close(lara_r.log_target_density(x, y, omega), lara_r.log_unnormalized_target(x, y, omega) - log_z,
                 atol=EXACT, rtol=EXACT, what="log p_n")
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    assert_close(lara_b.log_target_density(t(x), t(y), t(omega)), lara_r.log_target_density(x, y, omega),
                 atol=EXACT, rtol=EXACT, what="batched log p_n")


def _official_code(q, k, v, eps, num_landmarks, alpha_coeff=1.0):
    """The official LARA forward (HKUNLP/efficient-attention ``lara.py``, mis_type='mis-opt',
    1-D segment-mean landmarks, training mode), restated in numpy in the unscaled variables."""
    d = q.shape[-1]
    s = d**-0.5  # the official "data_normalizer"

    def prm(data, w):  # prm_projection(data, w, normalize=False) -> (..., C_w, T)
        return w @ np.swapaxes(s * data, -1, -2) - s * (data * data).sum(-1)[..., None, :] / 2.0

    seg = lambda a: a.reshape(*a.shape[:-2], num_landmarks, -1, d).mean(-2)  # noqa: E731 (N divisible by C)
    q_bar, k_bar = seg(q), seg(k)
    mu = q_bar + k_bar
    weights = mu + eps  # N(0, I) noise in the unscaled space
    log_proj_q, log_proj_k = prm(q, weights), prm(k, weights)  # (..., C, N), (..., C, M)
    kv_stats = softmax(log_proj_k, axis=-1) @ v
    t_nc = softmax(s * q_bar @ np.swapaxes(q, -1, -2), axis=-1)  # (..., C, N): softmax over queries
    log_proj_mu = prm(mu, weights)  # (..., C (sample), C (mu))
    log_proposal = np.diagonal(log_proj_mu, axis1=-2, axis2=-1)[..., None]
    balanced = np.exp(log_proposal - logsumexp(log_proj_mu, axis=-1, keepdims=True))
    alpha = balanced + alpha_coeff * (t_nc - t_nc.mean(-2, keepdims=True))
    log_alpha = np.log(np.maximum(alpha, 1e-8))
    log_true_prob = log_proj_q + logsumexp(log_proj_k, axis=-1, keepdims=True)
    sniw = softmax(log_alpha + log_true_prob - log_proposal, axis=-2)
    return np.swapaxes(sniw, -1, -2) @ kv_stats


@pytest.mark.parametrize("proposal_beta", [("eq34", 1.0), ("eq34", 2.0)], ids=["beta1", "beta2"])
def test_reproduces_official_code(proposal_beta, rng):
    """alpha_clamp=1e-8 + noise='reference-code' is the official code (N divisible by C)."""
    proposal, beta = proposal_beta
    q, k, v = _qkv(rng, batch=(2,), n=12, m=12, d=9, dv=4)
    q, k = 3.0 * q, 3.0 * k  # some clipped weights
    draws = _draw(q, k, 4, replicates=2)
    params = dict(proposal=proposal, weighting="decoupled", beta=beta, alpha_clamp=1e-8, noise="reference-code")
    ours = lara_r.estimate(q, k, v, draws, **params)
    official = _official_code(q, k, v, draws["eps"], 4, alpha_coeff=beta)
    assert_close(ours, official, atol=EXACT, rtol=EXACT, what="LARA vs official code")


# ---------------------------------------------------------------------------------------
# weighting functions


def _random_log_proposals(rng, proposal, *, d=2, n=7, m=6, c=4, at_proposal_samples=True):
    """log q_c'(omega_j) of real proposals at their own samples, or at arbitrary points."""
    q, k, v = _qkv(rng, batch=(3,), n=n, m=m, d=d, dv=2)
    draws = _draw(q, k, c, proposal=proposal, replicates=2)
    terms = lara_r.lara_terms(q, k, v, draws, proposal=proposal)
    if at_proposal_samples:
        return terms.log_proposals, lara_r.query_scores(terms.x, segment_means(terms.x, c))
    x, y = terms.x, terms.y
    x_lm = segment_means(x, c)
    y_lm = segment_means(y, c)
    mu = lara_r.proposal_means(x_lm, y_lm, y, proposal)
    omega = rng.standard_normal((2, 3, c, d)) * 1.5  # any points: the weights are functions of omega
    return lara_r.log_proposal_densities(omega, x_lm, y, mu, proposal), lara_r.query_scores(x, x_lm)


@pytest.mark.parametrize("weighting", ["balance", "coupled", "decoupled"])
@pytest.mark.parametrize("proposal", ["eq34", "eq32"])
@pytest.mark.parametrize("at_samples", [True, False], ids=["own-samples", "any-omega"])
def test_weighting_functions_sum_to_one(weighting, proposal, at_samples, rng):
    """sum_c alpha_nc(omega) = 1 for every query n and every omega (LARA eq. 9, app. F, G.3.2)."""
    log_q, scores = _random_log_proposals(rng, proposal, at_proposal_samples=at_samples)
    alpha = lara_r.weighting_functions(log_q, scores, weighting, beta=2.0 if weighting == "decoupled" else 1.0)
    assert alpha.shape == (2, 3, 7, 4, 4)
    assert_close(alpha.sum(-2), np.ones(alpha.sum(-2).shape), atol=SUM_TO_ONE, what=f"sum_c alpha ({weighting})")
    if weighting != "balance":
        # the query-specific correction is really there (D = 2 keeps the coupled q_c(omega) visible)
        balance = lara_r.weighting_functions(log_q, scores, "balance")
        assert np.abs(alpha - balance).max() > 1e-3


def test_weighting_functions_match_montecarlo_helpers(rng):
    """Balance and decoupled weights agree with the generic MIS helpers (independent code)."""
    montecarlo = pytest.importorskip("randattn.theory.montecarlo")
    log_q, scores = _random_log_proposals(rng, "eq34")
    ours = lara_r.weighting_functions(log_q, scores, "balance")
    theirs = montecarlo.balance_heuristic(log_q)[..., None, :, :]
    assert_close(ours, np.broadcast_to(theirs, ours.shape), atol=SUM_TO_ONE, what="balance")
    ours = lara_r.weighting_functions(log_q, scores, "decoupled", beta=2.0)
    theirs = montecarlo.decoupled_heuristic(log_q[..., None, :, :], scores[None], beta=2.0)
    assert_close(ours, theirs, atol=SUM_TO_ONE, what="decoupled")


@pytest.mark.parametrize("weighting", ["balance", "coupled", "decoupled", "constant"])
@pytest.mark.parametrize("clamp", [None, 1e-8])
def test_weights_at_own_samples_are_the_diagonal(weighting, clamp, rng):
    """The estimator's log|alpha_nc(omega_c)| (log space, reference and batched) is the
    diagonal of the full weighting functions."""
    q, k, v = _qkv(rng, batch=(2,), n=9, m=8, d=2, dv=2)
    params = dict(proposal="eq33", weighting=weighting, alpha_clamp=clamp)
    draws = _draw(q, k, 4, **params)
    terms = lara_r.lara_terms(q, k, v, draws, **params)
    full = lara_r.weighting_functions(terms.log_proposals, lara_r.query_scores(terms.x, segment_means(terms.x, 4)), weighting)
    diag = np.diagonal(full, axis1=-2, axis2=-1)
    if clamp is not None:
        diag = np.maximum(diag, clamp)
    sign = np.ones(diag.shape) if terms.alpha_sign is None else terms.alpha_sign
    assert_close(sign * np.exp(terms.log_abs_alpha), diag, atol=SUM_TO_ONE, what="reference alpha")
    bt = _terms("torch", q, k, v, draws, **params)
    assert_close(bt.log_abs_alpha, terms.log_abs_alpha, atol=EXACT, rtol=EXACT, what="batched log|alpha|")
    assert (bt.alpha_sign is None) == (terms.alpha_sign is None)
    if terms.alpha_sign is not None:
        assert np.array_equal(_np(bt.alpha_sign), terms.alpha_sign)


def test_query_scores_are_normalized_over_queries(rng):
    """Our reading of eq. 37: r'_nc is a softmax over queries n, so sum_n r'_nc = 1."""
    x = rng.standard_normal((3, 10, 4))
    r = lara_r.query_scores(x, segment_means(x, 3))
    assert_close(r.sum(-2), np.ones((3, 3)), atol=SUM_TO_ONE, what="sum_n r'")


# ---------------------------------------------------------------------------------------
# proposals, landmarks, draws layout


def test_proposal_means_follow_the_equations(rng):
    """eq. 33-35 from their definitions (eq. 35 summing over k~_c'); eq. 32's mean = eq. 33's."""
    q, k, _ = _qkv(rng, batch=(), n=12, m=10, d=3)
    x, y = q * 3**-0.25, k * 3**-0.25
    x_lm, y_lm = segment_means(x, 4), segment_means(y, 4)
    pi = np.exp(x_lm @ y.T) / np.exp(x_lm @ y.T).sum(-1, keepdims=True)
    a = np.exp(y_lm @ y_lm.T) / np.exp(y_lm @ y_lm.T).sum(-1, keepdims=True)
    expected = {
        "eq33": x_lm + pi @ y, "eq32": x_lm + pi @ y, "eq34": x_lm + y_lm,
        "eq35": x_lm + a @ y_lm, "standard": np.zeros_like(x_lm),
    }  # fmt: skip
    for proposal, mean in expected.items():
        assert_close(lara_r.proposal_means(x_lm, y_lm, y, proposal), mean, atol=1e-14, what=proposal)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("proposal", ["eq33", "eq34", "eq35", "standard"])
@pytest.mark.parametrize("noise", ["paper", "reference-code"])
def test_mean_mode_is_the_sample_with_zero_noise(backend, proposal, noise, rng):
    """sample='mean' (G.3.3) passes omega_c = mu_c: the random estimator with eps = 0."""
    q, k, v = _qkv(rng, batch=(2,), n=11, m=9, d=4, dv=3)
    mean_draws = _draw(q, k, 5, sample="mean", replicates=2)
    assert set(mean_draws.arrays) == {"proposal_slots"} and mean_draws["proposal_slots"].size == 0
    zero = Draws({"eps": np.zeros((2, 2, 5, 4))}, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
        mean = _estimate(backend, q, k, v, mean_draws, proposal=proposal, sample="mean", noise=noise)
        zero_noise = _estimate(backend, q, k, v, zero, proposal=proposal, noise=noise)
    assert_close(mean, zero_noise, atol=EXACT, rtol=EXACT, what=f"mean mode {proposal}")
    assert np.array_equal(mean[0], mean[1])


def test_reference_code_noise_scales_eps(rng):
    """noise='reference-code': omega_c = mu_c + sqrt(scale) eps_c (N(0, I) in the unscaled space)."""
    q, k, v = _qkv(rng, batch=(), n=8, m=8, d=16, dv=2)
    draws = _draw(q, k, 4)
    paper = lara_r.lara_terms(q, k, v, draws)
    code = lara_r.lara_terms(q, k, v, draws, noise="reference-code")
    mu = paper.omega - draws["eps"]
    assert_close(code.omega, mu + 16**-0.25 * draws["eps"], atol=1e-14, what="omega")


@pytest.mark.parametrize(
    "proposal, n, m, c, c_eff",
    [("eq34", 13, 11, 20, 11), ("eq34", 13, 11, 12, 11), ("eq33", 13, 11, 20, 13), ("standard", 5, 9, 7, 5), ("eq32", 13, 11, 12, 12)],
)
def test_more_proposals_than_tokens_use_the_first_rows(proposal, n, m, c, c_eff, rng):
    """C > N (or > M for the key-landmark proposals) uses the first C_eff rows of the draws."""
    assert lara_r.effective_proposals(n, m, c, proposal) == c_eff
    q, k, v = _qkv(rng, batch=(2,), n=n, m=m, d=4, dv=3)
    draws = _draw(q, k, c, proposal=proposal)
    sliced = Draws({key: a[..., :c_eff, :] if a.ndim == 4 else a[..., :c_eff] for key, a in draws.arrays.items()}, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
        for backend in BACKENDS:
            full = _estimate(backend, q, k, v, draws, proposal=proposal)
            first = _estimate(backend, q, k, v, sliced, proposal=proposal)
            assert np.array_equal(full, first)
    assert lara_r.lara_terms(q, k, v, draws, proposal=proposal).omega.shape == (3, 2, c_eff, 4)


def test_eq32_component_sampling_by_inverse_cdf(rng):
    """eq. 32: omega_c = x~_c + y_{z_c} + eps_c with z_c = #{m : F_cm < u_c}."""
    q, k, v = _qkv(rng, batch=(), n=8, m=6, d=3, dv=2)
    draws = _draw(q, k, 4, proposal="eq32", replicates=50)
    terms = lara_r.lara_terms(q, k, v, draws, proposal="eq32")
    x_lm = segment_means(terms.x, 4)
    picked = terms.omega - x_lm - draws["eps"]  # (R, C, D): must be one of the y_m
    dist = np.abs(picked[..., None, :] - terms.y[None, None]).max(-1)  # (R, C, M)
    z = dist.argmin(-1)
    assert np.all(dist.min(-1) < 1e-12)
    cdf = np.cumsum(softmax(x_lm @ terms.y.T, axis=-1), axis=-1)
    assert np.array_equal(z, np.minimum((cdf[None] < draws["u"][..., None]).sum(-1), 5))


# ---------------------------------------------------------------------------------------
# batched == reference, awkward sizes, large norms


@ignore_negative_normalizer
@pytest.mark.parametrize("variant", sorted(lara.SPEC.variants))
@pytest.mark.parametrize("num_samples", [1, 6, 20], ids=lambda c: f"C{c}")
def test_batched_matches_reference_every_variant(variant, num_samples, rng):
    params = _fit_grid(lara.SPEC.variants[variant], 13)
    q, k, v = _qkv(rng, m=13 if "grid" in params else 11)  # a grid is of N = M tokens
    draws = _draw(q, k, num_samples, **params)
    ref = _estimate("reference", q, k, v, draws, **params)
    bat = _estimate("torch", q, k, v, draws, **params)
    assert ref.shape == (3, 2, 3, 13, 5)
    atol, rtol = TOLERANCES["float64"]
    assert_close(bat, ref, atol=atol, rtol=rtol, what=f"{variant} C={num_samples}")


def _vit_like(rng, n, d=64, q_max=30.0, k_max=150.0):
    def with_norms(norms):
        x = rng.standard_normal((2, len(norms), d))
        return x / np.linalg.norm(x, axis=-1, keepdims=True) * norms[:, None]

    q = with_norms(rng.uniform(1.0, q_max, n))
    k_norms = rng.uniform(1.0, 40.0, n)
    k_norms[0] = k_max  # a CLS-like key
    return q, with_norms(k_norms), rng.standard_normal((2, n, d))


@ignore_negative_normalizer
@pytest.mark.parametrize("variant", ["eq34-decoupled", "eq32-coupled", "official-vit"])
def test_uneven_segments_and_vit_norms(variant, rng):
    """N = 197 tokens in C = 49 uneven segments, key norms up to 150 and query norms up to 30
    (scale 1/8): finite in float64 and float32, batched == reference in float64."""
    params = lara.SPEC.variants[variant]
    q, k, v = _vit_like(rng, 197)
    draws = _draw(q, k, 49, replicates=1, **params)
    ref = _estimate("reference", q, k, v, draws, **params)
    bat = _estimate("torch", q, k, v, draws, **params)
    t32 = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    b32 = lara_b.estimate(t32(q), t32(k), t32(v), draws.to_torch(dtype=torch.float32), **params)
    assert np.isfinite(ref).all() and np.isfinite(bat).all()
    assert torch.isfinite(b32).all()
    atol, rtol = TOLERANCES["float64"]
    assert_close(bat, ref, atol=atol, rtol=rtol, what=f"{variant} at ViT norms")


def _at_norm(rng, norm, params, batch=(8,), d=8):
    """Queries and keys all of norm ``norm``, values standard normal; N = 12, M = 16 (N = M = 13 for a grid)."""
    grid = params.get("grid") is not None
    n, m = (13, 13) if grid else (12, 16)

    def with_norm(x):
        return x * (norm / np.linalg.norm(x, axis=-1, keepdims=True))

    return (with_norm(rng.standard_normal((*batch, n, d))), with_norm(rng.standard_normal((*batch, m, d))),
            rng.standard_normal((*batch, m, 2)))


def _large_norm_tolerance(norm, d=8):
    """max(TOLERANCES["float64"], 4 u E), E = scale * norm^2 with scale = D^-1/2 (see the test below)."""
    return max(TOLERANCES["float64"][0], 4 * 2.0**-53 * d**-0.5 * norm**2)


@ignore_negative_normalizer
@pytest.mark.parametrize("norm", [300.0, 1e3, 1e4], ids=lambda s: f"norm{s:g}")
@pytest.mark.parametrize("variant", sorted(lara.SPEC.variants))
def test_batched_is_finite_and_matches_reference_at_large_norms(variant, norm):
    """Query and key norms 300, 1e3, 1e4 (D = 8, C = 4, 2 replicates x 8 batch elements): where the
    reference is finite, so is the batched form in float64, and the two agree.

    Before 0.2.0's fix the query-dependent weights (eq. 37, 38) were multiplied onto exponentials
    shifted by their maximum without alpha; where alpha is zero at that maximum (N(0, I) proposals,
    one-hot scores: 1/C - 1/C) every other product underflowed: NaN (standard-decoupled at 1e3 and
    1e4, eq35-decoupled-beta2 at every norm) or subnormal weights that lost their digits.

    Tolerance: max(1e-10, 4 u E), u = 2^-53, E = scale * norm^2 (the size of the key exponents
    omega.y - |y|^2/2 and of the query ones). The two forms round those exponents in different orders
    (numpy's einsum-free features against torch's products), each to u E absolute, which is a
    relative error u E on every weight and so on the self-normalized output: 1e-10 up to norm 1e3
    (4 u E = 1.6e-10 there), 1.6e-8 at 1e4, where 1.6e-9 was observed with positive weights (the
    same before the fix: the rounding of exponents of size 3.5e7, not this defect).
    """
    params = _fit_grid(lara.SPEC.variants[variant], 13)
    rng = np.random.default_rng(38)
    q, k, v = _at_norm(rng, norm, params)
    draws = _draw(q, k, 4, replicates=2, **params)
    ref = _estimate("reference", q, k, v, draws, **params)
    bat = _estimate("torch", q, k, v, draws, **params)
    finite = np.isfinite(ref).all(-1)
    assert finite.mean() > 0.9, "the reference itself should be finite on almost every row"
    assert np.isfinite(bat[finite]).all(), f"{variant} at norm {norm:g}: NaN where the reference is finite"
    tol = _large_norm_tolerance(norm)
    assert_close(bat[finite], ref[finite], atol=tol, rtol=tol, what=f"{variant} at norm {norm:g}")


@ignore_negative_normalizer
@pytest.mark.parametrize("norm", [300.0, 1e3, 1e4], ids=lambda s: f"norm{s:g}")
@pytest.mark.parametrize("variant", sorted(lara.SPEC.variants))
def test_float32_at_large_norms_is_finite_where_the_reference_is(variant, norm):
    """The inputs of the float64 test above rounded to float32 (draws in float64, as the module
    docstring asks), against the reference on the same rounded inputs: no NaN where it is finite.

    Signed weightings are computed in float64 whatever the input dtype, so there they also agree to
    the float64 test's tolerance plus float32's rounding of the output (2^-23 relative, 2^-23 absolute
    for the outputs of size ~1). Positive weightings are computed in float32, whose exponents of size
    up to 3.5e7 are not accurate to better than ~1: only finiteness is asked (their normalizer is a
    sum of positive terms, so float32 rounding cannot make it non-positive either)."""
    params = _fit_grid(lara.SPEC.variants[variant], 13)
    rng = np.random.default_rng(38)
    q, k, v = (a.astype(np.float32) for a in _at_norm(rng, norm, params))
    draws = _draw(q, k, 4, replicates=2, **params)
    ref = lara_r.estimate(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), draws, **params)
    out = lara_b.estimate(*(torch.as_tensor(a) for a in (q, k, v)), draws.to_torch(dtype=torch.float64), **params)
    assert out.dtype == torch.float32
    finite = np.isfinite(ref).all(-1)
    assert torch.isfinite(out[torch.as_tensor(finite)]).all(), f"{variant} at norm {norm:g}: NaN in float32"
    if lara_r.LaraOptions(**params).signed:
        tol = _large_norm_tolerance(norm) + 2.0**-23
        assert_close(out.double()[torch.as_tensor(finite)], ref[finite], atol=tol, rtol=tol,
                     what=f"float32 {variant} at norm {norm:g}")


@ignore_negative_normalizer
def test_every_batched_form_is_finite_on_one_hot_scores_at_norm_1e3():
    """The audit's case: N(0, I) proposals and decoupled weights at norm 1e3, where row 11's weight at
    its largest exponential is 1/C - 1/C = 0 exactly. The reference gives [1.0795, -0.0097]; the batched
    estimate gave NaN, and so did the probabilities, ``estimate_with_probabilities`` and the factors of
    ``estimate_with_probability_factors`` (one ``_weights_and_keys`` for all). Each equals the reference
    (v, or v = I_M for the probabilities) to 1e-10, the float64 tolerance (observed ~1e-16)."""
    rng = np.random.default_rng(38)
    q, k, v = rng.normal(size=(12, 8)), rng.normal(size=(16, 8)), rng.normal(size=(16, 2))
    q *= 1e3 / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= 1e3 / np.linalg.norm(k, axis=-1, keepdims=True)
    params = dict(proposal="standard")
    draws = _draw(q, k, 4, replicates=1, **params)
    ref = lara_r.estimate(q, k, v, draws, **params)
    ref_probs = lara_r.estimate(q, k, np.eye(16), draws, **params)
    assert np.isfinite(ref).all() and np.isfinite(ref_probs).all()
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    args = (t(q), t(k), t(v), draws.to_torch())
    out, probs = lara_b.estimate_with_probabilities(*args, **params)
    out_f, factor_l, factor_e = lara_b.estimate_with_probability_factors(*args, **params)
    out_32, _, _ = lara_b.estimate_with_float32_probabilities(*args, **params)
    atol, rtol = TOLERANCES["float64"]
    for what, got, expected in [
        ("estimate", lara_b.estimate(*args, **params), ref),
        ("estimate_with_probabilities", out, ref),
        ("estimate_with_probability_factors", out_f, ref),
        ("estimate_with_float32_probabilities", out_32, ref),
        ("probabilities", lara_b.probabilities(t(q), t(k), draws.to_torch(), **params), ref_probs),
        ("estimate_with_probabilities' probabilities", probs, ref_probs),
        ("L @ E", factor_l @ factor_e, ref_probs),
    ]:
        assert torch.isfinite(got).all(), what
        assert_close(got, expected, atol=atol, rtol=rtol, what=what)


@ignore_negative_normalizer
def test_decoupled_beta2_weights_of_zero_at_the_largest_exponential_at_norm_300():
    """eq. 38 with beta = 2 and well separated proposals (b_own = 1): scores r'_n. = (0, 1, 0, 1) give
    alpha = 1 + 2 (r' - 1/2) = (0, 2, 0, 2), a zero weight where the exponential is largest, at norms of
    300 already. The batched form gave NaN on this row (replicate 0, batch 0, query 4), the reference
    [-1.297, -1.938]; now they agree to the float64 tolerance (1e-10; 4 u E = 1.4e-11 at norm 300)."""
    params = lara.SPEC.variants["eq35-decoupled-beta2"]
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 12, 8)), rng.normal(size=(2, 16, 8)), rng.normal(size=(2, 16, 2))
    q *= 300 / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= 300 / np.linalg.norm(k, axis=-1, keepdims=True)
    draws = _draw(q, k, 4, seed=100, replicates=2, **params)
    terms = lara_r.lara_terms(q, k, v, draws, **params)
    assert np.array_equal(terms.alpha_sign[0, 0, 4], [0.0, 1.0, 0.0, 1.0])
    ref = _estimate("reference", q, k, v, draws, **params)
    bat = _estimate("torch", q, k, v, draws, **params)
    assert np.isfinite(ref).all() and np.isfinite(bat).all()
    atol, rtol = TOLERANCES["float64"]
    assert_close(bat, ref, atol=atol, rtol=rtol, what="eq35-decoupled-beta2 at norm 300")


def test_landmarks_of_197_tokens_in_49_segments(rng):
    """array_split segments: one of 5 tokens then 48 of 4 (segments.py); eq. 34 means."""
    q, k, v = _qkv(rng, batch=(), n=197, m=197, d=4, dv=2)
    terms = lara_r.lara_terms(q, k, v, _draw(q, k, 49, sample="mean", replicates=1), sample="mean")
    x, y = terms.x, terms.y
    assert_close(terms.omega[0, 0], x[:5].mean(0) + y[:5].mean(0), atol=1e-14, what="first landmark")
    assert_close(terms.omega[0, -1], x[-4:].mean(0) + y[-4:].mean(0), atol=1e-14, what="last landmark")


# ---------------------------------------------------------------------------------------
# consistency: error falls with C; unbiasedness of eq. 8


def _per_replicate_error(params, q, k, v, num_samples, replicates, seed):
    exact = _softmax_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
        est = randattn.estimate("lara", q, k, v, num_samples=num_samples, seed=seed, replicates=replicates, **params)
    return ((est - exact) ** 2).mean(axis=(-1, -2))  # (R,): squared error averaged over queries and dims


@pytest.mark.parametrize(
    "params",
    [{"weighting": "balance"}, {"weighting": "coupled"}, {"weighting": "decoupled", "alpha_clamp": 1e-8}],
    ids=["balance", "coupled", "decoupled-clamp"],
)
def test_error_falls_as_proposals_approach_n(params):
    """MSE(C = 2) > MSE(C = N) by more than N_SE standard errors of their difference.

    Each MSE is a mean of R iid per-replicate squared errors; SE = std / sqrt(R); the two
    runs use independent seeds, so SE_diff = sqrt(SE_2^2 + SE_N^2).

    The unclipped decoupled weights (eq. 38) are left out on purpose: they can be negative,
    the self-normalizer then comes near zero for some replicates and the squared error is
    heavy-tailed (on this input its mean *rises* with C, 0.10 -> ~8, while its median falls,
    0.083 -> 0.036), so a mean-based comparison is not meaningful for them. The official
    code's clipping (alpha_clamp) removes the tail.
    """
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, batch=(), n=16, m=16, d=4, dv=3)
    replicates = 400
    small = _per_replicate_error(params, q, k, v, 2, replicates, seed=1)
    full = _per_replicate_error(params, q, k, v, 16, replicates, seed=2)
    se = np.sqrt(small.var(ddof=1) / replicates + full.var(ddof=1) / replicates)
    assert small.mean() - full.mean() > N_SE * se, (
        f"MSE C=2 {small.mean():.4g} vs C=N {full.mean():.4g}, SE of difference {se:.3g}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["balance", "coupled", "decoupled"])
@pytest.mark.parametrize("proposal", ["eq34", "eq32"])
def test_mis_eq8_is_unbiased(weighting, proposal):
    """E[eq. 8] = softmax attention when sum_c alpha_nc = 1 (app. F), within N_SE SE per element.

    Small norms (|x + y|^2 <= ~2) keep p_n / q_c bounded enough for a finite variance.
    """
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, batch=(), n=6, m=5, d=2, dv=2)
    q, k = 0.5 * q, 0.5 * k
    replicates = 20000
    params = dict(proposal=proposal, weighting=weighting)
    draws = _draw(q, k, 3, replicates=replicates, seed=9, **params)
    est = lara_r.mis_estimate_eq8(lara_r.lara_terms(q, k, v, draws, **params))
    exact = _softmax_attention(q, k, v)
    se = est.std(axis=0, ddof=1) / np.sqrt(replicates)
    assert np.all(se < 0.02), f"SE {se.max():.3g} too large for a meaningful test"
    z = np.abs(est.mean(0) - exact) / se
    assert np.all(z < N_SE), f"max |mean - exact| / SE = {z.max():.2f} ({weighting}, {proposal})"


# ---------------------------------------------------------------------------------------
# bad input


BAD_OPTIONS = [
    pytest.param({"proposal": "nope"}, ValueError,
                 r"proposal='nope' is not allowed; choose one of 'eq34', 'eq33', 'eq35', 'eq32', 'standard'", id="proposal"),
    pytest.param({"weighting": "nope"}, ValueError,
                 r"weighting='nope' is not allowed; choose one of 'decoupled', 'balance', 'coupled', 'constant'",
                 id="weighting"),
    pytest.param({"sample": "median"}, ValueError, r"sample='median' is not allowed", id="sample"),
    pytest.param({"noise": "nope"}, ValueError, r"noise='nope' is not allowed", id="noise"),
    pytest.param({"weighting": "balance", "beta": 2.0}, ValueError, r"beta=2.0 scales .* weighting='decoupled'",
                 id="beta-not-decoupled"),
    pytest.param({"beta": float("inf")}, ValueError, "beta must be finite", id="beta-inf"),
    pytest.param({"alpha_clamp": 0.0}, ValueError, "alpha_clamp must be None or a finite number > 0", id="clamp-zero"),
    pytest.param({"alpha_clamp": "1e-8"}, TypeError, "alpha_clamp", id="clamp-str"),
]
#: layout options the registry's Param types let through, caught by LaraOptions itself
BAD_LAYOUT_OPTIONS = [
    pytest.param({"layout": "nope"}, ValueError, r"layout='nope' is not allowed", id="layout"),
    pytest.param({"grid": "4-4"}, ValueError, r"grid='4-4' is not a grid; write rows x columns as 'HxW'", id="grid"),
    pytest.param({"prefix_tokens": -1}, ValueError, r"prefix_tokens must be >= 0", id="prefix-negative"),
    pytest.param({"beta": "2"}, TypeError, r"beta must be a real number", id="beta-str"),
]
#: every entry point taking LARA's keyword options, as (function, takes v)
ENTRY_POINTS = [
    pytest.param(lara_r.lara_terms, True, id="reference.lara_terms"),
    pytest.param(lara_r.estimate, True, id="reference.estimate"),
    pytest.param(lara_b.lara_terms, True, id="batched.lara_terms"),
    pytest.param(lara_b.estimate, True, id="batched.estimate"),
    pytest.param(lara_b.probabilities, False, id="batched.probabilities"),
    pytest.param(lara_b.estimate_with_probabilities, True, id="batched.estimate_with_probabilities"),
    pytest.param(lara_b.estimate_with_float32_probabilities, True, id="batched.estimate_with_float32_probabilities"),
    pytest.param(lara_b.estimate_with_probability_factors, True, id="batched.estimate_with_probability_factors"),
]


@pytest.mark.parametrize("params, error, message", BAD_OPTIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_options_are_named(params, error, message, backend, rng):
    q, k, v = _qkv(rng, batch=(), n=6, m=6, d=4, dv=2)
    with pytest.raises(error, match=message):
        randattn.estimate("lara", q, k, v, num_samples=3, seed=0, backend=backend, **params)


@pytest.mark.parametrize("params, error, message", BAD_OPTIONS + BAD_LAYOUT_OPTIONS)
def test_options_object_names_the_bad_argument(params, error, message):
    with pytest.raises(error, match=message):
        lara_r.LaraOptions(**params)


@pytest.mark.parametrize("function, takes_v", ENTRY_POINTS)
@pytest.mark.parametrize("params, error, message", BAD_OPTIONS[:1] + BAD_LAYOUT_OPTIONS[:1])
def test_entry_points_validate_options_before_the_inputs(function, takes_v, params, error, message):
    """Every entry point builds its LaraOptions first: a bad option is named even with no inputs at all."""
    args = (None, None, None, None) if takes_v else (None, None, None)
    with pytest.raises(error, match=message):
        function(*args, **params)


@pytest.mark.parametrize("function, takes_v", ENTRY_POINTS)
def test_entry_points_share_the_options_defaults(function, takes_v):
    """The keyword signatures the engine calls are LaraOptions' fields with its defaults, in its order,
    and the registry's parameter defaults."""
    keywords = {name: p.default for name, p in inspect.signature(function).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f.default for f in dataclasses.fields(lara_r.LaraOptions)}
    assert list(keywords.items()) == list(fields.items())
    assert {name: param.default for name, param in lara.PARAMS.items()} == {
        name: default for name, default in fields.items() if name != "scale"}


def test_options_are_frozen_and_derive_layout_and_sign():
    options = lara_r.LaraOptions(grid=(3, 4), prefix_tokens=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.beta = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        lara_r.LaraOptions("eq34")  # type: ignore[misc]  # keyword-only: ten options, no positional slips
    assert options.token_layout == TokenLayout("grid", (3, 4), 1)
    with pytest.warns(DeprecationWarning, match="layout_kw is deprecated; use LaraOptions.token_layout"):
        assert options.layout_kw == {"layout": "grid", "grid": (3, 4), "prefix_tokens": 1}
    spec = randattn.get_spec("lara")
    for params in spec.variants.values():
        assert lara_r.LaraOptions(**params).signed == spec.signed_weights(params), params


@pytest.mark.parametrize("backend", BACKENDS)
def test_draws_of_another_proposal_or_mode_are_rejected(backend, rng):
    q, k, v = _qkv(rng, batch=(), n=6, m=6, d=4, dv=2)
    eq34_draws = _draw(q, k, 3, replicates=1)
    module = lara_r if backend == "reference" else lara_b
    if backend == "torch":
        q, k, v = (torch.as_tensor(a) for a in (q, k, v))
    with pytest.raises(KeyError, match="draws have no 'u'"):
        module.estimate(q, k, v, eq34_draws, proposal="eq32")
    with pytest.raises(KeyError, match="draws have no 'proposal_slots'"):
        module.estimate(q, k, v, eq34_draws, sample="mean")
    with pytest.raises(ValueError, match="were the draws made for inputs of another shape"):
        module.estimate(q[None], k[None], v[None], eq34_draws)


def test_spec_catalogue_entry():
    spec = randattn.get_spec("lara")
    assert spec.is_random(spec.resolve_params({})) and not spec.is_random(spec.resolve_params({"sample": "mean"}))
    combos = {(p["proposal"], p.get("weighting")) for p in spec.variants.values()}
    assert {(p, w) for p in lara_r.PROPOSALS for w in lara_r.WEIGHTINGS} <= combos
    assert spec.resolve_params({}) == {
        "proposal": "eq34", "weighting": "decoupled", "beta": 1.0, "alpha_clamp": None, "sample": "random", "noise": "paper",
        "layout": "grid", "grid": None, "prefix_tokens": 0,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------
# 2-D landmarks: the identities above, with grid-block landmarks (app. G.4)

GRIDS = [(3, 5), (14, 14), (28, 28)]
PREFIXES = [0, 1, 5]
_grid_id = lambda g: f"{g[0]}x{g[1]}"  # noqa: E731
#: the 785-token grid (28 x 28 + prefix) costs ~1 s per quadratic check: under ``-m slow``
GRID_PARAMS = [pytest.param(g, id=_grid_id(g), marks=pytest.mark.slow if g == (28, 28) else ()) for g in GRIDS]


def _grid_qkv(rng, grid, prefix, d=4, dv=3):
    n = prefix + grid[0] * grid[1]
    return _qkv(rng, batch=(), n=n, m=n, d=d, dv=dv)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grid", GRID_PARAMS)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_grid_standard_proposals_with_constant_weights_are_rfa(backend, grid, prefix, rng):
    """Sec. 4.3 with grid landmarks: N(0, I) proposals and constant weights are RFA with
    omega_c = eps_c; C = 20 > h w = 15 on 3 x 5 uses the first C_eff = 15 rows."""
    q, k, v = _grid_qkv(rng, grid, prefix)
    layout = dict(grid=grid, prefix_tokens=prefix)
    draws = _draw(q, k, 20, proposal="standard", replicates=2)
    out = _estimate(backend, q, k, v, draws, proposal="standard", weighting="constant", **layout)
    c_eff = min(20, grid[0] * grid[1])
    expected = rfa.reference.estimate(q, k, v, Draws({"omega": draws["eps"][..., :c_eff, :]}, 2))
    assert_close(out, expected, atol=EXACT, rtol=EXACT, what=f"grid LARA(standard, constant) vs RFA {grid} +{prefix}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grid", [(3, 5), (2, 7), (6, 6)], ids=_grid_id)
def test_grid_mixture_proposals_with_one_patch_blocks_and_delta_weights_are_ra(backend, grid, rng):
    """Sec. 4.3 through the grid path: C = h w blocks are single patches in raster order, so the
    grid landmarks are the queries and the eq. 32 mixture proposals are q_c = p_c (eq. 29); with
    alpha = delta and eq. 8 this is RA with S = 1, same component uniforms and noise."""
    q, k, v = _grid_qkv(rng, grid, 0)
    n = q.shape[-2]
    ra_draws = ra.draw(q.shape, k.shape, num_samples=1, replicates=4, rng=np.random.default_rng(3))
    draws = Draws({"u": ra_draws["u"][..., 0], "eps": ra_draws["eps"][..., 0, :]}, 4)
    terms = _terms(backend, q, k, v, draws, proposal="eq32", grid=grid)
    assert_close(terms.x_landmarks, terms.x, atol=0, what="one-patch landmarks")
    delta = np.broadcast_to(np.where(np.eye(n, dtype=bool), 0.0, -np.inf), (4, n, n)).copy()
    if backend == "reference":
        out = lara_r.mis_estimate_eq8(lara_r.LaraTerms(terms.x, terms.y, v, terms.omega, terms.log_proposals, delta, None))
        expected = ra.reference.estimate(q, k, v, ra_draws)
    else:
        t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
        out = lara_b.mis_estimate_eq8(
            lara_r.LaraTerms(terms.x, terms.y, t(v), terms.omega, terms.log_proposals, t(delta), None)).numpy()
        expected = ra.batched.estimate(t(q), t(k), t(v), ra_draws.to_torch()).numpy()
    assert_close(out, expected, atol=EXACT, rtol=EXACT, what=f"grid MIS(q_c = p_c, delta) vs RA {grid}")


GRID_VARIANTS = ["eq34-decoupled", "eq35-balance", "eq32-coupled", "eq33-decoupled", "official-vit", "eq34-decoupled-mean"]


def _grid_variant(grid, prefix, offset=0):
    """Variants in turn over the (grid, prefix) cases, so every kind meets a grid at little cost."""
    return GRID_VARIANTS[(GRIDS.index(grid) * len(PREFIXES) + PREFIXES.index(prefix) + offset) % len(GRID_VARIANTS)]


@ignore_negative_normalizer
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grid", GRID_PARAMS)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_grid_literal_eq10_equals_eq28_form(backend, grid, prefix, rng):
    """App. E with grid landmarks (non-square, square, 785-token grids; 0, 1, 5 prefix tokens),
    one variant per case in turn so that every proposal/weighting kind meets a grid."""
    variant = _grid_variant(grid, prefix)
    params = {**lara.SPEC.variants[variant], "grid": grid, "prefix_tokens": prefix}
    q, k, v = _grid_qkv(rng, grid, prefix)
    draws = _draw(q, k, 7, replicates=1, **params)  # 7 blocks: uneven on every grid here
    out = _estimate(backend, q, k, v, draws, **params)
    literal = _np(_module(backend).snis_estimate_eq10(_terms(backend, q, k, v, draws, **params)))
    assert_close(out, literal, atol=EXACT, rtol=EXACT, what=f"eq. 28 vs eq. 10, {variant} {grid} +{prefix}")


@ignore_negative_normalizer
@pytest.mark.parametrize("offset", [0, 3])
@pytest.mark.parametrize("grid", GRID_PARAMS)
@pytest.mark.parametrize("prefix", PREFIXES)
def test_grid_batched_matches_reference(offset, grid, prefix, rng):
    """Batched == reference (float64) with grid landmarks; the common suite adds every grid variant on small shapes."""
    variant = _grid_variant(grid, prefix, offset)
    params = {**lara.SPEC.variants[variant], "grid": grid, "prefix_tokens": prefix}
    q, k, v = _grid_qkv(rng, grid, prefix)
    num_samples = {(3, 5): 6, (14, 14): 49, (28, 28): 32}[grid]
    draws = _draw(q, k, num_samples, replicates=2, **params)
    ref = _estimate("reference", q, k, v, draws, **params)
    bat = _estimate("torch", q, k, v, draws, **params)
    atol, rtol = TOLERANCES["float64"]
    assert_close(bat, ref, atol=atol, rtol=rtol, what=f"{variant} {grid} +{prefix}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_landmarks_are_2x2_block_means_without_cls(backend, rng):
    """C = 49 on 14 x 14 after one CLS token: eq. 34 means x~_c + y~_c of 2 x 2 patch blocks (mean mode)."""
    q, k, v = _grid_qkv(rng, (14, 14), 1, d=3, dv=2)
    terms = _terms(backend, q, k, v, _draw(q, k, 49, sample="mean", replicates=1), sample="mean",
                   grid="14x14", prefix_tokens=1)
    x, y = _np(terms.x), _np(terms.y)
    pool = lambda a: a[1:].reshape(7, 2, 7, 2, 3).mean(axis=(1, 3)).reshape(49, 3)  # noqa: E731
    assert_close(terms.omega[0], pool(x) + pool(y), atol=1e-14, what="2x2 landmarks")


@pytest.mark.parametrize("backend", BACKENDS)
def test_grid_layout_needs_tokens_of_the_grid(backend, rng):
    q, k, v = _qkv(rng, batch=(), n=17, m=16, d=4, dv=2)
    with pytest.raises(ValueError, match=r"grid=4x4 with prefix_tokens=0 describes 16 tokens, but the queries have 17"):
        randattn.estimate("lara", q, q, v[:1].repeat(17, 0), num_samples=3, backend=backend, grid=(4, 4))
    with pytest.raises(ValueError, match=r"describes 17 tokens, but the keys have 16"):
        randattn.estimate("lara", q, k, v, num_samples=3, backend=backend, grid="4x4", prefix_tokens=1)
    with pytest.raises(ValueError, match=r"grid='4-4' is not a grid; write rows x columns as 'HxW'"):
        randattn.estimate("lara", q, k, v, num_samples=3, backend=backend, grid="4-4")


def test_grid_from_the_cli_spec():
    """``lara:grid=14x14,prefix_tokens=1`` parses to the string grid that LARA accepts."""
    from randattn.estimators.registry import parse_estimator

    name, params = parse_estimator("lara:grid=14x14,prefix_tokens=1,layout=grid")
    assert (name, params) == ("lara", {"grid": "14x14", "prefix_tokens": 1, "layout": "grid"})


# ---------------------------------------------------------------------------------------
# implied probabilities from a float32 product, with a bound on its rounding


@ignore_negative_normalizer
@pytest.mark.parametrize("variant", ["eq34-decoupled", "eq32-coupled", "eq35-balance-grid", "official-vit"])
def test_float32_probabilities_lie_within_their_bound_of_the_float64_reference(variant, rng):
    """At ViT norms (exponents ~1e2): the output is ``estimate``'s bits, and each row of the float32
    probabilities is within its bound of the float64 reference with ``v = I_M`` (an independent code
    path; 1e-10 covers the float64 difference between the two)."""
    params = _fit_grid(lara.SPEC.variants[variant], 197)
    q, k, v = _vit_like(rng, 197)
    draws = _draw(q, k, 49, replicates=2, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    out, probs, bound = lara_b.estimate_with_float32_probabilities(t(q), t(k), t(v), draws.to_torch(), **params)
    assert torch.equal(out, lara_b.estimate(t(q), t(k), t(v), draws.to_torch(), **params))
    assert probs.dtype == torch.float32 and bound.shape == probs.shape[:-1]
    eye = np.broadcast_to(np.eye(k.shape[-2]), (*k.shape[:-1], k.shape[-2]))
    exact = lara_r.estimate(q, k, eye, draws, **params)
    error = np.linalg.norm(probs.double().numpy() - exact, axis=-1)
    assert (error <= bound.numpy() + 1e-10).all()
    # and the bound is tight enough to use: far below the rows' norms
    assert (bound.numpy() < 1e-3 * np.linalg.norm(exact, axis=-1)).all()


def test_float32_quotient_bound_covers_a_near_cancelling_normalizer(rng):
    """Weights that cancel to 1e-6 of their size in the normalizer d: the float32 quotient's error is
    under the bound, and above what the bound would say without its division by |d| (so a bound
    that dropped it fails here)."""
    num_c, n, m = 64, 50, 40
    key_exp = torch.as_tensor(rng.uniform(0.0, 1.0, (1, num_c, m)))
    weights = torch.as_tensor(rng.uniform(0.5, 1.0, (1, num_c, n)))
    sums = key_exp.sum(-1)  # (1, C)
    # the last weight of each query sets d_n = sum_c W_cn s_c to 1e-6 of sum_{c < C} W_cn s_c
    partial = (weights[:, :-1] * sums[:, :-1, None]).sum(-2)  # (1, N)
    weights[:, -1] = -(partial * (1 - 1e-6)) / sums[:, -1:]
    den = (weights * sums[..., None]).sum(-2)
    exact = (weights.transpose(-1, -2) @ key_exp) / den[..., None]
    w32, e32 = weights.to(torch.float32), key_exp.to(torch.float32)
    approx = (w32.transpose(-1, -2) @ e32).mul_(den.reciprocal().to(torch.float32)[..., None])
    error = torch.linalg.vector_norm(approx.double() - exact, dim=-1)
    bound = lara_b.float32_quotient_bound(weights, key_exp, den)
    assert (error <= bound).all()
    u = 2.0**-24
    spread = (weights.abs().transpose(-1, -2) @ torch.linalg.vector_norm(key_exp, dim=-1, keepdim=True))[..., 0]
    assert (error > 2 * (num_c + 5) * u * spread).all()


@ignore_negative_normalizer
def test_float32_probabilities_beyond_float32_range_get_an_infinite_bound(rng):
    """beta = 1e42 puts the decoupled weights beyond float32's range (3.4e38): the float32 product
    overflows, and the bound says inf on those rows rather than a finite number it cannot keep."""
    q, k, v = _qkv(rng, batch=(2,), n=9, m=7, d=4)
    params = dict(weighting="decoupled", beta=1e42)
    draws = _draw(q, k, 5, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    _, probs, bound = lara_b.estimate_with_float32_probabilities(t(q), t(k), t(v), draws.to_torch(), **params)
    broken = ~torch.isfinite(probs).all(-1)
    assert broken.any()
    assert torch.isinf(bound[broken]).all()


@ignore_negative_normalizer
@pytest.mark.parametrize("norm", [1.0, 1e3])
def test_the_accelerator_path_of_the_underflow_rescue_gives_the_same_bits(norm, monkeypatch):
    """On an accelerator the batched form cannot ask whether a query's weights underflowed (a host read): it
    redoes every query in log space and keeps the linear form where nothing underflowed. Run that path on the
    CPU: the estimate is the same bits as the host path's, on ordinary inputs (norm 1) and on the audit's case
    (norm 1e3, where a query is redone)."""
    rng = np.random.default_rng(38)
    q, k, v = rng.normal(size=(12, 8)), rng.normal(size=(16, 8)), rng.normal(size=(16, 2))
    q *= norm / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= norm / np.linalg.norm(k, axis=-1, keepdims=True)
    params = dict(proposal="standard")
    draws = _draw(q, k, 4, replicates=1, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    host = lara_b.estimate(t(q), t(k), t(v), draws.to_torch(), **params)
    monkeypatch.setattr(lara_b, "ASK_FIRST_DEVICES", ())
    device = lara_b.estimate(t(q), t(k), t(v), draws.to_torch(), **params)
    assert torch.isfinite(device).all()
    assert torch.equal(host, device)


@ignore_negative_normalizer
def test_float32_probabilities_of_a_query_with_tiny_weights_are_finite_and_within_their_bound(monkeypatch):
    """The audit's case again: a query whose weighting function is ~1e-180 where its exponential is largest keeps
    float64 weights of that size, which float32 rounded to 0, so ``estimate_with_float32_probabilities`` gave
    0 / 0 for its row (with the bound inf). Its column and normalizer are now scaled by a power of two before the
    float32 product (exact, and cancelled by the quotient): every row finite, and within the stated bound of the
    reference's probabilities (v = I_M; plus 1e-10, the float64 agreement of the two forms). Without the scaling
    (the threshold set to 0) the row is not finite, so the case tests what it names."""
    rng = np.random.default_rng(38)
    q, k = rng.normal(size=(12, 8)), rng.normal(size=(16, 8))
    q *= 1e3 / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= 1e3 / np.linalg.norm(k, axis=-1, keepdims=True)
    params = dict(proposal="standard")
    draws = _draw(q, k, 4, replicates=1, **params)
    ref_probs = lara_r.estimate(q, k, np.eye(16), draws, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    args = (t(q), t(k), t(np.eye(16)[:, :2]), draws.to_torch())
    _, probs, bound = lara_b.estimate_with_float32_probabilities(*args, **params)
    assert torch.isfinite(probs).all() and torch.isfinite(bound).all()
    error = np.linalg.norm(probs.double().numpy() - ref_probs, axis=-1)
    assert (error <= bound.numpy() + 1e-10).all(), (error, bound)
    monkeypatch.setattr(lara_b, "FLOAT32_SCALE_BELOW", 0.0)
    _, unscaled, _ = lara_b.estimate_with_float32_probabilities(*args, **params)
    assert not torch.isfinite(unscaled).all()
