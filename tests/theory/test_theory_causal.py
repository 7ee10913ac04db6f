"""The causal-mask propositions of ``randattn verify``, each with a negative control that must fail.

A check that cannot fail verifies nothing: every check of :mod:`randattn.theory._causal` is run
with a broken component injected through its keyword parameter (an estimator that reads later keys,
off-by-one masks, a causal form that drops the query's own key, a window that leaves keys to the
control variates) and must then fail; with the defaults it must pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from randattn import theory
from randattn.theory import _causal
from randattn.estimators.registry import get_spec

CAUSAL = [c for c in theory.registry() if c.name.startswith("causal.")]


def _run(func, name, **broken):
    return func(theory.check_rng(0, name), True, None, **broken)


def test_the_causal_checks_are_registered_as_exact_identities_and_pass():
    assert [c.name for c in CAUSAL] == ["causal.prefix-invariance", "causal.mask-rule",
                                        "causal.last-query-bidirectional", "causal.eva-full-window"]
    for check in CAUSAL:
        assert check.method == "exact identity" and check.func.__doc__
        result = check.run(theory.check_rng(0, check.name), True)
        assert result.passed, (check.name, result.details)
        assert result.name == check.name


def test_the_loop_is_softmax_over_the_visible_keys_written_out():
    """The loop the checks trust, against a hand count: N = 2 queries over M = 3 keys, last visible 1 and 2."""
    q = np.array([[1.0, 0.0], [0.0, 1.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = np.array([[1.0], [2.0], [4.0]])
    out = _causal.loop_causal_softmax(q, k, v, 1.0)
    # query 0 sees keys 0, 1: logits 1, 0; query 1 sees keys 0..2: logits 0, 1, 1
    e = math.e
    np.testing.assert_allclose(out[0, 0], (e * 1.0 + 1.0 * 2.0) / (e + 1.0), rtol=1e-15)
    np.testing.assert_allclose(out[1, 0], (1.0 * 1.0 + e * 2.0 + e * 4.0) / (1.0 + 2 * e), rtol=1e-15)


def test_prefix_invariance_fails_for_an_estimator_that_reads_later_keys():
    def bidirectional(spec, q, k, v, draws, params, scale, mask="causal"):
        return _causal.run_reference(spec, q, k, v, draws, params, scale, mask=None)  # ignores the mask

    result = _run(_causal.prefix_invariance, "causal.prefix-invariance", run=bidirectional, run_fast=None)
    assert not result.passed and result.measured > 0
    assert "changed by" in result.details


def test_prefix_invariance_is_bit_exact_a_last_bit_change_fails():
    """The reference must be bit-identical: a change of one part in 1e15 in a protected output fails."""
    def nudged(spec, q, k, v, draws, params, scale, mask="causal"):
        out = _causal.run_reference(spec, q, k, v, draws, params, scale)
        return out * (1.0 + 1e-15 * (np.abs(k).max() > 5.0))  # junk keys are large: the output moves a last bit

    result = _run(_causal.prefix_invariance, "causal.prefix-invariance", run=nudged, run_fast=None,
                  estimators=["softmax"])
    assert not result.passed and 0 < result.measured < 1e-13


@pytest.mark.parametrize("last_key", [lambda n, nq, nk: n + nk - nq - 1, lambda n, nq, nk: n + nk - nq + 1],
                         ids=["m<n", "m<=n+1"])
def test_mask_rule_fails_for_off_by_one_masks(last_key):
    def visible(n_q, n_k):
        return np.array([[j <= last_key(n, n_q, n_k) for j in range(n_k)] for n in range(n_q)])

    assert not _run(_causal.mask_rule, "causal.mask-rule", visible=visible).passed

    def softmax_off_by_one(q, k, v, scale):
        # M > N keeps every row non-empty for m < n + M - N; for N == M row 0 would be empty: give it key 0
        safe = lambda n, nq, nk: max(last_key(n, nq, nk), 0)  # noqa: E731
        return {"off-by-one softmax": _causal.loop_causal_softmax(q, k, v, scale, last_key=lambda n, nq, nk: min(
            safe(n, nq, nk), nk - 1))}

    result = _run(_causal.mask_rule, "causal.mask-rule", implementations=softmax_off_by_one)
    assert not result.passed and result.measured > 1e-3


def test_last_query_check_fails_when_the_causal_form_drops_the_query_own_key():
    def drops_own_key(spec, q, k, v, draws, params, scale, mask="causal"):
        if mask is None:
            return _causal.run_reference(spec, q, k, v, draws, params, scale, mask=None)
        # "causal" as m < n + M - N: the last query misses the last key
        out = _causal.loop_causal_softmax(q, k, v, scale, last_key=lambda n, nq, nk: max(n + nk - nq - 1, 0))
        return np.broadcast_to(out, (draws.replicates, *out.shape))

    result = _run(_causal.last_query_is_bidirectional, "causal.last-query-bidirectional", run=drops_own_key,
                  estimators=["softmax"])
    assert not result.passed and result.measured > 1e-3


def test_eva_full_window_fails_when_the_window_leaves_keys_to_the_control_variates():
    if not get_spec("eva").supports_mask("causal"):
        pytest.skip("eva does not declare mask='causal' here")
    result = _run(_causal.eva_full_window_is_causal_softmax, "causal.eva-full-window",
                  params_for=lambda n, m: {"window": 2, "layout": "sequence", "partition": "paper"})
    assert not result.passed and result.measured > 1e-6


def test_eva_full_window_is_skipped_with_its_reason_when_the_estimator_has_no_causal_form():
    """LARA refuses mask='causal' (its landmarks pool every token): the check says so and does not fail."""
    result = _run(_causal.eva_full_window_is_causal_softmax, "causal.eva-full-window", estimator="lara")
    assert result.skipped and result.passed and math.isnan(result.measured)
    assert "does not declare mask='causal'" in result.details
    assert result.as_dict()["skipped"] is True
    missing = _run(_causal.eva_full_window_is_causal_softmax, "causal.eva-full-window", estimator="no-such")
    assert missing.skipped and "not registered" in missing.details


def test_verify_shows_a_skipped_check_without_failing(monkeypatch):
    from click.testing import CliRunner

    from randattn.cli import main

    def skipped(rng, quick, data):
        """Skips."""
        return theory.CheckResult("x.skip", float("nan"), 0.0, True, "skipped: nothing to check here", skipped=True)

    monkeypatch.setattr(theory, "registry", lambda: (theory.Check("x.skip", "claim", "src", "closed form", skipped),))
    result = CliRunner().invoke(main, ["verify", "--quick"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "1 of 1 checks passed (1 skipped: x.skip)" in " ".join(result.output.split())
