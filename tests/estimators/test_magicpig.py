"""MagicPIG (Chen et al. 2024, arXiv 2410.16179): the kit, a literal per-query loop, batched == reference, the
hash's collision law by Monte Carlo, keys_used by hand, limits, large norms and bad input.

Expected values come from independent computations: the paper's steps written out with Python loops and ``math``
(no package helper), the closed forms of eq. 10, Monte Carlo fractions of the hash itself, or hand counts.
Monte Carlo tolerances are 4 standard errors of the fraction (binomial), with fixed seeds; each such test has a
negative control showing that a wrong law (exponent K + 1) is rejected by the same test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from randattn.estimators.base import Draws
from randattn.estimators.magicpig import SPEC, batched, draw, reference
from randattn.testing import assert_close, parametrize_with_checks

CENTERS = ("all-keys", "hashed-keys", "none")


@parametrize_with_checks([SPEC, (SPEC, SPEC.variants["sampling"])])
def test_conformance(estimator, check):
    """The kit on the defaults (at the kit's sizes sinks + local hold every key) and on a variant that samples."""
    check(estimator)


@pytest.mark.slow
@parametrize_with_checks([(SPEC, SPEC.variants["one-collision-uncentred"]), (SPEC, SPEC.variants["official-code"])])
def test_conformance_of_the_other_variants(estimator, check):
    check(estimator)


def _draw(q, k, samples, params, *, replicates=1, seed=0, mask=None):
    kwargs = {"mask": mask} if mask else {}
    return draw(q.shape, k.shape, num_samples=samples, replicates=replicates, rng=np.random.default_rng(seed),
                **params, **kwargs)


def _params(**overrides):
    return {**{name: p.default for name, p in SPEC.params.items()}, **overrides}


def _mask_kw(mask):
    return {"mask": mask} if mask else {}


# ------------------------------------------------------------------------------------------ the paper, by loops
def _tail(table_p: float, tables: int, at_least: int) -> float:
    """P[Bin(L, P) >= c]: eq. 10 written out for c = 2, 1 - (1 - P)^L for c = 1, the binomial sum otherwise."""
    if at_least == 2:
        return 1 - (1 - table_p) ** tables - tables * table_p * (1 - table_p) ** (tables - 1)
    if at_least == 1:
        return 1 - (1 - table_p) ** tables
    return sum(math.comb(tables, j) * table_p**j * (1 - table_p) ** (tables - j) for j in range(at_least, tables + 1))


def _literal_magicpig(q, k, v, planes, *, scale, at_least, sinks, local, center, mask):
    """One replicate, no batch dims: Algorithm 1 for each query with Python loops, plus the sampled (n, m) pairs."""
    num_queries, dim = len(q), len(q[0])
    num_keys, tables, bits = len(k), len(planes), len(planes[0])
    out, sampled_pairs, skipped_pairs = [], [], []

    def code(vector, table):  # SimHash: the sign pattern of K projections
        return tuple(sum(planes[table][b][d] * vector[d] for d in range(dim)) > 0 for b in range(bits))

    for n in range(num_queries):
        last = n + num_keys - num_queries if mask else num_keys - 1
        width = int(mask.split(":")[1]) if mask and mask.startswith("sliding:") else num_keys
        visible = [m for m in range(num_keys) if last - width < m <= last]  # sinks a window has passed: not seen
        exact = [m for m in visible if m < sinks or m > last - local]
        candidates = [m for m in visible if m not in exact]
        pool = {"all-keys": visible, "hashed-keys": candidates, "none": []}[center]
        mean = [sum(k[m][d] for m in pool) / len(pool) if pool else 0.0 for d in range(dim)]
        weighted = [(scale * sum(q[n][d] * k[m][d] for d in range(dim)), m) for m in exact]  # log weight 0
        for m in candidates:
            centred = [k[m][d] - mean[d] for d in range(dim)]
            hits = sum(code(q[n], table) == code(centred, table) for table in range(tables))
            if hits < at_least:
                skipped_pairs.append((n, m))
                continue
            sampled_pairs.append((n, m))
            norms = math.sqrt(sum(a * a for a in q[n]) * sum(a * a for a in centred))
            # a zero vector is at a right angle to every vector (the package's convention, its unit vector 0)
            cosine = sum(q[n][d] * centred[d] for d in range(dim)) / norms if norms else 0.0
            p = 1 - math.acos(max(-1.0, min(1.0, cosine))) / math.pi
            u = _tail(p**bits, tables, at_least)
            weighted.append((scale * sum(q[n][d] * k[m][d] for d in range(dim)) - math.log(u), m))
        top = max(w for w, _ in weighted)
        total = sum(math.exp(w - top) for w, _ in weighted)
        out.append([sum(math.exp(w - top) * v[m][j] for w, m in weighted) / total for j in range(len(v[0]))])
    return np.array(out), sampled_pairs, skipped_pairs


@pytest.mark.parametrize("mask", [None, "causal", "sliding:3", "sliding:7"])
@pytest.mark.parametrize("at_least", [2, 1])
def test_reference_follows_the_paper_query_by_query(mask, at_least):
    """The reference against Algorithm 1 written out; under a window of 3 every query (tokens 5..8) has passed the
    sink (key 0), under a window of 7 the first query still sees it."""
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(4, 3)), rng.normal(size=(9, 3)), rng.normal(size=(9, 2))
    sampled = skipped = 0
    for center in CENTERS:
        params = _params(hash_bits=2, min_collisions=at_least, sinks=1, local=2, center=center)
        draws = _draw(q, k, 5, params, seed=4, mask=mask)
        expected, hits, misses = _literal_magicpig(q.tolist(), k.tolist(), v.tolist(),
                                                   draws["hyperplanes"][0].tolist(), scale=3**-0.5,
                                                   at_least=at_least, sinks=1, local=2, center=center, mask=mask)
        sampled, skipped = sampled + len(hits), skipped + len(misses)
        actual = reference.estimate(q, k, v, draws, **params, **_mask_kw(mask))
        assert_close(actual[0], expected, atol=1e-12, rtol=1e-10, what=f"reference vs the literal loop, {center}:")
    assert sampled > 0 and skipped > 0, "the inputs must exercise both sampled and rejected candidates"


# ----------------------------------------------------------------------------------------- batched == reference
@pytest.mark.parametrize("mask", [None, "causal", "sliding:9"])
@pytest.mark.parametrize(("label", "q_shape", "k_shape"), [
    ("decode N=3 over M=40", (3, 6), (40, 6)),
    ("batch 2, N=M=11", (2, 11, 5), (2, 11, 5)),
])
def test_batched_equals_reference(mask, label, q_shape, k_shape):
    rng = np.random.default_rng(5)
    q, k = rng.normal(size=q_shape), rng.normal(size=k_shape)
    v = rng.normal(size=(*k_shape[:-1], 3))
    t = torch.as_tensor
    for center, at_least in zip(CENTERS, (2, 1, 2)):
        params = _params(hash_bits=3, min_collisions=at_least, sinks=2, local=4, center=center)
        draws = _draw(q, k, 8, params, replicates=2, seed=6, mask=mask)
        ref_out, ref_probs = reference.estimate_with_probabilities(q, k, v, draws, **params, **_mask_kw(mask))
        out, probs = batched.estimate_with_probabilities(t(q), t(k), t(v), draws.to_torch(), **params,
                                                         **_mask_kw(mask))
        what = f"{label}, {center}, >= {at_least}, mask={mask}:"
        assert_close(out, ref_out, atol=1e-10, rtol=1e-10, what=f"batched output, {what}")
        assert_close(probs, ref_probs, atol=1e-10, rtol=1e-10, what=f"batched probabilities, {what}")
        assert_close(batched.probabilities(t(q), t(k), draws.to_torch(), **params, **_mask_kw(mask)), ref_probs,
                     atol=1e-10, rtol=1e-10, what=f"batched.probabilities, {what}")
        assert_close(ref_probs @ v, ref_out, atol=1e-12, rtol=1e-12, what=f"probabilities @ v, {what}")
        used = reference.keys_used(q, k, draws, **params, **_mask_kw(mask))
        assert np.array_equal(batched.keys_used(t(q), t(k), draws.to_torch(), **params, **_mask_kw(mask)).numpy(),
                              used), f"keys_used differs, {what}"
        # the sampler is exercised: some candidates sampled, some not
        exact, candidates = reference.exact_and_candidate_keys(q.shape[-2], k.shape[-2], 2, 4, mask)
        sampled = used - exact.sum(-1)
        assert sampled.min() >= 0 and sampled.max() > 0 and (sampled < candidates.sum(-1)).any(), what


@pytest.mark.parametrize("mask", [None, "causal", "sliding:4"])
def test_batched_in_chunks_of_one_query(mask, monkeypatch):
    """Chunking the queries (here one at a time) changes nothing."""
    rng = np.random.default_rng(9)
    q, k, v = rng.normal(size=(2, 5, 4)), rng.normal(size=(2, 9, 4)), rng.normal(size=(2, 9, 2))
    params = _params(hash_bits=2, sinks=1, local=2)
    draws = _draw(q, k, 6, params, replicates=2, seed=10, mask=mask)
    monkeypatch.setattr(batched, "CHUNK_ELEMENTS", 1)
    t = torch.as_tensor
    assert_close(batched.estimate(t(q), t(k), t(v), draws.to_torch(), **params, **_mask_kw(mask)),
                 reference.estimate(q, k, v, draws, **params, **_mask_kw(mask)), atol=1e-10, rtol=1e-10,
                 what="one query per chunk:")


# ------------------------------------------------------------------------------------- the hash, by Monte Carlo
def _z(fraction, probability, draws):
    return (fraction - probability) / np.sqrt(probability * (1 - probability) / draws)


@pytest.mark.parametrize("theta", [math.pi / 3, 2 * math.pi / 3])
def test_collision_probability_matches_monte_carlo_of_the_hash(theta):
    """The fraction of tables whose K-bit codes agree is (1 - theta/pi)^K within 4 standard errors; the same test
    rejects the exponent K + 1."""
    bits, tables = 3, 20000
    q = np.array([1.0, 0.0, 0.0, 0.0, 0.0])
    k = np.array([math.cos(theta), math.sin(theta), 0.0, 0.0, 0.0]) * 2.5
    planes = _draw(q[None], k[None], tables, _params(hash_bits=bits), seed=11)["hyperplanes"][0]  # (L, K, D)
    agree = (reference.hash_codes(q, planes) == reference.hash_codes(k, planes)).all(-1)  # (L,)
    p = 1 - math.acos(float(q @ k) / float(np.linalg.norm(q) * np.linalg.norm(k))) / math.pi
    assert abs(_z(agree.mean(), p**bits, tables)) < 4
    assert abs(_z(agree.mean(), p ** (bits + 1), tables)) > 4, "negative control: exponent K+1 must be rejected"
    log_p = reference.log_table_collision_probability(q, k[None], bits)
    assert_close(np.exp(log_p), [p**bits], atol=0, rtol=1e-12, what="(1 - theta/pi)^K:")


@pytest.mark.parametrize("at_least", [2, 1])
def test_inclusion_probability_matches_monte_carlo_of_the_sampler(at_least):
    """The fraction of independent hash draws that sample each candidate is u (eq. 10 for two tables) within 4
    standard errors; u computed with the exponent K + 1 is rejected by the same test."""
    bits, tables, replicates = 2, 6, 4000
    angles = [0.0, math.pi / 6, math.pi / 4, math.pi / 3, math.pi / 2, 2 * math.pi / 3]  # key 0 is a sink
    q = np.array([[1.0, 0.0, 0.0]])
    k = np.array([[math.cos(a), math.sin(a), 0.0] for a in angles]) * 1.5
    params = _params(hash_bits=bits, min_collisions=at_least, sinks=1, local=0, center="none")
    draws = _draw(q, k, tables, params, replicates=replicates, seed=12)
    chosen = reference.select(q, k, draws["hyperplanes"], min_collisions=at_least, sinks=1, local=0, center="none")
    fraction = chosen.sampled[:, 0, 1:].mean(0)
    p = np.array([1 - a / math.pi for a in angles[1:]])
    u = np.array([_tail(pk**bits, tables, at_least) for pk in p])
    u_wrong = np.array([_tail(pk ** (bits + 1), tables, at_least) for pk in p])
    assert_close(np.exp(chosen.log_inclusion[0, 1:]), u, atol=0, rtol=1e-12, what="u against eq. 10:")
    assert np.abs(_z(fraction, u, replicates)).max() < 4
    assert np.abs(_z(fraction, u_wrong, replicates)).max() > 4, "negative control: exponent K+1 must be rejected"


def test_log_inclusion_probability_in_log_space():
    """log u stays exact where the closed form cancels or underflows: P = 1e-200 gives log C(L,2) + 2 log P;
    u = 1 - 1e-21 gives log u = -1e-21; P = 1 gives 0; P = 0 gives -inf; moderate P agrees with eq. 10 and
    1 - (1 - P)^L."""
    log_p = np.log(np.array([1e-200, 1.0, 0.3, 0.02]))
    with np.errstate(divide="ignore"):
        log_p = np.append(log_p, -np.inf)
    two = reference.log_inclusion_probability(log_p, 150, 2)
    one = reference.log_inclusion_probability(log_p, 150, 1)
    assert_close(two[0], math.log(math.comb(150, 2)) + 2 * math.log(1e-200), atol=0, rtol=1e-14, what="tiny P, c=2:")
    assert_close(one[0], math.log(150) + math.log(1e-200), atol=0, rtol=1e-14, what="tiny P, c=1:")
    assert two[1] == 0.0 and one[1] == 0.0
    assert_close(np.exp(two[2:4]), [_tail(0.3, 150, 2), _tail(0.02, 150, 2)], atol=0, rtol=1e-12, what="eq. 10:")
    assert_close(np.exp(one[2:4]), [_tail(0.3, 150, 1), _tail(0.02, 150, 1)], atol=0, rtol=1e-12, what="c=1:")
    assert two[4] == -np.inf and one[4] == -np.inf
    # u -> 1: log u = log1p(-lower tail), exact where 1 - u is far below the float64 spacing at 1
    assert_close(two[2], -(0.7**150 + 150 * 0.3 * 0.7**149), atol=0, rtol=1e-12, what="u near 1, c=2:")
    assert_close(one[2], -(0.7**150), atol=0, rtol=1e-12, what="u near 1, c=1:")
    for form in (batched._log_inclusion, batched._log_inclusion_where_needed):  # an accelerator's, the host's
        for at_least, expected in ((2, two), (1, one)):
            as_torch = form(torch.as_tensor(log_p), 150, at_least).numpy()
            assert as_torch[4] == -np.inf
            assert_close(as_torch[:4], expected[:4], atol=1e-15, rtol=1e-13, what=f"torch log u, c={at_least}:")


def test_the_host_forms_upper_sum_where_u_crosses_one_half():
    """The host forms the upper sum only where u < 1/2: P around the median of Bin(150, P) >= 2 (u = 1/2 near
    P = 1.12e-2), on both sides and in float32, agrees with eq. 10 written out; every pair takes one branch."""
    table_p = np.array([1e-3, 5e-3, 1.0e-2, 1.1e-2, 1.15e-2, 1.2e-2, 2e-2, 0.5])
    u = np.array([_tail(p, 150, 2) for p in table_p])
    assert (u < 0.5).any() and (u > 0.5).any(), "the inputs must straddle u = 1/2"
    for dtype, rtol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        log_u = batched._log_inclusion_where_needed(torch.log(torch.as_tensor(table_p, dtype=dtype)), 150, 2)
        assert log_u.dtype == dtype
        assert_close(np.exp(log_u.double().numpy()), u, atol=0, rtol=rtol, what=f"host log u, {dtype}:")


# --------------------------------------------------------------------------------------------- keys_used, limits
@pytest.mark.parametrize(("mask", "expected"), [(None, [8, 8, 8]), ("causal", [7, 7, 8])])
def test_keys_used_by_hand(mask, expected):
    """Keys parallel to the query always collide (p = 1, u = 1), antiparallel ones never (p = 0): with sinks=2,
    local=3 over M=10 the count is 5 exact + the parallel candidates (even m). No mask: candidates 2..6 -> 2, 4, 6.
    Causal (t_n = 7, 8, 9): candidates 2..4, 2..5, 2..6 -> 2 + 2 + 3."""
    q = np.tile([[1.0, 0.0, 0.0, 0.0]], (3, 1))
    k = np.array([[(1 + m / 10) * (1 if m % 2 == 0 else -1), 0.0, 0.0, 0.0] for m in range(10)])
    v = np.random.default_rng(13).normal(size=(10, 2))
    params = _params(hash_bits=4, min_collisions=2, sinks=2, local=3, center="none")
    draws = _draw(q, k, 6, params, replicates=3, seed=14, mask=mask)
    used = reference.keys_used(q, k, draws, **params, **_mask_kw(mask))
    assert used.tolist() == [expected] * 3
    t = torch.as_tensor
    assert batched.keys_used(t(q), t(k), draws.to_torch(), **params, **_mask_kw(mask)).tolist() == [expected] * 3
    # and the weights are 1 (u = 1): softmax over exactly those keys
    out = reference.estimate(q, k, v, draws, **params, **_mask_kw(mask))
    for n in range(3):
        last = n + 7 if mask == "causal" else 9
        keys = [m for m in range(last + 1) if m < 2 or m > last - 3 or m % 2 == 0]
        logits = np.array([0.5 * k[m, 0] for m in keys])  # scale = 4 ** -0.5, q = e1
        weights = np.exp(logits - logits.max())
        assert_close(out[:, n], np.broadcast_to(weights @ v[keys] / weights.sum(), (3, 2)), atol=1e-14, rtol=1e-12,
                     what=f"query {n}:")


@pytest.mark.parametrize("mask", [None, "causal"])
def test_exact_when_sinks_and_local_cover_every_key(mask):
    rng = np.random.default_rng(15)
    q, k, v = rng.normal(size=(5, 4)), rng.normal(size=(12, 4)), rng.normal(size=(12, 3))
    logits = q @ k.T / 2
    if mask == "causal":
        logits = np.where(np.arange(12)[None] <= np.arange(5)[:, None] + 7, logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    exact = weights @ v / weights.sum(-1, keepdims=True)
    for sinks, local in ((0, 12), (12, 0), (5, 7)):
        params = _params(hash_bits=2, sinks=sinks, local=local)
        draws = _draw(q, k, 4, params, replicates=2, seed=16, mask=mask)
        assert_close(reference.estimate(q, k, v, draws, **params, **_mask_kw(mask)), np.broadcast_to(exact, (2, 5, 3)),
                     atol=1e-12, rtol=1e-10, what=f"sinks={sinks}, local={local}:")


def test_many_tables_sample_every_key_with_weight_one():
    """With K = 1 and L = 3000 every candidate collides in >= 2 tables and u = 1 to rounding (checked: the largest
    (1 - p)^(L-1) L is far below 1e-16), so MagicPIG is softmax attention."""
    rng = np.random.default_rng(17)
    q, k, v = rng.uniform(0.1, 1, size=(5, 4)), rng.uniform(0.1, 1, size=(12, 4)), rng.normal(size=(12, 3))
    cosine = (q @ k.T) / np.outer(np.linalg.norm(q, axis=1), np.linalg.norm(k, axis=1))
    p_min = 1 - np.arccos(cosine.min()) / np.pi
    assert 3000 * (1 - p_min) ** 2999 < 1e-30
    params = _params(hash_bits=1, sinks=1, local=0, center="none")
    draws = _draw(q, k, 3000, params, seed=18)
    weights = np.exp(q @ k.T / 2)
    exact = weights @ v / weights.sum(-1, keepdims=True)
    assert_close(reference.estimate(q, k, v, draws, **params)[0], exact, atol=1e-12, rtol=1e-10, what="L = 3000:")
    t = torch.as_tensor
    assert_close(batched.estimate(t(q), t(k), t(v), draws.to_torch(), **params)[0], exact, atol=1e-12, rtol=1e-10,
                 what="L = 3000, batched:")


# ------------------------------------------------------------------------------------------------- large norms
@pytest.mark.parametrize("mask", [None, "causal"])
def test_large_norms_finite_and_hashing_scale_invariant(mask):
    rng = np.random.default_rng(19)
    q, k = rng.normal(size=(2, 6, 8)), rng.normal(size=(2, 20, 8))
    q *= rng.uniform(100, 300, size=(2, 6, 1)) / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= rng.uniform(100, 300, size=(2, 20, 1)) / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(2, 20, 3))
    params = _params(hash_bits=2, sinks=1, local=2)
    draws = _draw(q, k, 8, params, replicates=2, seed=20, mask=mask)
    ref = reference.estimate(q, k, v, draws, **params, **_mask_kw(mask))
    assert np.isfinite(ref).all()
    t = torch.as_tensor
    assert_close(batched.estimate(t(q), t(k), t(v), draws.to_torch(), **params, **_mask_kw(mask)), ref, atol=1e-10,
                 rtol=1e-10, what="batched at norms 100-300:")
    out32 = batched.estimate(t(q).float(), t(k).float(), t(v).float(), draws.to_torch(dtype=torch.float32), **params,
                             **_mask_kw(mask))
    assert torch.isfinite(out32).all()
    # the codes and u see directions only: scaling by 128 (exact in binary) changes no bit of the selection
    select = {key: params[key] for key in ("min_collisions", "sinks", "local", "center")}
    small = reference.select(q / 128, k / 128, draws["hyperplanes"], mask=mask, **select)
    large = reference.select(q, k, draws["hyperplanes"], mask=mask, **select)
    assert np.array_equal(small.log_weights, large.log_weights)
    assert large.sampled.any()


# ------------------------------------------------------------------------------------------------- bad input
BAD = [
    ({"hash_bits": 0}, 4, ValueError, "hash_bits"),
    ({"hash_bits": 2.5}, 4, TypeError, "hash_bits"),
    ({"min_collisions": 0}, 4, ValueError, "min_collisions"),
    ({"min_collisions": 5}, 4, ValueError, "min_collisions=5 exceeds"),
    ({}, 0, ValueError, "num_samples"),
    ({"sinks": -1}, 4, ValueError, "sinks"),
    ({"sinks": 0, "local": 0}, 4, ValueError, "sinks + local"),
    ({"center": "mean"}, 4, ValueError, "center"),
]


@pytest.mark.parametrize(("bad", "samples", "error", "words"), BAD, ids=[b[3] for b in BAD])
def test_bad_input_named_in_draw_and_estimate(bad, samples, error, words):
    rng = np.random.default_rng(21)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    with pytest.raises(error, match=words.replace("+", r"\+")):
        _draw(q, k, samples, _params(**bad))
    if samples == 0:
        return  # L = 0 tables cannot be drawn; estimate reads L from the draws' shape
    good = _draw(q, k, samples, _params(hash_bits=2))
    t = torch.as_tensor
    for form, args in ((reference.estimate, (q, k, v)), (batched.estimate, (t(q), t(k), t(v)))):
        with pytest.raises(error, match=words.replace("+", r"\+")):
            form(*args, good, **_params(**{"hash_bits": 2, **bad}))


def test_bad_draws_and_masks():
    rng = np.random.default_rng(22)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), rng.normal(size=(5, 2))
    draws = _draw(q, k, 4, _params(hash_bits=3))
    with pytest.raises(ValueError, match="hash_bits=10"):
        reference.estimate(q, k, v, draws, **_params())
    with pytest.raises(ValueError, match="hash_bits=10"):
        batched.estimate(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), draws, **_params())
    with pytest.raises(KeyError, match="hyperplanes"):
        reference.estimate(q, k, v, Draws({"omega": np.zeros((1, 4, 4))}, 1), **_params())
    with pytest.raises(ValueError, match="were the draws made for inputs of another shape"):
        reference.estimate(q[:, :3], k[:, :3], v, draws, **_params(hash_bits=3))
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        draw((6, 4), (5, 4), num_samples=4, rng=np.random.default_rng(0), mask="causal")
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        reference.estimate(rng.normal(size=(6, 4)), k, v, _draw(rng.normal(size=(6, 4)), k, 4, _params()),
                           **_params(), mask="causal")


@pytest.mark.parametrize("center", CENTERS)
def test_a_window_past_the_sinks_is_magicpig_on_its_keys_alone(center):
    """Under ``sliding:W`` a query whose window has passed the sinks is unmasked MagicPIG over its W keys with no
    sinks (the same hyperplanes; "all-keys" centres on the window's keys, "hashed-keys" on its candidates)."""
    rng = np.random.default_rng(33)
    num_queries, num_keys, width = 4, 40, 12
    q, k, v = rng.normal(size=(2, num_queries, 5)), rng.normal(size=(2, num_keys, 5)), rng.normal(size=(2, num_keys, 3))
    params = _params(hash_bits=2, sinks=3, local=2, center=center)
    mask = f"sliding:{width}"
    draws = _draw(q, k, 6, params, replicates=3, seed=34, mask=mask)
    windowed = reference.estimate(q, k, v, draws, **params, mask=mask)
    for n in range(num_queries):
        last = n + num_keys - num_queries
        keys = slice(last - width + 1, last + 1)
        alone = reference.estimate(q[:, n:n + 1], k[:, keys], v[:, keys], draws, **{**params, "sinks": 0})
        assert_close(windowed[..., n, :], alone[..., 0, :], atol=1e-14, rtol=1e-12, what=f"{center}, query {n}:")


def test_a_window_needs_local_keys():
    """Under a sliding window the sinks pass out of view, so local=0 could leave a query no key: the spec declares
    no window for it (``randattn.estimate`` says why) and the options refuse it in every form."""
    import randattn

    rng = np.random.default_rng(23)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(8, 4)), rng.normal(size=(8, 2))
    assert "sliding" in SPEC.masks_of(_params(local=1)) and "sliding" not in SPEC.masks_of(_params(local=0))
    with pytest.raises(ValueError, match="with local=0 a query whose window has passed the sinks keeps no exact key"):
        randattn.estimate(SPEC, q, k, v, num_samples=4, sinks=2, local=0, mask="sliding:4")
    with pytest.raises(ValueError, match="local must be >= 1 under mask='sliding:4'"):
        _draw(q, k, 4, _params(sinks=2, local=0), mask="sliding:4")
    good = _draw(q, k, 4, _params(sinks=2, local=1), mask="sliding:4")
    with pytest.raises(ValueError, match="local must be >= 1 under mask='sliding:4'"):
        batched.estimate(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), good, **_params(sinks=2, local=0),
                         mask="sliding:4")


def test_presets_and_description_name_the_conventions():
    assert SPEC.describe(_params(), _params()) == ("K=10, >= 2 tables", ["4 sinks + 64 local"],
                                                   {"hash_bits", "min_collisions", "sinks", "local", "center"})
    assert SPEC.describe(_params(center="hashed-keys"), _params())[1][-1] == "centred on hashed keys"
    assert SPEC.resolve_params({"preset": "official-code"})["center"] == "hashed-keys"
    assert SPEC.resolve_params({"preset": "sparse-attention-hub"})["min_collisions"] == 1
    assert SPEC.resolve_params({})["min_collisions"] == 2 and SPEC.resolve_params({})["center"] == "all-keys"


def test_the_batched_exact_and_candidate_sets_are_the_references_made_on_the_device():
    """The position-only (N, M) sets, made with torch from the shapes (no host array uploaded per call), equal the
    reference's numpy sets for both masks, N < M, windows and sinks covering everything, and none at all; the
    shape-only test for "anything to hash" agrees with the sets."""
    for mask in (None, "causal", "sliding:1", "sliding:6"):
        for n, m in ((1, 1), (5, 5), (3, 11), (7, 20)):
            for sinks in (0, 1, 4):
                for local in (0, 1, 3, 30):
                    exact_np, candidates_np = reference.exact_and_candidate_keys(n, m, sinks, local, mask)
                    exact, candidates = batched.exact_and_candidate_keys(n, m, sinks, local, mask)
                    assert exact.dtype == candidates.dtype == torch.bool
                    np.testing.assert_array_equal(exact.numpy(), exact_np)
                    np.testing.assert_array_equal(candidates.numpy(), candidates_np)
                    anything = batched._has_candidates(m, sinks, local)
                    if mask is None or mask == "causal":
                        assert anything == bool(candidates_np.any())
                    else:  # from the shapes alone: a window may leave none where the causal mask has some
                        assert anything or not candidates_np.any()


# ---------------------------------------------------------------- the sampler's two forms: buckets, comparisons
def _sampled_by_batched(q, k, draws, params, mask):
    """The (n, m) candidate pairs the batched form samples in replicate 0, and its log weights ``(R, N, M)``."""
    t = torch.as_tensor
    selection = {name: params[name] for name in ("min_collisions", "sinks", "local", "center")}
    weights = batched.log_weights(t(q), t(k), t(draws["hyperplanes"]).to(t(q).dtype), mask=mask, **selection)
    _, candidates = reference.exact_and_candidate_keys(len(q), len(k), params["sinks"], params["local"], mask)
    rows, cols = np.nonzero(torch.isfinite(weights[0]).numpy() & candidates)
    return sorted(zip(rows.tolist(), cols.tolist())), weights


def _literal_pairs(q, k, draws, params, mask):
    _, sampled, skipped = _literal_magicpig(q.tolist(), k.tolist(), k[:, :1].tolist(),
                                            draws["hyperplanes"][0].tolist(), scale=1.0,
                                            at_least=params["min_collisions"], sinks=params["sinks"],
                                            local=params["local"], center=params["center"], mask=mask)
    return sorted(sampled), skipped


@pytest.mark.parametrize("tables_per_pass", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 5, 64])
@pytest.mark.parametrize("center", CENTERS)
def test_buckets_sample_the_literal_loops_pairs_where_the_thresholds_differ(group, center, tables_per_pass,
                                                                            monkeypatch):
    """Under the causal mask each query centres the keys on the mean of the keys it sees, so the thresholds of a
    group of queries spread and some (table, key) pairs fall in the band between them, where the buckets compare
    bit by bit. The sample is the literal loop's, pair for pair: groups of one query (no band), of five, and of
    all 20 (the widest bands), with the buckets' matches, the band's pairs and the queries listed one at a time;
    the 8 tables in passes of one, of three (the last pass short) and in one pass, their collisions added up."""
    monkeypatch.setattr(batched, "TABLES_PER_PASS", tables_per_pass)
    monkeypatch.setattr(batched, "QUERY_GROUP", group)
    monkeypatch.setattr(batched, "BUCKET_PIECE", 1)
    monkeypatch.setattr(batched, "CHUNK_ELEMENTS", 1)
    rng = np.random.default_rng(21)
    q, k = rng.normal(size=(20, 3)), rng.normal(size=(20, 3)) + 0.7
    params = _params(hash_bits=2, min_collisions=2, sinks=1, local=2, center=center)
    draws = _draw(q, k, 8, params, seed=22, mask="causal")
    expected, skipped = _literal_pairs(q, k, draws, params, "causal")
    actual, _ = _sampled_by_batched(q, k, draws, params, "causal")
    assert actual == expected, f"group {group}, {center}: batched samples {len(actual)} pairs, the loop {len(expected)}"
    assert expected and skipped, "the inputs must exercise both sampled and rejected candidates"


@pytest.mark.parametrize("center", ["all-keys", "none"])
def test_buckets_hash_a_key_on_the_hyperplane_as_the_loop_does(center):
    """A centred key of zero lies on every hyperplane and hashes to bit 0 (``w.v > 0`` is false), in the buckets as
    in the literal loop: integer keys in +/- pairs make the mean exactly 0, zero keys tie with it, and repeated keys
    share their bucket (no causal mask: one threshold for every query, so no band)."""
    rng = np.random.default_rng(23)
    base = rng.integers(-3, 4, size=(5, 3)).astype(np.float64)
    k = np.concatenate([base, -base, np.zeros((4, 3))])
    q = np.concatenate([rng.integers(-3, 4, size=(5, 3)).astype(np.float64), np.zeros((1, 3))])
    params = _params(hash_bits=1, min_collisions=1, sinks=1, local=1, center=center)
    draws = _draw(q, k, 3, params, seed=24)
    expected, skipped = _literal_pairs(q, k, draws, params, None)
    actual, _ = _sampled_by_batched(q, k, draws, params, None)
    assert actual == expected and expected and skipped
    zero_keys = set(range(10, 13))  # the candidates among the zero keys (the last key is local)
    assert any(m in zero_keys for _, m in expected) and any(m in zero_keys for _, m in skipped), (
        "the zero keys must be sampled by some query (the zero query: both codes all 0) and rejected by another")


@pytest.mark.parametrize("accelerator_form", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_key_equal_to_its_querys_mean_hashes_to_bit_0(dtype, accelerator_form, monkeypatch):
    """Centred on the hashed keys, a query with one candidate centres it to zero: ``(y - mu).w = 0``, bit 0 in every
    table (the loop subtracts first). The batched form compares ``y.w > mu.w``, so the two projections must be
    equal to the bit: they come from one product. Queries 3 and 4 of the causal mask (1 sink, 1 local key) have one
    and two candidates; one bit per table, so the tie decides collisions. Batch (2, 3) and 36 draws: projections
    made by separate products (the form before this test) broke one or two of these ties in each dtype."""
    if accelerator_form:
        monkeypatch.setattr(batched, "BUCKETED_DEVICES", ())
    params = _params(hash_bits=1, min_collisions=1, sinks=1, local=1, center="hashed-keys")
    t = torch.as_tensor
    differ = []
    for seed in range(12):
        rng = np.random.default_rng(seed)
        for dim in (5, 8, 16):
            q, k = rng.normal(size=(2, 3, 11, dim)).astype(dtype), (3 * rng.normal(size=(2, 3, 13, dim))).astype(dtype)
            draws = _draw(q, k, 6, params, seed=seed, mask="causal")
            weights = batched.log_weights(t(q), t(k), t(draws["hyperplanes"]).to(t(q).dtype), mask="causal",
                                          min_collisions=1, sinks=1, local=1, center="hashed-keys")
            _, candidates = reference.exact_and_candidate_keys(11, 13, 1, 1, "causal")
            for i, j in np.ndindex(2, 3):
                _, sampled, _ = _literal_magicpig(q[i, j].astype(np.float64).tolist(),
                                                  k[i, j].astype(np.float64).tolist(), k[i, j, :, :1].tolist(),
                                                  draws["hyperplanes"][0, i, j].tolist(), scale=1.0, at_least=1,
                                                  sinks=1, local=1, center="hashed-keys", mask="causal")
                rows, cols = np.nonzero(torch.isfinite(weights[0, i, j]).numpy() & candidates)
                if sorted(zip(rows.tolist(), cols.tolist())) != sorted(sampled):
                    differ.append((seed, dim, i, j))
    assert not differ, f"samples unlike the loop's (seed, D, batch element): {differ}"


@pytest.mark.parametrize("bits", [20, 40])
def test_long_codes_in_the_buckets(bits):
    """Codes of 20 bits (an int32 each) and 40 bits (an int64) in the buckets: the sample is the loop's (keys a few
    degrees from the query collide at these K, keys about 17 degrees off agree on some bits and not others, so a
    code cut short would collide wrongly; their negatives never collide)."""
    rng = np.random.default_rng(30 + bits)
    q = rng.normal(size=(2, 3))
    scatter = np.repeat([0.01, 0.3], [4, 26])[:, None]
    near = q[0] + scatter * np.linalg.norm(q[0]) * rng.normal(size=(30, 3))
    k = np.concatenate([q[:1], near, -near, q[:1]])
    params = _params(hash_bits=bits, min_collisions=1, sinks=1, local=1, center="none")
    draws = _draw(q, k, 4, params, seed=31)
    expected, skipped = _literal_pairs(q, k, draws, params, None)
    actual, _ = _sampled_by_batched(q, k, draws, params, None)
    assert actual == expected and expected and skipped


def test_the_bucket_matches_are_listed_in_whole_runs_of_about_a_piece():
    """Runs of sizes 3, 0, 5, 1, 9, 2 (cumulative 3, 3, 8, 9, 18, 20) in pieces of at most 6 matches: a run is never
    split, a run longer than a piece is a piece of its own, and every run is listed once."""
    ends = [3, 3, 8, 9, 18, 20]
    assert batched._runs_in_pieces(ends, 6) == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 6)]
    assert batched._runs_in_pieces(ends, 100) == [slice(0, 6)]
    assert batched._runs_in_pieces(ends, 1) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4), slice(4, 5),
                                                slice(5, 6)]
    assert batched._runs_in_pieces([], 6) == []
    assert batched._pieces(7, 3) == [slice(0, 3), slice(3, 6), slice(6, 7)] and batched._pieces(2, 0) == [
        slice(0, 1), slice(1, 2)]


def test_codes_longer_than_an_int64_are_compared_densely(monkeypatch):
    """K = 63 bits do not fit the buckets' int64 codes: the sampler compares every bit, and samples the loop's
    pairs (keys a few degrees from the query collide even at K = 63; their negatives never do)."""
    def no_buckets(*args, **kwargs):
        raise AssertionError("63-bit codes went to the buckets")

    monkeypatch.setattr(batched, "_sample_in_buckets", no_buckets)
    rng = np.random.default_rng(25)
    q = rng.normal(size=(1, 3))
    near = q + 0.01 * np.linalg.norm(q) * rng.normal(size=(5, 3))
    k = np.concatenate([q, near, -near, q])
    params = _params(hash_bits=63, min_collisions=1, sinks=1, local=1, center="none")
    draws = _draw(q, k, 3, params, seed=26)
    expected, skipped = _literal_pairs(q, k, draws, params, None)
    actual, _ = _sampled_by_batched(q, k, draws, params, None)
    assert actual == expected and expected and skipped


def test_the_host_and_accelerator_forms_sample_the_same_keys(monkeypatch):
    """The paper's defaults (K = 10, L = 150, 4 sinks, 64 local) on the last 64 queries of 2,048 causal keys, two
    replicates, float64: the buckets (host) and the dense comparisons (an accelerator's form, forced here) sample
    the same keys, and the log weights agree to 1e-12 (log u is formed at the sampled pairs alone on the host, at
    every candidate on an accelerator: the same function of the same angle)."""
    rng = np.random.default_rng(27)
    drift = np.cumsum(rng.normal(scale=0.05, size=(2048, 16)), axis=0)  # keys whose mean moves, as in a context
    k = rng.normal(size=(2048, 16)) + drift
    q = rng.normal(size=(64, 16)) + drift[-64:]
    params = _params()
    draws = _draw(q, k, 150, params, replicates=2, seed=28, mask="causal")
    _, on_host = _sampled_by_batched(q, k, draws, params, "causal")
    monkeypatch.setattr(batched, "BUCKETED_DEVICES", ())
    _, on_accelerator = _sampled_by_batched(q, k, draws, params, "causal")
    np.testing.assert_array_equal(torch.isfinite(on_host).numpy(), torch.isfinite(on_accelerator).numpy())
    sampled = torch.isfinite(on_host) & (on_host > 0)
    assert 0 < sampled.sum() < sampled.numel() // 4, "the sampler must keep some candidates and leave most"
    finite = torch.isfinite(on_host)
    assert_close(on_host[finite], on_accelerator[finite], atol=0, rtol=1e-12,
                 what="log weights, host vs accelerator form:")


def _repeated_key_inputs(seed, dim, batch=()):
    """Queries at random and keys that repeat one key (keys 0..11), then, in ``(..., 12, D)``, the same with channel
    0 of each key drawn afresh: identical keys, and keys identical in every channel but one."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(*batch, 6, dim))
    k = np.repeat(rng.normal(size=(*batch, 1, dim)), 12, axis=-2)
    partly = k.copy()
    partly[..., 0] = rng.normal(size=(*batch, 12))
    return q, k, partly, rng.normal(size=(*batch, 12, 3))


@pytest.mark.parametrize("center", CENTERS)
@pytest.mark.parametrize("mask", [None, "causal", "sliding:6"])
def test_the_mean_of_a_constant_channel_is_its_value_in_both_forms(center, mask):
    """Twelve copies of a key (and copies differing in channel 0 alone): the mean of each channel that every key
    averaged holds at one value is that value, bit for bit, in both forms, so those channels centre to exactly 0;
    the other channels' means are the rounded means, unchanged (reference: ``mean``; batched: the row product
    over the count). The rounded mean of twelve copies missed the value by an ulp in some channels, in each form
    in its own way."""
    t = torch.as_tensor
    exact, candidates = reference.exact_and_candidate_keys(6, 12, 1, 2, mask)
    visible = exact | candidates
    rows = visible if center == "all-keys" else candidates
    for seed in range(4):
        _, k, partly, _ = _repeated_key_inputs(seed, 5)
        for keys in (k, partly):
            ref = reference.centering_means(keys, visible, candidates, center)
            bat = batched._centering_means(t(keys), t(visible), t(candidates), center).numpy()
            if center == "none":
                assert not ref.any() and not bat.any()
                continue
            weights = t(rows).to(torch.float64)
            plain_batched = ((weights @ t(keys)) / weights.sum(-1, keepdim=True).clamp(min=1)).numpy()
            for n in np.flatnonzero(rows.any(-1)):
                assert np.array_equal(ref[n, 1:], keys[0, 1:]) and np.array_equal(bat[n, 1:], keys[0, 1:])
                if keys is partly and rows[n].sum() > 1:  # channel 0 varies: the rounded mean, as before
                    assert ref[n, 0] == keys[rows[n]].mean(axis=-2)[0] and bat[n, 0] == plain_batched[n, 0]


def test_ordinary_centring_means_are_the_rounded_means_bit_for_bit():
    """Keys at random (no channel constant over two keys): both forms' means are the plain rounded means, bit for bit
    (the rule for constant channels changes nothing else), under every mask and centring."""
    rng = np.random.default_rng(40)
    k = rng.normal(size=(2, 20, 7))
    t = torch.as_tensor
    for mask in (None, "causal", "sliding:5"):
        exact, candidates = reference.exact_and_candidate_keys(9, 20, 2, 3, mask)
        visible = exact | candidates
        for center in ("all-keys", "hashed-keys"):
            rows = visible if center == "all-keys" else candidates
            plain = np.zeros((2, 9, 7))
            for n in np.flatnonzero(rows.any(-1)):
                plain[:, n] = k[:, rows[n]].mean(axis=-2)
            assert np.array_equal(reference.centering_means(k, visible, candidates, center), plain)
            weights = t(rows).to(torch.float64)
            counts = weights.sum(-1, keepdim=True)
            plain_batched = (weights @ t(k)) / torch.where(counts > 0, counts, torch.ones_like(counts))
            assert torch.equal(batched._centering_means(t(k), t(visible), t(candidates), center), plain_batched)


@pytest.mark.parametrize("accelerator_form", [False, True])
@pytest.mark.parametrize("center", CENTERS)
@pytest.mark.parametrize("mask", [None, "causal", "sliding:6"])
def test_repeated_keys_are_sampled_and_weighed_alike_in_both_forms(center, mask, accelerator_form, monkeypatch):
    """Twelve copies of one key, N = 6, K = 2, 1 sink, 2 local (and copies differing in channel 0 alone), batch
    (2,) and D = 4, 5, 8, 16: a copy centres to exactly 0 in both forms, so it hashes to the all-zero code and
    makes the angle pi/2 with every query in both, and the forms agree to 1e-10 in float64. Before the constant
    channels' means were exact, the centred copies were rounding noise that differed between numpy and torch, and
    so did their codes and angles (0.8 apart centred on all keys, 0.7 on the hashed keys)."""
    if accelerator_form:
        monkeypatch.setattr(batched, "BUCKETED_DEVICES", ())
    params = _params(hash_bits=2, sinks=1, local=2, center=center)
    t = torch.as_tensor
    for seed, dim in enumerate((4, 5, 8, 16)):
        q, k, partly, v = _repeated_key_inputs(seed, dim, batch=(2,))
        for keys in (k, partly):
            draws = _draw(q, keys, 8, params, replicates=3, seed=seed, mask=mask)
            ref_out, ref_probs = reference.estimate_with_probabilities(q, keys, v, draws, **params, **_mask_kw(mask))
            out, probs = batched.estimate_with_probabilities(t(q), t(keys), t(v), draws.to_torch(), **params,
                                                             **_mask_kw(mask))
            what = f"D={dim}, {'partly ' if keys is partly else ''}repeated keys, {center}, mask={mask}:"
            assert_close(probs, ref_probs, atol=1e-10, rtol=1e-10, what=f"probabilities, {what}")
            assert_close(out, ref_out, atol=1e-10, rtol=1e-10, what=f"output, {what}")
