"""Causal RFA / Performer (ARCHITECTURE sec. 12; Performer App. B.1 eq. 11): the chunked prefix sums
(``rfa.causal`` over ``snis.prefix``) against the literal masked reference and against a loop over queries
written out here, independently of the package.

Tolerances: float64 batched == reference to 1e-10 (summation order alone gives ~1e-15, ARCHITECTURE sec. 3);
the explicit-feature loop agrees to 1e-12 at the small norms where its features cannot overflow; float32
at key norms 150-200 within ``8 L eps32 max|v|``, the rounding of a logit of size L (the conformance kit's
bound, ``randattn.testing.checks``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.features import DATA_DEPENDENT_MAPS, FEATURE_MAPS
from randattn.estimators.rfa import SPEC
from randattn.estimators.rfa import batched as rfa_batched
from randattn.estimators.rfa import reference as rfa_ref
from randattn.estimators.rfa.causal import causal_estimate
from randattn.estimators.sampling import sphere_project
from randattn.estimators.snis import NonPositiveDenominatorWarning
from randattn.testing import assert_close

EPS32 = float(np.finfo(np.float32).eps)
CAUSAL_MAPS = tuple(f for f in FEATURE_MAPS if f not in DATA_DEPENDENT_MAPS)
#: every registered variant the causal mask applies to (the data-dependent maps are refused, tested below)
CAUSAL_VARIANTS = {name: params for name, params in SPEC.variants.items() if params["feature_map"] in CAUSAL_MAPS}
#: (N, M): self-attention, a prompt of M - N keys before the queries, odd sizes and one query
SHAPES = [(13, 13), (13, 20), (1, 6)]
#: chunk sizes: 1 (state only), 4 (does not divide N = 13), 32 (larger than N: one padded chunk)
CHUNKS = [1, 4, 32]


def _inputs(seed: int, n: int, m: int, *, batch=(2,), d=5, dv=3, size=0.5):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((*batch, n, d)) * size, rng.standard_normal((*batch, m, d)) * size,
            rng.standard_normal((*batch, m, dv)))


def _t(*arrays, dtype=torch.float64):
    return [torch.as_tensor(a, dtype=dtype) for a in arrays]


def _quiet(func):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonPositiveDenominatorWarning)
        return func()


# ------------------------------------------------------------------------------ an independent computation
def _explicit_features(feature_map: str, x: np.ndarray, omega: np.ndarray) -> np.ndarray:
    """phi(x) : (..., T, S, L) exponentiated directly (Performer sec. 2.3, Lemma 1; safe at small norms)."""
    if feature_map == "regularized":
        feature_map, omega = "positive", sphere_project(omega, omega.shape[-1])
    proj = x @ np.swapaxes(omega, -1, -2)  # (..., T, S)
    half = 0.5 * (x * x).sum(-1, keepdims=True)
    if feature_map == "positive":
        return np.exp(proj - half)[..., None]
    if feature_map == "hyperbolic":
        return np.stack([np.exp(proj - half), np.exp(-proj - half)], axis=-1) / np.sqrt(2.0)
    assert feature_map == "trigonometric"
    return np.stack([np.sin(proj), np.cos(proj)], axis=-1) * np.exp(half)[..., None]


def _loop_rfa(q, k, v, omega, feature_map, *, offset=0):
    """Causal RFA as a loop over queries: y_n = sum_{m visible} K_nm v_m / sum_{m visible} K_nm with the kernel
    estimate K_nm = sum_s phi(x_n, w_s) . phi(y_m, w_s); key m visible iff m <= n + (M - N) + ``offset``
    (offset 0 is the causal mask; +-1 are the off-by-one mistakes the negative controls plant).

    ``q : (B, N, D)``, ``omega : (R, B, S, D)`` -> (R, B, N, Dv); NaN for a query that sees no key."""
    scale = q.shape[-1] ** -0.5
    x, y = q * np.sqrt(scale), k * np.sqrt(scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = np.full((omega.shape[0], *v.shape[:-2], n_q, v.shape[-1]), np.nan)
    for r in range(omega.shape[0]):
        for b in range(q.shape[0]):
            phi_x = _explicit_features(feature_map, x[b], omega[r, b])
            phi_y = _explicit_features(feature_map, y[b], omega[r, b])
            kernel = np.einsum("nsl,msl->nm", phi_x, phi_y)
            for n in range(n_q):
                last = n + (n_k - n_q) + offset
                if last < 0:
                    continue
                weights = kernel[n, : last + 1]
                out[r, b, n] = weights @ v[b, : last + 1] / weights.sum()
    return out


@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
@pytest.mark.parametrize("n, m", [(7, 7), (5, 9)], ids=["N7-M7", "N5-M9"])
def test_reference_and_batched_equal_the_loop_over_queries(feature_map, n, m):
    q, k, v = _inputs(1, n, m)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=2, replicates=2, feature_map=feature_map,
                          mask="causal")
    expected = _loop_rfa(q, k, v, draws["omega"], feature_map)
    ref = _quiet(lambda: rfa_ref.estimate(q, k, v, draws, feature_map=feature_map, mask="causal"))
    assert_close(ref, expected, atol=1e-12, rtol=1e-12, what="reference vs loop:")
    for chunk in (1, 2, 4):
        got = _quiet(lambda: causal_estimate(*_t(q, k, v), draws.to_torch(), feature_map=feature_map,
                                             chunk_size=chunk))
        assert_close(got, expected, atol=1e-12, rtol=1e-12, what=f"batched (chunk {chunk}) vs loop:")


@pytest.mark.parametrize("offset", [-1, 1], ids=["m<n", "m<=n+1"])
def test_negative_control_an_off_by_one_mask_fails_the_comparison(offset):
    """The comparison above can fail: a loop whose mask is off by one (m < n, or m <= n + 1) differs from
    both forms by far more than the tolerance (query 0 sees no key under m < n and is left out)."""
    q, k, v = _inputs(3, 9, 9)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=4, mask="causal")
    wrong = _loop_rfa(q, k, v, draws["omega"], "positive", offset=offset)[..., 1:, :]
    ref = rfa_ref.estimate(q, k, v, draws, mask="causal")[..., 1:, :]
    got = causal_estimate(*_t(q, k, v), draws.to_torch()).numpy()[..., 1:, :]
    for ours in (ref, got):
        assert np.abs(ours - wrong).max() > 1e-3
        with pytest.raises(AssertionError, match="not close"):
            assert_close(ours, wrong, atol=1e-12, rtol=1e-12)


# ------------------------------------------------------------------------------ batched against the reference
@pytest.mark.parametrize("variant", sorted(CAUSAL_VARIANTS))
def test_batched_equals_reference_for_every_variant(variant):
    """Same draws, float64: the prefix sums equal the literal masked sums to 1e-10 for every chunk size,
    N = M and M > N (a prompt folded into the initial state), replicates and batch dims."""
    params = CAUSAL_VARIANTS[variant]
    for n, m in SHAPES:
        q, k, v = _inputs(5, n, m)
        draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=6, replicates=2, mask="causal", **params)
        ref = _quiet(lambda: rfa_ref.estimate(q, k, v, draws, mask="causal", **params))
        assert np.isfinite(ref).all()
        for chunk in CHUNKS:
            got = _quiet(lambda: causal_estimate(*_t(q, k, v), draws.to_torch(), chunk_size=chunk,
                                                 feature_map=params["feature_map"]))
            assert_close(got, ref, atol=1e-10, rtol=1e-10, what=f"{variant} N={n} M={m} chunk {chunk}:")
        via_spec = _quiet(lambda: SPEC.batched(*_t(q, k, v), draws.to_torch(), mask="causal", **params))
        assert_close(via_spec, ref, atol=1e-10, rtol=1e-10, what=f"{variant} N={n} M={m} through the spec:")


def test_many_groups_and_chunks_match_the_reference():
    """N = 700 queries after a prompt of 300 keys: several vectorized groups of chunks and the prompt's own
    groups, at a chunk size that divides neither (the group boundaries and the padding of the last chunk)."""
    q, k, v = _inputs(7, 700, 1000, batch=(), d=4, dv=2, size=0.6)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=256, seed=8, mask="causal")
    picks = [0, 1, 63, 64, 299, 511, 699]
    # the literal reference of query n alone: one query over keys 0..n + M - N (its visible keys)
    expected = np.stack([rfa_ref.estimate(q[n : n + 1], k[: n + 301], v[: n + 301], draws, mask="causal")[0, 0]
                         for n in picks])
    for chunk in (16, 64):
        got = causal_estimate(*_t(q, k, v), draws.to_torch(), chunk_size=chunk)[0].numpy()
        assert_close(got[picks], expected, atol=1e-10, rtol=1e-10, what=f"chunk {chunk}:")


def _operator_count(n: int, chunk: int, feature_map: str) -> int:
    """The aten operators one causal_estimate call dispatches (TorchDispatchMode sees every one)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    q, k, v = _t(*_inputs(9, n, n, batch=(), d=4, dv=2))
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=8, seed=10, mask="causal").to_torch()
    with Count():
        _quiet(lambda: causal_estimate(q, k, v, draws, feature_map=feature_map, chunk_size=chunk))
    return Count.calls


@pytest.mark.parametrize("feature_map", ["positive", "trigonometric"])
def test_the_operators_do_not_grow_with_the_number_of_chunks(feature_map):
    """Chunkwise-parallel: 8 and 128 chunks of 4 tokens (one vectorized group either way, at S = 8 and 1 head)
    dispatch the same operators, a fixed count: no Python loop over the chunks (the prefix sums of the chunks'
    key states are one masked product, not a chunk-by-chunk update); the only loop left is over the log2 C
    dyadic levels inside a chunk."""
    few, many = _operator_count(32, 4, feature_map), _operator_count(512, 4, feature_map)
    assert few == many, f"{few} operators for 8 chunks, {many} for 128"


# ------------------------------------------------------------------------------ what the mask implies
@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
@pytest.mark.parametrize("n, m", [(10, 10), (6, 10)], ids=["N10-M10", "N6-M10"])
def test_junk_after_the_last_visible_key_changes_nothing(feature_map, n, m):
    """Keys and values a query may not see are replaced by junk (norms x 50, values x 1e3): its output is
    bit-identical, in the reference and in the batched form (whose stabilizers never look past the query)."""
    q, k, v = _inputs(9, n, m)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=10, feature_map=feature_map, mask="causal")
    ref = _quiet(lambda: rfa_ref.estimate(q, k, v, draws, feature_map=feature_map, mask="causal"))
    bat = _quiet(lambda: causal_estimate(*_t(q, k, v), draws.to_torch(), feature_map=feature_map, chunk_size=4))
    rng = np.random.default_rng(11)
    for cut in (0, n // 2, n - 2):
        hidden = slice(cut + (m - n) + 1, None)
        k2, v2 = k.copy(), v.copy()
        k2[..., hidden, :] = rng.standard_normal(k2[..., hidden, :].shape) * 50
        v2[..., hidden, :] = rng.standard_normal(v2[..., hidden, :].shape) * 1e3
        ref2 = _quiet(lambda: rfa_ref.estimate(q, k2, v2, draws, feature_map=feature_map, mask="causal"))
        bat2 = _quiet(lambda: causal_estimate(*_t(q, k2, v2), draws.to_torch(), feature_map=feature_map,
                                              chunk_size=4))
        assert np.array_equal(ref[..., : cut + 1, :], ref2[..., : cut + 1, :])
        assert torch.equal(bat[..., : cut + 1, :], bat2[..., : cut + 1, :])


def test_junk_keys_with_huge_norms_change_nothing_in_float32():
    """A later key of norm 1e4 would overflow any exponent taken relative to it: the earlier outputs keep every
    bit in float32 too, and stay finite."""
    q, k, v = _inputs(12, 64, 64, batch=(3,), d=8, dv=4, size=1.0)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=16, seed=13, mask="causal")
    k2 = k.copy()
    k2[..., 40:, :] *= 1e4 / np.linalg.norm(k2[..., 40:, :], axis=-1, keepdims=True)
    out = causal_estimate(*_t(q, k, v, dtype=torch.float32), draws.to_torch(dtype=torch.float32))
    out2 = causal_estimate(*_t(q, k2, v, dtype=torch.float32), draws.to_torch(dtype=torch.float32))
    assert torch.isfinite(out).all() and torch.isfinite(out2[..., :40, :]).all()
    assert torch.equal(out[..., :40, :], out2[..., :40, :])


@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
def test_one_visible_key_returns_its_value(feature_map):
    """Query 0 of self-attention sees key 0 only: a weight divided by itself, v_0 to a few roundings."""
    q, k, v = _inputs(14, 8, 8)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=16, seed=15, replicates=3, feature_map=feature_map)
    expected = np.broadcast_to(v[..., 0, :], (3, *v.shape[:-2], v.shape[-1]))
    ref = _quiet(lambda: rfa_ref.estimate(q, k, v, draws, feature_map=feature_map, mask="causal"))
    bat = _quiet(lambda: causal_estimate(*_t(q, k, v), draws.to_torch(), feature_map=feature_map))
    assert_close(ref[..., 0, :], expected, atol=0.0, rtol=1e-15, what="reference:")
    assert_close(bat[..., 0, :], expected, atol=0.0, rtol=1e-15, what="batched:")


@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
@pytest.mark.parametrize("n, m", [(11, 11), (4, 11)], ids=["N11-M11", "N4-M11"])
def test_last_query_equals_the_bidirectional_output(feature_map, n, m):
    """The last query sees every key: with the same draws it equals the bidirectional estimate."""
    q, k, v = _inputs(16, n, m)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=17, feature_map=feature_map)
    both = _quiet(lambda: rfa_ref.estimate(q, k, v, draws, feature_map=feature_map))[..., -1, :]
    ref = _quiet(lambda: rfa_ref.estimate(q, k, v, draws, feature_map=feature_map, mask="causal"))[..., -1, :]
    bat = _quiet(lambda: causal_estimate(*_t(q, k, v), draws.to_torch(), feature_map=feature_map))[..., -1, :]
    assert_close(ref, both, atol=1e-12, rtol=1e-12, what="reference:")
    assert_close(bat, both, atol=1e-10, rtol=1e-10, what="batched:")


# ------------------------------------------------------------------------------ numerics at real key norms
def _norms_150_200(rng, shape):
    a = rng.standard_normal(shape)
    return a / np.linalg.norm(a, axis=-1, keepdims=True) * rng.uniform(150, 200, (*shape[:-1], 1))


def _float32_tolerance(q, k, v) -> float:
    """``8 L eps32 max|v|`` with L the largest logit size (``|s q.k| <= s |q| |k|``, ``s |q|^2``, ``s |k|^2``)."""
    scale = q.shape[-1] ** -0.5
    qn, kn = np.linalg.norm(q, axis=-1).max(), np.linalg.norm(k, axis=-1).max()
    return 8 * scale * max(qn * kn, qn * qn, kn * kn) * EPS32 * np.abs(v).max()


@pytest.mark.parametrize("feature_map", ["positive", "hyperbolic", "regularized"])
def test_key_norms_150_to_200_small(feature_map):
    """Query and key norms 150-200 (exp(x.y) overflows float64 far below): float64 batched equals the
    reference to 1e-10, float32 is finite and within the rounding of its logits."""
    rng = np.random.default_rng(18)
    q, k = _norms_150_200(rng, (2, 50, 16)), _norms_150_200(rng, (2, 60, 16))
    v = rng.standard_normal((2, 60, 4))
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=16, seed=19, feature_map=feature_map)
    ref = rfa_ref.estimate(q, k, v, draws, feature_map=feature_map, mask="causal")
    assert np.isfinite(ref).all()
    bat64 = causal_estimate(*_t(q, k, v), draws.to_torch(), feature_map=feature_map, chunk_size=8)
    assert_close(bat64, ref, atol=1e-10 * np.abs(v).max(), rtol=1e-10, what="float64:")
    bat32 = causal_estimate(*_t(q, k, v, dtype=torch.float32), draws.to_torch(dtype=torch.float32),
                            feature_map=feature_map, chunk_size=8)
    assert torch.isfinite(bat32).all()
    assert_close(bat32, ref, atol=_float32_tolerance(q, k, v), rtol=0.0, what="float32:")


def test_key_norms_150_to_200_at_16384_tokens_and_6_heads():
    """N = M = 16384, 6 heads, key and query norms 150-200, S = 64, float32: the batched form is finite, and at
    queries spread over the sequence (chunk and group boundaries included) within ``8 L eps32 max|v|`` of the
    literal float64 reference of that query (one query over its visible keys, O(N S Dv) each)."""
    rng = np.random.default_rng(20)
    n, heads = 16384, 6
    q, k = _norms_150_200(rng, (heads, n, 64)), _norms_150_200(rng, (heads, n, 64))
    v = rng.standard_normal((heads, n, 64))
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=64, seed=21, mask="causal")
    picks = [0, 31, 32, 8191, n - 1]
    expected = np.stack([rfa_ref.estimate(q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], draws, mask="causal")[0, :, 0]
                         for i in picks], axis=-2)  # (heads, picks, Dv)
    out32 = causal_estimate(*_t(q, k, v, dtype=torch.float32), draws.to_torch(dtype=torch.float32))[0]
    assert torch.isfinite(out32).all()
    assert_close(out32[:, picks], expected, atol=_float32_tolerance(q, k, v), rtol=0.0, what="float32:")


# ------------------------------------------------------------------------------ memory
def test_no_n_by_m_and_no_n_by_s_by_dv_allocation():
    """N = M = 8192, S = 64, Dv = 64 (float32): the peak working memory beyond the inputs
    (:func:`randattn.analysis.memory.measure_peak`, output included) stays below a quarter of one float32
    N x S x Dv array (128 MiB); an N x M matrix would be 256 MiB."""
    from randattn.analysis.memory import measure_peak

    n, s, dv = 8192, 64, 64
    gen = torch.Generator().manual_seed(22)
    q, k = torch.randn(n, 64, generator=gen), torch.randn(n, 64, generator=gen)
    v = torch.randn(n, dv, generator=gen)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=s, seed=23, mask="causal").to_torch(dtype=torch.float32)
    inputs = (q, k, v, draws["omega"])

    def run():
        for t in inputs:
            t.view(t.shape)  # measure_peak counts a storage when an operator first returns it: register the inputs
        causal_estimate(q, k, v, draws)

    extra = measure_peak(run, torch_tensors=True) - sum(t.untyped_storage().nbytes() for t in inputs)
    assert 0 < extra < n * s * dv * 4 / 4, f"peak beyond the inputs {extra / 2**20:.1f} MiB"


# ------------------------------------------------------------------------------ signed features, refusals, API
def test_non_positive_causal_denominators_are_reported_not_hidden():
    """Trigonometric features with one sample: a prefix's signed denominator often vanishes or turns negative.
    Both forms warn (no epsilon is added), and agree where the denominators are positive."""
    q, k, v = _inputs(24, 12, 12, size=1.5)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=1, seed=25, replicates=4)
    with pytest.warns(NonPositiveDenominatorWarning):
        ref = rfa_ref.estimate(q, k, v, draws, feature_map="trigonometric", mask="causal")
    with pytest.warns(NonPositiveDenominatorWarning):
        bat = rfa_batched.estimate(*_t(q, k, v), draws.to_torch(), feature_map="trigonometric", mask="causal")
    finite = np.isfinite(ref)
    assert_close(bat.numpy()[finite], ref[finite], atol=1e-8, rtol=1e-8)


@pytest.mark.parametrize("feature_map", DATA_DEPENDENT_MAPS)
def test_data_dependent_maps_are_refused_under_the_causal_mask(feature_map):
    """OPRF's A* and SDERF's (A, B) are fitted from every token: a causal form would let later tokens move
    earlier outputs. The spec declares it per configuration (the conformance kit then skips its causal check),
    and draw, the reference and the batched form refuse, naming the feature map."""
    assert not SPEC.supports_mask("causal", SPEC.resolve_params({"feature_map": feature_map}))
    assert all(SPEC.supports_mask("causal", SPEC.resolve_params(params)) for params in CAUSAL_VARIANTS.values())
    q, k, v = _inputs(26, 5, 5)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=4, seed=27, feature_map=feature_map)
    with pytest.raises(ValueError, match=f"feature_map='{feature_map}' has no causal form"):
        randattn.estimate("rfa", q, k, v, num_samples=4, seed=0, feature_map=feature_map, mask="causal")
    with pytest.raises(ValueError, match="feature_map"):
        SPEC.draw(q.shape, k.shape, num_samples=4, rng=np.random.default_rng(0), feature_map=feature_map,
                  mask="causal")
    with pytest.raises(ValueError, match="feature_map"):
        rfa_ref.estimate(q, k, v, draws, feature_map=feature_map, mask="causal")
    with pytest.raises(ValueError, match="feature_map"):
        rfa_batched.estimate(*_t(q, k, v), draws.to_torch(), feature_map=feature_map, mask="causal")


def test_bad_mask_shapes_and_chunk_size_name_the_problem():
    q, k, v = _inputs(28, 6, 4)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=4, seed=29)
    with pytest.raises(ValueError, match="mask"):
        rfa_batched.estimate(*_t(q, k, v), draws.to_torch(), mask="sideways")
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        rfa_ref.estimate(q, k, v, draws, mask="causal")
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        causal_estimate(*_t(q, k, v), draws.to_torch())
    with pytest.raises(ValueError, match="chunk_size must be a positive power of two"):
        causal_estimate(*_t(k, k, v), draws.to_torch(), chunk_size=24)


def test_estimate_through_the_api_reference_and_torch_agree():
    q, k, v = _inputs(30, 9, 12)
    kwargs = dict(num_samples=16, seed=31, replicates=2, mask="causal", coupling="orthogonal")
    ref = randattn.estimate("rfa", q, k, v, **kwargs)
    bat = randattn.estimate("rfa", q, k, v, backend="torch", dtype=torch.float64, **kwargs)
    assert_close(bat, ref, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
def test_causal_probabilities_are_masked_and_reproduce_the_estimate(feature_map):
    """Under the mask the implied probabilities are 0 at every hidden key, their rows sum to 1 (for positive
    features), ``probabilities @ v`` is the causal estimate, and the pair of ``estimate_with_probabilities``
    holds the same; the rank-J factors do not exist (None)."""
    q, k, v = _inputs(32, 9, 12)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=16, seed=33, replicates=2).to_torch()
    tq, tk, tv = _t(q, k, v)
    params = {"feature_map": feature_map, "mask": "causal"}
    probs = _quiet(lambda: SPEC.forms.get("probabilities")(tq, tk, draws, **params)).numpy()
    out = _quiet(lambda: SPEC.batched(tq, tk, tv, draws, **params)).numpy()
    from randattn.estimators.masks import causal_visible

    hidden = ~causal_visible(9, 12)
    assert (probs[..., hidden] == 0).all()
    if feature_map != "trigonometric":
        assert_close(probs.sum(-1), np.ones(probs.shape[:-1]), atol=1e-12, rtol=0)
    assert_close(probs @ v, out, atol=1e-12, rtol=1e-12, what="probabilities @ v vs estimate:")
    pair = _quiet(lambda: SPEC.forms.get("estimate_with_probabilities")(tq, tk, tv, draws, **params))
    # the pair's estimate is the prefix sums' (the same bits, whether or not probabilities are asked for)
    assert torch.equal(pair[1], torch.as_tensor(probs)) and torch.equal(pair[0], torch.as_tensor(out))
    assert SPEC.forms.get("estimate_with_probability_factors")(tq, tk, tv, draws, **params) is None


def _loop_probabilities(q, k, omega, feature_map):
    """The implied causal probabilities written out: K_nm / sum_{m' visible} K_nm' with the explicit-feature
    kernel of :func:`_loop_rfa`, 0 at hidden keys. ``q : (B, N, D)``, ``omega : (R, B, S, D)`` -> (R, B, N, M)."""
    scale = q.shape[-1] ** -0.5
    x, y = q * np.sqrt(scale), k * np.sqrt(scale)
    n_q, n_k = q.shape[-2], k.shape[-2]
    out = np.zeros((omega.shape[0], q.shape[0], n_q, n_k))
    for r in range(omega.shape[0]):
        for b in range(q.shape[0]):
            kernel = np.einsum("nsl,msl->nm", _explicit_features(feature_map, x[b], omega[r, b]),
                               _explicit_features(feature_map, y[b], omega[r, b]))
            for n in range(n_q):
                last = n + n_k - n_q
                out[r, b, n, : last + 1] = kernel[n, : last + 1] / kernel[n, : last + 1].sum()
    return out


@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
@pytest.mark.parametrize("n, m", [(1, 1), (13, 13), (16, 16), (17, 20), (5, 40)],
                         ids=["N1", "N13", "N16-power-of-two", "N17-M20", "N5-M40"])
def test_dense_causal_probabilities_equal_the_loop_in_many_groups(feature_map, n, m, monkeypatch):
    """The dense dyadic weights (``snis.prefix.causal_feature_weights``) against the probabilities written out
    query by query, 1e-10 (float64, small norms where the explicit features cannot overflow): with the triangle
    padded to a power of two or not, a prompt of M - N keys, and the (replicate, head) slices cut into groups
    of one and of three."""
    from randattn.estimators.snis import prefix

    q, k, _ = _inputs(40, n, m, batch=(2,), d=4, size=0.6)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=6, seed=41, replicates=3, feature_map=feature_map)
    expected = _loop_probabilities(q, k, draws["omega"], feature_map)
    for elements in (1, 3 * 4 * 32 * 8 * 2, prefix._GROUP_ELEMENTS):
        monkeypatch.setattr(prefix, "_GROUP_ELEMENTS", elements)
        got = _quiet(lambda: rfa_batched.probabilities(*_t(q, k), draws.to_torch(), feature_map=feature_map,
                                                       mask="causal"))
        assert_close(got, expected, atol=1e-10, rtol=1e-10, what=f"group of {elements} elements:")


@pytest.mark.parametrize("n, m", [(16, 16), (13, 13), (8, 11)], ids=["in-place", "padded", "prompt"])
def test_dense_causal_weights_write_every_entry(n, m):
    """The weights overwrite a NaN-filled output everywhere: the hidden keys (above the diagonal) get exact 0s,
    whether the triangle is written in place (N a power of two) or through a padded scratch."""
    from randattn.estimators.snis.prefix import causal_feature_weights

    rng = np.random.default_rng(47)
    lq, lk = (torch.as_tensor(rng.standard_normal((3, t, 5))) for t in (n, m))
    out = torch.full((3, n, m), float("nan"), dtype=torch.float64)
    weights = causal_feature_weights(lq, None, lk, None, out=out)
    from randattn.estimators.masks import causal_visible

    visible = torch.as_tensor(causal_visible(n, m))
    assert weights.data_ptr() == out.data_ptr() and not torch.isnan(out).any()
    assert (out[:, ~visible] == 0).all() and (out[:, visible] > 0).all()


@pytest.mark.parametrize("feature_map", CAUSAL_MAPS)
def test_dense_causal_probabilities_ignore_junk_after_the_query(feature_map):
    """Keys a query may not see replaced by junk (norms x 50): its row of the dense probabilities keeps every
    bit, in float64 and in float32 (no stabilizer is taken over a later key)."""
    n = m = 21
    q, k, _ = _inputs(42, n, m)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=32, seed=43, feature_map=feature_map)
    rng = np.random.default_rng(44)
    for dtype in (torch.float64, torch.float32):
        probs = _quiet(lambda: rfa_batched.probabilities(*_t(q, k, dtype=dtype), draws.to_torch(dtype=dtype),
                                                         feature_map=feature_map, mask="causal"))
        for cut in (0, 7, 16):
            k2 = k.copy()
            k2[..., cut + 1 :, :] = rng.standard_normal(k2[..., cut + 1 :, :].shape) * 50
            probs2 = _quiet(lambda: rfa_batched.probabilities(*_t(q, k2, dtype=dtype), draws.to_torch(dtype=dtype),
                                                              feature_map=feature_map, mask="causal"))
            assert torch.equal(probs[..., : cut + 1, :], probs2[..., : cut + 1, :]), (dtype, cut)


@pytest.mark.parametrize("n", [48, 32], ids=["self", "prompt-of-16"])
def test_dense_causal_probabilities_at_key_norms_150_to_200_in_float32(n):
    """Real key norms: the float32 dense probabilities are finite, rows sum to 1 within M eps32, and agree
    with the float64 ones within 8 L eps32 (L the largest logit, the conformance kit's bound). The keys
    grow from norm 150 to 200 along the sequence, so the prompt's keys (seen by all) and the later ones
    have per-feature maxima thousands of octaves apart: a stabilizer missing either side overflows."""
    rng = np.random.default_rng(45)
    q = rng.standard_normal((3, n, 16))
    k = rng.standard_normal((3, 48, 16))
    k *= np.linspace(150, 200, 48)[:, None] / np.linalg.norm(k, axis=-1, keepdims=True)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=64, seed=46)
    p64 = rfa_batched.probabilities(*_t(q, k), draws.to_torch(), mask="causal")
    p32 = rfa_batched.probabilities(*_t(q, k, dtype=torch.float32), draws.to_torch(dtype=torch.float32),
                                    mask="causal")
    assert torch.isfinite(p32).all()
    assert_close(p32.sum(-1).double(), torch.ones(p32.shape[:-1], dtype=torch.float64), atol=48 * EPS32, rtol=0)
    logit = float(np.abs(q @ np.swapaxes(k, -1, -2)).max()) * 16**-0.5
    assert_close(p32.double(), p64, atol=8 * logit * EPS32, rtol=0)


def test_bidirectional_path_is_untouched_by_the_mask_argument():
    """mask=None (and no mask at all) gives the bidirectional estimate bit for bit, through every entry point."""
    q, k, v = _inputs(34, 9, 12)
    draws = randattn.draw("rfa", q.shape, k.shape, num_samples=16, seed=35)
    tq, tk, tv = _t(q, k, v)
    tdraws = draws.to_torch()
    assert np.array_equal(rfa_ref.estimate(q, k, v, draws), rfa_ref.estimate(q, k, v, draws, mask=None))
    assert torch.equal(SPEC.batched(tq, tk, tv, tdraws), SPEC.batched(tq, tk, tv, tdraws, mask=None))
    assert torch.equal(SPEC.forms.get("probabilities")(tq, tk, tdraws),
                       SPEC.forms.get("probabilities")(tq, tk, tdraws, mask=None))


@pytest.mark.parametrize("n, m", [(5, 5), (4, 9)])
@pytest.mark.parametrize("signed", [False, True])
def test_snis_feature_attention_causal_mask_is_the_visible_sum_written_out(n, m, signed):
    """``snis.reference.feature_attention(..., mask="causal")`` against Performer App. B.1 eq. 11 written out here
    with explicit features: query n sums ``a_nj b_mj v_m`` over the keys ``m <= n + M - N`` only. Small
    log-features, so the plain exponentials cannot overflow; 1e-12, the float64 rounding of a few dozen sums."""
    from randattn.estimators.snis.reference import feature_attention

    rng = np.random.default_rng(36)
    log_qf, log_kf = rng.normal(size=(2, n, 3, 2)), rng.normal(size=(2, m, 3, 2))
    v = rng.normal(size=(2, m, 4))
    q_sign = np.where(rng.random(log_qf.shape) < 0.2, -1.0, 1.0) if signed else None
    a = np.exp(log_qf).reshape(2, n, -1) * (1.0 if q_sign is None else q_sign.reshape(2, n, -1))
    b = np.exp(log_kf).reshape(2, m, -1)
    expected = np.empty((2, n, 4))
    for i in range(n):
        last = i + m - n  # the query's last visible key
        weights = a[:, i, None, :] * b[:, : last + 1, :]  # (2, keys seen, J)
        expected[:, i] = (weights.sum(-1)[..., None] * v[:, : last + 1]).sum(1) / weights.sum((-1, -2))[:, None]
    out, sign = feature_attention(log_qf, log_kf, v, q_sign=q_sign, mask="causal")
    assert_close(out, expected, atol=1e-12, rtol=1e-12)
    bidirectional, _ = feature_attention(log_qf, log_kf, v, q_sign=q_sign)
    assert not np.allclose(out[:, :-1], bidirectional[:, :-1])  # the mask changes every query but the last
    assert np.array_equal(sign, np.ones((2, n))) or signed


def test_snis_feature_attention_refuses_a_mask_it_has_no_form_for():
    from randattn.estimators.snis.reference import feature_attention

    rng = np.random.default_rng(37)
    with pytest.raises(ValueError, match=r"mask='sliding:2' is not allowed; choose one of None, 'causal'"):
        feature_attention(rng.normal(size=(3, 2, 1)), rng.normal(size=(4, 2, 1)), rng.normal(size=(4, 2)),
                          mask="sliding:2")


def test_snis_causal_feature_attention_is_deprecated_for_the_mask_argument():
    """The former name still answers, with a DeprecationWarning naming its replacement and the caller's line."""
    from randattn.estimators.snis import reference as snis_ref

    rng = np.random.default_rng(38)
    log_qf, log_kf, v = rng.normal(size=(3, 2, 1)), rng.normal(size=(5, 2, 1)), rng.normal(size=(5, 2))
    with pytest.warns(DeprecationWarning, match=r'feature_attention\(.*mask="causal"\)') as caught:
        old = snis_ref.causal_feature_attention(log_qf, log_kf, v)
    assert caught[0].filename == __file__
    new = snis_ref.feature_attention(log_qf, log_kf, v, mask="causal")
    assert all(np.array_equal(a, b) for a, b in zip(old, new))
    assert "causal_feature_attention" not in snis_ref.__all__
