"""StreamingLLM: the conformance kit, the kept keys written out by hand, keys_used, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.streaming import SPEC, batched, reference
from randattn.testing import assert_close, parametrize_with_checks


@parametrize_with_checks([SPEC, (SPEC, {"sinks": 0})])
def test_conformance(estimator, check):
    check(estimator)


def _sets(rows):
    """Key sets as an (N, M) boolean; ``rows`` lists the kept keys of each query."""
    keep = np.zeros((len(rows), 1 + max(max(r) for r in rows)), dtype=bool)
    for n, keys in enumerate(rows):
        keep[n, list(keys)] = True
    return keep


SELF_ATTENTION_S6_SINKS2 = {  # N = M = 10, S = 6 (sinks 0, 1 and a window of 4 keys)
    "causal": [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 3, 4, 5, 6],
               [0, 1, 4, 5, 6, 7], [0, 1, 5, 6, 7, 8], [0, 1, 6, 7, 8, 9]],
    # no mask: a query before token S - 1 sees the cache of the first S tokens, later ones as above
    None: [[0, 1, 2, 3, 4, 5]] * 6 + [[0, 1, 3, 4, 5, 6], [0, 1, 4, 5, 6, 7], [0, 1, 5, 6, 7, 8], [0, 1, 6, 7, 8, 9]],
}
#: N = M = 12, S = 5 (sinks 0, 1 and a window of 3 keys) under ``sliding:4``: the rule's keys that the window shows.
#: Query 4 keeps 0..4 (the cache is not yet full), of which 1..4 are in its window; from query 5 on the window has
#: passed both sinks, and the query reads its 3 recent keys alone.
SLIDING4_S5_SINKS2 = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4]] + [[n - 2, n - 1, n] for n in range(5, 12)]
#: N = 3 queries (tokens 37, 38, 39) of M = 40, S = 8 with the paper's 4 sinks: the same under both masks
DECODE_S8 = [[0, 1, 2, 3, 34, 35, 36, 37], [0, 1, 2, 3, 35, 36, 37, 38], [0, 1, 2, 3, 36, 37, 38, 39]]


def _kept(q, k, draws, params, mask):
    """The keys each query's estimate reads, from the implied probabilities, in both forms (they must agree)."""
    kw = {"mask": mask} if mask else {}
    ref = reference.probabilities(q, k, draws, **params, **kw)[0] > 0
    bat = batched.probabilities(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(), **params, **kw)[0] > 0
    assert np.array_equal(ref, bat.numpy())
    return ref


@pytest.mark.parametrize("mask", ["causal", None])
def test_self_attention_keys_by_hand(mask):
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 10, 4))
    draws = SPEC.draw(q.shape, k.shape, num_samples=6, sinks=2)
    assert np.array_equal(_kept(q, k, draws, {"sinks": 2}, mask), _sets(SELF_ATTENTION_S6_SINKS2[mask]))


@pytest.mark.parametrize("mask", ["causal", None])
def test_decode_keys_by_hand_and_output(mask):
    """Keys by hand, and the output equals softmax attention over exactly those keys (a literal sum per query)."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 5)), rng.standard_normal((40, 5)), rng.standard_normal((40, 2))
    kw = {"mask": mask} if mask else {}
    draws = SPEC.draw(q.shape, k.shape, num_samples=8, **kw)
    assert np.array_equal(_kept(q, k, draws, {}, mask), _sets(DECODE_S8))
    expected = []
    for n, keys in enumerate(DECODE_S8):
        logits = np.array([q[n] @ k[m] for m in keys]) / np.sqrt(5)
        weights = np.exp(logits - logits.max())
        expected.append(weights @ v[keys] / weights.sum())
    assert_close(reference.estimate(q, k, v, draws, **kw)[0], np.array(expected), atol=1e-12, rtol=1e-12,
                 what=f"StreamingLLM decode output, mask={mask}:")


def test_sliding_window_keys_by_hand():
    """``sliding:4``: the sinks are tokens 0, 1 (not the window's first keys); a query whose window has passed them
    reads its recent keys alone, and ``keys_used`` counts what it reads; a window over every key is causal."""
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 12, 4))
    draws = SPEC.draw(q.shape, k.shape, num_samples=5, sinks=2, mask="sliding:4")
    assert np.array_equal(_kept(q, k, draws, {"sinks": 2}, "sliding:4"), _sets(SLIDING4_S5_SINKS2))
    expected_used = [len(keys) for keys in SLIDING4_S5_SINKS2]
    assert reference.keys_used(q, k, draws, sinks=2, mask="sliding:4")[0].tolist() == expected_used
    used = batched.keys_used(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(), sinks=2, mask="sliding:4")
    assert used[0].tolist() == expected_used
    assert np.array_equal(_kept(q, k, draws, {"sinks": 2}, "sliding:12"), _kept(q, k, draws, {"sinks": 2}, "causal"))


def test_a_window_needs_a_recent_window():
    """S = sinks reads the sinks alone: under a window that has passed them a query would keep no key, refused in
    ``draw`` and in every form; S = sinks + 1 is allowed."""
    q, k, v = np.ones((6, 3)), np.ones((6, 3)), np.ones((6, 2))
    with pytest.raises(ValueError, match=r"num_samples S=4 equals sinks=4 under mask='sliding:3'.*use S > 4"):
        SPEC.draw(q.shape, k.shape, num_samples=4, mask="sliding:3")
    draws = SPEC.draw(q.shape, k.shape, num_samples=4)  # a valid budget without a window
    for form, args in ((reference.estimate, (q, k, v)), (batched.estimate, map(torch.as_tensor, (q, k, v)))):
        with pytest.raises(ValueError, match="equals sinks=4 under mask='sliding:3'"):
            form(*args, draws, mask="sliding:3")
    SPEC.draw(q.shape, k.shape, num_samples=5, mask="sliding:3")


def test_more_queries_than_keys_without_a_mask():
    """N = 5 > M = 3, S = 2, no sinks: queries before key S - 1 keep keys 0..1, the others the two up to t_n."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((5, 4)), rng.standard_normal((3, 4))
    draws = SPEC.draw(q.shape, k.shape, num_samples=2, sinks=0)
    assert np.array_equal(_kept(q, k, draws, {"sinks": 0}, None), _sets([[0, 1], [0, 1], [0, 1], [0, 1], [1, 2]]))


@pytest.mark.parametrize(("num_samples", "sinks", "words"), [
    (3, 4, r"num_samples S=3 must be >= sinks=4"),
    (4, -1, "sinks must be >= 0"),
    (0, 0, "num_samples must be >= 1"),
])
def test_bad_parameters_are_refused_in_draw(num_samples, sinks, words):
    with pytest.raises(ValueError, match=words):
        SPEC.draw((4, 3), (5, 3), num_samples=num_samples, sinks=sinks)


def test_sinks_must_be_an_integer():
    with pytest.raises(TypeError, match="sinks must be int"):
        randattn.estimate(SPEC, np.ones((4, 3)), np.ones((5, 3)), np.ones((5, 2)), num_samples=6, sinks=1.5)
