"""Replicate metrics: hand-computed cases, the debiasing, deterministic and degenerate inputs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from randattn.analysis.metrics import (
    jackknife_debiased_bias_sq,
    metrics_with_relative_error,
    normal_ci,
    probability_mse,
    relative_error,
    replicate_metrics,
)


def test_hand_computed_three_replicates_two_elements():
    # element a: replicates 1, 2, 6 vs exact 0; element b: 0, 0, 3 vs exact 1
    est = np.array([[[1.0, 0.0]], [[2.0, 0.0]], [[6.0, 3.0]]])  # (R=3, N=1, Dv=2)
    exact = np.array([[0.0, 1.0]])
    m = replicate_metrics(est, exact)
    # mse: a (1 + 4 + 36)/3 = 41/3, b (1 + 1 + 4)/3 = 2 -> avg 47/6
    assert m.mse == pytest.approx(47 / 6, rel=1e-15)
    # variance: a mean 3, (4 + 1 + 9)/2 = 7; b mean 1, (1 + 1 + 4)/2 = 3 -> 5
    assert m.variance == pytest.approx(5.0, rel=1e-15)
    # naive bias^2: a 9, b 0 -> 4.5; debiased: a 9 - 7/3, b 0 - 1 -> (20/3 - 1)/2 = 17/6
    assert m.bias_sq_naive == pytest.approx(4.5, rel=1e-15)
    assert m.bias_sq == pytest.approx(17 / 6, rel=1e-15)
    # mse SE: per-replicate errors (1+1)/2=1, (4+1)/2=2.5, (36+4)/2=20 -> sd/sqrt(3)
    assert m.mse_se == pytest.approx(np.std([1.0, 2.5, 20.0], ddof=1) / np.sqrt(3), rel=1e-14)
    assert m.replicates == 3 and m.random


def test_sample_bias_variance_decomposition(rng):
    est = rng.normal(size=(7, 2, 5, 3))
    exact = rng.normal(size=(2, 5, 3))
    m = replicate_metrics(est, exact)
    np.testing.assert_allclose(m.mse, m.bias_sq_naive + 6 / 7 * m.variance, rtol=1e-13)
    np.testing.assert_allclose(m.bias_sq, m.bias_sq_naive - m.variance / 7, rtol=1e-13)
    assert m.mse.shape == (2,)


def test_debiased_bias_sq_is_the_u_statistic(rng):
    est = rng.normal(size=(5, 4, 3))
    exact = rng.normal(size=(4, 3))
    d = est - exact
    pairs = sum(d[i] * d[j] for i in range(5) for j in range(5) if i != j) / 20
    assert replicate_metrics(est, exact).bias_sq == pytest.approx(pairs.mean(), rel=1e-12)


def test_jackknife_matches_brute_force(rng):
    est = rng.normal(size=(6, 3, 4, 2)) + 0.3
    exact = rng.normal(size=(3, 4, 2))

    def theta(sub):
        r = sub.shape[0]
        return ((sub.mean(0) - exact) ** 2 - sub.var(0, ddof=1) / r).mean(axis=(-2, -1))

    loo = np.stack([theta(np.delete(est, r, axis=0)) for r in range(6)])
    brute = np.sqrt(5 / 6 * ((loo - loo.mean(0)) ** 2).sum(0))
    np.testing.assert_allclose(jackknife_debiased_bias_sq(est, exact), brute, rtol=1e-12)


def test_debiasing_on_gaussian_replicates_with_known_bias(rng):
    # y_r = y + b + sigma * eps: bias^2 = b^2 per element; K independent experiments in the batch dim
    experiments, reps, b, sigma = 4000, 8, 0.5, 1.0
    exact = np.zeros((experiments, 3, 2))
    est = exact + b + sigma * rng.standard_normal((reps, experiments, 3, 2))
    m = replicate_metrics(est, exact)
    se = m.bias_sq.std(ddof=1) / np.sqrt(experiments)
    # unbiased: within 4 standard errors of the truth
    assert abs(m.bias_sq.mean() - b**2) < 4 * se
    # the naive estimate sits sigma^2 / R above it, far more than 4 SE away
    assert abs(m.bias_sq_naive.mean() - (b**2 + sigma**2 / reps)) < 4 * se
    assert m.bias_sq_naive.mean() - b**2 > 10 * se
    # the jackknife SE is calibrated: its mean matches the spread across experiments to within 10 %
    # (the SD of the sample SD over 4000 experiments is ~1 %; jackknife bias for a U-statistic is O(1/R))
    assert m.bias_sq_se.mean() == pytest.approx(m.bias_sq.std(ddof=1), rel=0.1)
    # and the MSE SE likewise
    assert m.mse_se.mean() == pytest.approx(m.mse.std(ddof=1), rel=0.1)


def test_deterministic_estimator_zero_variance_from_one_replicate(rng):
    exact = rng.normal(size=(2, 4, 3))
    est = (exact + 0.1)[None]
    m = replicate_metrics(est, exact, random=False)
    assert m.replicates == 1 and not m.random
    np.testing.assert_array_equal(m.variance, 0.0)
    np.testing.assert_array_equal(m.mse_se, 0.0)
    np.testing.assert_array_equal(m.bias_sq_se, 0.0)
    np.testing.assert_allclose(m.mse, 0.01, rtol=1e-12)
    np.testing.assert_array_equal(m.bias_sq, m.mse)


def test_random_estimator_single_replicate_warns_and_gives_nan(rng):
    with pytest.warns(RuntimeWarning, match="R >= 2"):
        m = replicate_metrics(rng.normal(size=(1, 3, 2)), np.zeros((3, 2)))
    assert np.isnan(m.variance) and np.isnan(m.bias_sq) and np.isnan(m.mse_se)
    assert np.isfinite(m.mse) and np.isfinite(m.bias_sq_naive)


def test_two_replicates_warn_for_jackknife(rng):
    with pytest.warns(RuntimeWarning, match="R >= 3"):
        m = replicate_metrics(rng.normal(size=(2, 3, 2)), np.zeros((3, 2)))
    assert np.isnan(m.bias_sq_se) and np.isfinite(m.variance)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="expected \\(R, \\*exact.shape\\)"):
        replicate_metrics(np.zeros((3, 4, 2)), np.zeros((5, 2)))
    with pytest.raises(TypeError, match="random must be a bool"):
        replicate_metrics(np.zeros((3, 4, 2)), np.zeros((4, 2)), random="yes")


def test_relative_error_and_probability_mse():
    exact = np.array([[3.0, 4.0], [1.0, 0.0]])  # norms 5, 1
    est = np.stack([exact + [[0.0, 5.0], [0.0, 0.0]], exact + [[0.0, 0.0], [0.0, 2.0]]])
    # replicate 0: 5/5 = 1, 0; replicate 1: 0, 2/1 = 2 -> mean 0.75
    assert relative_error(est, exact) == pytest.approx(0.75)
    p = np.array([[0.5, 0.5]])
    assert probability_mse(np.array([[[1.0, 0.0]]]), p) == pytest.approx(0.25)


def test_normal_ci():
    lo, hi = normal_ci(1.0, 0.5, level=0.95)
    assert lo == pytest.approx(1.0 - 1.959963984540054 * 0.5)
    assert hi == pytest.approx(1.0 + 1.959963984540054 * 0.5)
    with pytest.raises(ValueError, match="level"):
        normal_ci(1.0, 0.5, level=1.5)


@pytest.mark.parametrize("reps, random", [(5, True), (2, True), (1, True), (3, False)])
def test_metrics_with_relative_error_is_both_calls_bit_for_bit(rng, reps, random):
    """One difference array serves both results: the same bits as replicate_metrics and relative_error."""
    exact = rng.normal(size=(2, 4, 3))
    est = exact + 0.1 * rng.normal(size=(reps, 2, 4, 3))
    if not random:
        est = np.broadcast_to(est[:1], est.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # R = 1, 2: NaN fields, warned (checked below)
        metrics, rel = metrics_with_relative_error(est, exact, random=random)
        expected = replicate_metrics(est, exact, random=random)
    expected_rel = relative_error(est[: expected.replicates], exact)
    for field in ("mean_abs", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se"):
        np.testing.assert_array_equal(getattr(metrics, field), getattr(expected, field), err_msg=field)
    assert metrics.replicates == expected.replicates and metrics.random == expected.random
    np.testing.assert_array_equal(rel, expected_rel)


def test_metrics_with_relative_error_hand_computed_and_warns_at_the_caller(rng):
    exact = np.array([[3.0, 4.0], [1.0, 0.0]])  # norms 5, 1
    est = np.stack([exact + [[0.0, 5.0], [0.0, 0.0]], exact + [[0.0, 0.0], [0.0, 2.0]]])
    with pytest.warns(RuntimeWarning, match="R >= 3") as record:
        _, rel = metrics_with_relative_error(est, exact)
    assert rel == pytest.approx(0.75)  # replicate 0: 5/5, 0; replicate 1: 0, 2/1
    assert record[0].filename == __file__
    with pytest.warns(RuntimeWarning, match="R >= 2") as record:
        _, rel = metrics_with_relative_error(est[:1], exact)
    assert rel == pytest.approx(0.5)  # replicate 0 alone
    assert record[0].filename == __file__


# ------------------------------------------------------------------------------------------------ the torch form
def _differences(est: np.ndarray, exact: np.ndarray):
    import torch

    return torch.from_numpy(est - exact), torch.from_numpy(exact)


def _hand_case() -> tuple[np.ndarray, np.ndarray]:
    exact = np.array([[3.0, 4.0], [1.0, 0.0]])  # row norms 5, 1
    return np.stack([exact + [[0.0, 5.0], [0.0, 0.0]], exact + [[0.0, 0.0], [0.0, 2.0]]]), exact


def test_metrics_of_differences_hand_computed():
    """The case above, written out: diffs d_0 = [[0, 5], [0, 0]], d_1 = [[0, 0], [0, 2]], N Dv = 4."""
    from randattn.analysis.metrics import metrics_of_differences

    est, exact = _hand_case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # R = 2 and 1 warn (the next test)
        m, rel = metrics_of_differences(*_differences(est, exact))
        one, rel_one = metrics_of_differences(*_differences(est[:1], exact))
    assert rel == pytest.approx(0.75)  # replicate 0: 5/5, 0; replicate 1: 0, 2/1
    assert m.mse == pytest.approx((25 / 4 + 4 / 4) / 2, rel=1e-15)  # per replicate 6.25 and 1
    # mean difference [[0, 2.5], [0, 1]]: naive bias^2 (6.25 + 1) / 4; deviations +-[[0, 2.5], [0, -1]]
    assert m.bias_sq_naive == pytest.approx(7.25 / 4, rel=1e-15)
    assert m.variance == pytest.approx(2 * 7.25 / 4, rel=1e-15)  # sum of two 1.8125, over R - 1 = 1
    assert m.bias_sq == pytest.approx(0.0, abs=1e-15)  # 1.8125 - 3.625 / 2
    assert m.mse_se == pytest.approx(np.std([6.25, 1.0], ddof=1) / np.sqrt(2), rel=1e-15)
    assert np.isnan(m.bias_sq_se) and m.replicates == 2 and m.random is True
    assert m.mean_abs == pytest.approx((3 + 6.5 + 1 + 1) / 4, rel=1e-15)  # |exact + mean difference|
    # one replicate of a random estimator: its error, no variance
    assert rel_one == pytest.approx(0.5) and one.mse == pytest.approx(6.25, rel=1e-15)
    assert one.replicates == 1 and one.random is True and np.isnan(one.variance) and np.isnan(one.mse_se)


def test_metrics_of_differences_warn_at_the_caller():
    from randattn.analysis.metrics import metrics_of_differences

    est, exact = _hand_case()
    with pytest.warns(RuntimeWarning) as record:
        metrics_of_differences(*_differences(est, exact))
    assert str(record[0].message) == ("replicate_metrics: the jackknife SE of the debiased bias^2 needs R >= 3 "
                                      "replicates, got R = 2; bias_sq_se is NaN")
    assert record[0].filename == __file__
    with pytest.warns(RuntimeWarning) as record:
        metrics_of_differences(*_differences(est[:1], exact))
    assert str(record[0].message) == ("replicate_metrics: a random estimator needs R >= 2 replicates for a "
                                      "variance; got R = 1, so variance, debiased bias^2 and standard errors are NaN")
    assert record[0].filename == __file__


def test_metrics_of_differences_of_a_deterministic_estimator_use_the_first_replicate(rng):
    from randattn.analysis.metrics import metrics_of_differences

    exact = rng.normal(size=(3, 12, 5))
    est = exact + rng.normal(size=(4, 3, 12, 5))  # replicates that differ: only the first may count
    first, rel_first = metrics_of_differences(*_differences(est[:1], exact), random=False)
    every, rel_every = metrics_of_differences(*_differences(est, exact), random=False)
    for field in ("mean_abs", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se"):
        np.testing.assert_array_equal(getattr(every, field), getattr(first, field), err_msg=field)
    np.testing.assert_array_equal(rel_every, rel_first)
    assert every.replicates == 1 and every.random is False and (every.variance == 0).all()


@pytest.mark.parametrize("batch", [(3,), (1,)], ids=["3-heads", "1-head"])
@pytest.mark.parametrize("reps, random", [(32, True), (5, True), (2, True), (1, True), (3, False)])
def test_metrics_of_differences_match_the_numpy_metrics(rng, reps, random, batch):
    """The same sums as :func:`metrics_with_relative_error` in another order: equal within their rounding.

    Each field is a float64 sum of T <= R N Dv = 32 x 12 x 5 terms; two orders of a sum differ by at most
    2 gamma_T times the sum of the terms' magnitudes (Higham, Accuracy and Stability, eq. 3.5), which is
    below 1e-12 of it here: rtol = 1e-12 for the sums of squares, and the signed bias_sq (a difference)
    within 1e-12 of the magnitude of its two terms.
    """
    from randattn.analysis.metrics import metrics_of_differences

    exact = rng.normal(size=(*batch, 12, 5))
    est = exact + 0.3 * rng.normal(size=(reps, *batch, 12, 5)) + 0.05
    if not random:
        est = np.broadcast_to(est[:1], est.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # R = 1, 2: NaN fields, warned (checked above)
        expected, expected_rel = metrics_with_relative_error(est, exact, random=random)
        metrics, rel = metrics_of_differences(*_differences(np.array(est), exact), random=random)
    for field in ("mean_abs", "mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se"):
        assert np.shape(getattr(metrics, field)) == batch, field  # NaN fields too: one per batch element
    for field in ("mean_abs", "mse", "mse_se", "variance", "bias_sq_naive", "bias_sq_se"):
        np.testing.assert_allclose(getattr(metrics, field), getattr(expected, field), rtol=1e-12, atol=0,
                                   err_msg=field)
    scale = expected.bias_sq_naive + np.nan_to_num(expected.variance) / expected.replicates
    np.testing.assert_array_less(np.nan_to_num(np.abs(metrics.bias_sq - expected.bias_sq)), 1e-12 * scale)
    assert np.isnan(metrics.bias_sq).tolist() == np.isnan(expected.bias_sq).tolist()
    assert metrics.replicates == expected.replicates and metrics.random == expected.random
    np.testing.assert_allclose(rel, expected_rel, rtol=1e-12, atol=0)


def test_metrics_of_differences_move_only_per_replicate_sums_to_the_host(rng, monkeypatch):
    """GPU-ready (issue 9): the (R, ..., N, Dv) differences stay on their device; what crosses is (R, ...) at most."""
    import randattn.analysis.metrics as metrics_module

    crossed = []
    real = metrics_module._to_host
    monkeypatch.setattr(metrics_module, "_to_host", lambda t: crossed.append(tuple(t.shape)) or real(t))
    exact = rng.normal(size=(3, 12, 5))
    metrics_module.metrics_of_differences(*_differences(exact + rng.normal(size=(4, 3, 12, 5)), exact))
    assert crossed and all(int(np.prod(shape)) <= 4 * 3 for shape in crossed), crossed


def test_metrics_of_differences_refuse_bad_input(rng):
    import torch

    from randattn.analysis.metrics import metrics_of_differences

    diff, exact = _differences(rng.normal(size=(4, 3, 12, 5)), rng.normal(size=(3, 12, 5)))
    arrays = "^metrics_of_differences takes torch tensors; use metrics_with_relative_error for arrays$"
    with pytest.raises(TypeError, match=arrays):
        metrics_of_differences(diff.numpy(), exact.numpy())
    with pytest.raises(TypeError, match=arrays):
        metrics_of_differences(diff.numpy(), exact)
    with pytest.raises(TypeError, match=arrays):
        metrics_of_differences(diff, exact.numpy())
    with pytest.raises(TypeError, match="^metrics_of_differences needs float64 tensors, got torch.float32 and"):
        metrics_of_differences(diff.to(torch.float32), exact)
    with pytest.raises(ValueError, match=r"^differences of shape \(4, 2, 12, 5\) do not match exact of shape "
                                         r"\(3, 12, 5\): expected \(R, \*exact.shape\)$"):
        metrics_of_differences(diff[:, :2], exact)
    with pytest.raises(ValueError, match="expected"):
        metrics_of_differences(diff[0, 0], exact[0])  # (N, Dv): no replicate dim
    with pytest.raises(TypeError, match="^random must be a bool, got int$"):
        metrics_of_differences(diff, exact, random=1)


def test_metrics_of_a_long_unit_form_their_products_a_group_of_replicates_at_a_time(monkeypatch):
    """Above PRODUCT_CHUNK_BYTES the products of metrics_of_differences are taken a group of replicates at a time:
    the metrics are the same bits as one call (each group is reduced row by row as the whole was), and no tensor the
    metrics allocate is larger than a group, where vecdot's product of the whole was as large as the differences
    (it put a 32,768-token unit over 2 GiB)."""
    import torch

    import randattn.analysis.metrics as metrics

    gen = torch.Generator().manual_seed(0)
    diff = torch.randn(8, 2, 512, 32, generator=gen, dtype=torch.float64)  # 2 MiB
    exact = torch.randn(2, 512, 32, generator=gen, dtype=torch.float64)
    whole, whole_rel = metrics.metrics_of_differences(diff.clone(), exact, random=True)
    monkeypatch.setattr(metrics, "PRODUCT_CHUNK_BYTES", diff[0].numel() * 8 * 2)  # groups of 2 replicates
    grouped, grouped_rel = metrics.metrics_of_differences(diff.clone(), exact, random=True)
    for field in ("mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "mean_abs"):
        np.testing.assert_array_equal(getattr(grouped, field), getattr(whole, field), err_msg=field)
    np.testing.assert_array_equal(grouped_rel, whole_rel)
    work = diff.clone()
    largest = _largest_new_tensor(lambda: metrics.metrics_of_differences(work, exact, random=True))
    assert 0 < largest <= diff.numel() // 4  # a group of 2 of the 8 replicates; one call formed all 8


def _largest_new_tensor(func) -> int:
    """The most elements of a tensor that an operator called by ``func()`` allocates (results that share an
    input's storage -- views, in-place operations -- are not new)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        size = 0

        def __torch_dispatch__(self, op, types, args=(), kwargs=None):
            result = op(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(result):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    Largest.size = max(Largest.size, t.numel())
            return result

    with Largest():
        func()
    return Largest.size
