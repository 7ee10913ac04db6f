"""Oracle top-k attention: the conformance kit, a pure-Python sort per query, the tie rule, keys_used, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from randattn.estimators.topk import SPEC, batched, reference
from randattn.testing import assert_close, parametrize_with_checks


@parametrize_with_checks([SPEC])
def test_conformance(estimator, check):
    check(estimator)


def _literal_topk(q, k, v, budget, causal, window=None):
    """Top-k attention one query at a time in pure Python: logits by explicit sums, a sort on (-logit, index)
    (ties to the lower index), softmax over the first S visible keys; ``window`` W: only the last W of the keys the
    causal rule shows."""
    num_queries, num_keys, dim = len(q), len(k), len(q[0])
    scale = dim**-0.5
    out = []
    for n in range(num_queries):
        last = n + num_keys - num_queries
        visible = [m for m in range(num_keys) if not causal or m <= last]
        if window is not None:
            visible = [m for m in visible if m > last - window]
        logits = {m: scale * sum(q[n][i] * k[m][i] for i in range(dim)) for m in visible}
        kept = sorted(visible, key=lambda m: (-logits[m], m))[:budget]
        top = max(logits[m] for m in kept)
        weights = {m: math.exp(logits[m] - top) for m in kept}
        total = sum(weights.values())
        out.append([sum(weights[m] * v[m][j] for m in kept) / total for j in range(len(v[0]))])
    return np.array(out)


@pytest.mark.parametrize("mask", [None, "causal", "sliding:5", "sliding:1"])
@pytest.mark.parametrize(("num_queries", "num_keys", "budget"), [(10, 10, 3), (3, 40, 7), (4, 6, 9)])
def test_reference_matches_a_literal_sort_per_query(mask, num_queries, num_keys, budget):
    """Against pure Python (float64 sums in another order): 1e-12, a few roundings of outputs of order one. A
    sliding window ranks the keys inside it only (S = 9 > W = 5: every window key is kept); the batched form and
    its keys_used (the window's kept keys, min(S, W, position)) agree."""
    rng = np.random.default_rng(num_queries * 100 + num_keys)
    q, k = rng.standard_normal((num_queries, 5)), rng.standard_normal((num_keys, 5))
    v = rng.standard_normal((num_keys, 2))
    kw = {"mask": mask} if mask else {}
    window = int(mask.split(":")[1]) if mask and mask.startswith("sliding") else None
    draws = SPEC.draw(q.shape, k.shape, num_samples=budget, replicates=2, **kw)
    expected = _literal_topk(q.tolist(), k.tolist(), v.tolist(), budget, causal=mask is not None, window=window)
    assert_close(reference.estimate(q, k, v, draws, **kw), np.broadcast_to(expected, (2, *expected.shape)),
                 atol=1e-12, rtol=1e-12, what=f"topk reference vs literal sort, mask={mask}:")
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    assert_close(batched.estimate(t(q), t(k), t(v), draws.to_torch(), **kw).numpy(),
                 np.broadcast_to(expected, (2, *expected.shape)), atol=1e-12, rtol=1e-12,
                 what=f"topk batched vs literal sort, mask={mask}:")
    positions = np.arange(num_queries) + num_keys - num_queries + 1  # the keys the causal rule shows each query
    sees = positions if mask is not None else np.full(num_queries, num_keys)
    sees = np.minimum(sees, window) if window is not None else sees
    used = batched.keys_used(t(q), t(k), draws.to_torch(), **kw).numpy()
    assert np.array_equal(used, np.broadcast_to(np.minimum(sees, budget), used.shape).astype(float))


def test_ties_go_to_the_lower_key_index_in_both_forms():
    """Keys 1, 3 and 5 are equal, so their logits tie exactly; with S = 2 and key 1 best (key 0 much worse) the
    kept keys must be 1 and 3 (not 5) for every query, in float64 and in float32."""
    rng = np.random.default_rng(3)
    q = np.abs(rng.standard_normal((4, 3)))  # positive queries: the tied key (all ones) beats the others
    k = -np.ones((6, 3))
    k[[1, 3, 5]] = 1.0
    draws = SPEC.draw(q.shape, k.shape, num_samples=2)
    expected = np.zeros((1, 4, 6), dtype=bool)
    expected[..., [1, 3]] = True
    assert np.array_equal(reference.probabilities(q, k, draws) > 0, expected)
    for dtype in (torch.float64, torch.float32):
        probs = batched.probabilities(torch.as_tensor(q, dtype=dtype), torch.as_tensor(k, dtype=dtype),
                                      draws.to_torch(dtype=dtype))
        assert np.array_equal(probs.numpy() > 0, expected), dtype


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_integer_inputs_with_exact_products_break_ties_by_key_index_in_both_forms(scale):
    """Entries in {-1, 0, 1} tie often. Where ``sqrt(scale)`` keeps the products exact (1 and 1/2), the kept keys
    are those of a sort by (-integer dot product, key index) over the visible keys, in both forms; at
    ``scale = 1/2`` the products round, and the forms may order such ties differently (the package docstring)."""
    rng = np.random.default_rng(9)
    q = rng.integers(-1, 2, (3, 4)).astype(float)
    k = rng.integers(-1, 2, (20, 4)).astype(float)
    budget = 4
    draws = SPEC.draw(q.shape, k.shape, num_samples=budget)
    expected = np.zeros((3, 20), dtype=bool)
    dots = q.astype(int) @ k.astype(int).T
    for n in range(3):
        visible = range(n + 20 - 3 + 1)
        expected[n, sorted(visible, key=lambda m: (-dots[n, m], m))[:budget]] = True
    assert len({tuple(row) for row in dots}) == 3 and any(len(set(row)) < 20 for row in dots)  # ties there are
    kept_reference = reference.probabilities(q, k, draws, mask="causal", scale=scale)[0] > 0
    kept_batched = batched.probabilities(torch.as_tensor(q), torch.as_tensor(k), draws.to_torch(), mask="causal",
                                         scale=scale)[0].numpy() > 0
    assert np.array_equal(kept_reference, expected) and np.array_equal(kept_batched, expected)


@pytest.mark.parametrize(("num_samples", "error", "words"), [
    (0, ValueError, "num_samples must be >= 1"),
    (2.5, TypeError, "num_samples must be an integer"),
])
def test_bad_budget_is_refused_in_draw(num_samples, error, words):
    with pytest.raises(error, match=words):
        SPEC.draw((4, 3), (5, 3), num_samples=num_samples)
