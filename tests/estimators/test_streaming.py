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
