"""The batched forms of a spec (``BatchedForms``): declared capabilities, asked for by name, and the keywords of
the earlier protocol (``batched=``, ``batched_probabilities=``, ...), which still build a working spec with a
DeprecationWarning naming the new way."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pandas as pd
import pytest

import randattn
from randattn.activations import make_activations
from randattn.analysis.masking import diagnostics_skip_reason, takes_mask
from randattn.analysis.plan import SweepConfig, parse_estimator_list
from randattn.analysis.sweep import run_sweep
from randattn.estimators import OPTIONAL_FORMS, BatchedForms, EstimatorSpec, ImportanceWeights, validate_spec
from randattn.estimators.base import SpecError
from randattn.estimators.registry import register_estimator, unregister_estimator
from randattn.testing import check_estimator

RFA = randattn.get_spec("rfa")
#: the fields of RFA's spec other than its forms, to build specs of either protocol around its functions
RFA_FACTS = {f.name: getattr(RFA, f.name) for f in dataclasses.fields(RFA) if f.name not in ("name", "forms")}


def _estimate(*args, **params):
    raise AssertionError("not called")


def _probabilities(*args, **params):
    raise AssertionError("not called")


def _legacy_spec(name: str, **legacy) -> EstimatorSpec:
    """RFA's spec written to the earlier protocol: its forms as separate keywords."""
    with pytest.warns(DeprecationWarning, match=r"forms=BatchedForms\("):
        return EstimatorSpec(name=name, **RFA_FACTS, **legacy)


def _counting(calls: dict, name: str, function):
    def counted(*args, **params):
        calls[name] = calls.get(name, 0) + 1
        return function(*args, **params)

    return counted


# ------------------------------------------------------------------------------------------------ the forms object
def test_declared_forms_are_asked_for_by_name():
    forms = BatchedForms(estimate=_estimate, probabilities=_probabilities)
    assert forms.declared == ("probabilities",)
    assert forms.has("probabilities") and not forms.has("estimate_with_probability_factors")
    assert forms.get("probabilities") is _probabilities
    assert set(OPTIONAL_FORMS) == {"probabilities", "estimate_with_probabilities",
                                   "estimate_with_float32_probabilities", "estimate_with_probability_factors",
                                   "estimate_with_probabilities_and_keys_used",
                                   "estimate_with_probabilities_keys_used_and_log_denominator"}
    assert BatchedForms(_estimate).declared == ()


def test_an_undeclared_form_is_a_lookup_error_naming_the_declared_ones():
    forms = BatchedForms(estimate=_estimate, probabilities=_probabilities)
    with pytest.raises(LookupError, match=r"'estimate_with_probabilities' is not declared \(declared: "
                                          r"probabilities\)"):
        forms.get("estimate_with_probabilities")
    with pytest.raises(LookupError, match=r"declared: none"):
        BatchedForms(_estimate).get("probabilities")


@pytest.mark.parametrize("ask", ["has", "get"])
def test_an_unknown_form_name_is_refused_listing_the_names(ask):
    forms = BatchedForms(estimate=_estimate, probabilities=_probabilities)
    with pytest.raises(ValueError, match=r"form='batched_probabilities' is not allowed; choose one of "
                                         r"'probabilities', 'estimate_with_probabilities'"):
        getattr(forms, ask)("batched_probabilities")


@pytest.mark.parametrize("form", ["estimate", *OPTIONAL_FORMS])
def test_a_form_that_is_not_callable_is_refused_when_declared(form):
    given = {"estimate": _estimate, form: "yes"}
    with pytest.raises(TypeError, match=rf"BatchedForms: {form} must be callable.*got str"):
        BatchedForms(**given)


def test_replace_declares_and_withdraws_forms():
    forms = BatchedForms(estimate=_estimate, probabilities=_probabilities)
    changed = forms.replace(probabilities=None, estimate_with_probabilities=_probabilities)
    assert changed.declared == ("estimate_with_probabilities",) and forms.declared == ("probabilities",)
    with pytest.raises(TypeError, match="estimate_with_probability_factors must be callable"):
        forms.replace(estimate_with_probability_factors=1)


def test_a_spec_holds_its_forms_and_batched_is_their_estimate():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert RFA.batched is RFA.forms.estimate
        assert RFA.forms.declared == ("probabilities", "estimate_with_probabilities",
                                      "estimate_with_probability_factors")


def test_validate_spec_refuses_forms_of_another_type():
    spec = EstimatorSpec(name="no-forms", **{**RFA_FACTS, "forms": "rfa"})
    with pytest.raises(SpecError, match="forms must be a randattn.estimators.BatchedForms, got str"):
        validate_spec(spec)


# ------------------------------------------------------------------------------------------------ the earlier protocol
def test_the_old_keywords_build_the_same_spec_and_warn_naming_the_new_way():
    with pytest.warns(DeprecationWarning) as caught:
        old = EstimatorSpec(name="rfa", **RFA_FACTS, batched=RFA.batched,
                            batched_probabilities=RFA.forms.probabilities,
                            batched_with_probabilities=RFA.forms.estimate_with_probabilities,
                            batched_with_probability_factors=RFA.forms.estimate_with_probability_factors)
    (warning,) = caught
    assert str(warning.message) == (
        "EstimatorSpec(batched=, batched_probabilities=, batched_with_probabilities=, "
        "batched_with_probability_factors=) is deprecated; declare the batched forms in one object, "
        "EstimatorSpec(..., forms=BatchedForms(estimate=..., probabilities=..., estimate_with_probabilities=..., "
        "estimate_with_probability_factors=...))")
    assert warning.filename == __file__  # the caller's line, not randattn's
    assert old == RFA and validate_spec(old) is old


def test_the_batched_estimate_by_position_still_builds_a_spec():
    positional = [RFA.name, RFA.summary, RFA.source, RFA.complexity, RFA.params, RFA.draw, RFA.reference]
    with pytest.warns(DeprecationWarning, match=r"EstimatorSpec\(batched=\) is deprecated"):
        old = EstimatorSpec(*positional, RFA.batched)
    assert old.forms == BatchedForms(estimate=RFA.batched)
    with pytest.warns(DeprecationWarning, match=r"forms=BatchedForms\(probabilities=\.\.\.\)"):
        mixed = EstimatorSpec(*positional, RFA.batched, batched_probabilities=_probabilities)
    assert mixed.forms == BatchedForms(estimate=RFA.batched, probabilities=_probabilities)


def test_the_old_field_names_still_read_with_a_warning():
    old = _legacy_spec("old", batched=_estimate, batched_probabilities=_probabilities)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert old.batched is _estimate  # the main form: no warning
    with pytest.warns(DeprecationWarning, match=r"EstimatorSpec.batched_probabilities is deprecated; ask "
                                                r"spec.forms.has\('probabilities'\) and spec.forms.get"):
        assert old.batched_probabilities is _probabilities
    with pytest.warns(DeprecationWarning, match="estimate_with_float32_probabilities"):
        assert old.batched_with_float32_probabilities is None  # undeclared reads as None, as it did


def test_replacing_an_old_field_replaces_that_form():
    with pytest.warns(DeprecationWarning, match=r"EstimatorSpec\(batched_with_probabilities=\)"):
        spec = dataclasses.replace(RFA, batched_with_probabilities=None)
    assert spec.forms == RFA.forms.replace(estimate_with_probabilities=None)
    with pytest.warns(DeprecationWarning, match=r"EstimatorSpec\(batched=\)"):
        spec = dataclasses.replace(RFA, batched=_estimate)
    assert spec.batched is _estimate and spec.forms.declared == RFA.forms.declared


def test_an_old_protocol_spec_passes_the_kit_on_its_optional_forms():
    old = _legacy_spec("rfa-old-protocol", batched=RFA.batched, batched_probabilities=RFA.forms.probabilities,
                       batched_with_probabilities=RFA.forms.estimate_with_probabilities,
                       batched_with_probability_factors=RFA.forms.estimate_with_probability_factors)
    checks = ["spec is valid", "probabilities", "with probabilities", "probability factors"]
    report = check_estimator(old, checks=checks)
    assert {r.check: r.status for r in report.results} == dict.fromkeys(checks, "passed")


def _sweep(spec: EstimatorSpec) -> pd.DataFrame:
    register_estimator(spec)
    try:
        rng = np.random.default_rng(3)
        # 33 queries and S = 2: the factored probability error pays (16 S <= N), in float32 (dtype auto)
        arrays = {0: tuple(rng.normal(size=(1, 2, 33, 4)) for _ in range(3))}
        acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic"})
        config = SweepConfig(estimators=parse_estimator_list(spec.name), num_samples=(2,), replicates=3, seed=0,
                             diagnostics=False, probabilities=True, dtype="auto")
        table = run_sweep(acts, config)
    finally:
        unregister_estimator(spec.name)
    return table.drop(columns=[c for c in table.columns if "seconds" in c or "time" in c])


@pytest.mark.parametrize("form", ["estimate_with_probabilities", "estimate_with_probability_factors"])
def test_an_old_protocol_spec_runs_in_a_sweep_through_its_forms(form):
    """The sweep finds the old keywords' forms (it calls them) and gives the table of the new declaration."""
    calls: dict = {}
    keyword = {"estimate_with_probabilities": "batched_with_probabilities",
               "estimate_with_probability_factors": "batched_with_probability_factors"}[form]
    old = _legacy_spec("forms-probe", batched=RFA.batched, batched_probabilities=RFA.forms.probabilities,
                       **{keyword: _counting(calls, form, RFA.forms.get(form))})
    assert old.forms.has(form) and calls == {}
    old_table = _sweep(old)
    assert calls.get(form, 0) > 0, calls
    assert old_table["prob_mse"].notna().all()
    new = dataclasses.replace(old, forms=BatchedForms(RFA.batched, **{name: RFA.forms.get(name) for name in
                                                                       old.forms.declared}))
    pd.testing.assert_frame_equal(old_table, _sweep(new))


# ------------------------------------------------------------------------------------------------ masks of the weights
def _weights(masks=(None,)) -> ImportanceWeights:
    return ImportanceWeights(reference=RFA.importance_weights.reference, batched=RFA.importance_weights.batched,
                             applies=RFA.importance_weights.applies, masks=masks)


@pytest.mark.parametrize(("masks", "skipped"), [((None,), True), ((None, "causal"), False),
                                                (lambda params: (None, "causal"), False)])
def test_diagnostics_under_a_mask_follow_the_declared_masks_of_the_weights(masks, skipped):
    spec = dataclasses.replace(RFA, importance_weights=_weights(masks))
    params = spec.resolve_params({})
    assert diagnostics_skip_reason(spec, params, None) is None
    reason = diagnostics_skip_reason(spec, params, "causal")
    assert (reason is not None) == skipped
    if skipped:
        assert "not computed under mask='causal'" in reason and "takes no mask" in reason


def test_the_builtin_weights_declare_bidirectional_masks_only():
    for name in ("rfa", "lara"):
        spec = randattn.get_spec(name)
        assert spec.importance_weights.masks_of(spec.resolve_params({})) == (None,)


@pytest.mark.parametrize("masks", [("causal",), (None, "sliding:4"), ()])
def test_validate_spec_refuses_weights_masks_outside_the_protocol(masks):
    spec = dataclasses.replace(RFA, importance_weights=_weights(masks))
    with pytest.raises(SpecError, match="importance_weights.masks must be a tuple holding None"):
        validate_spec(spec)


def test_takes_mask_still_reads_a_signature_and_warns():
    def with_mask(q, *, mask=None):
        return q

    with pytest.warns(DeprecationWarning, match=r"takes_mask is deprecated.*ImportanceWeights\(masks=\.\.\.\)"):
        assert takes_mask(with_mask)
    with pytest.warns(DeprecationWarning):
        assert not takes_mask(lambda q: q) and not takes_mask(None)


@pytest.mark.parametrize("name", sorted(set(randattn.list_estimators()) - {"lara"}))
@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_precision_inputs_are_refused_by_the_batched_forms(name, half):
    """``randattn.estimate`` refused half precision; the batched forms took it, and float16 logits of norms ~300
    overflowed 65,504 into a silent NaN (bfloat16 met a TypeError from numpy in the sparse families). LARA, whose
    signed weights are computed in float64 from any input dtype, is the one family that takes them."""
    import torch

    spec = randattn.get_spec(name)
    dtype = getattr(torch, half)
    q, k, v = (torch.as_tensor(a, dtype=dtype) for a in np.random.default_rng(45).normal(size=(3, 16, 8)))
    params = {}
    draws = spec.draw(q.shape, k.shape, num_samples=16 if spec.needs_samples_of(params) else None,
                      rng=np.random.default_rng(46))  # 16: a whole Quest page
    with pytest.raises(TypeError, match=rf"q, k and v are torch.{half}: the batched forms compute in torch.float32 "
                                        r"or torch.float64 .*convert them, e.g. q.float\(\)"):
        spec.batched(q, k, v, draws.to_torch())
