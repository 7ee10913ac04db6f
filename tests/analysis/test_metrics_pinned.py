"""Replicate metrics pinned by explicit loops over replicates and batch elements (mutation survivors, issue #13).

Inputs are float32 with batch dimensions (the sweep's shapes); expected values are formed here
in float64 from the definitions (module docstring of :mod:`randattn.analysis.metrics`), one batch
element and one left-out replicate at a time.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.stats import norm

from randattn.analysis.metrics import normal_ci, probability_mse, relative_error, replicate_metrics


def _at_caller(filename):
    """The warning's stacklevel points at the caller (mutmut's trampoline adds a frame of its own)."""
    return filename == __file__ or "mutmut" in filename


def _loop_metrics(est, ex):
    """Definitions, per batch element: est (R, B, N, Dv) float64, ex (B, N, Dv)."""
    r = est.shape[0]
    out = {k: [] for k in ("mean_abs", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se")}
    for b in range(ex.shape[0]):
        y, t = est[:, b], ex[b]
        per_rep = np.array([((y[i] - t) ** 2).mean() for i in range(r)])
        mean = sum(y[i] for i in range(r)) / r
        var = sum((y[i] - mean) ** 2 for i in range(r)) / (r - 1)
        naive = ((mean - t) ** 2).mean()

        def debiased(rows):
            m = rows.mean(0)
            s2 = ((rows - m) ** 2).sum(0) / (len(rows) - 1)
            return ((m - t) ** 2 - s2 / len(rows)).mean()

        loo = np.array([debiased(np.delete(y, i, axis=0)) for i in range(r)])
        out["mean_abs"].append(np.abs(mean).mean())
        out["mse"].append(per_rep.mean())
        out["mse_se"].append(per_rep.std(ddof=1) / np.sqrt(r))
        out["variance"].append(var.mean())
        out["bias_sq"].append(naive - var.mean() / r)
        out["bias_sq_naive"].append(naive)
        out["bias_sq_se"].append(np.sqrt((r - 1) / r * ((loo - loo.mean()) ** 2).sum()))
    return {k: np.array(v) for k, v in out.items()}


@pytest.mark.parametrize("reps", [3, 6])
def test_replicate_metrics_match_the_definitions_with_batch_dims_in_float32(reps, rng):
    est32 = (rng.standard_normal((reps, 2, 3, 2)) * 0.7 + 0.3).astype(np.float32)
    ex32 = rng.standard_normal((2, 3, 2)).astype(np.float32)
    got = replicate_metrics(est32, ex32)
    want = _loop_metrics(est32.astype(np.float64), ex32.astype(np.float64))
    for field, value in want.items():
        np.testing.assert_allclose(getattr(got, field), value, rtol=1e-12, atol=1e-15, err_msg=field)
        assert getattr(got, field).shape == (2,), field
    assert got.replicates == reps and got.random is True


def test_deterministic_metrics_use_the_first_replicate_per_batch_element(rng):
    one = rng.standard_normal((1, 2, 3, 2)).astype(np.float32)
    ex = rng.standard_normal((2, 3, 2))
    got = replicate_metrics(np.concatenate([one, one]), ex, random=False)
    err = ((one[0].astype(np.float64) - ex) ** 2).mean(axis=(-2, -1))
    np.testing.assert_allclose(got.mse, err, rtol=1e-12)
    np.testing.assert_allclose(got.bias_sq, err, rtol=1e-12)
    np.testing.assert_allclose(got.bias_sq_naive, err, rtol=1e-12)
    np.testing.assert_allclose(got.mean_abs, np.abs(one[0].astype(np.float64)).mean(axis=(-2, -1)), rtol=1e-12)
    for field in ("mse_se", "variance", "bias_sq_se"):
        np.testing.assert_array_equal(getattr(got, field), np.zeros(2))
    assert got.replicates == 1 and got.random is False


def test_one_random_replicate_warns_at_the_caller_and_reports_nan(rng):
    est = rng.standard_normal((1, 2, 3, 2))
    ex = rng.standard_normal((2, 3, 2))
    with pytest.warns(RuntimeWarning, match=r"^replicate_metrics: a random estimator needs R >= 2 replicates.*NaN$") as rec:
        got = replicate_metrics(est, ex)
    assert _at_caller(rec[0].filename)
    np.testing.assert_allclose(got.mse, ((est[0] - ex) ** 2).mean(axis=(-2, -1)), rtol=1e-12)
    np.testing.assert_allclose(got.bias_sq_naive, got.mse, rtol=1e-12)
    np.testing.assert_allclose(got.mean_abs, np.abs(est[0]).mean(axis=(-2, -1)), rtol=1e-12)
    for field in ("mse_se", "variance", "bias_sq", "bias_sq_se"):
        assert getattr(got, field).shape == (2,) and np.isnan(getattr(got, field)).all(), field
    assert got.replicates == 1 and got.random is True


def test_two_replicates_warn_about_the_jackknife_and_three_do_not(rng):
    ex = rng.standard_normal((3, 2))
    with pytest.warns(RuntimeWarning, match=r"^replicate_metrics: the jackknife SE of the debiased bias\^2 needs R >= 3.*NaN$") as rec:
        two = replicate_metrics(rng.standard_normal((2, 3, 2)), ex)
    assert _at_caller(rec[0].filename)
    assert np.isnan(two.bias_sq_se) and np.isfinite(two.variance)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        three = replicate_metrics(rng.standard_normal((3, 3, 2)), ex)
    assert np.isfinite(three.bias_sq_se)


def test_metrics_input_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"estimates must have shape \(R, \.\.\., N, Dv\), got \(3, 2\)"):
        replicate_metrics(np.zeros((3, 2)), np.zeros(2))
    with pytest.raises(TypeError, match="random must be a bool, got str"):
        replicate_metrics(np.zeros((2, 3, 2)), np.zeros((3, 2)), random="yes")


def test_normal_ci_level_bounds_default_and_float64():
    est, se = np.float32(0.1), np.float32(0.3)
    lo, hi = normal_ci(est, se)
    z = norm.ppf(0.975)
    np.testing.assert_allclose([lo, hi], [float(est) - z * float(se), float(est) + z * float(se)], rtol=1e-14)
    for level in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="level must be in"):
            normal_ci(0.0, 1.0, level=level)


def test_relative_error_and_probability_mse_with_batch_dims_in_float32(rng):
    est = rng.standard_normal((4, 2, 3, 5)).astype(np.float32)
    ex = rng.standard_normal((2, 3, 5)).astype(np.float32)
    e64, x64 = est.astype(np.float64), ex.astype(np.float64)
    want_rel = [np.mean([np.linalg.norm(e64[r, b, n] - x64[b, n]) / np.linalg.norm(x64[b, n])
                         for r in range(4) for n in range(3)]) for b in range(2)]
    np.testing.assert_allclose(relative_error(est, ex), want_rel, rtol=1e-12)
    want_p = [np.mean([(e64[r, b, n, m] - x64[b, n, m]) ** 2 for r in range(4) for n in range(3) for m in range(5)])
              for b in range(2)]
    np.testing.assert_allclose(probability_mse(est, ex), want_p, rtol=1e-12)


def test_relative_error_of_a_zero_output_is_inf_without_a_warning():
    ex = np.array([[1.0, 0.0], [0.0, 0.0]])  # second query's exact output is 0
    est = np.array([[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isinf(relative_error(est[:1], ex))
        assert np.isnan(relative_error(est[1:], ex))


def test_metric_confidence_intervals_use_their_own_standard_errors(rng):
    got = replicate_metrics(rng.standard_normal((5, 2, 3, 2)), rng.standard_normal((2, 3, 2)))
    cases = [(got.mse_ci(), got.mse, got.mse_se, 0.95), (got.mse_ci(0.8), got.mse, got.mse_se, 0.8),
             (got.bias_sq_ci(), got.bias_sq, got.bias_sq_se, 0.95), (got.bias_sq_ci(0.9), got.bias_sq, got.bias_sq_se, 0.9)]
    for (lo, hi), centre, se, level in cases:
        half = norm.ppf(0.5 + level / 2) * se
        np.testing.assert_allclose(lo, centre - half, rtol=1e-13)
        np.testing.assert_allclose(hi, centre + half, rtol=1e-13)
