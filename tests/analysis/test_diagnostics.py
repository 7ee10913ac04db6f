"""Importance-sampling diagnostics: RFA weights, ESS, delta-method variance, Pareto k-hat."""

from __future__ import annotations

import numpy as np
import pytest

import randattn
from randattn.analysis.diagnostics import (
    estimator_diagnostics,
    pareto_khat,
    snis_diagnostics,
)
from randattn.theory.montecarlo import kish_ess, snis_delta_method_variance
from randattn.estimators.rfa.weights import rfa_snis_terms


@pytest.fixture
def qkv(rng):
    q, k = 0.6 * rng.normal(size=(2, 2, 11, 6))
    v = rng.normal(size=(2, 9, 5))
    return q, k[:, :9], v


@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic", "oprf", "regularized"])
def test_rfa_terms_reproduce_the_estimate(qkv, feature_map):
    q, k, v = qkv
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=7, seed=3, replicates=3, feature_map=feature_map)
    log_w, f = rfa_snis_terms(q, k, v, draws["omega"], feature_map=feature_map)
    w = np.exp(log_w - log_w.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    est = randattn.estimate("rfa", q, k, v, num_samples=7, seed=3, replicates=3, feature_map=feature_map)
    np.testing.assert_allclose(w @ f, est, rtol=0, atol=1e-12)


def test_snis_diagnostics_agree_with_montecarlo(qkv):
    q, k, v = qkv
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=40, seed=5, replicates=2)
    log_w, f = rfa_snis_terms(q, k, v, draws["omega"])
    d = snis_diagnostics(log_w, f, khat_queries=4)
    delta = snis_delta_method_variance(log_w, f[..., None, :, :]).mean(axis=(-2, -1)).mean(0)
    np.testing.assert_allclose(d.delta_variance, delta, rtol=1e-10)
    np.testing.assert_allclose(d.ess_mean, kish_ess(log_w).mean(axis=(0, -1)), rtol=1e-13)
    assert d.num_weights == 40 and d.pareto_khat.shape == (2,)
    assert np.all(np.isfinite(d.pareto_khat))


def test_ess_of_equal_weights_is_the_sample_count():
    d = snis_diagnostics(np.zeros((2, 3, 4, 30)), np.ones((2, 3, 30, 2)), khat_queries=0)
    np.testing.assert_allclose(d.ess_mean, 30.0)
    assert np.all(d.delta_variance == 0.0)  # equal values: every f_j - mu is exactly 0 once f is centred
    assert np.isnan(d.pareto_khat).all()


def _spread_in_decimal(log_w: np.ndarray, f: np.ndarray) -> list[float]:
    """sum_j w_j^2 |f_j - mu|^2 per row of ``log_w (N, J)``, ``f (J, Dv)``, written out in 60-digit decimal."""
    import decimal

    with decimal.localcontext() as ctx:
        ctx.prec = 60
        out = []
        for row in log_w:
            top = max(row)
            e = [(decimal.Decimal(float(x)) - decimal.Decimal(float(top))).exp() for x in row]
            w = [x / sum(e) for x in e]
            fd = [[decimal.Decimal(float(x)) for x in fj] for fj in f]
            mu = [sum(w[j] * fd[j][d] for j in range(len(w))) for d in range(f.shape[1])]
            out.append(float(sum(w[j] ** 2 * sum((fd[j][d] - mu[d]) ** 2 for d in range(len(mu)))
                                 for j in range(len(w)))))
        return out


# (J, Dv): J <= Dv takes the Gram-matrix products, J > Dv the products with f itself
@pytest.mark.parametrize("samples, dim", [(6, 8), (8, 8), (12, 3)])
def test_delta_method_spread_is_exact_when_one_weight_holds_the_mass(samples, dim):
    """ESS near 1 (RFA on early ViT layers): the plain expansion sum w^2|f|^2 - 2 mu.(w^2 f) + |mu|^2 sum w^2
    returns rounding noise about eps |f|^2 where the sum is about 1e-80; each row's largest weight is the pivot."""
    import torch

    from randattn.analysis.diagnostics import delta_method_spread

    rng = np.random.default_rng(samples)
    # far from 0, a different way in each dimension: uncentred Gram terms are 1e6 times the spread
    f = 1000.0 * (-1.0) ** np.arange(dim) + rng.normal(size=(samples, dim))
    log_w = np.stack([
        np.r_[0.0, -90.0 - 10 * rng.random(samples - 1)],  # 1 - w_p ~ 1e-39
        np.r_[-200.0 * rng.random(samples - 1), 5.0],  # the pivot is not the first sample
        rng.normal(size=samples),  # no weight dominates
        np.r_[0.0, 0.0, np.full(samples - 2, -60.0)],  # two equal largest weights
    ])
    expected = _spread_in_decimal(log_w, f)
    weights = torch.softmax(torch.from_numpy(log_w), dim=-1)
    got = delta_method_spread(weights, torch.from_numpy(f)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    assert expected[0] < 1e-70  # the case the expansion gets wrong by ~60 orders of magnitude


def test_delta_method_spread_batches_and_keeps_nan_rows():
    """Leading dims broadcast as (R, ..., N, J) with (R, ..., J, Dv); a NaN row (undefined weights) stays NaN."""
    import torch

    from randattn.analysis.diagnostics import delta_method_spread

    rng = np.random.default_rng(7)
    log_w, f = rng.normal(size=(2, 3, 5, 4)), rng.normal(size=(2, 3, 4, 6))
    log_w[1, 2, 3] = np.nan
    got = delta_method_spread(torch.softmax(torch.from_numpy(log_w), -1), torch.from_numpy(f)).numpy()
    assert got.shape == (2, 3, 5)
    assert np.isnan(got[1, 2, 3]) and np.isfinite(np.delete(got.reshape(-1), 1 * 15 + 2 * 5 + 3)).all()
    for r, c in [(0, 0), (1, 2)]:
        rows = [n for n in range(5) if not np.isnan(log_w[r, c, n]).any()]
        np.testing.assert_allclose(got[r, c, rows], _spread_in_decimal(log_w[r, c, rows], f[r, c]), rtol=1e-12)


def test_pareto_khat_separates_light_and_heavy_tails(rng):
    s = 2000
    light = -0.5 * rng.standard_normal((4, s)) ** 2  # bounded weights: k-hat < 0.5
    heavy = rng.exponential(scale=1.0, size=(4, s))  # Pareto(alpha=1) weights: k = 1
    assert np.all(pareto_khat(light) < 0.5)
    assert np.all(pareto_khat(heavy) > 0.7)


def test_pareto_khat_is_nan_when_the_tail_is_too_short():
    assert np.isnan(pareto_khat(np.zeros((3, 24)))).all()  # arviz tail of 24 weights holds only 4


def test_estimators_without_weights_report_nan(qkv):
    q, k, v = qkv
    draws = randattn.draw("ra", q.shape, k.shape, num_samples=4, seed=0, replicates=2)
    d = estimator_diagnostics("ra", q, k, v, draws, scale=None, params={})
    assert d.ess_mean.shape == (2,) and np.isnan(d.ess_mean).all() and np.isnan(d.pareto_khat).all()
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=4, seed=0, replicates=2)
    d = estimator_diagnostics("rfa", q, k, v, draws, scale=None, params={"feature_map": "trigonometric"})
    assert np.isnan(d.delta_variance).all()


def test_lara_diagnostics_use_its_eq28_weights_when_they_are_positive():
    """Balance-heuristic LARA: the provider's SNIS terms reproduce the estimate exactly (so the
    weights diagnosed are the estimator's own); signed decoupled weights report NaN."""
    import randattn
    from randattn.analysis.diagnostics import estimator_diagnostics
    from randattn.estimators.lara import reference as lara_ref
    from randattn.theory.montecarlo import snis

    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((3, 2, 30, 8))
    params = randattn.get_spec("lara").resolve_params({"weighting": "balance"})
    draws = randattn.draw("lara", q.shape, k.shape, num_samples=6, seed=1, replicates=2, **params)
    log_w, f = randattn.get_spec("lara").importance_weights.reference(q, k, v, draws, scale=None, params=params)
    via_snis = snis(log_w, f[..., None, :, :])
    np.testing.assert_allclose(via_snis, lara_ref.estimate(q, k, v, draws, **params), atol=1e-12)
    diag = estimator_diagnostics("lara", q, k, v, draws, scale=None, params=params, khat_queries=0)
    assert np.all((diag.ess_mean >= 1) & (diag.ess_mean <= 6))

    # beta = 50: the query-specific correction of eq. 38 dominates, so some alpha_nc are negative
    signed = randattn.get_spec("lara").resolve_params({"weighting": "decoupled", "beta": 50.0})
    assert (lara_ref.lara_terms(q, k, v, draws, **signed).alpha_sign < 0).any()
    rng_draws = randattn.draw("lara", q.shape, k.shape, num_samples=6, seed=1, replicates=2, **signed)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nan_diag = estimator_diagnostics("lara", q, k, v, rng_draws, scale=None, params=signed, khat_queries=0)
    assert np.all(np.isnan(nan_diag.ess_mean))


@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic", "oprf", "sderf"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_replicate_diagnostics_reduce_to_the_reference_ones(feature_map, backend):
    """The sweep's per-replicate diagnostics, averaged over replicates, equal estimator_diagnostics (numpy)."""
    import randattn
    from randattn.analysis.diagnostics import estimator_diagnostics, replicate_snis_diagnostics

    rng = np.random.default_rng(4)
    q, k, v = (rng.normal(size=(2, 30, 8)) for _ in range(3))
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=1, replicates=3, feature_map=feature_map)
    params = {"feature_map": feature_map}
    per_rep = replicate_snis_diagnostics("rfa", q, k, v, draws, scale=0.3, params=params, backend=backend,
                                         dtype="float64", khat_queries=4)
    whole = estimator_diagnostics("rfa", q, k, v, draws, scale=0.3, params=params, khat_queries=4)
    assert per_rep.ess.shape == per_rep.delta_variance.shape == (3, 2)
    np.testing.assert_allclose(per_rep.ess.mean(0), whole.ess_mean, rtol=1e-12)
    np.testing.assert_allclose(per_rep.delta_variance.mean(0), whole.delta_variance, rtol=1e-10)
    np.testing.assert_allclose(per_rep.khat, whole.pareto_khat, rtol=1e-12)


def test_signed_lara_weights_are_undefined_per_replicate_and_cell():
    import randattn
    from randattn.analysis.diagnostics import replicate_snis_diagnostics

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 2, 20, 4)) * np.array([1.0, 4.0, 4.0])[:, None, None, None]
    draws = randattn.draw("lara", q.shape, k.shape, num_samples=8, seed=3, replicates=4)
    for backend in ("torch", "reference"):
        d = replicate_snis_diagnostics("lara", q, k, v, draws, scale=1.0, params={"weighting": "decoupled"},
                                       backend=backend, dtype="float64", khat_queries=0)
        balance = replicate_snis_diagnostics("lara", q, k, v, draws, scale=1.0, params={"weighting": "balance"},
                                             backend=backend, dtype="float64", khat_queries=0)
        assert np.isfinite(balance.ess).all()
        # NaN exactly where some weight of that (replicate, cell) is non-positive, finite elsewhere
        assert np.isnan(d.ess).any() and np.isfinite(d.ess).any(), backend


def test_signed_lara_with_a_non_positive_weight_everywhere_has_no_diagnostics():
    """Every (replicate, cell) holding a non-positive weight: nothing is defined, and the sweep gets None
    (its NaN) without computing the weights' spread; the signs are checked here on the reference terms."""
    import randattn
    from randattn.analysis.diagnostics import replicate_snis_diagnostics
    from randattn.estimators.lara import reference as lara_ref

    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(3, 2, 20, 4)) * np.array([1.0, 4.0, 4.0])[:, None, None, None]
    signed = randattn.get_spec("lara").resolve_params({"weighting": "decoupled", "beta": 50.0})
    draws = randattn.draw("lara", q.shape, k.shape, num_samples=8, seed=3, replicates=3, **signed)
    sign = lara_ref.lara_terms(q, k, v, draws, scale=1.0, **signed).alpha_sign  # (R, cells, N, C)
    assert (sign <= 0).reshape(3, 2, -1).any(-1).all()
    for backend in ("torch", "reference"):
        assert replicate_snis_diagnostics("lara", q, k, v, draws, scale=1.0, params=signed, backend=backend,
                                          dtype="float64", khat_queries=4) is None, backend


def test_vectorized_khat_equals_arviz_row_by_row():
    import warnings

    import arviz

    rng = np.random.default_rng(1)
    rows = np.concatenate([rng.standard_t(2, size=(40, 64)) * 3, rng.normal(size=(40, 64)),
                           np.tile(np.r_[np.zeros(60), np.ones(4)], (2, 1))])  # ties at the cutoff: arviz path
    from randattn.analysis.diagnostics import pareto_khat

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = np.array([arviz.psislw(r.copy())[1] for r in rows], dtype=float)
    expected = np.where(np.isfinite(expected), expected, np.nan)
    np.testing.assert_allclose(pareto_khat(rows), expected, rtol=1e-12, atol=1e-12)


def test_snis_diagnostics_take_read_only_and_reversed_values():
    """``f`` as a read-only broadcast view with a negative stride (what np.asarray may hand on) gives the copy's result."""
    import warnings

    rng = np.random.default_rng(11)
    log_w = rng.normal(size=(2, 3, 5, 40))
    f = np.broadcast_to(rng.normal(size=(1, 3, 40, 4)), (2, 3, 40, 4))[..., ::-1, :]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        d = snis_diagnostics(log_w, f, khat_queries=0)
    delta = snis_delta_method_variance(log_w, np.array(f)[..., None, :, :]).mean(axis=(-2, -1)).mean(0)
    np.testing.assert_allclose(d.delta_variance, delta, rtol=1e-12)
