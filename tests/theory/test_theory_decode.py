"""The decode-time propositions of ``randattn verify``, each shown able to fail.

Every check of :mod:`randattn.theory._decode` passes with the package's estimators and fails with a broken
one injected through its keyword parameter: an exact limit that leaves a key out, the collision probability with
the exponent K + 1, a MagicPIG ``select`` weighted for one collision less or sampling on one table less. The two
negative controls of the registry (wrong exponent, reweighting off by one) must detect.
"""

from __future__ import annotations

import dataclasses

import pytest

from randattn import theory
from randattn.theory import _decode
from randattn.estimators.base import ExactLimit
from randattn.estimators.registry import get_spec

DECODE = [c for c in theory.registry() if c.name.startswith("decode.")]


@pytest.mark.parametrize("check", DECODE, ids=lambda c: c.name)
def test_the_decode_checks_pass(check):
    result = check.run(theory.check_rng(0, check.name), True)
    assert result.passed and not result.skipped, (check.name, result.details)
    assert check.func.__doc__


def test_every_budgeted_estimator_is_covered_by_the_exact_limit_check():
    names = {name for name, _ in _decode.budget_estimators()}
    assert {"magicpig", "vattention"} <= names


def test_an_exact_limit_that_leaves_a_key_out_fails():
    """MagicPIG with a local window one key short of the 24-key cache and no sampling is not softmax."""
    spec = get_spec("magicpig")
    short = ExactLimit("one key short", params=lambda n, m: {"sinks": 0, "local": m - 1, "hash_bits": 30})
    broken = dataclasses.replace(spec, exact_limits=(short,))
    result = _decode.budget_covers_every_key(theory.check_rng(0, "x"), True,
                                             estimators=[("topk", get_spec("topk")), ("my-magicpig", broken)])
    assert not result.passed and result.measured > 1e-3
    # the estimator that fails is named (a plugin's failure must not read as a built-in's)
    assert "estimators (topk, my-magicpig)" in result.details
    assert "worst: my-magicpig " in result.details and "(one key short)" in result.details


def test_the_collision_check_rejects_a_wrong_exponent():
    result = _decode.magicpig_collision_probability(theory.check_rng(0, "x"), True, exponent_offset=1)
    assert not result.passed and result.measured > theory.MC_K_SE


def test_the_budget_check_rejects_half_the_budget():
    """b at half the theorem's size puts epsilon D at z / sqrt(2) standard deviations: P(|Z| > 0.91) = 0.36, far
    above delta + the Berry-Esseen term (0.24)."""
    result = _decode.vattention_clt_budget(theory.check_rng(0, "x"), True, budget_scale=0.5)
    assert not result.passed and result.measured > theory.MC_K_SE


def test_the_budget_check_measures_the_packages_denominator(monkeypatch):
    """A denominator estimate 2 % high (every draw's weight, as a wrong n_s / b would make it) violates epsilon = 1 %
    nearly always: the check reads the package's log_denominator, not a copy of its own."""
    import math

    from randattn.estimators.vattention import batched

    honest = batched.log_denominator
    monkeypatch.setattr(batched, "log_denominator", lambda *a, **kw: honest(*a, **kw) + math.log(1.02))
    result = _decode.vattention_clt_budget(theory.check_rng(0, "x"), True)
    assert not result.passed and result.measured > theory.MC_K_SE


def test_the_collision_check_false_alarms_as_its_exact_binomial_test_says():
    """The SimHash agreement counts are binomial, and at 2.8 rad a quick run expects 6.4 of 5,000: with the replicate
    SE, a run that saw 1 agreement was z = -5.4, a failure in 1.2 % of correct runs (and |z| > 3 in about 6 %).
    Tested exactly, 400 quick runs must go past 3.0 no more often than normal z-scores would: 6 x 2 P(|Z| > 3)
    per run, 6.5 expected (the exact test's discreteness only lowers it); 16 or more has Poisson probability
    0.1 %. Measured: 7."""
    from scipy.stats import norm, poisson

    from randattn import theory
    from randattn.theory import _decode

    runs, threshold = 400, 3.0
    expected = runs * len(_decode.SIMHASH_ANGLES) * 2 * norm.sf(threshold)
    over = sum(_decode.magicpig_collision_probability(theory.check_rng(seed, "decode.magicpig-collision-probability"),
                                                      True).measured > threshold for seed in range(runs))
    assert poisson.sf(15, expected) < 0.002
    assert over <= 15, (over, expected)


# ------------------------------------------------------------------- MagicPIG: the package's sampler and weights
INCLUSION = "decode.magicpig-inclusion-probability"


def _weights_off_by_one(x, y, hyperplanes, *, min_collisions, **kw):
    """The package's sample, weighted by -log P[Bin(L, P) >= c - 1]: the reviewer's break of the weights."""
    import numpy as np

    from randattn.estimators.magicpig.reference import select

    honest = select(x, y, hyperplanes, min_collisions=min_collisions, **kw)
    loose = select(x, y, hyperplanes, min_collisions=min_collisions - 1, **kw)
    return dataclasses.replace(honest, log_weights=np.where(honest.sampled, -loose.log_inclusion, honest.log_weights),
                               log_inclusion=loose.log_inclusion)


def _samples_on_one_table_less(x, y, hyperplanes, **kw):
    """Collisions counted over the first L - 1 tables, weights -log u of all L: right weights, wrong sample."""
    import numpy as np

    from randattn.estimators.magicpig.reference import select

    honest = select(x, y, hyperplanes, **kw)
    short = select(x, y, hyperplanes[..., :-1, :, :], **kw)
    log_weights = np.where(honest.exact, 0.0, np.where(short.sampled, -honest.log_inclusion, -np.inf))
    return dataclasses.replace(honest, sampled=short.sampled, collisions=short.collisions, log_weights=log_weights)


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_inclusion_check_passes_for_the_package(seed, quick):
    result = _decode.magicpig_inclusion_probability(theory.check_rng(seed, INCLUSION), quick)
    assert result.passed and result.tested == 10, result.details
    assert result.measured <= 1e-13  # the weights agree to roundings; the row shows the closed form's gap
    assert "exact keys 0 and unsampled -inf" in result.details


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_inclusion_check_rejects_weights_for_one_collision_less(seed):
    """-log P[Bin >= 1] for -log P[Bin >= 2]: the weights of every key are off by far more than 1e-10."""
    result = _decode.magicpig_inclusion_probability(theory.check_rng(seed, INCLUSION), True,
                                                    select=_weights_off_by_one)
    assert not result.passed and result.measured > 0.1, result.details
    assert "(FAILED); Monte Carlo vs the package" in result.details and "(ok;" in result.details


def test_the_inclusion_check_reads_the_packages_log_inclusion_probability(monkeypatch):
    """The default select is the package's, whose weights come from log_inclusion_probability: the same break made
    there (min_collisions off by one) fails the check."""
    from randattn.estimators.magicpig import reference

    honest = reference.log_inclusion_probability
    monkeypatch.setattr(reference, "log_inclusion_probability", lambda log_p, tables, c: honest(log_p, tables, c - 1))
    result = _decode.magicpig_inclusion_probability(theory.check_rng(0, INCLUSION), True)
    assert not result.passed and result.measured > 0.1, result.details


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_inclusion_check_rejects_a_sample_on_one_table_less(seed):
    """Right weights, collisions over L - 1 = 7 tables: u falls by up to 0.08 (0.61 -> 0.53 at 1.6 rad), up to 12
    binomial SEs of a quick run; the closed form holds, the Monte Carlo part fails and its |z| is the row's value."""
    result = _decode.magicpig_inclusion_probability(theory.check_rng(seed, INCLUSION), True,
                                                    select=_samples_on_one_table_less)
    assert not result.passed and result.measured > theory.MC_K_SE, result.details
    assert "(ok); Monte Carlo vs the package" in result.details and "(FAILED;" in result.details


@pytest.mark.slow  # 300 quick runs: about 6 s on two cores
def test_the_inclusion_check_false_alarms_as_its_exact_binomial_test_says():
    """300 quick runs of the correct package test 10 binomial counts each: |z| > 3 should come up about
    300 x 10 x 2 P(|Z| > 3) = 8.1 times (fewer: the exact test is discrete); 18 or more has Poisson probability
    0.1 %. No run fails (|z| > 4.5). Measured: 4 over 3, none failed, max |z| = 3.3."""
    import re

    from scipy.stats import norm, poisson

    runs, threshold = 300, 3.0
    expected = runs * len(_decode.INCLUSION_ANGLES) * 2 * norm.sf(threshold)
    over = failed = 0
    for seed in range(runs):
        result = _decode.magicpig_inclusion_probability(theory.check_rng(seed, INCLUSION), True)
        failed += not result.passed
        largest = re.search(r"Monte Carlo vs the package: ([0-9.e+-]+) <=", result.details).group(1)
        over += float(largest) > threshold
    assert poisson.sf(17, expected) < 0.002
    assert failed == 0 and over <= 17, (failed, over, expected)


def test_the_budget_check_holds_the_packages_adaptive_rule_to_the_formula(monkeypatch):
    """The Monte Carlo part fixes b, so the rule that sizes b from a base sample (``sample_size``) went untested:
    a normal quantile divided by 3 (b 9 times too small) passed every check. The closed-form part now compares the
    rule with the bound written out, on base samples where the cap, the bound and the floor each set b."""
    from randattn.estimators.vattention import reference

    import re

    honest = _decode.vattention_clt_budget(theory.check_rng(0, "x"), True)
    sizes = [int(b) for b in re.search(r"b = ([0-9, ]+)\)", honest.details).group(1).split(", ")]
    base = [b0 for _ in _decode.BUDGET_RULE_EPSILONS for b0 in _decode.BUDGET_BASE_SIZES]
    assert honest.passed and 1012 in sizes, honest.details  # the cap n_s
    assert any(b == b0 for b, b0 in zip(sizes, base)) and any(b0 < b < 1012 for b, b0 in zip(sizes, base)), sizes
    quantile = reference.normal_quantile
    monkeypatch.setattr(reference, "normal_quantile", lambda delta, which: quantile(delta, which) / 3)
    broken = _decode.vattention_clt_budget(theory.check_rng(0, "x"), True)
    assert not broken.passed and broken.measured > 0.5, broken
    monkeypatch.undo()
    floored = lambda *a, **kw: reference.sample_size(*a, **{**kw, "rounding": "floor"})  # noqa: E731
    floor = _decode.vattention_clt_budget(theory.check_rng(0, "x"), True, sample_size=floored)
    assert not floor.passed and floor.measured > 1e-3  # one draw short where the bound sets b


def test_the_inclusion_check_rejects_weights_on_the_exact_keys():
    """The sink and the local key are read exactly, weight 1 (log 0): a sampler that weighs them otherwise, with
    every sampled key's weight right, fails the check's closed-form part."""
    import numpy as np

    from randattn.estimators.magicpig import reference

    def heavy_sink(*args, **kwargs):
        chosen = reference.select(*args, **kwargs)
        log_weights = np.array(chosen.log_weights, copy=True)
        log_weights[..., 0] = np.log(2.0)
        return dataclasses.replace(chosen, log_weights=log_weights)

    result = _decode.magicpig_inclusion_probability(theory.check_rng(0, "x"), True, select=heavy_sink)
    assert not result.passed and "WRONG weights of exact or unsampled keys" in result.details
