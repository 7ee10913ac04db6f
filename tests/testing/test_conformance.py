"""The conformance kit: every built-in passes it, and each kind of broken estimator fails the check that
guards against it, with a message that says which check and why.

The broken estimators are real ones with one defect planted each (a biased estimator declared unbiased or
consistent, one that peeks at future keys, one that allocates N x M while declaring linear cost, one whose
float32 path computes in half precision). The causal estimators below are written out here, independently of
the package: softmax over the keys ``m <= n + offset + M - N``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.base import BatchedForms, Draws, EstimatorSpec, ExactLimit, SpecError
from randattn.testing import EstimatorCheckError, check_estimator, parametrize_with_checks

#: configurations beyond the defaults whose declared facts differ (orthogonal draws, positive LARA weights,
#: EVA's linear code partition, the biased RA, vAttention at a budget below the checks' inputs), with every check;
#: every built-in's defaults, and with -m slow every registered variant, run the kit in
#: tests/estimators/test_common.py
VARIANTS = [("rfa", {"coupling": "orthogonal"}), ("lara", {"weighting": "balance"}),
            ("eva", {"partition": "reference-code", "chunk_weight": "mean-key"}), ("ra", {"variant": "biased"}),
            # vAttention's defaults (128 sinks, 128 local keys) are exact on every check's input, where the checks of
            # the masks, keys used, the limits and the query blocks are skipped as such: a small budget runs them
            ("vattention", {"sinks": 1, "local": 2, "top_k": 2, "epsilon": 0.2, "delta": 0.2, "base_rate": 0.25})]


@parametrize_with_checks(VARIANTS)
def test_builtin_variants_conform(estimator, check):
    check(estimator)


# ------------------------------------------------------------------------------------------------ causal softmax
def _causal_softmax_spec(name: str, offset: int, *, causal_batched=None) -> EstimatorSpec:
    """Exact causal softmax with key m visible to query n iff m <= n + offset + (M - N); offset 0 is correct.

    ``causal_batched(logits, keep) -> out``, when given, replaces the batched form's masked softmax (a planted
    defect that only a causal call runs)."""

    def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng, mask=None):
        return Draws({"slots": np.zeros((replicates, *q_shape[:-2], 0))}, replicates)

    def visible(n, m):
        return np.arange(m)[None, :] <= np.arange(n)[:, None] + offset + (m - n)

    def checked(scale, d):
        from randattn._validation import check_scale

        return check_scale(scale, d)

    def reference(q, k, v, draws, *, scale=None, mask=None):
        scale = checked(scale, q.shape[-1])
        logits = scale * np.einsum("...nd,...md->...nm", q, k)
        if mask == "causal":
            logits = np.where(visible(q.shape[-2], k.shape[-2]), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out = np.einsum("...nm,...md->...nd", w / w.sum(-1, keepdims=True), v)
        return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()

    def batched(q, k, v, draws, *, scale=None, mask=None):
        scale = checked(scale, q.shape[-1])
        logits = scale * q @ k.transpose(-1, -2)
        if mask == "causal":
            keep = torch.as_tensor(visible(q.shape[-2], k.shape[-2]), device=q.device)
            if causal_batched is not None:
                out = causal_batched(logits, keep) @ v
                return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
            logits = logits.masked_fill(~keep, float("-inf"))
        out = torch.softmax(logits, -1) @ v
        return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()

    return EstimatorSpec(name=name, summary="causal softmax (test)", source="test", complexity="O(N M D)", params={},
                         draw=draw, reference=reference, forms=BatchedForms(estimate=batched), needs_samples=False,
                         is_random=lambda p: False, convergence="exact", normalized=True, masks=(None, "causal"))


def test_a_correct_causal_estimator_passes_prefix_invariance():
    report = check_estimator(_causal_softmax_spec("causal-softmax", 0))
    assert {r.check: r.status for r in report.results}["causal prefix invariance"] == "passed"


@pytest.mark.parametrize(("offset", "expected"), [
    (1, "uses keys its mask hides"),        # m <= n + 1: peeks one key ahead
    (-1, "query 0 sees key 0 only"),        # m < n: query 0 sees nothing (NaN), every other query one key short
])
def test_an_off_by_one_causal_mask_fails(offset, expected):
    with pytest.raises(EstimatorCheckError) as info:
        check_estimator(_causal_softmax_spec("off-by-one", offset))
    failed = {r.check: r.message for r in info.value.report.failures}
    assert "causal prefix invariance" in failed and expected in failed["causal prefix invariance"]


def _causal_off_by_1e8(logits, keep):
    """The right masked softmax, times 1 + 1e-8: a disagreement only the float64 comparison can see."""
    return torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) * (1 + 1e-8)


def _causal_diagonal_counted_twice(logits, keep):
    """A weighting bug: the last visible key of each query (its own token) weighs twice. It reads no hidden key,
    and the last query's weights still sum to one, so prefix invariance and query 0's check cannot see it."""
    n, m = logits.shape[-2:]
    own = torch.arange(m)[None, :] == torch.arange(n)[:, None] + (m - n)
    logits = logits + torch.log(torch.tensor(2.0, dtype=logits.dtype)) * own
    return torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)


@pytest.mark.parametrize(("defect", "failing"), [
    (_causal_off_by_1e8, {"reference == batched (float64)", "key norms 150-200", "ViT-like norms"}),
    # at key norms 150-200 one key takes nearly all the weight, and doubling another one moves no output visibly
    (_causal_diagonal_counted_twice, {"reference == batched (float64)", "float32 batched", "ViT-like norms"}),
], ids=["off-by-1e-8", "diagonal-counted-twice"])
def test_a_batched_form_wrong_only_under_the_causal_mask_fails(defect, failing):
    """Both defects live in the causal branch of batched only; the kit compares batched with the reference under
    every mask the spec declares, so the bidirectional comparisons pass and the causal ones fail, naming the mask."""
    failed = _failures(_causal_softmax_spec("causal-only-defect", 0, causal_batched=defect))
    assert set(failed) == failing
    for check in failing:
        assert "mask='causal'" in failed[check] and "not close" in failed[check], failed[check]
        assert "np." not in failed[check], failed[check]  # plain numbers: (0, 1, 2), not (np.int64(0), ...)


# ------------------------------------------------------------------------------------------------ discrete selection
def _hard_attention_spec(selection: str, *, second_best: bool = False) -> EstimatorSpec:
    """Hard attention: each query returns the value of its highest-scoring key (a top-1 selection, written out
    here). ``second_best`` plants a defect: batched returns the runner-up's value instead."""

    def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng):
        return Draws({"slots": np.zeros((replicates, *q_shape[:-2], 0))}, replicates)

    def reference(q, k, v, draws, *, scale=None):
        best = np.argmax(np.einsum("...nd,...md->...nm", q, k), -1)
        out = np.take_along_axis(v, best[..., None], -2)
        return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()

    def batched(q, k, v, draws, *, scale=None):
        scores = q @ k.transpose(-1, -2)
        pick = scores.topk(2, -1).indices[..., 1] if second_best else scores.argmax(-1)
        out = torch.gather(v, -2, pick[..., None].expand(*pick.shape, v.shape[-1]))
        return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()

    return EstimatorSpec(name="hard-attention", summary="top-1 hard attention (test)", source="test",
                         complexity="O(N M D)", params={}, draw=draw, reference=reference,
                         forms=BatchedForms(estimate=batched),
                         needs_samples=False, is_random=lambda p: False, selection=selection)


@pytest.fixture
def near_tied_keys(monkeypatch):
    """The kit's inputs, rounded to float32, with key 1 = key 0 (1 + 1e-9): float32 rounds the two to the same
    key (1e-9 is below half an ulp, 6e-8), so its argmax takes key 0 (torch returns the first maximum), while
    float64 sees key 1 score higher wherever key 0's score is positive, which it is where the pair wins."""
    from randattn.testing import checks

    original = checks._inputs

    def inputs(shapes, seed, scale=1.0):
        q, k, v = (np.asarray(a, dtype=np.float32).astype(np.float64) for a in original(shapes, seed, scale))
        k[..., 1, :] = k[..., 0, :] * (1 + 1e-9)
        return q, k, v

    monkeypatch.setattr(checks, "_inputs", inputs)


def _float32_check(spec):
    report = check_estimator(spec, checks=["float32 batched"], raise_on_failure=False)
    return report.results[0]


def test_a_discrete_selection_declared_continuous_fails_at_near_ties(near_tied_keys):
    """The near tie is real: compared row for row, float32 picks other keys than the float64 reference."""
    result = _float32_check(_hard_attention_spec("continuous"))
    assert result.status == "failed" and "not close" in result.message


def test_a_declared_discrete_selection_compares_near_ties_like_with_like(near_tied_keys):
    """The rows where float32 took key 0 match the reference with q and k perturbed by float32-sized amounts."""
    assert _float32_check(_hard_attention_spec("discrete")).status == "passed"


def test_a_declared_discrete_selection_still_fails_a_wrong_selection(near_tied_keys):
    """Taking the runner-up everywhere moves rows whose reference no float32-sized perturbation moves."""
    result = _float32_check(_hard_attention_spec("discrete", second_best=True))
    assert result.status == "failed" and "selection='discrete'" in result.message
    assert "so this is no near tie" in result.message and "np." not in result.message, result.message


# ------------------------------------------------------------------------------------------------ planted defects
def _wrap(spec: EstimatorSpec, name: str, *, reference=None, batched=None, **facts) -> EstimatorSpec:
    """``spec`` renamed, with its forms replaced; a new batched form drops the optional probability forms (they
    would describe the original estimator)."""
    forms = {} if batched is None else {"forms": BatchedForms(estimate=batched)}
    return dataclasses.replace(spec, name=name, reference=reference or spec.reference, **forms, **facts)


def _failures(spec, params=None):
    with pytest.raises(EstimatorCheckError) as info:
        check_estimator(spec, params)
    return {r.check: r.message for r in info.value.report.failures}


def test_a_biased_estimator_declared_unbiased_fails_the_convergence_check():
    ra = randattn.get_spec("ra")
    # the mean-field proposal of eq. 31 (biased RA) under the unbiased estimator's name
    biased = _wrap(ra, "ra-mislabelled",
                   reference=lambda *a, **p: ra.reference(*a, **{**p, "variant": "biased"}),
                   batched=lambda *a, **p: ra.batched(*a, **{**p, "variant": "biased"}))
    failed = _failures(biased)
    assert set(failed) == {"declared convergence"}
    assert "declared unbiased" in failed["declared convergence"]
    # plain numbers: "element (1, 2)", not "(np.int64(1), np.int64(2))"; the difference itself, which six digits of
    # the mean and the exact value may not show
    message = failed["declared convergence"]
    assert re.search(r"at element \(\d+, \d+\) \(mean -?[\d.e+-]+, exact -?[\d.e+-]+, difference -?[\d.e+-]+, "
                     r"standard error [\d.e+-]+, at least the rounding floor [\d.e+-]+;", message), message
    assert "np." not in message, message


def test_a_biased_estimator_declared_consistent_fails_the_convergence_check():
    rfa = randattn.get_spec("rfa")
    # plain QR without the sign fix: orthogonal features whose kernel estimate is biased (ARCHITECTURE sec. 10)
    plain = _wrap(rfa, "rfa-plain-qr-mislabelled", convergence="consistent")
    failed = _failures(plain, {"coupling": "orthogonal-plain-qr"})
    assert set(failed) == {"declared convergence"}
    assert "does not approach exact softmax" in failed["declared convergence"]


def test_a_key_budget_with_a_constant_bias_declared_consistent_fails_the_convergence_check():
    """Exact softmax plus 0.2 wherever the budget S leaves keys out (S < M), S in the draws as top-k's: a constant
    bias at every S below M. The check compares S = 4 with S = 32 on M = 128 keys, so that the larger budget does not
    cover every key (where the estimate is exact and any bias below M would pass unseen)."""
    softmax, topk = randattn.get_spec("softmax"), randattn.get_spec("topk")

    def offset(out, k, draws):
        budget = draws["budget"]
        budget = float(np.asarray(budget.cpu() if hasattr(budget, "cpu") else budget).ravel()[0])
        return out + 0.2 * (budget < k.shape[-2])

    def reference(q, k, v, draws, *, scale=None, mask=None):
        return offset(softmax.reference(q, k, v, draws, scale=scale, mask=mask), k, draws)

    def batched(q, k, v, draws, *, scale=None, mask=None):
        return offset(softmax.batched(q, k, v, draws, scale=scale, mask=mask), k, draws)

    spec = dataclasses.replace(softmax, name="budget-offset", draw=topk.draw, needs_samples=True, reference=reference,
                               forms=BatchedForms(estimate=batched), convergence="consistent")
    report = check_estimator(spec, checks=["declared convergence"], raise_on_failure=False)
    assert report.results[0].status == "failed" and "does not approach exact softmax" in report.results[0].message


def test_an_n_by_m_allocation_declared_linear_fails_the_memory_check():
    rfa = randattn.get_spec("rfa")

    def quadratic(q, k, v, draws, **params):
        scores = q @ k.transpose(-1, -2)  # an N x M array a linear estimator must never hold
        return rfa.batched(q, k, v, draws, **params) + 0.0 * scores.sum()

    failed = _failures(_wrap(rfa, "rfa-quadratic", batched=quadratic))
    assert set(failed) == {"no N x M memory"}
    assert "allocates an N x M array" in failed["no N x M memory"]


def test_a_float32_path_in_half_precision_fails_the_float32_check():
    rfa = randattn.get_spec("rfa")

    def half(q, k, v, draws, **params):
        if q.dtype == torch.float32:
            q, k, v = (t.half().float() for t in (q, k, v))
        return rfa.batched(q, k, v, draws, **params)

    failed = _failures(_wrap(rfa, "rfa-half", batched=half))
    assert "float32 batched" in failed and "not close" in failed["float32 batched"]
    assert "reference == batched (float64)" not in failed


def test_a_batched_form_that_disagrees_in_float64_fails():
    lara = randattn.get_spec("lara")
    off = _wrap(lara, "lara-off", batched=lambda *a, **p: lara.batched(*a, **p) * (1 + 1e-8))
    failed = _failures(off)
    assert "reference == batched (float64)" in failed and "not close" in failed["reference == batched (float64)"]


def test_an_invalid_spec_fails_validation_with_every_problem_listed():
    bad = dataclasses.replace(randattn.get_spec("rfa"), name="Bad:Name", convergence="sometimes", masks=("causal",),
                              selection="fuzzy")
    with pytest.raises(SpecError) as info:
        randattn.estimators.validate_spec(bad)
    message = str(info.value)
    assert "name 'Bad:Name'" in message and "'sometimes'" in message and "masks" in message
    assert "selection of the defaults is 'fuzzy'; allowed: continuous, discrete" in message
    report = check_estimator(bad, raise_on_failure=False)
    assert [r.check for r in report.failures] == ["spec is valid"] or "spec is valid" in [r.check for r in report.failures]


def test_assert_close_names_the_worst_element_in_plain_numbers():
    """Index and values as python prints them, with the digits that tell 0.4274710001 from 0.427471."""
    from randattn.testing import assert_close

    expected = np.zeros((2, 3))
    expected[1, 2] = 0.427471
    actual = expected.copy()
    actual[1, 2] = 0.4274710001
    with pytest.raises(AssertionError) as info:
        assert_close(actual, expected, atol=1e-12, what="x:")
    assert "worst at index (1, 2): actual 0.4274710001, expected 0.427471, |diff| 1.000e-10" in str(info.value)
    nan = actual.copy()
    nan[0, 1] = np.nan
    with pytest.raises(AssertionError, match=r"NaN in one array only at \(0, 1\): actual nan, expected 0.0"):
        assert_close(nan, expected, atol=1.0)


# ------------------------------------------------------------------------------------------------------ keys used
def _visible_counts(off_by: int):
    """keys_used of exact softmax: every visible key (M, or n + 1 + M - N under the causal mask), plus ``off_by``."""

    def keys_used(q, k, draws, *, scale=None, mask=None):
        n, m = q.shape[-2], k.shape[-2]
        counts = torch.arange(1, n + 1, dtype=torch.float64) + (m - n) if mask == "causal" else torch.full((n,), m)
        counts = counts.to(torch.float64) + off_by
        return counts.expand(draws.replicates, *q.shape[:-2], n).clone()

    return keys_used


def test_a_true_keys_used_passes_and_an_off_by_one_count_fails():
    right = dataclasses.replace(_causal_softmax_spec("counted-softmax", 0), keys_used=_visible_counts(0))
    assert check_estimator(right).passed
    wrong = dataclasses.replace(_causal_softmax_spec("miscounted-softmax", 0), keys_used=_visible_counts(1))
    with pytest.raises(EstimatorCheckError, match=r"keys used.*says 10 keys .* but the estimate gives 9 keys"):
        check_estimator(wrong)


def test_a_promise_outside_the_unit_interval_is_an_invalid_spec():
    spec = dataclasses.replace(_causal_softmax_spec("promising-softmax", 0), promise=lambda p: (0.1, 1.5))
    with pytest.raises(SpecError, match=r"promise must give \(epsilon, delta\) in \(0, 1\) or None, got \(0.1, 1.5\)"):
        randattn.estimators.base.validate_spec(spec)


# ---------------------------------------------------------------------------------------------- log denominator
def _log_normaliser(defect: str = ""):
    """log_denominator of exact softmax: the logsumexp of the visible logits (written out here), or with a
    planted ``defect``: ``"+1%"`` (the normaliser 1% high), ``"float32"`` (the wrong dtype), ``"unshifted"``
    (exp before log: inf at large norms)."""

    def log_denominator(q, k, draws, *, scale=None, mask=None):
        n, m = q.shape[-2], k.shape[-2]
        logits = (q.shape[-1] ** -0.5 if scale is None else scale) * (q @ k.transpose(-1, -2))
        if mask == "causal":
            logits = logits.masked_fill(~torch.as_tensor(np.arange(m)[None, :] <= np.arange(n)[:, None] + m - n),
                                        float("-inf"))
        logs = (torch.exp(logits).sum(-1).log() if defect == "unshifted" else torch.logsumexp(logits, dim=-1))
        logs = logs + math.log(1.01) if defect == "+1%" else logs
        logs = logs.to(torch.float32) if defect == "float32" else logs
        return logs.expand(draws.replicates, *logs.shape).clone()

    return log_denominator


def _denominator_softmax(name: str, defect: str = "") -> EstimatorSpec:
    return dataclasses.replace(_causal_softmax_spec(name, 0), log_denominator=_log_normaliser(defect),
                               exact_limits=(ExactLimit("always: it is softmax attention"),),
                               promise=lambda p: (0.1, 0.1), promise_on="denominator")


@pytest.mark.parametrize(("defect", "words"), [
    ("+1%", r"log_denominator in the exact limit 'always: it is softmax attention' \(N=12, M=12\)"),
    ("float32", "log_denominator must return a float64 torch tensor, got torch.float32"),
    ("unshifted", r"log_denominator at key norms 150-200: \d+ of \d+ values not finite"),
])
def test_a_true_log_denominator_passes_and_each_planted_defect_fails(defect, words):
    assert _only(_denominator_softmax("normalised-softmax"), "log denominator").status == "passed"
    result = _only(_denominator_softmax("misnormalised-softmax", defect), "log denominator")
    assert result.status == "failed" and re.search(words, result.message), result.message


def test_a_denominator_promise_without_log_denominator_is_an_invalid_spec():
    spec = dataclasses.replace(_denominator_softmax("denominator-softmax"), log_denominator=None)
    with pytest.raises(SpecError, match="promise an accuracy of the denominator but the spec declares no "
                                        "log_denominator"):
        randattn.estimators.base.validate_spec(spec)
    with pytest.raises(SpecError, match="promise_on of the defaults is 'numerator'; allowed: output, denominator"):
        randattn.estimators.base.validate_spec(dataclasses.replace(spec, promise_on="numerator"))


# ------------------------------------------------------------------------------------------------ optional forms
def _only(spec, check, params=None):
    """The one result of ``check`` on ``spec``."""
    return check_estimator(spec, params, checks=[check], raise_on_failure=False).results[0]


def test_the_optional_forms_are_skipped_where_not_declared():
    lara = randattn.get_spec("lara")
    bare = dataclasses.replace(lara, name="lara-bare", forms=BatchedForms(estimate=lara.batched))
    for check in ("probabilities", "with probabilities", "float32 probabilities", "probability factors",
                  "with keys used"):
        result = _only(bare, check)
        assert result.status == "skipped" and "declares no forms." in result.message, (check, result)


def test_probabilities_transposed_where_square_fail():
    """The implied probabilities of the keys by the queries instead of the queries by the keys: the shapes agree
    where N = M, the values do not."""
    lara = randattn.get_spec("lara")

    def transposed(q, k, draws, **params):
        probs = lara.forms.get("probabilities")(q, k, draws, **params)
        return probs.transpose(-1, -2) if probs.shape[-1] == probs.shape[-2] else probs

    spec = dataclasses.replace(lara, name="lara-transposed", forms=lara.forms.replace(probabilities=transposed))
    result = _only(spec, "probabilities")
    assert result.status == "failed" and "N=M=29" in result.message and "not close" in result.message, result


def test_probabilities_of_the_wrong_shape_fail():
    lara = randattn.get_spec("lara")
    flat = lambda q, k, draws, **params: lara.forms.get("probabilities")(q, k, draws, **params)[0]  # noqa: E731
    result = _only(dataclasses.replace(lara, name="lara-one-replicate", forms=lara.forms.replace(probabilities=flat)),
                   "probabilities")
    assert result.status == "failed" and "expected a torch.float64 tensor of shape (3, 2, 3, 13, 11)" in result.message


def test_a_one_pass_form_that_reorders_a_sum_fails():
    """``out = probabilities @ v``: the same estimate to rounding, but not batched's bits (another summation)."""
    lara = randattn.get_spec("lara")

    def reordered(q, k, v, draws, **params):
        probs = lara.forms.get("probabilities")(q, k, draws, **params)
        return probs @ v, probs

    result = _only(dataclasses.replace(lara, name="lara-reordered",
                                       forms=lara.forms.replace(estimate_with_probabilities=reordered)),
                   "with probabilities")
    assert result.status == "failed" and "not the same bits as the separate call" in result.message, result
    assert "output" in result.message


def test_a_one_pass_form_that_drops_a_warning_fails():
    """batched warns (as signed LARA weights warn of a non-positive normalizer); a one-pass form computed with
    warnings silenced gives the same bits but hides the warning."""
    softmax = _causal_softmax_spec("warning-softmax", 0)

    def batched(q, k, v, draws, **params):
        warnings.warn("a normalizer is not positive", RuntimeWarning)
        return softmax.batched(q, k, v, draws, **params)

    def probabilities(q, k, draws, **params):
        m = k.shape[-2]
        return softmax.batched(q, k, torch.eye(m, dtype=k.dtype).expand(*k.shape[:-1], m), draws, **params)

    def silent(q, k, v, draws, **params):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return batched(q, k, v, draws, **params), probabilities(q, k, draws, **params)

    def loud(q, k, v, draws, **params):
        return batched(q, k, v, draws, **params), probabilities(q, k, draws, **params)

    for one_pass, status in ((loud, "passed"), (silent, "failed")):
        spec = dataclasses.replace(softmax, forms=BatchedForms(estimate=batched, probabilities=probabilities,
                                                               estimate_with_probabilities=one_pass))
        result = _only(spec, "with probabilities")
        assert result.status == status, result
    assert "warned [], but batched and forms.probabilities warn ['a normalizer is not positive']" in result.message


def _magicpig_small():
    """MagicPIG configured to sample among the kit's small inputs (its defaults keep every key exact there)."""
    return randattn.get_spec("magicpig"), {"sinks": 1, "local": 2, "hash_bits": 2}


def test_a_one_pass_form_that_counts_a_key_it_does_not_read_fails():
    """MagicPIG's one hashing gives the estimate, its probabilities and the keys each query read; a form that
    counts one key too many per query (the sampled keys plus every exact key again, say) is refused by name."""
    magicpig, params = _magicpig_small()
    assert _only(magicpig, "with keys used", params).status == "passed"
    one_pass = magicpig.forms.get("estimate_with_probabilities_and_keys_used")

    def overcounted(q, k, v, draws, **kwargs):
        out, probs, counts = one_pass(q, k, v, draws, **kwargs)
        return out, probs, counts + 1

    spec = dataclasses.replace(magicpig, name="magicpig-overcounted",
                               forms=magicpig.forms.replace(estimate_with_probabilities_and_keys_used=overcounted))
    result = _only(spec, "with keys used", params)
    assert result.status == "failed", result
    assert "keys_used on" in result.message and "not the same bits as the separate call" in result.message


def test_a_one_pass_form_whose_log_denominator_is_a_rounding_off_fails():
    """vAttention's one selection gives its estimate, probabilities, keys used and log-denominator; a form whose
    log-denominator differs from the separate call's by one rounding (summed in the input dtype, not float64) is
    refused: the violation count of its promise must not depend on the path the sweep took."""
    vattention = randattn.get_spec("vattention")
    params = vattention.variants["adaptive-small"]
    assert _only(vattention, "with log denominator", params).status == "passed"
    form = "estimate_with_probabilities_keys_used_and_log_denominator"
    one_pass = vattention.forms.get(form)

    def rounded(q, k, v, draws, **kwargs):
        out, probs, counts, logs = one_pass(q, k, v, draws, **kwargs)
        return out, probs, counts, logs.to(q.dtype).to(torch.float64) + (0 if q.dtype == torch.float32 else 1e-15)

    spec = dataclasses.replace(vattention, name="vattention-rounded", forms=vattention.forms.replace(**{form: rounded}))
    result = _only(spec, "with log denominator", params)
    assert result.status == "failed", result
    assert ("forms.estimate_with_probabilities_keys_used_and_log_denominator' log_denominator on" in result.message
            and "not the same bits as the separate call" in result.message), result.message
    with pytest.raises(SpecError, match="estimate_with_probabilities_keys_used_and_log_denominator but the spec "
                                        "declares no keys_used or no log_denominator"):
        randattn.estimators.base.validate_spec(dataclasses.replace(vattention, name="vattention-unlogged",
                                                                   log_denominator=None))


def test_a_one_pass_keys_used_form_without_keys_used_is_an_invalid_spec():
    magicpig, _ = _magicpig_small()
    with pytest.raises(SpecError, match="estimate_with_probabilities_and_keys_used but the spec declares no "
                                        "keys_used"):
        randattn.estimators.base.validate_spec(dataclasses.replace(magicpig, name="magicpig-uncounted",
                                                                   keys_used=None))


@pytest.mark.parametrize("shrink", [0.0, 1e-3])
def test_a_float32_bound_that_is_too_small_fails(shrink):
    """LARA's bound holds (its own check passes); shrunk, the float32 probabilities leave it."""
    lara = randattn.get_spec("lara")
    assert _only(lara, "float32 probabilities").status == "passed"

    def small(*args, **params):
        out, probs, bound = lara.forms.get("estimate_with_float32_probabilities")(*args, **params)
        return out, probs, bound * shrink

    result = _only(dataclasses.replace(lara, name="lara-small-bound",
                                       forms=lara.forms.replace(estimate_with_float32_probabilities=small)),
                   "float32 probabilities")
    assert result.status == "failed" and "the bound does not bound the rounding" in result.message, result


def test_a_float32_form_whose_output_is_not_batched_fails():
    lara = randattn.get_spec("lara")

    def rounded(*args, **params):
        out, probs, bound = lara.forms.get("estimate_with_float32_probabilities")(*args, **params)
        return out.float().double(), probs, bound

    result = _only(dataclasses.replace(lara, name="lara-rounded-out",
                                       forms=lara.forms.replace(estimate_with_float32_probabilities=rounded)),
                   "float32 probabilities")
    assert result.status == "failed" and "output" in result.message and "same bits" in result.message, result


def test_factors_whose_product_misses_a_row_fail():
    rfa = randattn.get_spec("rfa")

    def missing_row(*args, **params):
        result = rfa.forms.get("estimate_with_probability_factors")(*args, **params)
        if result is None:
            return None
        out, left, right = result
        left = left.clone()
        left[..., -1, :] = 0  # the last query's row of left @ right is zero, not its probabilities
        return out, left, right

    spec = dataclasses.replace(rfa, name="rfa-missing-row",
                               forms=rfa.forms.replace(estimate_with_probability_factors=missing_row))
    result = _only(spec, "probability factors")
    assert result.status == "failed" and "left @ right against the probabilities" in result.message, result


def test_factors_outside_the_unit_interval_fail():
    rfa = randattn.get_spec("rfa")

    def scaled(*args, **params):
        out, left, right = rfa.forms.get("estimate_with_probability_factors")(*args, **params)
        return out, left / 2, right * 2  # the same product; right's key softmax no longer in [0, 1]

    result = _only(dataclasses.replace(rfa, name="rfa-scaled-factors",
                                       forms=rfa.forms.replace(estimate_with_probability_factors=scaled)),
                   "probability factors", {"feature_map": "positive"})
    assert result.status == "failed" and "right factor entry" in result.message and "outside [0, 1]" in result.message


def test_factors_for_a_configuration_without_them_skip():
    result = _only(randattn.get_spec("rfa"), "probability factors", {"feature_map": "trigonometric"})
    assert result.status == "skipped" and "returns None" in result.message


# ------------------------------------------------------------------------------------------------ seeds, replicates
def test_replicates_that_share_their_draws_fail():
    rfa = randattn.get_spec("rfa")

    def shared_draw(q_shape, k_shape, *, replicates, **kwargs):
        one = rfa.draw(q_shape, k_shape, replicates=1, **kwargs)
        return Draws({key: np.repeat(a, replicates, axis=0) for key, a in one.arrays.items()}, replicates)

    result = _only(dataclasses.replace(rfa, name="rfa-shared-replicates", draw=shared_draw), "replicates")
    assert result.status == "failed" and "replicates share their draws" in result.message, result


def test_a_deterministic_estimator_that_depends_on_the_seed_fails():
    """Exact softmax plus noise from the draws, declared deterministic."""
    softmax = _causal_softmax_spec("noisy-softmax", 0)

    def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng, mask=None):
        return Draws({"noise": rng.standard_normal((replicates, 1))}, replicates)

    def reference(q, k, v, draws, **params):
        return softmax.reference(q, k, v, draws, **params) + 1e-3 * draws["noise"][(...,) + (None,) * (q.ndim - 1)]

    def batched(q, k, v, draws, **params):
        return softmax.batched(q, k, v, draws, **params) + 1e-3 * draws["noise"][(...,) + (None,) * (q.dim() - 1)]

    spec = dataclasses.replace(softmax, draw=draw, reference=reference, forms=BatchedForms(estimate=batched),
                               convergence="none")
    result = _only(spec, "seeded reproducibility")
    assert result.status == "failed" and "depends on the seed" in result.message, result


def test_a_random_estimator_exact_at_the_kits_size_may_ignore_the_seed():
    """Declared random, but every key is covered by its deterministic part at 64 tokens (vAttention's 128 sink and
    128 local keys): no random variable reaches the output, and seeds 7 and 8 rightly give the same bits."""
    result = _only(randattn.get_spec("vattention"), "seeded reproducibility")
    assert result.status == "passed", result


# ------------------------------------------------------------------------------------------------ ViT-like norms
def test_an_unshifted_exponential_fails_at_vit_like_norms():
    """exp of the logits without subtracting their maximum: float32 overflows at logits near 560."""

    def unshifted(logits, keep):
        weights = torch.exp(logits).masked_fill(~keep, 0.0)
        return weights / weights.sum(-1, keepdim=True)

    spec = _causal_softmax_spec("unshifted-softmax", 0, causal_batched=unshifted)
    result = _only(spec, "ViT-like norms")
    assert result.status == "failed" and "not finite at ViT-like norms, mask='causal'" in result.message, result


# ------------------------------------------------------------------------------------------------ the draws
def _with_draw(name: str, draw, **facts) -> EstimatorSpec:
    """Exact causal softmax (it ignores its draws) with another ``draw``: only the draws' checks can fail."""
    return dataclasses.replace(_causal_softmax_spec(name, 0), draw=draw, **facts)


def test_draws_without_the_batch_dims_fail_the_layout_check():
    def shared_by_the_batch(q_shape, k_shape, *, num_samples=None, replicates=1, rng, mask=None):
        return Draws({"slots": np.zeros((replicates, 0))}, replicates)

    failed = _failures(_with_draw("no-batch-dims", shared_by_the_batch))
    assert set(failed) == {"draws layout"}
    assert "gave 'slots' as ndarray float64 of shape (2, 0); expected a float64 numpy array whose shape starts " \
           "with (replicates, *batch dims) = (2, 2, 3)" in failed["draws layout"]


def test_draws_of_integers_fail_the_layout_check():
    """Draws are float64 (``Draws``: "numpy float64 as drawn"); key indices as int64 are refused by name."""
    def integer_indices(q_shape, k_shape, *, num_samples=None, replicates=1, rng, mask=None):
        return Draws({"idx": np.zeros((replicates, *q_shape[:-2], 2), dtype=np.int64)}, replicates)

    failed = _failures(_with_draw("integer-draws", integer_indices))
    assert set(failed) == {"draws layout"} and "gave 'idx' as ndarray int64 of shape (2, 2, 3, 2)" in failed["draws layout"]


@pytest.mark.parametrize(("rng_use", "expected"), [
    # a method the grid of generators does not have
    (lambda rng, lead: rng.integers(0, 2, size=(*lead, 1)), "raised StackedDrawError: draw() asked its rng for "
                                                             "Generator.integers"),
    # a size that does not start with (replicates, *batch dims)
    (lambda rng, lead: np.broadcast_to(rng.standard_normal(size=(3,)), (*lead, 3)), "raised ValueError"),
    # the grid's sizes, but numbers that mix the replicates: not the one-cell draws stacked
    (lambda rng, lead: rng.standard_normal(size=(*lead, 2)).cumsum(axis=0), "gave another 'slots' for cell 0, replicate 1"),
])
def test_a_draw_declaring_stacked_draw_wrongly_fails_its_check(rng_use, expected):
    def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng, mask=None):
        return Draws({"slots": np.array(rng_use(rng, (replicates, *q_shape[:-2])), dtype=np.float64)}, replicates)

    assert _failures_or_none(_with_draw("stacks-not-declared", draw)) == {}  # one call a cell: every check passes
    failed = _failures(_with_draw("stacks-declared", draw, stacked_draw=True))
    assert set(failed) == {"stacked draw"} and expected in failed["stacked draw"]
    assert "must not declare stacked_draw" in failed["stacked draw"]


def _failures_or_none(spec) -> dict[str, str]:
    try:
        check_estimator(spec)
    except EstimatorCheckError as exc:
        return {r.check: r.message for r in exc.report.failures}
    return {}


# ------------------------------------------------------------------------------------------------ sliding window
def _sliding_softmax_spec(name: str, widen: int, *, smallest: int = 1, batched_window: bool = True) -> EstimatorSpec:
    """Exact softmax declaring every mask; under ``"sliding:W"`` key m is visible to query n iff
    ``n + M - N - W' < m <= n + M - N`` with ``W' = max(W + widen, smallest)`` (written out here): ``widen`` 0 and
    ``smallest`` 1 are correct; ``widen`` 1 peeks one key before the window, -1 drops the window's first key;
    ``smallest`` 2 is a kernel that cannot hold a window of one key. ``batched_window=False``: the torch form
    ignores the window (causal), the reference keeps it."""
    base = _causal_softmax_spec(name, 0)

    def visible(n, m, mask, *, window_kept=True):
        last = np.arange(n)[:, None] + m - n
        keys = np.arange(m)[None, :]
        if mask is None:
            return np.ones((n, m), dtype=bool)
        window = m if mask == "causal" or not window_kept else max(int(mask.split(":")[1]) + widen, smallest)
        return (keys <= last) & (keys > last - window)

    def reference(q, k, v, draws, *, scale=None, mask=None):
        logits = (q.shape[-1] ** -0.5 if scale is None else scale) * np.einsum("...nd,...md->...nm", q, k)
        logits = np.where(visible(q.shape[-2], k.shape[-2], mask), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out = np.einsum("...nm,...md->...nd", w / w.sum(-1, keepdims=True), v)
        return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()

    def batched(q, k, v, draws, *, scale=None, mask=None):
        logits = (q.shape[-1] ** -0.5 if scale is None else scale) * q @ k.transpose(-1, -2)
        keep = torch.as_tensor(visible(q.shape[-2], k.shape[-2], mask, window_kept=batched_window), device=q.device)
        out = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) @ v
        return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()

    return dataclasses.replace(base, reference=reference, forms=BatchedForms(estimate=batched),
                               masks=(None, "causal", "sliding"))


def test_a_correct_sliding_window_passes_and_runs_the_other_checks_under_it():
    report = check_estimator(_sliding_softmax_spec("sliding-softmax", 0))
    assert {r.check: r.status for r in report.results}["sliding window"] == "passed"


@pytest.mark.parametrize(("widen", "expected"), [
    (1, "changed its reference output"),           # sees one key before its window
    (-1, "a window over every key is the causal mask"),  # drops its window's first key
])
def test_an_off_by_one_sliding_window_fails(widen, expected):
    failed = _failures(_sliding_softmax_spec("off-by-one-window", widen))
    assert "sliding window" in failed and expected in failed["sliding window"], failed


def test_a_window_that_cannot_hold_one_key_fails_only_at_a_window_of_one():
    failed = _failures(_sliding_softmax_spec("two-key-window", 0, smallest=2))
    assert set(failed) == {"sliding window"}
    assert "sliding:1 (N=10, M=10): each query sees its own key only" in failed["sliding window"]


def test_a_torch_form_that_ignores_the_window_fails_the_comparisons_run_under_it():
    """Every masked check runs sliding:4 too: reference == batched names the mask where only the torch form is
    wrong, as the sliding-window check does."""
    failed = _failures(_sliding_softmax_spec("torch-without-window", 0, batched_window=False))
    assert "mask='sliding:4'" in failed["reference == batched (float64)"]
    assert "sliding window" in failed


def test_a_spec_declaring_an_unknown_mask_is_invalid():
    with pytest.raises(SpecError, match="masks must be a tuple holding None and optionally 'causal' and 'sliding', "
                                        "got \\(None, 'sliding:4'\\)"):
        randattn.estimators.validate_spec(dataclasses.replace(_causal_softmax_spec("bad-masks", 0),
                                                              masks=(None, "sliding:4")))


# ------------------------------------------------------------------------------------------------ a crash, located
def _reference_with_a_shape_error(q, k, v, draws, *, scale=None, mask=None):
    return np.einsum("...nd,...dm->...nm", q, k)  # k not transposed: the line a plugin author must change


def test_a_crash_inside_an_estimator_names_the_line_that_raised_and_chains_its_traceback():
    """A reference whose shape error numpy raises (its innermost Python frame numpy's einsum): each check it crashes
    names the file, line and function of the estimator's frame, not numpy's nor the kit's, and the pytest form of
    the check raises an AssertionError whose cause is the estimator's exception, so that pytest shows its
    traceback."""
    import inspect

    from randattn.testing import _Check

    spec = dataclasses.replace(_causal_softmax_spec("crashes", 0), reference=_reference_with_a_shape_error)
    line = inspect.getsourcelines(_reference_with_a_shape_error)[1] + 1
    failed = _failures(spec)
    where = f"at {__file__}:{line} in _reference_with_a_shape_error"
    crashed = {check: message for check, message in failed.items() if message.startswith("raised ValueError: ")}
    assert "reference == batched (float64)" in crashed  # (with one key the einsum runs, to a shape the kit refuses)
    assert all(message.endswith(f"({where})") for message in crashed.values()), crashed
    with pytest.raises(AssertionError, match=r"check 'reference == batched \(float64\)' failed") as raised:
        _Check("reference == batched (float64)", {})(spec)
    assert isinstance(raised.value.__cause__, ValueError)


def test_every_check_id_selects_itself_with_pytest_k():
    """Each id of the kit over every variant parses as a ``pytest -k`` expression, selects its own test and no
    other (pytest's own expression grammar and matcher; the check names hold spaces, ``==`` and parentheses, and
    the configurations ``=`` and ``,``, none of which ``-k`` reads)."""
    from _pytest.mark.expression import Expression

    from randattn.testing import all_variants

    configurations = {(name, tuple(params.items())): (name, params) for name, _, params in all_variants()}
    ids = [param.id for param in parametrize_with_checks(configurations.values()).args[1]]
    assert len(set(ids)) == len(ids)
    assert "softmax-reference_eq_batched_float64" in ids
    for one in ids:
        # one name to pytest (its matcher is then asked for the whole id), which as -k selects the tests whose
        # names hold it: its own alone
        assert Expression.compile(one).evaluate(lambda word, one=one: word == one), one
        assert [other for other in ids if one in other] == [one]


def test_an_estimate_that_pools_the_queries_fails_the_query_blocks_check():
    """Softmax of the queries centred on their mean: each row depends on the others present, so queries 4..8
    estimated alone differ from those rows of one call; declared 'independent' (the default) it fails the check
    that randattn mse's query blocks rest on, declared 'proportional' it is skipped (never blocked)."""
    softmax = randattn.get_spec("softmax")

    def centred(q, k, v, draws, **params):
        return softmax.reference(q - np.mean(q, axis=-2, keepdims=True), k, v, draws, **params)

    def centred_batched(q, k, v, draws, **params):
        return softmax.batched(q - q.mean(dim=-2, keepdim=True), k, v, draws, **params)

    pooled = _wrap(softmax, "centred", reference=centred, batched=centred_batched, exact_limits=(),
                   convergence="none")
    result = _only(pooled, "query blocks")
    assert result.status == "failed", result
    assert result.message.startswith("queries 4..8 of 12 with the first 12 keys: estimated alone they differ from "
                                     "those rows of one call over every query (max ")
    assert "query_placement='independent' denies" in result.message
    assert _only(dataclasses.replace(pooled, query_placement="proportional"), "query blocks").status == "skipped"
    assert _only(softmax, "query blocks").status == "passed"


@pytest.mark.parametrize(("name", "params", "noted"), [
    ("vattention", {}, True),  # 128 sinks and 128 local keys cover the checks' 64
    ("vattention", {"sinks": 1, "local": 2, "top_k": 2, "epsilon": 0.2, "delta": 0.2, "base_rate": 0.25}, False),
    ("topk", {}, False),  # S = 16 of 64 keys
    ("softmax", {}, False),  # declared exact: nothing to note
])
def test_a_configuration_exact_on_every_check_input_is_noted(name, params, noted):
    """An H2O-like plugin whose default window of 64 keys read every key of every check's input passed every check
    with its approximation never run (the masks, the query blocks and the convergence saw softmax). The report now
    says so in a note; the checks' verdict is unchanged."""
    from randattn.testing import EXACT_HERE_NOTE

    checks = ["spec is valid", "reference == batched (float64)"]
    report = check_estimator(name, params, checks=checks, raise_on_failure=False)
    assert report.passed
    assert report.notes == ((EXACT_HERE_NOTE,) if noted else ())
    assert ("NOTE    on the checks' inputs" in report.summary()) == noted


def test_an_estimator_that_drops_the_replicate_dim_of_one_replicate_is_told_so():
    """A reference that squeezes R = 1 passed every shape check (they draw 3 replicates) and failed only through
    ``randattn.estimate(replicates=None)``, whose message did not point at the dropped dim."""
    topk = randattn.get_spec("topk")

    def squeezing(q, k, v, draws, **params):
        out = topk.reference(q, k, v, draws, **params)
        return out[0] if out.shape[0] == 1 else out

    report = check_estimator(dataclasses.replace(topk, name="squeezes", reference=squeezing), {},
                             checks=["replicates"], raise_on_failure=False)
    [result] = report.failures
    assert result.message == ("the reference with draws of one replicate returned shape (64, 3); expected (R, N, Dv) "
                              "= (1, 64, 3): the replicate dim stays when R = 1 (randattn removes it for "
                              "replicates=None)")


def test_an_estimate_a_millionth_from_softmax_is_not_noted_exact():
    """The note's test is softmax to 1e-12: an estimate 1e-6 away from it on every entry approximates."""
    from randattn.testing.checks import exact_on_check_inputs

    softmax = randattn.get_spec("softmax")

    def near(q, k, v, draws, **params):
        return softmax.reference(q, k, v, draws, **params) + 1e-6

    assert exact_on_check_inputs(dataclasses.replace(softmax, convergence="none"), {})
    assert not exact_on_check_inputs(dataclasses.replace(softmax, convergence="none", reference=near), {})


def test_a_runtime_warning_of_the_estimator_is_noted_not_swallowed():
    """A plugin's reference took log(0) on every call (numpy's RuntimeWarning 'divide by zero encountered in log')
    and passed every check in silence: the kit silenced every warning to keep randattn's own (non-positive
    denominators) out of the report. Plain RuntimeWarnings are now noted, with their count and first line; the
    verdict is unchanged, and randattn's own estimators raise none (softmax's report has no note)."""
    softmax = randattn.get_spec("softmax")

    def noisy(q, k, v, draws, **params):
        np.log(np.zeros(1))
        return softmax.reference(q, k, v, draws, **params)

    checks = ["reference == batched (float64)", "shapes and dtypes"]
    report = check_estimator(dataclasses.replace(softmax, name="noisy", reference=noisy), checks=checks,
                             raise_on_failure=False)
    assert report.passed
    (note,) = report.notes
    assert note.startswith("the estimator raised RuntimeWarning 'divide by zero encountered in log' ")
    assert f"(first at {__file__}:" in note
    count = int(note.split("' ")[1].split(" time")[0])
    assert count >= 2  # one per reference call: both checks called it
    assert check_estimator("softmax", checks=checks).notes == ()
