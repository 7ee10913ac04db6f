"""``verify`` checks package behaviour against an independent ground truth (issue #13, issue #11 item 9).

Negative controls here break the *package* (monkeypatched estimator code), never functions
local to the theory module, and the checks must then fail.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from scipy.special import softmax

from randattn import theory
from randattn.theory import _base, _eva, _lara, _performer, _stability
from randattn.estimators import _prepare

CHECKS = theory.registry()


def _run(pattern, **kw):
    return theory.run_checks(theory.select_checks(CHECKS, pattern), seed=0, quick=True, **kw)


def test_exact_attention_is_the_written_out_softmax(rng):
    q, k, v = rng.standard_normal((5, 3)), rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    scale = 0.3
    expected = np.array([sum(np.exp(scale * q[n] @ k[m]) * v[m] for m in range(4))
                         / sum(np.exp(scale * q[n] @ k[m]) for m in range(4)) for n in range(5)])
    np.testing.assert_allclose(_base.exact_attention(q, k, v, scale), expected, rtol=1e-13)


def test_theory_module_does_not_use_the_package_softmax_or_input_preparation():
    import inspect

    for module in (_base, _eva, _lara, _performer, _stability):
        source = inspect.getsource(module)
        assert "softmax_ref" not in source and "prepare_reference" not in source, module.__name__


# ---------------------------------------------------------------------------------------
# a wrong temperature convention, planted consistently in every estimator (reference and batched)

_REFERENCE = ["softmax", "rfa", "ra", "lara", "eva", "scatterbrain", "local"]


def _wrong_prepare(original):
    def prepare(q, k, v, scale):
        x, y, v, s, batch = original(q, k, v, scale)
        return x * s**0.5, y * s**0.5, v, s, batch  # logits scale^2 q.k instead of scale q.k
    return prepare


@pytest.fixture
def wrong_temperature(monkeypatch):
    for name in _REFERENCE:
        ref = importlib.import_module(f"randattn.estimators.{name}.reference")
        monkeypatch.setattr(ref, "prepare_reference", _wrong_prepare(_prepare.prepare_reference))
        bat = importlib.import_module(f"randattn.estimators.{name}.batched")
        monkeypatch.setattr(bat, "prepare_batched", _wrong_prepare(_prepare.prepare_batched))


@pytest.mark.parametrize("name", ["eva.G.1.softmax-window", "eva.G.1.softmax-C=M", "lara.prop3.2.ra-unbiased",
                                  "numerics.large-norm-stability"])
def test_checks_against_the_exact_softmax_catch_a_wrong_temperature(wrong_temperature, name):
    (result,) = _run(name)
    assert not result.passed, result.details


# ---------------------------------------------------------------------------------------
# numerical stability


def test_stability_check_passes_and_covers_every_registered_estimator():
    from randattn.estimators.registry import list_estimators

    (result,) = _run("numerics.large-norm-stability")
    assert result.passed, result.details
    assert result.tested == len(list_estimators())


def test_the_full_stability_check_runs_every_variant_on_the_tokens_its_layout_holds():
    """Without ``--quick`` every registered variant runs too: the patch-grid ones (``grid="3x4"`` and one prefix
    token: 13 tokens; ``"3x5"``: 15; ``"2x2"`` and five: 9; ``"8x8"``: 64) refuse the 12 tokens of the others, and
    the full ``randattn verify`` failed on a fresh clone. Each runs on as many tokens as its layout holds, and the
    check passes."""
    from randattn.estimators.registry import get_spec, list_estimators

    (result,) = theory.run_checks(theory.select_checks(CHECKS, "numerics.large-norm-stability"), seed=0, quick=False)
    assert result.passed, result.details
    assert result.tested == sum(len({"default": {}, **get_spec(name).variants}) for name in list_estimators())
    assert "N = M = 12 (9, 13, 15, 64 for the patch-grid variants)" in result.details


def test_stability_gives_a_plugin_torch_draws_and_names_one_that_raises():
    """A registered plugin whose torch form reads its draws as tensors (``.to``) is measured as the kit measures it
    (the draws converted, as ``randattn.check`` and ``randattn.estimate`` give them); one that raises fails the check
    by name, and the other estimators are still measured."""
    import importlib.util
    from dataclasses import replace
    from pathlib import Path

    from randattn.estimators.base import BatchedForms
    from randattn.estimators.registry import register_estimator, unregister_estimator

    location = importlib.util.spec_from_file_location(
        "_uniform_keys", Path(__file__).resolve().parents[1] / "analysis" / "_uniform_keys.py")
    module = importlib.util.module_from_spec(location)
    location.loader.exec_module(module)
    register_estimator(module.SPEC)  # its batched form calls draws["idx"].long()
    try:
        (result,) = _run("numerics.large-norm-stability")
        assert result.passed, result.details
    finally:
        unregister_estimator(module.NAME)

    def raises(q, k, v, draws, **params):
        raise RuntimeError("planted")

    register_estimator(replace(module.SPEC, name="raises-keys", forms=BatchedForms(estimate=raises)))
    try:
        (result,) = _run("numerics.large-norm-stability")
    finally:
        unregister_estimator("raises-keys")
    assert not result.passed and "raises-keys[default]: raised RuntimeError: planted" in result.details
    assert "worst: raises-keys[default] raised;" in result.details  # not the worst of those that ran
    problems = [part for part in result.details.split("; ") if "[default]:" in part]
    assert problems == ["raises-keys[default]: raised RuntimeError: planted"]  # the built-ins measured and passing


def test_stability_compares_with_the_ground_truth_what_the_spec_declares_exact():
    from dataclasses import replace

    from randattn.estimators.registry import get_spec, register_estimator, unregister_estimator

    assert _stability._is_exact("softmax", {}) and not _stability._is_exact("rfa", {})
    assert not _stability._is_exact("not-installed", {})
    register_estimator(replace(get_spec("softmax"), name="myexact"))
    try:
        assert _stability._is_exact("myexact", {})
    finally:
        unregister_estimator("myexact")


def test_stability_check_fails_for_a_softmax_without_the_max_shift(monkeypatch):
    """A plain exp overflows at key norms >= 150: the package's softmax reference made naive."""
    from randattn.estimators.softmax import reference as softmax_ref

    def naive_softmax(logits, axis=-1):
        with np.errstate(over="ignore", invalid="ignore"):
            e = np.exp(logits)
            return e / e.sum(axis, keepdims=True)

    monkeypatch.setattr(softmax_ref, "softmax", naive_softmax)
    (result,) = _run("numerics.large-norm-stability")
    assert not result.passed and "softmax[default]" in result.details


# ---------------------------------------------------------------------------------------
# closed forms checked against the package's Monte Carlo behaviour


def _eva_with_unit_sigma_ratio(monkeypatch):
    """The importance ratio of the package's EVA computed as if sigma were 1 (the path tests used to take)."""
    from randattn.estimators.eva import reference as eva_ref

    original = eva_ref.log_proposal_ratio
    monkeypatch.setattr(eva_ref, "log_proposal_ratio", lambda omega, mu, sigma: original(omega, mu, 1.0))


@pytest.mark.parametrize("name", ["eva.prop2.eq10-minimizer", "eva.lemma3.partition"])
def test_chunk_coefficient_checks_fail_when_the_package_eva_is_broken(monkeypatch, name):
    (good,) = _run(name)
    assert good.passed, good.details
    _eva_with_unit_sigma_ratio(monkeypatch)
    (bad,) = _run(name)
    assert not bad.passed and "FAILED" in bad.details, bad.details


def test_chunk_coefficient_checks_fail_for_a_wrong_closed_form(rng):
    """Shared mean instead of chunk means: the package's EVA does not estimate it."""
    def shared(x_n, y, v, chunks):
        p = softmax(y @ x_n)
        return np.stack([p @ v for _ in chunks])

    samples, targets, _ = _eva.package_chunk_coefficients_mc(rng, True, shared)
    assert not _base.mc_unbiased_result("x", samples, targets, "x").passed


def test_printed_theorem2_check_fails_when_the_package_features_are_broken(monkeypatch):
    from randattn.estimators.features import reference as fr

    original = fr.positive_log_features
    monkeypatch.setattr(fr, "positive_log_features", lambda x, omega: (original(1.3 * x, omega)[0], None))
    (result,) = _run("performer.thm2.printed-bound-infeasible")
    assert not result.passed and "FAILED" in result.details


# ---------------------------------------------------------------------------------------
# issue #11 item 9: rare mixture components


def _rare_component_head():
    """4 queries; key 0 holds 99.97% of each query's mass, key 1 the rest; values 0 and 10.

    Keys of norm 6 (orthogonal): f_n(omega) is then (almost) exactly v_0 whenever the dominant
    component is drawn, so the sample SE is ~0 when the rare one is not drawn (R S pi = 0.6 draws
    expected in quick mode) while the mean is off by 3e-4 x 10.
    """
    d = 8
    k = np.zeros((3, d))
    k[0, 0], k[1, 1], k[2, 2] = 6.0, 6.0, 6.0
    gap = np.log(0.9997 / 0.0003)  # logit gap for pi = (0.9997, 0.0003, ~0)
    q = np.zeros((4, d))
    q[:, 0] = gap / 6.0
    q[:, 2] = -3.0  # key 2 negligible
    q[:, 3:] = np.random.default_rng(0).standard_normal((4, d - 3))  # distinct queries, no effect on pi
    v = np.zeros((3, 2))
    v[1] = [10.0, -10.0]
    return _base.HeadData(q, k, v, 1.0, "rare component")


def test_ra_check_has_its_false_alarm_rate_with_a_rare_mixture_component():
    """Before the SE floor, the RA check failed on most seeds (max |z| ~ 1e9) although RA is unbiased."""
    data = _base.VerifyData((_rare_component_head(),), "synthetic rare component")
    outputs = []

    def recording(*args):
        out = _lara.ra_paper_noise(*args)
        outputs.append(out.reshape(out.shape[0], -1))
        return out

    failures, plain_failures = 0, 0
    for seed in range(12):
        result = _lara.prop32_ra_unbiased(np.random.default_rng(seed), True, data, ra_estimate=recording)
        failures += not result.passed
        head = data.heads[0]
        exact = _base.exact_attention(head.q, head.k, head.v, head.scale).ravel()
        z, _ = _base.z_scores(outputs[-1], exact)  # the plain sample SE
        plain_failures += np.abs(z).max() > _base.MC_K_SE
    assert plain_failures >= 6, "the rare-component situation is not reproduced"
    assert failures == 0


def test_rare_component_floor_is_zero_without_rare_components_and_bounds_the_count_noise():
    pi = np.array([[0.5, 0.5, 0.0], [0.9997, 0.0003, 0.0]])
    v = np.array([[0.0, 1.0], [10.0, 1.0], [5.0, 1.0]])
    floor = _base.rare_component_se_floor(pi, v, 2000)
    assert (floor[0] == 0).all()  # every component drawn ~1000 times (the zero-mass one contributes 0)
    np.testing.assert_allclose(floor[1], [np.sqrt(0.0003 / 2000) * 10.0, 0.0])
