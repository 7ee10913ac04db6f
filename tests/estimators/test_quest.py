"""Quest: the conformance kit, Alg. 1's bound by explicit loops, its upper-bound property, the page selection written
out per query, keys_used, the official-code preset, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators import topk
from randattn.estimators.quest import SPEC, batched, reference
from randattn.testing import assert_close, parametrize_with_checks


@parametrize_with_checks([(SPEC, {"page_size": 2}), (SPEC, {"page_size": 2, "current_page": "keep"})])
def test_conformance(estimator, check):
    check(estimator)


def _seen(n, num_queries, num_keys, mask):
    """``(first, last)``: query n sees keys ``first <= m <= last`` (every key; causal: up to its token
    ``n + M - N``; ``sliding:W``: the W keys ending there)."""
    last = n + num_keys - num_queries if mask else num_keys - 1
    width = int(mask.split(":")[1]) if mask and mask.startswith("sliding:") else num_keys
    return last - width + 1, last


def _loop_bounds(x, y, page_size, mask):
    """Alg. 1 with explicit loops over queries, pages and channels: ``U[n][p] = sum_i max(x_i min_i, x_i max_i)``
    over the keys of page p that query n sees (None for a page it does not see)."""
    num_queries, num_keys, dim = len(x), len(y), len(x[0])
    num_pages = math.ceil(num_keys / page_size)
    bounds = []
    for n in range(num_queries):
        first, last = _seen(n, num_queries, num_keys, mask)
        row = []
        for p in range(num_pages):
            keys = [m for m in range(p * page_size, min((p + 1) * page_size, num_keys)) if first <= m <= last]
            if not keys:
                row.append(None)
                continue
            total = 0.0
            for i in range(dim):
                low, high = min(y[m][i] for m in keys), max(y[m][i] for m in keys)
                total += max(x[n][i] * low, x[n][i] * high)
            row.append(total)
        bounds.append(row)
    return bounds


def _assert_bounds(actual, bounds, what):
    """``actual`` (numpy or torch) is ``-inf`` exactly where the loops found no visible key, else within 1e-12."""
    actual = np.asarray(actual)
    unseen = np.array([[b is None for b in row] for row in bounds])
    assert np.array_equal(actual == -np.inf, unseen), f"{what} pages without a visible key"
    expected = np.array([[0.0 if b is None else b for b in row] for row in bounds])
    assert_close(np.where(unseen, 0.0, actual), expected, atol=1e-12, rtol=1e-12, what=what)


@pytest.mark.parametrize("mask", [None, "causal", "sliding:2", "sliding:6", "sliding:13"])
@pytest.mark.parametrize(("num_queries", "num_keys", "page_size"), [(10, 10, 4), (3, 40, 4), (7, 11, 3)])
def test_page_bounds_match_explicit_loops(mask, num_queries, num_keys, page_size):
    """Both forms against the loops (one rounding per term, sums in another order: 1e-12). Windows of 2 keys (inside
    one page or across two), 6 (cutting a page at each end) and 13 (covering some queries' every key)."""
    rng = np.random.default_rng(num_keys)
    x, y = rng.standard_normal((num_queries, 5)), rng.standard_normal((num_keys, 5))
    expected = _loop_bounds(x.tolist(), y.tolist(), page_size, mask)
    _assert_bounds(reference.page_upper_bounds(x, y, page_size, mask), expected, f"reference, mask={mask}:")
    _assert_bounds(batched.page_upper_bounds(torch.as_tensor(x), torch.as_tensor(y), page_size, mask).numpy(),
                   expected, f"batched, mask={mask}:")


@pytest.mark.parametrize("seed", range(4))
def test_bound_is_at_least_every_visible_score_in_its_page(seed):
    """Quest's upper-bound property, U_np >= x_n . y_m for every key m of page p that query n sees, on random inputs
    of growing size (entries up to ~50), every mask kind and both forms. Each term max(x_i m_i, x_i M_i) >= x_i y_mi
    holds in floating point too (rounding is monotone); only the order of the sums differs, hence the allowance of
    1e-12 sum_i |x_i y_mi|."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 7)) * 10**seed / 20
    y = rng.standard_normal((23, 7)) * 10**seed / 20
    page_size = 5
    scores = x @ y.T
    allowance = 1e-12 * np.abs(x) @ np.abs(y).T
    page_of = np.arange(23) // page_size
    own = (np.arange(6) + 17)[:, None]
    for mask, visible in ((None, np.ones((6, 23), dtype=bool)), ("causal", np.arange(23)[None, :] <= own),
                          ("sliding:7", (np.arange(23)[None, :] <= own) & (np.arange(23)[None, :] > own - 7))):
        for bounds in (reference.page_upper_bounds(x, y, page_size, mask),
                       batched.page_upper_bounds(torch.as_tensor(x), torch.as_tensor(y), page_size, mask).numpy()):
            per_key = bounds[:, page_of]
            assert (per_key[visible] >= scores[visible] - allowance[visible]).all()
            # a page the query does not see at all does not compete
            unseen = (bounds == -np.inf)[:, page_of]
            assert not (unseen & visible).any()


def _literal_quest(q, k, v, budget, page_size, mask, keep_current):
    """Quest per query: loop bounds, pages sorted on (-bound, page) with the own page first when kept, softmax
    over the visible keys of the first S / page_size pages."""
    num_queries, num_keys, dim = len(q), len(k), len(q[0])
    root = dim**-0.25  # x = q scale^(1/2), y = k scale^(1/2)
    x = [[a * root for a in row] for row in q]
    y = [[a * root for a in row] for row in k]
    bounds = _loop_bounds(x, y, page_size, mask)
    out = []
    for n in range(num_queries):
        token = min(max(n + num_keys - num_queries, 0), num_keys - 1)
        first, last = _seen(n, num_queries, num_keys, mask)
        pages = [p for p, b in enumerate(bounds[n]) if b is not None]
        order = sorted(pages, key=lambda p: (not (keep_current and p == token // page_size), -bounds[n][p], p))
        kept_pages = order[: budget // page_size]
        keys = [m for p in kept_pages for m in range(p * page_size, min((p + 1) * page_size, num_keys))
                if first <= m <= last]
        logits = [sum(x[n][i] * y[m][i] for i in range(dim)) for m in keys]
        weights = [math.exp(logit - max(logits)) for logit in logits]
        out.append([sum(w * v[m][j] for w, m in zip(weights, keys)) / sum(weights) for j in range(len(v[0]))])
    return np.array(out)


@pytest.mark.parametrize("current_page", ["compete", "keep"])
@pytest.mark.parametrize("mask", [None, "causal", "sliding:2", "sliding:7"])
@pytest.mark.parametrize(("num_queries", "num_keys", "page_size", "budget"), [(10, 10, 3, 6), (3, 40, 4, 8),
                                                                                (5, 3, 2, 2)])
def test_reference_matches_the_selection_written_out(current_page, mask, num_queries, num_keys, page_size, budget):
    if mask and num_queries > num_keys:
        pytest.skip("a mask needs N <= M")
    rng = np.random.default_rng(10 * num_keys + page_size)
    q, k = rng.standard_normal((num_queries, 4)), rng.standard_normal((num_keys, 4))
    v = rng.standard_normal((num_keys, 3))
    kw = {"mask": mask} if mask else {}
    params = {"page_size": page_size, "current_page": current_page}
    draws = SPEC.draw(q.shape, k.shape, num_samples=budget, **params, **kw)
    expected = _literal_quest(q.tolist(), k.tolist(), v.tolist(), budget, page_size, mask, current_page == "keep")
    assert_close(reference.estimate(q, k, v, draws, **params, **kw)[0], expected, atol=1e-12, rtol=1e-12,
                 what=f"Quest reference vs the selection written out ({current_page}, mask={mask}):")


@pytest.mark.parametrize("mask", [None, "causal", "sliding:4"])
def test_one_key_pages_that_compete_are_top_k_attention(mask):
    """page_size = 1: the bound of a one-key page is its logit, so Quest is oracle top-k attention."""
    rng = np.random.default_rng(11)
    q, k, v = rng.standard_normal((6, 5)), rng.standard_normal((14, 5)), rng.standard_normal((14, 2))
    kw = {"mask": mask} if mask else {}
    quest = randattn.estimate(SPEC, q, k, v, num_samples=5, page_size=1, **kw)
    assert_close(quest, randattn.estimate(topk.SPEC, q, k, v, num_samples=5, **kw), atol=1e-14, rtol=1e-14,
                 what="Quest with one-key pages vs top-k:")


def test_keys_used_with_a_partial_last_page_by_hand():
    """Decode without a mask over M = 42 keys whose last page (keys 40, 41) dominates every bound: pages of 4, S = 8
    keeps that page and one whole page, 2 + 4 keys; the same with M = 40 keeps two whole pages, 8 keys."""
    rng = np.random.default_rng(12)
    q = np.abs(rng.standard_normal((3, 4)))
    k = rng.standard_normal((42, 4))
    k[40:] = 10.0  # far above the others in every channel, and the queries are positive
    for num_keys, count in ((42, 6), (40, 8)):
        draws = SPEC.draw(q.shape, (num_keys, 4), num_samples=8, page_size=4)
        assert reference.keys_used(q, k[:num_keys], draws, page_size=4)[0].tolist() == [count] * 3
        tq, tk = torch.as_tensor(q), torch.as_tensor(k[:num_keys])
        assert SPEC.keys_used(tq, tk, draws.to_torch(), page_size=4)[0].tolist() == [count] * 3


def test_current_page_keep_is_the_official_code_preset():
    assert SPEC.resolve_params({"preset": "official-code"}) == {"page_size": 16, "current_page": "keep"}
    assert SPEC.resolve_params({})["current_page"] == "compete"


@pytest.mark.parametrize(("params", "words"), [
    ({"num_samples": 24}, "num_samples S=24 must be a multiple of page_size=16"),
    ({"num_samples": 16, "page_size": 0}, "page_size must be >= 1"),
    ({"num_samples": 16, "current_page": "first"}, "current_page='first' is not allowed"),
    ({"num_samples": 0}, "num_samples must be >= 1"),
])
def test_bad_parameters_are_refused_in_draw(params, words):
    with pytest.raises(ValueError, match=words):
        SPEC.draw((4, 3), (5, 3), **params)


