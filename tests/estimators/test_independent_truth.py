"""The estimators against their papers' formulas written out here, independently (issue #13).

Every expected value below is computed in this file with plain numpy/scipy and explicit loops
over queries, keys, proposals and samples, from the paper's equations: nothing is imported from
the package except the estimator under test. Inputs are tiny and of small norm, so every
exponential is evaluated directly (no log space): a shared helper bug (temperature, log-feature,
importance ratio, normalizer, proposal mean, weighting) cannot cancel out.

Where a Monte Carlo check is used (the chunk-mass estimates of EVA and Scatterbrain), the target
is a known exact value and the tolerance is 4.5 standard errors of the replicate mean.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import log_softmax, softmax

from randattn.estimators.base import Draws
from randattn.estimators.eva import reference as eva_ref
from randattn.estimators.lara import reference as lara_ref
from randattn.estimators.ra import reference as ra_ref
from randattn.estimators.rfa import reference as rfa_ref
from randattn.estimators.scatterbrain import reference as scatterbrain_ref
from randattn.testing import assert_close

SCALE = 0.7  # not D^-1/2: a wrong temperature convention changes every value below


# ----------------------------------------------------------------------------- plain formulas


def normal_pdf(w, mean, var=1.0):
    """N(w; mean, var I), written out."""
    d = len(w)
    diff = np.asarray(w, dtype=float) - mean
    return float(np.exp(-0.5 * diff @ diff / var) / (2.0 * np.pi * var) ** (d / 2))


def xi(a, w):
    """Positive random feature exp(w.a - |a|^2/2) (Performer eq. 7, LARA sec. 2.2)."""
    return float(np.exp(w @ a - 0.5 * a @ a))


def f_n(w, y, v):
    """LARA eq. 6: sum_m xi(y_m, w) v_m / sum_m xi(y_m, w)."""
    weights = np.array([xi(ym, w) for ym in y])
    return weights @ v / weights.sum()


def landmarks(a, count):
    """Means of ``count`` contiguous segments (first ones one longer), LARA G.3.1."""
    return np.stack([seg.mean(0) for seg in np.array_split(a, count)])


def inputs(rng, n=5, m=6, d=2, dv=3, size=0.6):
    q = size * rng.standard_normal((n, d))
    k = size * rng.standard_normal((m, d))
    v = rng.standard_normal((m, dv))
    return q, k, v, q * np.sqrt(SCALE), k * np.sqrt(SCALE)


def inverse_cdf(probs, u):
    """Index z with F(z-1) < u <= F(z): the categorical draw by inverse CDF."""
    return int(min(np.searchsorted(np.cumsum(probs), u, side="left"), len(probs) - 1))


# ----------------------------------------------------------------------------- RFA (LARA eq. 2)


def feature_vector(kind, a, w, big_a=None):
    d = len(a)
    if kind == "positive":
        return np.array([xi(a, w)])
    if kind == "hyperbolic":
        return np.exp(-0.5 * a @ a) / np.sqrt(2) * np.array([np.exp(w @ a), np.exp(-(w @ a))])
    if kind == "trigonometric":
        return np.exp(0.5 * a @ a) * np.array([np.sin(w @ a), np.cos(w @ a)])
    if kind == "regularized":  # omega on the sphere of radius sqrt(D) (Performer sec. 2.3)
        return np.array([xi(a, w * np.sqrt(d) / np.linalg.norm(w))])
    b = np.sqrt(1 - 4 * big_a)  # OPRF: D0 exp(A|w|^2 + B w.a - |a|^2/2), D0 = (1-4A)^(D/4)
    return np.array([(1 - 4 * big_a) ** (d / 4) * np.exp(big_a * w @ w + b * w @ a - 0.5 * a @ a)])


@pytest.mark.parametrize("kind", ["positive", "hyperbolic", "trigonometric", "regularized", "oprf"])
def test_rfa_is_eq2_with_features_written_out(kind, rng):
    q, k, v, x, y = inputs(rng)
    omega = rng.standard_normal((2, 7, 2))  # R = 2 replicates, S = 7
    rho = np.mean([[(xn + ym) @ (xn + ym) for ym in y] for xn in x]) / 2  # mean |x+y|^2 / D
    big_a = (1 - 2 * rho - np.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16  # OPRF's A*
    expected = np.empty((2, 5, 3))
    for r in range(2):
        for n, xn in enumerate(x):
            kern = np.array([sum(feature_vector(kind, xn, w, big_a) @ feature_vector(kind, ym, w, big_a)
                                 for w in omega[r]) for ym in y])
            expected[r, n] = kern @ v / kern.sum()
    got = rfa_ref.estimate(q, k, v, Draws({"omega": omega}, 2), scale=SCALE, feature_map=kind)
    assert_close(got, expected, atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------- RA (LARA eq. 29-31)


@pytest.mark.parametrize("variant, sample, noise", [("unbiased", "random", "paper"), ("biased", "random", "paper"),
                                                    ("biased", "mean", "paper"), ("unbiased", "random", "reference-code")])
def test_ra_is_eq29_to_31_written_out(variant, sample, noise, rng):
    """omega_ns = x_n + y_z + sigma eps (eq. 29-30, z ~ pi_n) or x_n + sum_m pi_nm y_m + sigma eps (biased,
    eq. 31; eps = 0 for sample='mean'); RA = mean_s f_n(omega_ns). sigma = 1 or sqrt(scale)."""
    q, k, v, x, y = inputs(rng)
    reps, s = 2, 4
    u, eps = rng.random((reps, 5, s)), rng.standard_normal((reps, 5, s, 2))
    sigma = 1.0 if noise == "paper" else np.sqrt(SCALE)
    expected = np.empty((reps, 5, 3))
    for r in range(reps):
        for n, xn in enumerate(x):
            pi = softmax(y @ xn)
            if sample == "mean":
                omegas = [xn + pi @ y]
            elif variant == "biased":
                omegas = [xn + pi @ y + sigma * eps[r, n, j] for j in range(s)]
            else:
                omegas = [xn + y[inverse_cdf(pi, u[r, n, j])] + sigma * eps[r, n, j] for j in range(s)]
            expected[r, n] = np.mean([f_n(w, y, v) for w in omegas], axis=0)
    arrays = {} if sample == "mean" else ({"eps": eps} if variant == "biased" else {"u": u, "eps": eps})
    got = ra_ref.estimate(q, k, v, Draws(arrays, reps), scale=SCALE, variant=variant, sample=sample, noise=noise)
    assert_close(got, expected, atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------- LARA (eq. 10, 32-38)


def lara_written_out(x, y, v, eps, u, *, proposal, weighting, beta=1.0, sample="random", sigma=1.0):
    """LARA eq. 10 for one replicate: proposals of app. G.3.1 (eq. 32-35), weights of G.3.2 (eq. 36-38).

    ``eps : (C, D)``, ``u : (C,)``; C proposals with query landmarks ``x~_c`` (segment means).
    """
    num_c = len(eps)
    xl, yl = landmarks(x, num_c), landmarks(y, num_c)
    pis = [softmax(y @ xl[c]) for c in range(num_c)]  # eq. 32-33 component weights
    if proposal == "eq33" or proposal == "eq32":
        mus = [xl[c] + pis[c] @ y for c in range(num_c)]
    elif proposal == "eq34":
        mus = [xl[c] + yl[c] for c in range(num_c)]
    elif proposal == "eq35":
        mus = [xl[c] + softmax(yl @ yl[c]) @ yl for c in range(num_c)]
    else:
        mus = [np.zeros(x.shape[1]) for _ in range(num_c)]

    def q_density(c, w):
        if proposal == "eq32":  # mixture sum_m pi_cm N(w; x~_c + y_m, I)
            return sum(pis[c][m] * normal_pdf(w, xl[c] + y[m]) for m in range(len(y)))
        return normal_pdf(w, mus[c])

    if sample == "mean":
        omegas = mus
    elif proposal == "eq32":
        omegas = [xl[c] + y[inverse_cdf(pis[c], u[c])] + sigma * eps[c] for c in range(num_c)]
    else:
        omegas = [mus[c] + sigma * eps[c] for c in range(num_c)]
    r_prime = np.array([softmax(x @ xl[c]) for c in range(num_c)]).T  # (N, C), softmax over queries (eq. 37)

    def alpha(n, c, w):
        qs = np.array([q_density(j, w) for j in range(num_c)])
        b = qs / qs.sum()  # balance heuristic, eq. 36
        if weighting == "balance":
            return b[c]
        if weighting == "constant":
            return 1.0 / num_c
        if weighting == "coupled":  # eq. 37, with the b-weighted average of r' over proposals
            return b[c] + qs[c] * (r_prime[n, c] - sum(b[j] * r_prime[n, j] for j in range(num_c)))
        return b[c] + beta * (r_prime[n, c] - r_prime[n].mean())  # decoupled, eq. 38

    out = np.empty((len(x), v.shape[1]))
    for n, xn in enumerate(x):
        num, den = 0.0, 0.0
        for c, w in enumerate(omegas):
            p_tilde = normal_pdf(w, 0.0) * xi(xn, w) * sum(xi(ym, w) for ym in y)  # LARA sec. 4.2
            weight = alpha(n, c, w) * p_tilde / q_density(c, w)
            num = num + weight * f_n(w, y, v)
            den += weight
        out[n] = num / den
    return out


LARA_CASES = [
    ("eq34", "decoupled", "random"), ("eq33", "coupled", "random"), ("eq35", "balance", "random"),
    ("eq32", "coupled", "random"), ("standard", "constant", "random"), ("eq34", "coupled", "random"),
    ("eq32", "balance", "random"), ("eq33", "decoupled", "mean"), ("eq35", "coupled", "mean"),
    ("eq34", "balance", "mean"), ("eq32", "balance", "mean"),
]


@pytest.mark.parametrize("proposal, weighting, sample", LARA_CASES)
def test_lara_is_eq10_with_proposals_and_weights_written_out(proposal, weighting, sample, rng):
    """D = 2, so the coupled correction q_c(w) (...) of eq. 37 is not negligible (q_c <= 1/2pi)."""
    q, k, v, x, y = inputs(rng)
    num_c, reps = 3, 2
    eps, u = rng.standard_normal((reps, num_c, 2)), rng.random((reps, num_c))
    if sample == "mean":
        arrays = {"proposal_slots": np.zeros((reps, num_c, 0))}
    else:
        arrays = {"eps": eps, **({"u": u} if proposal == "eq32" else {})}
    beta = 2.0 if weighting == "decoupled" else 1.0
    got = lara_ref.estimate(q, k, v, Draws(arrays, reps), scale=SCALE, proposal=proposal, weighting=weighting,
                            beta=beta, sample=sample)
    expected = np.stack([lara_written_out(x, y, v, eps[r], u[r], proposal=proposal, weighting=weighting, beta=beta,
                                          sample=sample) for r in range(reps)])
    assert_close(got, expected, atol=1e-11, rtol=1e-9)


def test_lara_coupled_correction_is_large_enough_to_be_pinned(rng):
    """The eq. 37 test above has teeth: coupled and balance differ by far more than its tolerance here."""
    q, k, v, x, y = inputs(rng)
    eps = rng.standard_normal((3, 2))
    coupled = lara_written_out(x, y, v, eps, None, proposal="eq34", weighting="coupled")
    balance = lara_written_out(x, y, v, eps, None, proposal="eq34", weighting="balance")
    assert np.abs(coupled - balance).max() > 1e-4


def test_lara_noise_reference_code_keeps_identity_covariance_densities(rng):
    """noise='reference-code': omega = mu + sqrt(scale) eps, densities still N(mu, I) (official code)."""
    q, k, v, x, y = inputs(rng)
    eps = rng.standard_normal((1, 3, 2))
    got = lara_ref.estimate(q, k, v, Draws({"eps": eps}, 1), scale=SCALE, proposal="eq34", weighting="balance",
                            noise="reference-code")
    expected = lara_written_out(x, y, v, eps[0], None, proposal="eq34", weighting="balance", sigma=np.sqrt(SCALE))
    assert_close(got[0], expected, atol=1e-12, rtol=1e-10)


# ----------------------------------------------------------------------------- EVA (eq. 13, 16, app. C)


# N = M = 8, window 4, prefix 0, paper partition, C = 2: the query block {0..3} has exact keys
# {0..3} and chunks {4, 5}, {6, 7}; block {4..7} exact {4..7}, chunks {0, 1}, {2, 3}. A chunk's
# query landmark is the mean of the queries at the chunk's positions (EVA app. C); chunk slot c
# of every block uses eps[:, c] (common random numbers).
EVA_BLOCKS = [(range(0, 4), [np.arange(4, 6), np.arange(6, 8)]), (range(4, 8), [np.arange(0, 2), np.arange(2, 4)])]


def eva_written_out(x, y, v, eps, *, chunk_weight, proposal_mean, sigma, add_log_chunk_size=False, sample="random"):
    """EVA for one replicate, ``eps : (C, S, D)``."""
    out = np.empty((len(x), v.shape[1]))
    for block, chunks in EVA_BLOCKS:
        exact = np.array(block)
        for n in block:
            xn = x[n]
            num = sum(np.exp(xn @ y[m]) * v[m] for m in exact)
            den = sum(np.exp(xn @ y[m]) for m in exact)
            for c, keys in enumerate(chunks):
                centre = x[keys].mean(0) + y[keys].mean(0)
                mu = {"sum": centre, "half": 0.5 * centre, "standard": 0.0 * centre}[proposal_mean]
                omegas = [mu] if sample == "mean" else [mu + sigma * e for e in eps[c]]
                # alpha(w) = N(w; 0, I) / N(w; mu, sigma^2 I) (EVA app. C)
                terms = [normal_pdf(w, 0.0) / normal_pdf(w, mu, sigma**2) * xi(xn, w) for w in omegas]
                mass = [sum(xi(y[m], w) for m in keys) for w in omegas]
                weighted_v = [sum(xi(y[m], w) * v[m] for m in keys) for w in omegas]
                beta = sum(t * wv for t, wv in zip(terms, weighted_v)) / sum(t * ms for t, ms in zip(terms, mass))
                if chunk_weight == "exact":  # eq. 13
                    weight = sum(np.exp(xn @ y[m]) for m in keys)
                elif chunk_weight == "mean-key":  # eq. 16
                    weight = np.exp(xn @ y[keys].mean(0)) * (len(keys) if add_log_chunk_size else 1)
                else:  # importance-sampling estimate of the chunk's mass
                    weight = np.mean([t * ms for t, ms in zip(terms, mass)])
                num = num + weight * beta
                den += weight
            out[n] = num / den
    return out


@pytest.mark.parametrize("chunk_weight, proposal_mean, noise, add_log, sample", [
    ("exact", "sum", "reference-code", False, "random"), ("rfa", "sum", "reference-code", False, "random"),
    ("rfa", "half", "paper", False, "random"), ("mean-key", "sum", "reference-code", True, "random"),
    ("mean-key", "half", "reference-code", False, "random"), ("rfa", "standard", "reference-code", False, "random"),
    ("exact", "sum", "paper", False, "mean"), ("rfa", "half", "paper", False, "mean"),
])
def test_eva_is_app_c_written_out_at_sigma_not_one(chunk_weight, proposal_mean, noise, add_log, sample, rng):
    """sigma = sqrt(scale) != 1 (noise='reference-code'): the importance ratio N(0, I)/N(mu, sigma^2 I)
    does not vanish, and with S = 3 samples per chunk it differs between samples."""
    q, k, v, x, y = inputs(rng, n=8, m=8, d=3)
    reps, s = 2, 3
    eps = rng.standard_normal((reps, 2, s if sample == "random" else 0, 3))
    sigma = 1.0 if noise == "paper" else np.sqrt(SCALE)
    got = eva_ref.estimate(q, k, v, Draws({"eps": eps}, reps), scale=SCALE, window=4, chunk_weight=chunk_weight,
                           proposal_mean=proposal_mean, noise=noise, add_log_chunk_size=add_log,
                           samples_per_chunk=s, sample=sample)
    expected = np.stack([eva_written_out(x, y, v, eps[r], chunk_weight=chunk_weight, proposal_mean=proposal_mean,
                                         sigma=sigma, add_log_chunk_size=add_log, sample=sample) for r in range(reps)])
    assert_close(got, expected, atol=1e-12, rtol=1e-10)


def scatterbrain_written_out(x, y, v, omega):
    """EVA eq. 29-30: exact scores on the local block, positive random features off it, one normalizer."""
    out = np.empty((len(x), v.shape[1]))
    for block, _ in EVA_BLOCKS:
        rest = [m for m in range(len(y)) if m not in block]
        for n in block:
            num = sum(np.exp(x[n] @ y[m]) * v[m] for m in block)
            den = sum(np.exp(x[n] @ y[m]) for m in block)
            for m in rest:
                kern = np.mean([xi(x[n], w) * xi(y[m], w) for w in omega])  # phi(x)^T phi(y) with 1/S
                num = num + kern * v[m]
                den += kern
            out[n] = num / den
    return out


def test_scatterbrain_is_eq29_30_written_out(rng):
    q, k, v, x, y = inputs(rng, n=8, m=8, d=3)
    omega = rng.standard_normal((2, 5, 3))
    got = scatterbrain_ref.estimate(q, k, v, Draws({"omega": omega}, 2), scale=SCALE, window=4)
    expected = np.stack([scatterbrain_written_out(x, y, v, omega[r]) for r in range(2)])
    assert_close(got, expected, atol=1e-12, rtol=1e-10)


def _recovered_chunk_mass(out, x, y):
    """With v = [1, 0] on the exact keys and [0, 1] off them, out_n = (E_n, W_n) / (E_n + W_n): W_n = E_n out1/out0."""
    exact_mass = np.array([sum(np.exp(x[n] @ y[m]) for m in block) for block, _ in EVA_BLOCKS for n in block])
    return exact_mass * out[..., 1] / out[..., 0]


@pytest.mark.parametrize("which", ["eva-rfa-sigma", "eva-rfa-paper", "scatterbrain"])
def test_random_feature_chunk_mass_is_unbiased_for_the_exact_mass(which, rng):
    """Known truth: E[W_n] = sum_{m off the block} exp(x_n.y_m) for EVA's chunk_weight='rfa' (C = 1, any
    proposal mean and sigma: the importance ratio makes it unbiased) and for Scatterbrain. A wrong
    log S normalizer (W times S), a wrong importance ratio or a wrong feature would bias it.
    Monte Carlo: 4000 replicates, |z| <= 4.5 for each of the 8 queries (norms 0.3: light tails)."""
    reps, s = 4000, 2
    q, k, _, x, y = inputs(rng, n=8, m=8, d=3, size=0.3)
    v = np.zeros((8, 2))
    v[:4, 0] = 1.0
    v[4:, 1] = 1.0
    v_b = v[:, ::-1].copy()  # block {4..7}: its exact keys 4..7 get [1, 0]
    if which == "scatterbrain":
        draws = Draws({"omega": rng.standard_normal((reps, s, 3))}, reps)
        run = lambda vv: scatterbrain_ref.estimate(q, k, vv, draws, scale=SCALE, window=4)  # noqa: E731
    else:
        noise = "reference-code" if which == "eva-rfa-sigma" else "paper"
        draws = Draws({"eps": rng.standard_normal((reps, 1, s, 3))}, reps)
        run = lambda vv: eva_ref.estimate(q, k, vv, draws, scale=SCALE, window=4, chunk_weight="rfa",  # noqa: E731
                                          proposal_mean="sum", noise=noise, samples_per_chunk=s)
    out = np.concatenate([run(v)[:, :4], run(v_b)[:, 4:]], axis=1)  # (R, 8, 2)
    w = _recovered_chunk_mass(out, x, y)  # (R, 8)
    truth = np.array([sum(np.exp(x[n] @ y[m]) for m in range(8) if (m < 4) != (n < 4)) for n in range(8)])
    z = (w.mean(0) - truth) / (w.std(0, ddof=1) / np.sqrt(reps))
    assert np.abs(z).max() <= 4.5, z
    # and the test has power: S times the mass (a dropped log S) is far outside
    assert (np.abs((s * w.mean(0) - truth) / (s * w.std(0, ddof=1) / np.sqrt(reps))) > 4.5).all()


# ----------------------------------------------------------------------------- edge cases found by mutation testing


def test_ra_component_index_is_clamped_when_u_exceeds_the_rounded_total_mass():
    """u just below 1 above a cumulative sum that rounds below 1: the last component, not an index error."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        q, k = rng.standard_normal((1, 3)), rng.standard_normal((7, 3))
        x, y = q * np.sqrt(SCALE), k * np.sqrt(SCALE)
        pi = np.exp(log_softmax(x @ y.T, axis=-1))  # LARA eq. 29's weights, rounded as an RA sampler would
        if np.cumsum(pi, axis=-1)[0, -1] < np.nextafter(1.0, 0.0):
            break
    else:
        pytest.skip("no rounded-down total mass found")
    v = rng.standard_normal((7, 2))
    u = np.full((1, 1, 1), np.nextafter(1.0, 0.0))
    eps = rng.standard_normal((1, 1, 1, 3))
    got = ra_ref.estimate(q, k, v, Draws({"u": u, "eps": eps}, 1), scale=SCALE)
    assert_close(got[0, 0], f_n(x[0] + y[-1] + eps[0, 0, 0], y, v), atol=1e-12, rtol=1e-10)


def test_smreg_and_exact_kernel_with_batch_dims_and_at_z_zero():
    """SMREG(x, y) = e^{-(|x|^2+|y|^2)/2} E_u e^{kappa u_1}, kappa = sqrt(D)|x+y| (Performer Thm. 1), by
    quadrature over u_1 (density ~ (1-t^2)^((D-3)/2)); at x + y = 0 the expectation is 1."""
    from scipy import integrate
    from scipy.special import betaln

    from randattn.estimators.features import reference as fr

    rng = np.random.default_rng(12)
    d = 5
    x = 0.4 * rng.standard_normal((2, 3, d))
    y = 0.4 * rng.standard_normal((2, 4, d))
    y[1, 0] = -x[1, 2]  # kappa = 0 for this pair
    log_norm = betaln(0.5, (d - 1) / 2)

    def log_mean(kappa):
        val, _ = integrate.quad(lambda t: np.exp(kappa * t - log_norm) * (1 - t * t) ** ((d - 3) / 2), -1, 1)
        return np.log(val)

    expected = np.empty((2, 3, 4))
    for b in range(2):
        for n in range(3):
            for m in range(4):
                kappa = np.sqrt(d) * np.linalg.norm(x[b, n] + y[b, m])
                expected[b, n, m] = log_mean(kappa) - 0.5 * (x[b, n] @ x[b, n] + y[b, m] @ y[b, m])
    with np.errstate(all="raise"):
        got = fr.log_smreg(x, y)
    assert_close(got, expected, atol=1e-8, rtol=1e-8)
    assert_close(fr.exact_kernel("positive", x, y), np.exp(np.einsum("bnd,bmd->bnm", x, y)), atol=0, rtol=1e-13)
    with pytest.raises(ValueError, match=r"^feature_map='nope' is not allowed"):
        fr.exact_kernel("nope", x, y)


@pytest.mark.parametrize("weighting", ["coupled", "decoupled"])
def test_lara_literal_eq8_and_eq10_with_batch_dims(weighting, rng):
    """mis_estimate_eq8 = sum_c alpha_nc (p_n/q_c)(omega_c) f_n(omega_c), snis_estimate_eq10 its self-normalized
    form, with the exact RA mixture p_n = sum_m pi_nm N(x_n + y_m, I) written out; batch of 2 heads."""
    num_c, reps = 3, 2
    qs, ks, vs = [], [], []
    for _ in range(2):
        q, k, v, _, _ = inputs(rng)
        qs.append(q), ks.append(k), vs.append(v)
    q, k, v = np.stack(qs), np.stack(ks), np.stack(vs)
    eps = rng.standard_normal((reps, 2, num_c, 2))
    beta = 3.0 if weighting == "decoupled" else 1.0  # beta = 3: some weights negative (signed MIS)
    terms = lara_ref.lara_terms(q, k, v, Draws({"eps": eps}, reps), scale=SCALE, proposal="eq34",
                                weighting=weighting, beta=beta)
    got8, got10 = lara_ref.mis_estimate_eq8(terms), lara_ref.snis_estimate_eq10(terms)
    # two batch dims (2, 1): the literal forms must not confuse batch axes with proposal axes
    terms2 = lara_ref.lara_terms(q[:, None], k[:, None], v[:, None], Draws({"eps": eps[:, :, None]}, reps), scale=SCALE,
                                 proposal="eq34", weighting=weighting, beta=beta)
    assert_close(lara_ref.mis_estimate_eq8(terms2)[:, :, 0], got8, atol=1e-12, rtol=1e-10)
    assert_close(lara_ref.snis_estimate_eq10(terms2)[:, :, 0], got10, atol=1e-12, rtol=1e-10)
    want8, want10 = np.empty_like(got8), np.empty_like(got10)
    signs = []
    for r in range(reps):
        for b in range(2):
            x, y = q[b] * np.sqrt(SCALE), k[b] * np.sqrt(SCALE)
            xl, yl = landmarks(x, num_c), landmarks(y, num_c)
            mus = xl + yl
            omegas = mus + eps[r, b]
            r_prime = np.array([softmax(x @ xl[c]) for c in range(num_c)]).T
            for n in range(len(x)):
                pi = softmax(y @ x[n])
                num8, num10, den10 = 0.0, 0.0, 0.0
                for c, w in enumerate(omegas):
                    qd = np.array([normal_pdf(w, mus[j]) for j in range(num_c)])
                    bal = qd / qd.sum()
                    if weighting == "coupled":
                        alpha = bal[c] + qd[c] * (r_prime[n, c] - bal @ r_prime[n])
                    else:
                        alpha = bal[c] + beta * (r_prime[n, c] - r_prime[n].mean())
                    signs.append(np.sign(alpha))
                    p_n = sum(pi[m] * normal_pdf(w, x[n] + y[m]) for m in range(len(y)))
                    p_tilde = normal_pdf(w, 0.0) * xi(x[n], w) * sum(xi(ym, w) for ym in y)
                    num8 = num8 + alpha * p_n / qd[c] * f_n(w, y, v[b])
                    num10 = num10 + alpha * p_tilde / qd[c] * f_n(w, y, v[b])
                    den10 += alpha * p_tilde / qd[c]
                want8[r, b, n], want10[r, b, n] = num8, num10 / den10
    assert_close(got8, want8, atol=1e-11, rtol=1e-9)
    assert_close(got10, want10, atol=1e-11, rtol=1e-9)
    if weighting == "decoupled":
        assert min(signs) < 0  # the signed path is exercised
    # eq. 10 is invariant to a per-query factor on the weights, however large (log space, row-wise shift)
    offset = np.array([800.0, -800.0, 0.0, 300.0, -300.0])[None, None, :, None]
    shifted = lara_ref.LaraTerms(terms.x, terms.y, terms.v, terms.omega, terms.log_proposals,
                                 terms.log_abs_alpha + offset, terms.alpha_sign)
    assert_close(lara_ref.snis_estimate_eq10(shifted), got10, atol=1e-11, rtol=1e-9)
