"""The conformance kit: every built-in passes it, and each kind of broken estimator fails the check that
guards against it, with a message that says which check and why.

The broken estimators are real ones with one defect planted each (a biased estimator declared unbiased or
consistent, one that peeks at future keys, one that allocates N x M while declaring linear cost, one whose
float32 path computes in half precision). The causal estimators below are written out here, independently of
the package: softmax over the keys ``m <= n + offset + M - N``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.base import Draws, EstimatorSpec, SpecError
from randattn.testing import EstimatorCheckError, check_estimator, parametrize_with_checks

BUILTIN = ["softmax", "rfa", "ra", "lara", "eva", "scatterbrain", "local"]
#: configurations beyond the defaults whose declared facts differ (orthogonal draws, positive LARA weights,
#: EVA's linear code partition, the biased RA)
VARIANTS = [("rfa", {"coupling": "orthogonal"}), ("lara", {"weighting": "balance"}),
            ("eva", {"partition": "reference-code", "chunk_weight": "mean-key"}), ("ra", {"variant": "biased"})]


@parametrize_with_checks([*BUILTIN, *VARIANTS])
def test_builtin_estimators_conform(estimator, check):
    check(estimator)


# ------------------------------------------------------------------------------------------------ causal softmax
def _causal_softmax_spec(name: str, offset: int, *, causal_batched=None) -> EstimatorSpec:
    """Exact causal softmax with key m visible to query n iff m <= n + offset + (M - N); offset 0 is correct.

    ``causal_batched(logits, keep) -> out``, when given, replaces the batched form's masked softmax (a planted
    defect that only a causal call runs)."""

    def draw(q_shape, k_shape, *, num_samples=None, replicates=1, rng, mask=None):
        return Draws({"slots": np.zeros((replicates, 0))}, replicates)

    def visible(n, m):
        return np.arange(m)[None, :] <= np.arange(n)[:, None] + offset + (m - n)

    def reference(q, k, v, draws, *, scale=None, mask=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        logits = scale * np.einsum("...nd,...md->...nm", q, k)
        if mask == "causal":
            logits = np.where(visible(q.shape[-2], k.shape[-2]), logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out = np.einsum("...nm,...md->...nd", w / w.sum(-1, keepdims=True), v)
        return np.broadcast_to(out, (draws.replicates, *out.shape)).copy()

    def batched(q, k, v, draws, *, scale=None, mask=None):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
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
                         draw=draw, reference=reference, batched=batched, needs_samples=False,
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
    (_causal_off_by_1e8, {"reference == batched (float64)", "key norms 150-200"}),
    # at key norms 150-200 one key takes nearly all the weight, and doubling another one moves no output visibly
    (_causal_diagonal_counted_twice, {"reference == batched (float64)", "float32 batched"}),
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
        return Draws({"slots": np.zeros((replicates, 0))}, replicates)

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
                         complexity="O(N M D)", params={}, draw=draw, reference=reference, batched=batched,
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
    return dataclasses.replace(spec, name=name, reference=reference or spec.reference,
                               batched=batched or spec.batched, **facts)


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
                     r"standard error [\d.e+-]+;", message), message
    assert "np." not in message, message


def test_a_biased_estimator_declared_consistent_fails_the_convergence_check():
    rfa = randattn.get_spec("rfa")
    # plain QR without the sign fix: orthogonal features whose kernel estimate is biased (ARCHITECTURE sec. 10)
    plain = _wrap(rfa, "rfa-plain-qr-mislabelled", convergence="consistent")
    failed = _failures(plain, {"coupling": "orthogonal-plain-qr"})
    assert set(failed) == {"declared convergence"}
    assert "does not approach exact softmax" in failed["declared convergence"]


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
