"""The z-scores of the variance and MSE checks: squared deviations, skewed to the right, corrected for their skewness
(Hall 1992) so that a correct check's z is near normal in the tails the 4.5-SE threshold reads."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from randattn import theory
from randattn.theory import _performer, _sderf
from randattn.theory._base import second_moment_z_scores, z_scores


def test_the_correction_is_halls_transformation_of_the_studentized_mean():
    """Written out on four numbers, with scipy's skewness (the biased moment ratio m3 / m2^{3/2}, rescaled to the
    ddof-1 standard deviation that T uses): T + g T^2 / 3 + g^2 T^3 / 27 + g / 6, g = skewness / sqrt(R)."""
    squares, target = np.array([[1.0], [2.0], [3.0], [10.0]]), np.array([3.0])
    r = 4
    sd = math.sqrt(np.var(squares[:, 0], ddof=1))
    t = (4.0 - 3.0) / (sd / math.sqrt(r))
    m2 = np.var(squares[:, 0])  # ddof 0
    gamma = stats.skew(squares[:, 0]) * (m2 / sd**2) ** 1.5
    g = gamma / math.sqrt(r)
    z, se = second_moment_z_scores(squares, target)
    assert z[0] == pytest.approx(t + g * t**2 / 3 + g**2 * t**3 / 27 + g / 6, rel=1e-12)
    assert se[0] == pytest.approx(sd / 2, rel=1e-12)


def test_symmetric_squares_keep_the_plain_z():
    """Without skewness there is nothing to correct: the z of z_scores, whatever the deviation."""
    squares = np.array([1.0, 2.0, 3.0, 4.0, 5.0])[:, None] * np.ones((1, 3))
    target = np.array([2.0, 3.0, 4.5])
    np.testing.assert_allclose(second_moment_z_scores(squares, target)[0], z_scores(squares, target)[0], rtol=1e-12)


def test_squares_without_spread_are_compared_to_rounding():
    """Equal squares (an exact estimator's): z is the deviation over z_scores' 1e-12 floor, not 0 / 0."""
    squares = np.full((10, 2), 0.25)
    z, _ = second_moment_z_scores(squares, np.array([0.25, 0.5]))
    assert z[0] == 0.0 and z[1] == pytest.approx(-0.25 / 1e-12)


@pytest.mark.slow  # 3,000 quick runs of three checks: about 40 s on two cores
def test_the_second_moment_checks_false_alarm_about_as_a_normal_z_would():
    """Correct variance and MSE checks (Performer Lemma 2 hyperbolic, OPRF's and SDERF's variances), 1,000 quick runs
    each: the runs with some |z| > 4.0 are counted against normal z-scores, 2 P(|Z| > 4) per element (3 + 12 + 12
    elements: 1.71 expected in all); 8 or more has Poisson probability 0.04 %. Measured: 2. Before (4 features in
    Lemma 2, the sample variance over its own fourth-moment SE, SDERF's random A up to 0.03): 11."""
    checks = [(_performer.lemma2_hyperbolic, "performer.lemma2.hyperbolic-mse", 3),
              (_performer.oprf_variance_closed_form, "oprf.variance-closed-form", 12),
              (_sderf.sderf_variance_closed_form, "sderf.variance-closed-form", 12)]
    runs, threshold = 1000, 4.0
    over, expected = 0, 0.0
    for func, name, elements in checks:
        expected += runs * elements * 2 * stats.norm.sf(threshold)
        for seed in range(runs):
            over += func(theory.check_rng(seed, name), True, None).measured > threshold
    assert stats.poisson.sf(7, expected) < 0.002
    assert over <= 7, (over, expected)
