"""What the deterministic selection estimators (top-k, StreamingLLM, Quest) share, checked on each: batched == reference
in float64 in the decode regime, the implied probabilities, keys_used in both forms and by hand, the exact limit in
decode, large norms, no host reads on an accelerator, the budget draws and the parameters refused in estimate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators import quest, streaming, topk
from randattn.estimators.base import Draws
from randattn.testing import TOLERANCES, assert_close

#: (id, spec, reference module, params, S)
CONFIGURATIONS = [
    ("topk", topk.SPEC, topk.reference, {}, 7),
    ("streaming", streaming.SPEC, streaming.reference, {}, 8),
    ("quest", quest.SPEC, quest.reference, {"page_size": 4}, 8),
    ("quest-keep", quest.SPEC, quest.reference, {"page_size": 4, "current_page": "keep"}, 8),
]
#: (id, q shape, k shape, v shape): decode (3 queries over 40 keys) and batched self-attention with a partial page
SHAPES = [("decode-N3-M40", (3, 6), (40, 6), (40, 2)), ("b2-N13-M13", (2, 13, 5), (2, 13, 5), (2, 13, 3))]
MASKS = [None, "causal"]


def _case(config, shape, mask, norm=1.0):
    _, spec, ref, params, budget = config
    _, q_shape, k_shape, v_shape = shape
    rng = np.random.default_rng(len(q_shape) * 100 + q_shape[-2])
    q, k, v = rng.standard_normal(q_shape) * norm, rng.standard_normal(k_shape) * norm, rng.standard_normal(v_shape)
    kw = {"mask": mask} if mask else {}
    draws = spec.draw(q.shape, k.shape, num_samples=budget, replicates=2, **params, **kw)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    return spec, ref, {**params, **kw}, (q, k, v, draws), (t(q), t(k), t(v), draws.to_torch())


@pytest.fixture(params=CONFIGURATIONS, ids=[c[0] for c in CONFIGURATIONS])
def config(request):
    return request.param


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_batched_matches_reference_with_probabilities_and_keys_used(config, shape, mask):
    """float64, same draws: outputs and probabilities to 1e-10 (ARCHITECTURE sec. 3), keys_used equal; the
    probabilities are the output with v = I, estimate_with_probabilities gives the separate calls' bits."""
    spec, ref, params, (q, k, v, draws), (tq, tk, tv, tdraws) = _case(config, shape, mask)
    atol, rtol = TOLERANCES["float64"]
    out = spec.batched(tq, tk, tv, tdraws, **params)
    assert out.shape == (2, *q.shape[:-1], v.shape[-1])
    assert_close(out, ref.estimate(q, k, v, draws, **params), atol=atol, rtol=rtol, what="batched vs reference:")
    probabilities = spec.forms.get("probabilities")(tq, tk, tdraws, **params)
    assert_close(probabilities, ref.probabilities(q, k, draws, **params), atol=atol, rtol=rtol,
                 what="batched probabilities vs reference:")
    identity = np.broadcast_to(np.eye(k.shape[-2]), (*k.shape[:-2], k.shape[-2], k.shape[-2]))
    assert_close(ref.estimate(q, k, identity, draws, **params), probabilities, atol=atol, rtol=rtol,
                 what="reference with v = I vs batched probabilities:")
    both = spec.forms.get("estimate_with_probabilities")(tq, tk, tv, tdraws, **params)
    assert torch.equal(both[0], out) and torch.equal(both[1], probabilities)
    used = spec.keys_used(tq, tk, tdraws, **params)
    assert used.dtype == torch.float64 and used.shape == (2, *q.shape[:-1])
    assert np.array_equal(used.numpy(), ref.keys_used(q, k, draws, **params))
    assert np.array_equal(used.numpy(), (probabilities > 0).sum(-1).numpy())
    assert (used.numpy() <= config[4]).all()


@pytest.mark.parametrize("mask", MASKS)
def test_large_norms_stay_finite(config, mask):
    """Queries and keys with entries of size 300 (norms ~700, logits ~1e5): finite, both forms agree."""
    spec, ref, params, (q, k, v, draws), (tq, tk, tv, tdraws) = _case(config, SHAPES[0], mask, norm=300.0)
    expected = ref.estimate(q, k, v, draws, **params)
    assert np.isfinite(expected).all()
    out = spec.batched(tq, tk, tv, tdraws, **params)
    assert_close(out, expected, atol=1e-10 * np.abs(v).max(), rtol=1e-10, what="large norms, batched vs reference:")


def test_draws_carry_the_budget_only_with_the_batch_dims(config):
    """``budget : (R, ...)``: a replicate dim and the batch dims, like every draw (a sweep slices draws by cell)."""
    _, spec, _, params, budget = config
    draws = spec.draw((2, 5, 3, 4), (2, 5, 9, 4), num_samples=budget, replicates=3, rng=np.random.default_rng(0),
                      **params)
    assert set(draws.arrays) == {"budget"} and draws.replicates == 3
    assert draws["budget"].dtype == np.float64 and draws["budget"].shape == (3, 2, 5)
    assert (draws["budget"] == budget).all()


@pytest.mark.parametrize("mask", MASKS)
def test_batched_forms_read_nothing_back_from_an_accelerator(config, mask):
    """Under FakeTensorMode on the ``meta`` device (as tests/gpu/test_fake_device.py) every batched form runs: no
    ``.item()``, no host copy of the budget, no operand left on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec, _, params, (q, k, v, draws), _ = _case(config, SHAPES[1], mask)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = [torch.empty(a.shape, dtype=torch.float32, device="meta") for a in (q, k, v)]
        fake_draws = Draws({"budget": torch.empty(draws["budget"].shape, device="meta")}, draws.replicates)
        out, probabilities = spec.forms.get("estimate_with_probabilities")(*fake, fake_draws, **params)
        used = spec.keys_used(fake[0], fake[1], fake_draws, **params)
    assert out.device.type == probabilities.device.type == used.device.type == "meta"
    assert tuple(used.shape) == (2, *q.shape[:-1])


def test_draws_without_one_budget_are_refused(config):
    _, spec, ref, params, budget = config
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 4)), rng.standard_normal((9, 4)), rng.standard_normal((9, 2))
    for values, words in (([budget, budget + 1.0], "one positive integer"), ([0.5, 0.5], "one positive integer")):
        with pytest.raises(ValueError, match=words):
            ref.estimate(q, k, v, Draws({"budget": np.array(values)}, 2), **params)
    with pytest.raises(KeyError, match="budget"):
        ref.estimate(q, k, v, Draws({"omega": np.zeros((1, 2, 4))}, 1), **params)



#: (id, spec, reference, params, S, keys_used of N = M = 10 under the causal mask, counted by hand)
KEYS_USED_BY_HAND = [
    ("topk", topk.SPEC, topk.reference, {}, 4, [1, 2, 3, 4, 4, 4, 4, 4, 4, 4]),  # min(S, n + 1)
    ("streaming", streaming.SPEC, streaming.reference, {"sinks": 2}, 6, [1, 2, 3, 4, 5, 6, 6, 6, 6, 6]),
    # pages {0..3}, {4..7}, {8, 9}, two kept: queries 0-7 see at most two pages and keep them (n + 1 keys); with the
    # own page kept, query 8 keeps its 1 visible key there and one whole page (5), query 9 2 + 4 = 6
    ("quest-keep", quest.SPEC, quest.reference, {"page_size": 4, "current_page": "keep"}, 8,
     [1, 2, 3, 4, 5, 6, 7, 8, 5, 6]),
]


@pytest.mark.parametrize(("spec", "ref", "params", "budget", "expected"), [c[1:] for c in KEYS_USED_BY_HAND],
                         ids=[c[0] for c in KEYS_USED_BY_HAND])
def test_keys_used_by_hand_under_the_causal_mask(spec, ref, params, budget, expected):
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 10, 4))
    draws = spec.draw(q.shape, k.shape, num_samples=budget, replicates=2, mask="causal", **params)
    assert ref.keys_used(q, k, draws, mask="causal", **params).tolist() == [expected] * 2
    used = spec.keys_used(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(), mask="causal", **params)
    assert used.tolist() == [expected] * 2


@pytest.mark.parametrize(("spec", "params", "budget"), [
    (topk.SPEC, {}, 40), (streaming.SPEC, {}, 40), (quest.SPEC, {}, 48), (quest.SPEC, {"current_page": "keep"}, 48),
], ids=["topk", "streaming", "quest", "quest-keep"])
def test_budget_covering_the_cache_is_causal_softmax_in_decode(spec, params, budget):
    """S >= M (Quest: 3 pages of 16 over M = 40) for N = 3 queries of M = 40 keys under the causal mask: exact causal
    softmax attention, both forms."""
    rng = np.random.default_rng(13)
    q, k, v = rng.standard_normal((3, 6)), rng.standard_normal((40, 6)), rng.standard_normal((40, 2))
    exact = randattn.estimate("softmax", q, k, v, mask="causal")
    for backend in ("reference", "torch"):
        out = randattn.estimate(spec, q, k, v, num_samples=budget, mask="causal", backend=backend,
                                dtype=torch.float64 if backend == "torch" else None, **params)
        assert_close(out, exact, atol=1e-12, rtol=1e-10, what=f"{spec.name} covering every key, {backend}:")


#: (id, spec, reference, batched, S of valid draws, parameters that do not fit them, the error's words)
REFUSED_IN_ESTIMATE = [
    ("streaming-sinks-above-S", streaming.SPEC, streaming.reference, streaming.batched, 8, {"sinks": 9},
     r"num_samples S=8 must be >= sinks=9"),
    ("streaming-negative-sinks", streaming.SPEC, streaming.reference, streaming.batched, 8, {"sinks": -1},
     "sinks must be >= 0"),
    ("quest-page-not-dividing-S", quest.SPEC, quest.reference, quest.batched, 32, {"page_size": 5},
     "num_samples S=32 must be a multiple of page_size=5"),
    ("quest-page-0", quest.SPEC, quest.reference, quest.batched, 32, {"page_size": 0}, "page_size must be >= 1"),
    ("quest-unknown-current-page", quest.SPEC, quest.reference, quest.batched, 32, {"current_page": "first"},
     "current_page='first' is not allowed"),
]


@pytest.mark.parametrize(("spec", "ref", "bat", "budget", "params", "words"), [c[1:] for c in REFUSED_IN_ESTIMATE],
                         ids=[c[0] for c in REFUSED_IN_ESTIMATE])
def test_parameters_that_do_not_fit_the_draws_are_refused_in_estimate(spec, ref, bat, budget, params, words):
    """Valid draws used with parameters that do not fit them: both forms raise before any work."""
    draws = spec.draw((4, 3), (5, 3), num_samples=budget)
    q, k, v = np.ones((4, 3)), np.ones((5, 3)), np.ones((5, 2))
    with pytest.raises(ValueError, match=words):
        ref.estimate(q, k, v, draws, **params)
    with pytest.raises(ValueError, match=words):
        bat.estimate(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), draws.to_torch(), **params)


@pytest.mark.parametrize(("n", "m"), [(1, 1), (1, 9), (5, 5), (4, 11), (16, 16)])
def test_visible_keys_are_the_causal_mask_made_on_the_device(monkeypatch, n, m):
    """The causal visibility of the sparse estimators' torch forms: key m visible to query n iff m <= n + M - N
    (written out here), built where the logits are, never as a host array (``masks.causal_visible`` is numpy)."""
    from randattn.estimators.sparse import batched as sparse_batched

    def host_array(*args):
        pytest.fail("the visible keys went through a host array")

    monkeypatch.setattr("randattn.estimators.masks.causal_visible", host_array)
    monkeypatch.setattr(sparse_batched, "causal_visible", host_array, raising=False)  # a name bound at import
    got = sparse_batched.visible_keys(n, m, "causal", device="cpu")
    expected = np.array([[key <= query + m - n for key in range(m)] for query in range(n)])
    assert got.dtype == torch.bool and got.device.type == "cpu"
    np.testing.assert_array_equal(got.numpy(), expected)
    assert sparse_batched.visible_keys(n, m, None) is None


def test_visible_keys_refuse_fewer_keys_than_queries():
    from randattn.estimators.sparse import batched as sparse_batched

    with pytest.raises(ValueError, match="at least as many keys as queries"):
        sparse_batched.visible_keys(5, 4, "causal")
