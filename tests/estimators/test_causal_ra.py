"""Causal randomized attention (LARA sec. 3.2, app. G.2 eq. 29-31 over each query's visible keys).

Under ``mask="causal"`` key m is visible to query n iff ``m <= n + (M - N)`` (ARCHITECTURE sec. 12). RA's
mixture weights pi_n, its component draw, the biased variant's mean and eq. 6's key sums all run over the
visible keys only; the draws are the same as bidirectional RA's.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
from scipy.stats import norm

import randattn
from randattn.estimators.base import Draws
from randattn.estimators.ra import batched as ra_bat
from randattn.estimators.ra import reference as ra_ref
from randattn.testing import assert_close

SPEC = randattn.get_spec("ra")
VARIANTS = {name: SPEC.resolve_params(params) for name, params in SPEC.variants.items()}

#: (id, batch dims, N, M, D, Dv): self-attention (N == M), prefix (M > N), one query, one key, odd sizes
SHAPES = [
    ("N=M=7 batch 2 D=3 Dv=2", (2,), 7, 7, 3, 2),
    ("N=5 M=11 batch 2x3 D=5 Dv=4", (2, 3), 5, 11, 5, 4),
    ("N=1 M=6 D=3 Dv=3", (), 1, 6, 3, 3),
    ("N=M=1 D=2 Dv=1", (), 1, 1, 2, 1),
    ("N=M=13 D=6 Dv=5", (), 13, 13, 6, 5),
]


def _inputs(seed: int, batch: tuple[int, ...], n: int, m: int, d: int, dv: int, size: float = 1.0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*batch, n, d)) * size, rng.standard_normal((*batch, m, d)) * size,
            rng.standard_normal((*batch, m, dv)))


def _draws(q, k, params: dict[str, Any], *, samples: int = 3, replicates: int = 2, seed: int = 0) -> Draws:
    return SPEC.draw(q.shape, k.shape, num_samples=samples, replicates=replicates, rng=np.random.default_rng(seed),
                     **params, mask="causal")


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=torch.float64)


def _batched(q, k, v, draws, params, **kw) -> np.ndarray:
    return ra_bat.estimate(_t(q), _t(k), _t(v), draws.to_torch(), **params, **kw).numpy()


# ---------------------------------------------------------------------------------------------- the loop form
def _visible_correct(n: int, m: int, num_q: int, num_k: int) -> bool:
    return m <= n + (num_k - num_q)


def _visible_strict(n: int, m: int, num_q: int, num_k: int) -> bool:  # negative control: m < n
    return m < n + (num_k - num_q)


def _visible_one_ahead(n: int, m: int, num_q: int, num_k: int) -> bool:  # negative control: m <= n + 1
    return m <= n + 1 + (num_k - num_q)


def _loop_ra(q, k, v, draws: Draws, *, variant: str, noise: str, sample: str,
             visible: Callable[[int, int, int, int], bool] = _visible_correct) -> np.ndarray:
    """Causal RA for unbatched q (N, D), k (M, D), v (M, Dv), written out query by query from the same draws.

    For query n with visible set V_n (``visible``): pi_nm = exp(x_n.y_m) / sum_{V_n} (eq. 29);
    z = the first visible m whose running sum of pi reaches u (inverse CDF; the last visible key if none
    does), omega = x_n + y_z + sigma eps (eq. 30), or x_n + sum_{V_n} pi_nm y_m + sigma eps (biased,
    eq. 31; eps = 0 for sample='mean'); f_n(omega) = sum_{V_n} softmax(omega.y_m - |y_m|^2/2) v_m (eq. 6);
    the output is the mean of f_n over the S samples. Rows with no visible key are NaN.
    """
    num_q, dim = q.shape
    num_k = k.shape[0]
    scale = dim**-0.5
    x, y = q * math.sqrt(scale), k * math.sqrt(scale)
    sigma = 1.0 if noise == "paper" else math.sqrt(scale)
    reps = draws.replicates
    samples = 1 if sample == "mean" else draws["eps"].shape[-2]
    out = np.full((reps, num_q, v.shape[1]), np.nan)
    for r in range(reps):
        for n in range(num_q):
            keys = [m for m in range(num_k) if visible(n, m, num_q, num_k)]
            if not keys:
                continue
            scores = [float(x[n] @ y[m]) for m in keys]
            top = max(scores)
            mass = [math.exp(s - top) for s in scores]
            pi = [w / sum(mass) for w in mass]
            total = np.zeros(v.shape[1])
            for s in range(samples):
                if variant == "unbiased":
                    u, running, z = draws["u"][r, n, s], 0.0, keys[-1]
                    for m, p in zip(keys, pi):
                        running += p
                        if running >= u:
                            z = m
                            break
                    centre = x[n] + y[z]
                else:
                    centre = x[n] + sum(p * y[m] for m, p in zip(keys, pi))
                omega = centre if sample == "mean" else centre + sigma * draws["eps"][r, n, s]
                logits = [float(omega @ y[m]) - 0.5 * float(y[m] @ y[m]) for m in keys]
                top = max(logits)
                weights = [math.exp(a - top) for a in logits]
                total += sum(w * v[m] for m, w in zip(keys, weights)) / sum(weights)
            out[r, n] = total / samples
    return out


def _causal_softmax(q, k, v) -> np.ndarray:
    """Exact causal softmax attention, unbatched, written out query by query (m <= n + M - N)."""
    num_q, num_k = q.shape[0], k.shape[0]
    scale = q.shape[1] ** -0.5
    out = np.empty((num_q, v.shape[1]))
    for n in range(num_q):
        keys = np.arange(n + (num_k - num_q) + 1)
        logits = scale * k[keys] @ q[n]
        weights = np.exp(logits - logits.max())
        out[n] = weights @ v[keys] / weights.sum()
    return out


# ---------------------------------------------------------------------------------------------- reference == batched
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_causal_reference_matches_batched(variant, shape):
    """Same draws, float64: batched == reference to 1e-10 (ARCHITECTURE sec. 3), every variant and shape."""
    _, batch, n, m, d, dv = shape
    params = VARIANTS[variant]
    q, k, v = _inputs(1, batch, n, m, d, dv)
    draws = _draws(q, k, params, seed=2)
    ref = ra_ref.estimate(q, k, v, draws, **params, mask="causal")
    assert ref.shape == (2, *batch, n, dv) and np.isfinite(ref).all()
    assert_close(_batched(q, k, v, draws, params, mask="causal"), ref, atol=1e-10, rtol=1e-10,
                 what=f"causal {variant}, {shape[0]}:")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_causal_large_key_norms_stay_finite_and_agree(variant):
    """Keys and queries of norm 150-200 (logits in the thousands): the log-space masking stays finite, and
    batched float64 == reference to 1e-10 times max|v| (the kit's large-norm tolerance)."""
    params = VARIANTS[variant]
    q, k, v = _inputs(3, (2,), 6, 9, 6, 3)
    rng = np.random.default_rng(33)
    q, k = (a / np.linalg.norm(a, axis=-1, keepdims=True) * rng.uniform(150, 200, a.shape[:-1] + (1,)) for a in (q, k))
    draws = _draws(q, k, params, seed=4)
    ref = ra_ref.estimate(q, k, v, draws, **params, mask="causal")
    assert np.isfinite(ref).all()
    assert_close(_batched(q, k, v, draws, params, mask="causal"), ref, atol=1e-10 * np.abs(v).max(), rtol=1e-10)


# ---------------------------------------------------------------------------------------------- independent loops
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n, m", [(5, 5), (4, 7)])
def test_causal_reference_equals_the_loop_over_queries(variant, n, m):
    """The reference equals RA written out query by query over the visible keys, from the same draws (1e-12)."""
    params = VARIANTS[variant]
    q, k, v = _inputs(5, (), n, m, 3, 2)
    draws = _draws(q, k, params, seed=6)
    expected = _loop_ra(q, k, v, draws, **params)
    assert_close(ra_ref.estimate(q, k, v, draws, **params, mask="causal"), expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("wrong", [_visible_strict, _visible_one_ahead], ids=["m<n", "m<=n+1"])
@pytest.mark.parametrize("n, m", [(5, 5), (4, 7)])
def test_negative_control_off_by_one_mask_differs(variant, wrong, n, m):
    """The loop with an off-by-one rule (m < n, or m <= n + 1; both offset by M - N) differs from the
    reference by more than 1e-6 somewhere (rows a wrong rule leaves empty are skipped), while the correct
    rule matches it to 1e-12: the loop comparison above can fail."""
    params = VARIANTS[variant]
    q, k, v = _inputs(5, (), n, m, 3, 2)
    draws = _draws(q, k, params, seed=6)
    ref = ra_ref.estimate(q, k, v, draws, **params, mask="causal")
    off = _loop_ra(q, k, v, draws, **params, visible=wrong)
    rows = ~np.isnan(off).any(-1)
    assert rows.any()
    assert np.abs(off[rows] - ref[rows]).max() > 1e-6


@pytest.mark.parametrize(("u", "mask", "offset", "seen", "picked"), [
    # u = 1, above any rounded-down total of pi_n: the last visible key, not a hidden one after it
    (1.0, "causal", 2, lambda last: np.arange(last + 1), lambda last: last),
    # u = 0 counts no key of the CDF, which is 0 before a window: the window's first key, not key 0 (hidden)
    (0.0, "sliding:2", 3, lambda last: np.arange(last - 1, last + 1), lambda last: last - 1),
], ids=["u=1-causal", "u=0-window"])
def test_unbiased_component_at_the_ends_of_the_cdf_is_a_visible_key(u, mask, offset, seen, picked):
    """Zero queries make pi_n uniform over V_n, eps = 0 gives omega = y_z, and eq. 6 over V_n is written out here,
    with z the key the rule names; both forms (scale 1: x = q, y = k)."""
    rng = np.random.default_rng(7)
    q, k, v = np.zeros((3, 4)), rng.standard_normal((3 + offset, 4)), rng.standard_normal((3 + offset, 2))
    draws = Draws({"u": np.full((1, 3, 1), u), "eps": np.zeros((1, 3, 1, 4))}, 1)
    expected = np.empty((3, 2))
    for n in range(3):
        keys = seen(n + offset)  # the last visible key is n + M - N
        logits = k[keys] @ k[picked(n + offset)] - 0.5 * (k[keys] * k[keys]).sum(-1)
        w = np.exp(logits - logits.max())
        expected[n] = w @ v[keys] / w.sum()
    assert_close(ra_ref.estimate(q, k, v, draws, scale=1.0, mask=mask)[0], expected, atol=1e-12)
    bat = ra_bat.estimate(_t(q), _t(k), _t(v), draws.to_torch(), scale=1.0, mask=mask)
    assert_close(bat[0], expected, atol=1e-12)


# ---------------------------------------------------------------------------------------------- prefix structure
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n, m", [(9, 9), (6, 10)])
def test_causal_prefix_invariance(variant, n, m):
    """Junk keys/values after query `cut`'s last visible key leave outputs 0..cut bit-identical in the
    reference (1e-12 in batched), for every cut; the later outputs do change (the junk is not inert)."""
    params = VARIANTS[variant]
    q, k, v = _inputs(8, (2,), n, m, 4, 3)
    draws = _draws(q, k, params, seed=9)
    ref = ra_ref.estimate(q, k, v, draws, **params, mask="causal")
    bat = _batched(q, k, v, draws, params, mask="causal")
    junk = np.random.default_rng(10)
    for cut in range(n - 1):
        last = cut + (m - n)
        k2, v2 = k.copy(), v.copy()
        k2[..., last + 1 :, :] = junk.standard_normal(k2[..., last + 1 :, :].shape) * 50
        v2[..., last + 1 :, :] = junk.standard_normal(v2[..., last + 1 :, :].shape) * 1e3
        ref2 = ra_ref.estimate(q, k2, v2, draws, **params, mask="causal")
        assert np.array_equal(ref2[..., : cut + 1, :], ref[..., : cut + 1, :]), f"cut {cut}"
        assert not np.allclose(ref2[..., cut + 1 :, :], ref[..., cut + 1 :, :]), f"cut {cut}"
        bat2 = _batched(q, k2, v2, draws, params, mask="causal")
        assert_close(bat2[..., : cut + 1, :], bat[..., : cut + 1, :], atol=1e-12, rtol=1e-12)


def test_negative_control_bidirectional_ra_is_not_prefix_invariant():
    """Without the mask the same junk changes query 0's output: the prefix test can fail."""
    params = VARIANTS["unbiased"]
    q, k, v = _inputs(8, (), 6, 6, 4, 3)
    draws = _draws(q, k, params, seed=9)
    k2, v2 = k.copy(), v.copy()
    k2[3:], v2[3:] = k2[3:] * 5, v2[3:] * 100
    assert not np.allclose(ra_ref.estimate(q, k2, v2, draws, **params)[..., 0, :],
                           ra_ref.estimate(q, k, v, draws, **params)[..., 0, :])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_visible_key_returns_its_value(variant):
    """N == M: query 0 sees key 0 only, so every variant returns v_0 (rtol 1e-12: a weight over itself)."""
    params = VARIANTS[variant]
    q, k, v = _inputs(11, (3,), 8, 8, 5, 2)
    draws = _draws(q, k, params, seed=12)
    expected = np.broadcast_to(v[:, 0, :], (2, 3, 2))
    assert_close(ra_ref.estimate(q, k, v, draws, **params, mask="causal")[..., 0, :], expected, atol=0, rtol=1e-12)
    assert_close(_batched(q, k, v, draws, params, mask="causal")[..., 0, :], expected, atol=0, rtol=1e-12)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n, m", [(7, 7), (3, 8)])
def test_last_query_equals_bidirectional(variant, n, m):
    """The last query sees every key, so with the same draws it equals bidirectional RA's last output."""
    params = VARIANTS[variant]
    q, k, v = _inputs(13, (2,), n, m, 4, 3)
    draws = _draws(q, k, params, seed=14)
    causal = ra_ref.estimate(q, k, v, draws, **params, mask="causal")
    full = ra_ref.estimate(q, k, v, draws, **params)
    assert_close(causal[..., -1, :], full[..., -1, :], atol=1e-12, rtol=1e-12)
    assert_close(_batched(q, k, v, draws, params, mask="causal")[..., -1, :],
                 _batched(q, k, v, draws, params)[..., -1, :], atol=1e-12, rtol=1e-12)
    assert not np.allclose(causal[..., 0, :], full[..., 0, :])  # the earlier queries do differ


# ---------------------------------------------------------------------------------------------- unbiasedness
@pytest.mark.parametrize("n, m", [(5, 7), (6, 6)])
def test_causal_ra_is_unbiased_for_causal_softmax(n, m):
    """E[causal RA] = causal softmax (Prop. 3.2 per query, over V_n), paper noise, unbiased variant.

    R = 4000 replicates of S = 2 at D = 4, entries N(0, 0.4^2) (|x + y|^2 near 1). Each element's mean is
    within the Bonferroni bound z < Phi^-1(1 - alpha / (2 E)) standard errors, alpha = 1e-6 over the E
    elements (5.40 for E = 15, 5.43 for E = 18): a correct RA fails it with probability < 1e-6. Elements
    without spread (query 0 of N == M sees one key, so its output is v_0 in every replicate; the standard
    error is then rounding, < 1e-12) must equal exact softmax to 1e-12 instead.
    The same replicates are far (> the bound) from the *bidirectional* softmax: the test has power.
    """
    rng = np.random.default_rng(15)
    q, k, v = rng.normal(0, 0.4, (n, 4)), rng.normal(0, 0.4, (m, 4)), rng.standard_normal((m, 3))
    replicates = 4000
    out = randattn.estimate("ra", q, k, v, num_samples=2, seed=16, replicates=replicates, mask="causal",
                            backend="torch", dtype=torch.float64).numpy()
    exact = _causal_softmax(q, k, v)
    se = out.std(0, ddof=1) / math.sqrt(replicates)
    bound = norm.isf(1e-6 / (2 * exact.size))
    spread = se > 1e-12
    z = (out.mean(0) - exact)[spread] / se[spread]
    assert np.abs(z).max() < bound, f"max |z| {np.abs(z).max():.2f} >= {bound:.2f}"
    assert_close(out.mean(0)[~spread], exact[~spread], atol=1e-12, rtol=1e-12)
    bidirectional = randattn.estimate("softmax", q, k, v)
    z_wrong = (out.mean(0) - bidirectional)[spread] / se[spread]
    assert np.abs(z_wrong).max() > bound


# ---------------------------------------------------------------------------------------------- probabilities
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n, m", [(6, 6), (4, 9)])
def test_causal_probabilities_are_masked_and_agree_with_the_estimate(variant, n, m):
    """Under causal the spec's probability forms have exact zeros at hidden entries, rows summing to 1,
    probs @ v == estimate (1e-12), and the one-pass form returns the same bits as the two separate calls."""
    params = VARIANTS[variant]
    q, k, v = _inputs(17, (2,), n, m, 4, 3)
    draws = _draws(q, k, params, samples=4, seed=18).to_torch()
    tq, tk, tv = _t(q), _t(k), _t(v)
    probs = SPEC.forms.get("probabilities")(tq, tk, draws, scale=None, **params, mask="causal")
    out = SPEC.batched(tq, tk, tv, draws, scale=None, **params, mask="causal")
    hidden = torch.as_tensor(np.arange(m)[None, :] > np.arange(n)[:, None] + (m - n))
    assert probs.shape == (2, 2, n, m)
    assert (probs[..., hidden] == 0).all() and (probs[..., ~hidden] > 0).all()
    assert_close(probs.sum(-1), torch.ones(2, 2, n, dtype=torch.float64), atol=1e-12)
    assert_close(probs @ tv, out, atol=1e-12, rtol=1e-12)
    pair = SPEC.forms.get("estimate_with_probabilities")(tq, tk, tv, draws, scale=None, **params, mask="causal")
    assert torch.equal(pair[0], out) and torch.equal(pair[1], probs)


# ---------------------------------------------------------------------------------------------- API and spec
def test_draws_ignore_the_mask_and_the_api_runs_causal():
    q, k, v = _inputs(19, (), 4, 6, 3, 2)
    with_mask = randattn.draw("ra", q.shape, k.shape, num_samples=3, seed=20, mask="causal")
    without = randattn.draw("ra", q.shape, k.shape, num_samples=3, seed=20)
    assert with_mask.arrays.keys() == without.arrays.keys()
    assert all(np.array_equal(with_mask[a], without[a]) for a in without.arrays)
    ref = randattn.estimate("ra", q, k, v, num_samples=3, seed=20, mask="causal")
    bat = randattn.estimate("ra", q, k, v, num_samples=3, seed=20, mask="causal", backend="torch", dtype=torch.float64)
    assert_close(bat, ref, atol=1e-10, rtol=1e-10)
    assert_close(ref, ra_ref.estimate(q, k, v, without, mask="causal")[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        randattn.estimate("ra", k, q, q[:, :2], num_samples=3, mask="causal")
    with pytest.raises(ValueError, match="mask"):
        ra_ref.estimate(q, k, v, without, mask="sideways")
    with pytest.raises(ValueError, match="mask"):
        ra_bat.estimate(_t(q), _t(k), _t(v), without.to_torch(), mask="sideways")


def test_spec_declares_causal_support():
    assert SPEC.masks == (None, "causal", "sliding") and SPEC.supports_mask("causal")
    assert SPEC.supports_mask("sliding:5") and not SPEC.supports_mask("sliding") and not SPEC.supports_mask("none")
    assert "causal" in SPEC.summary and "quadratic" in SPEC.summary
    assert "causal" in SPEC.complexity and "quadratic" in SPEC.complexity


# ---------------------------------------------------------------------------------------------- sliding window
def _window_of(width: int) -> Callable[[int, int, int, int], bool]:
    """Key m visible to query n iff n + M - N - W < m <= n + M - N (a sliding window of W keys), written out."""
    def visible(n: int, m: int, num_q: int, num_k: int) -> bool:
        last = n + (num_k - num_q)
        return last - width < m <= last

    return visible


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n, m, width", [(6, 6, 3), (4, 9, 2), (5, 7, 1), (5, 7, 7)])
def test_sliding_window_reference_and_batched_equal_the_loop_over_queries(variant, n, m, width):
    """``mask="sliding:W"``: RA over each query's last W visible keys (eq. 29-31 and eq. 6 over that window), the
    loop from the same draws (1e-12); batched == reference (1e-10); W = 7 >= M is causal RA, bit for bit."""
    params = VARIANTS[variant]
    q, k, v = _inputs(8, (), n, m, 3, 2)
    draws = _draws(q, k, params, seed=9)
    mask = f"sliding:{width}"
    expected = _loop_ra(q, k, v, draws, **params, visible=_window_of(width))
    ref = ra_ref.estimate(q, k, v, draws, **params, mask=mask)
    assert_close(ref, expected, atol=1e-12, rtol=1e-12, what=f"sliding:{width} {variant}, reference vs loop:")
    assert_close(_batched(q, k, v, draws, params, mask=mask), ref, atol=1e-10, rtol=1e-10,
                 what=f"sliding:{width} {variant}, batched vs reference:")
    if width >= m:
        assert np.array_equal(ref, ra_ref.estimate(q, k, v, draws, **params, mask="causal"))

