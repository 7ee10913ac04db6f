"""The family-wise promise decision of :mod:`randattn.analysis.relative_error`: each head's one-sided binomial
p-value, Holm's step-down procedure over a configuration's heads, and the counts behind them in the table.

Expected values are written out here: the binomial tail as a sum of ``math.comb`` terms, Holm's rejections by hand
from his rule, the error rates from simulation with tolerances of the simulation's standard error."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from randattn.analysis.relative_error import (
    FALSE_FLAG_RATE,
    broken_promises,
    budget_summary,
    clopper_pearson,
    familywise_broken,
    holm_rejections,
    relative_error_columns,
    violation_p_values,
)


def _tail(x: int, n: int, p: float) -> float:
    """P(X >= x), X ~ Bin(n, p), as the sum of its terms."""
    return sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(x, n + 1))


def test_the_p_value_is_the_binomial_tail_written_out():
    got = violation_p_values(np.arange(8), 7, 0.2)
    assert got == pytest.approx([_tail(x, 7, 0.2) for x in range(8)], rel=1e-12)
    assert got[0] == 1.0 and np.isnan(violation_p_values(0, 0, 0.2)) and np.isnan(violation_p_values(1, 5, np.nan))


@pytest.mark.parametrize("delta", [0.01, 0.05, 0.3])
@pytest.mark.parametrize("trials", [1, 5, 40, 400])
def test_the_p_value_is_below_the_flag_rate_exactly_where_the_interval_lies_above_delta(trials, delta):
    """The per-head flag (the 95% Clopper-Pearson interval wholly above delta) is the one-sided test at 2.5 %: the
    interval's lower end is the probability at which the tail is 2.5 %, and the tail grows with the probability."""
    x = np.arange(trials + 1)
    lo, _ = clopper_pearson(x, np.full(x.shape, trials))
    p = violation_p_values(x, trials, delta)
    clear = np.abs(p - FALSE_FLAG_RATE) > 1e-9  # a tail at the bound itself is decided by rounding either way
    assert ((lo > delta) == (p < FALSE_FLAG_RATE))[clear].all()


@pytest.mark.parametrize(("p_values", "level", "expected"), [
    # ordered 0.005 < 0.05/4, 0.01 < 0.05/3, then 0.03 >= 0.05/2: stop; 0.04 < 0.05 is not reached
    ([0.01, 0.04, 0.03, 0.005], 0.05, [True, False, False, True]),
    # ordered 0.001 < 0.05/3, 0.02 < 0.05/2, 0.3 >= 0.05
    ([0.001, 0.3, 0.02], 0.05, [True, False, True]),
    # the smallest already fails its bound 0.05/3: nothing is rejected, though 0.04 < 0.05
    ([0.02, 0.03, 0.04], 0.05, [False, False, False]),
    ([0.001, 0.002, 0.003], 0.05, [True, True, True]),
    # no test (NaN) is no hypothesis: H = 1
    ([np.nan, 0.02], 0.025, [False, True]),  # counted in H, the bound would be 0.0125
    # one head alone: the per-head flag's strict inequality
    ([0.02], 0.025, [True]),
    ([0.025], 0.025, [False]),
    ([], 0.025, []),
])
def test_holm_by_hand(p_values, level, expected):
    assert holm_rejections(p_values, level).tolist() == expected


def test_holm_refuses_a_level_outside_zero_one():
    with pytest.raises(ValueError, match="level must be in"):
        holm_rejections([0.1], 1.0)


def test_a_family_of_heads_that_keep_their_promise_is_flagged_at_most_at_the_flag_rate():
    """Every head's violation probability exactly delta (the worst case of a kept promise): the fraction of families
    with any head flagged family-wise stays within 3 standard errors (binomial, over the simulated families) of at
    most 2.5 %, while the fraction with any head flagged alone is 1 - (1 - f)^H with f the exact per-head flag
    probability (summed from the binomial terms), within 4 standard errors: the control is the procedure's."""
    rng = np.random.default_rng(20261129)
    families, heads, trials, delta = 2000, 54, 320, 0.05
    violations = rng.binomial(trials, delta, size=(families, heads))
    p = violation_p_values(violations, trials, delta)
    familywise = np.array([holm_rejections(row).any() for row in p]).mean()
    assert familywise <= FALSE_FLAG_RATE + 3 * math.sqrt(FALSE_FLAG_RATE * (1 - FALSE_FLAG_RATE) / families)
    flag = sum(math.comb(trials, x) * delta ** x * (1 - delta) ** (trials - x)
               for x in range(trials + 1) if _tail(x, trials, delta) < FALSE_FLAG_RATE)
    alone = 1 - (1 - flag) ** heads
    assert (p < FALSE_FLAG_RATE).any(axis=1).mean() == pytest.approx(
        alone, abs=4 * math.sqrt(alone * (1 - alone) / families))
    assert alone > 10 * FALSE_FLAG_RATE  # what the family-wise decision is for


def test_a_head_well_above_delta_is_flagged_family_wise_among_many_that_keep_it():
    """One head at three times delta among 53 at delta, 320 trials each. A head whose tail is below 2.5 % / 54 is
    rejected by Holm whatever the others (every ordered p-value before it is smaller still, and under its own bound):
    the probability q of that (summed from the binomial terms at 3 delta) bounds the rate at which it is flagged from
    below, within 4 standard errors of the simulated families."""
    rng = np.random.default_rng(7)
    families, heads, trials, delta = 400, 54, 320, 0.05
    violations = rng.binomial(trials, delta, size=(families, heads))
    violations[:, 0] = rng.binomial(trials, 3 * delta, size=families)
    flagged = np.array([holm_rejections(row)[0] for row in violation_p_values(violations, trials, delta)]).mean()
    q = sum(math.comb(trials, x) * (3 * delta) ** x * (1 - 3 * delta) ** (trials - x)
            for x in range(trials + 1) if _tail(x, trials, delta) < FALSE_FLAG_RATE / heads)
    assert q > 0.99  # the power the case is for
    assert flagged >= q - 4 * math.sqrt(q * (1 - q) / families)


def _table(rows) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(rows)
    rate = frame["violations"] / frame["trials"]
    lo, hi = clopper_pearson(frame["violations"], frame["trials"])
    return frame.assign(estimator="e", tokens=64, mask="causal", queries="last:4", image="x", layer=0,
                        epsilon=0.1, violation_rate=rate, violation_lo=lo, violation_hi=hi,
                        promise_broken=lo > frame["delta"], violation_of="output", keys_used=np.nan,
                        keys_fraction=np.nan, rel_err_median=0.1, rel_err_p95=0.2)


def test_a_configuration_is_one_family_and_each_family_its_own_holm():
    """Configuration A (S = 8): three heads, tails at delta = 0.1 of 6/20, 7/20 and 2/20 violations. The first two
    are flagged alone (their tails 0.0113 and 0.00239 are below 2.5 %); Holm over three heads needs 0.00239 <
    0.025 / 3 (yes) and then 0.0113 < 0.025 / 2 (yes). Configuration B (S = 16), the same first head beside four
    heads at 0 violations: its tail is not below 0.025 / 5, so B flags it alone and not family-wise. Without a
    promise no head is flagged; without the counts the decision is unknown (None)."""
    tails = [_tail(6, 20, 0.1), _tail(7, 20, 0.1), _tail(2, 20, 0.1)]
    assert tails[1] < 0.025 / 3 and 0.025 / 3 < tails[0] < 0.025 / 2 and tails[2] > 0.025  # the case as described
    rows = [dict(label="e:a", num_samples=8, head=h, violations=x, trials=20, delta=0.1)
            for h, x in enumerate((6, 7, 2))]
    rows += [dict(label="e:a", num_samples=16, head=h, violations=x, trials=20, delta=0.1)
             for h, x in enumerate((6, 0, 0, 0, 0))]
    rows += [dict(label="e:none", num_samples=8, head=0, violations=20, trials=20, delta=np.nan)]
    table = _table(rows)
    assert familywise_broken(table).tolist() == [True, True, False, False, False, False, False, False, False]
    assert table["promise_broken"].tolist()[:6] == [True, True, False, True, False, False]
    summary = budget_summary(table)
    assert summary["promises_broken"].tolist() == [2, 1, 0]
    assert summary["promises_broken_familywise"].tolist() == [2, 0, 0]  # no promise: 0, as promises_broken
    assert summary["epsilon"].tolist()[:2] == [0.1, 0.1]  # the configuration's own, not a mean that rounds it
    assert [(b["num_samples"], b["head"], b["familywise"]) for b in broken_promises(table)] == [
        (8, 0, True), (8, 1, True), (16, 0, False)]
    before = table.drop(columns=["violations", "trials"])  # a table written before the counts
    assert familywise_broken(before).tolist()[:8] == [None] * 8
    assert budget_summary(before)["promises_broken_familywise"].tolist() == [pd.NA, pd.NA, 0]
    assert {b["familywise"] for b in broken_promises(before)} == {None}


def test_the_counts_behind_the_rate_by_hand():
    """Two cells, R = 2 replicates x N = 3 queries: 2 and 5 errors above 0.1, one NaN (0 / 0) left out of the first
    cell's trials; without a tolerance the counts are NaN."""
    errors = np.array([[[0.2, 0.05, 0.3], [0.5, 0.6, 0.01]], [[0.0, np.nan, 0.0], [0.7, 0.2, 0.9]]])  # (R, C, N)
    columns = relative_error_columns(errors, 0.1, None)
    assert columns["violations"].tolist() == [2.0, 5.0] and columns["trials"].tolist() == [5.0, 6.0]
    assert columns["violation_rate"] == pytest.approx([2 / 5, 5 / 6])
    none = relative_error_columns(errors, None, None)
    assert np.isnan(none["violations"]).all() and np.isnan(none["trials"]).all()
