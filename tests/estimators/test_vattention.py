"""vAttention: the conformance kit, a literal per-query loop, batched == reference, unbiased residual sums, the
adaptive sample size written out by hand, keys_used by hand, large norms, bad inputs.

Every expected value comes from an independent computation (the loop below, the budget formula by hand with
scipy's normal quantile, softmax written out here), never from the function under test.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
from scipy.stats import norm

import randattn
from randattn.estimators.base import Draws
from randattn.estimators.vattention import OFFICIAL_CODE, SPEC, batched, draw, reference
from randattn.testing import TOLERANCES, assert_close, parametrize_with_checks

SMALL_FIXED = SPEC.variants["fixed-small"]
SMALL_ADAPTIVE = SPEC.variants["adaptive-small"]
SMALL_OFFICIAL = SPEC.variants["official-code-small"]
CONFIGS = {"default": {}, "fixed-small": SMALL_FIXED, "adaptive-small": SMALL_ADAPTIVE,
           "official-code-small": SMALL_OFFICIAL}
#: sliding:6 over the literal loop's 9 keys: the sink (key 0) in view of the first queries, passed for later ones
MASKS = (None, "causal", "sliding:6")


# the defaults (exact attention at the kit's small sizes: 128 sinks), the fixed budget (whose "consistent" claim
# the kit checks) and the official code's conventions with the adaptive budget; the variant adaptive-small runs
# in the common variant suite, and against the reference below
@parametrize_with_checks([SPEC, (SPEC, SMALL_FIXED), (SPEC, SMALL_OFFICIAL)])
def test_conformance(estimator, check):
    check(estimator)


# ------------------------------------------------------------------------------------------------ helpers
def _params(**params):
    return SPEC.resolve_params(params)


def _masked(mask):
    return {} if mask is None else {"mask": mask}


def _draws(q_shape, k_shape, params, *, samples=5, replicates=3, seed=0, mask=None):
    return draw(q_shape, k_shape, num_samples=samples, replicates=replicates, rng=np.random.default_rng(seed),
                **params, **_masked(mask))


def _tensors(*arrays):
    return tuple(torch.as_tensor(a, dtype=torch.float64) for a in arrays)


def literal_vattention(q, k, v, draws, params, mask=None):
    """The algorithm once more, one replicate, batch element and query at a time, in plain Python.

    Returns ``(out (R, ..., N, Dv), sample sizes (R, ..., N), keys read (R, ..., N), log D_hat (R, ..., N))``.
    """
    *batch, num_queries, dim = q.shape
    num_keys = k.shape[-2]
    scale = dim**-0.5
    replicates = draws.replicates
    main = np.asarray(draws["residual_uniforms"])
    base = np.asarray(draws["base_uniforms"]) if params["budget"] == "adaptive" else None
    tail = params["delta"] / 2 if params["quantile"] == "two-sided" else params["delta"]
    z = norm.ppf(1 - tail)
    out = np.zeros((replicates, *batch, num_queries, v.shape[-1]))
    sizes = np.zeros((replicates, *batch, num_queries))
    read = np.zeros((replicates, *batch, num_queries))
    log_den = np.zeros((replicates, *batch, num_queries))
    for r in range(replicates):
        for element in np.ndindex(*batch):
            for n in range(num_queries):
                at = (*element, n)
                own = n + num_keys - num_queries
                width = int(mask.split(":")[1]) if mask and mask.startswith("sliding:") else num_keys
                visible = [m for m in range(num_keys) if own - width < m <= own] if mask else list(range(num_keys))

                def size(p, available=len(visible)):
                    return min(p, available) if isinstance(p, int) else math.floor(p * available)

                logit = {m: scale * float(np.dot(q[at], k[(*element, m)])) for m in visible}
                sinks = [m for m in visible if m < size(params["sinks"])]
                local = [m for m in visible if own - size(params["local"]) < m <= own]
                candidates = [m for m in visible if m not in sinks and m not in local]
                top = sorted(candidates, key=lambda m: (-logit[m], m))[: size(params["top_k"])]
                heavy = set(sinks) | set(local) | set(top)
                pool = candidates if params["sample_from"] == "window" else [m for m in visible if m not in heavy]
                shift = max(logit.values())
                e = {m: math.exp(logit[m] - shift) for m in visible}
                weight = {m: 1.0 for m in heavy}
                n_s, b = len(pool), 0
                if params["sample_from"] == "window" and 0 < n_s < 2:
                    weight = {m: 1.0 for m in visible}
                elif n_s > 0:
                    if base is None:
                        b = main.shape[-1]
                    else:
                        rate = params["base_rate"]
                        b0 = max(2, rate if isinstance(rate, int) else math.floor(rate * n_s))
                        picked = [pool[min(math.floor(u * n_s), n_s - 1)] for u in base[(r, *at)][:b0]]
                        values = [e[m] for m in picked]
                        sigma = statistics.stdev(values)
                        base_sum = sum(values) if params["duplicates"] == "count" else sum(e[m] for m in set(picked))
                        den = sum(e[m] for m in heavy) + n_s / b0 * base_sum
                        bound = (z * n_s * sigma / (params["epsilon"] * den)) ** 2 if den > 0 else math.inf
                        if math.isinf(bound):
                            b = n_s
                        else:
                            rounded = math.ceil(bound) if params["rounding"] == "ceil" else math.floor(bound)
                            b = min(max(b0, rounded), n_s)
                    picks = [pool[min(math.floor(u * n_s), n_s - 1)] for u in main[(r, *at)][:b]]
                    for m in set(picks) - heavy:
                        weight[m] = n_s / b * (picks.count(m) if params["duplicates"] == "count" else 1)
                numerator = sum(weight[m] * e[m] * v[(*element, m)] for m in weight)
                denominator = sum(weight[m] * e[m] for m in weight)
                out[(r, *at)] = numerator / denominator
                sizes[(r, *at)], read[(r, *at)] = b, len(weight)
                log_den[(r, *at)] = math.log(denominator) + shift
    return out, sizes, read, log_den


# ------------------------------------------------------------------------------------------------ identities
@pytest.mark.parametrize("mask", MASKS, ids=["none", "causal", "sliding:6"])
@pytest.mark.parametrize("config", ["fixed-small", "adaptive-small", "official-code-small", "fixed-window-merge"])
def test_reference_matches_a_literal_loop(config, mask):
    """Reference == the loop above on tiny inputs (N=5, M=9, batch 2): outputs, sample sizes and keys read."""
    params = _params(**({"budget": "fixed", **SMALL_FIXED, "sample_from": "window", "duplicates": "merge"}
                        if config == "fixed-window-merge" else CONFIGS[config]))
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(2, 5, 3)), rng.normal(size=(2, 9, 3)), rng.normal(size=(2, 9, 2))
    draws = _draws(q.shape, k.shape, params, samples=4, replicates=3, seed=2, mask=mask)
    expected, sizes, read, log_den = literal_vattention(q, k, v, draws, params, mask)
    assert_close(reference.estimate(q, k, v, draws, **params, **_masked(mask)), expected, atol=1e-12, rtol=1e-12,
                 what="reference against the literal loop:")
    chosen = reference.select(q, k, draws, **params, **_masked(mask))
    np.testing.assert_array_equal(chosen.sample_sizes, sizes)
    np.testing.assert_array_equal(reference.keys_used(q, k, draws, **params, **_masked(mask)), read)
    # log D_hat: an absolute difference of logs is a relative one of the denominators (1e-12: a few roundings)
    assert_close(reference.log_denominator(q, k, draws, **params, **_masked(mask)), log_den, atol=1e-12, rtol=0.0,
                 what="reference log D_hat against the literal loop:")


@pytest.mark.parametrize("mask", MASKS, ids=["none", "causal", "sliding:6"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_batched_matches_reference_in_decode(config, mask):
    """Decode (N=3 queries over M=40 keys, 2 heads): batched float64 == reference for the outputs, probabilities,
    sample sizes and keys_used, same draws."""
    params = _params(**CONFIGS[config])
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 40, 8)), rng.normal(size=(2, 40, 5))
    draws = _draws(q.shape, k.shape, params, samples=6, replicates=4, seed=4, mask=mask)
    atol, rtol = TOLERANCES["float64"]
    ref_out, ref_probs = reference.estimate_with_probabilities(q, k, v, draws, **params, **_masked(mask))
    out, probs = batched.estimate_with_probabilities(*_tensors(q, k, v), draws.to_torch(), **params, **_masked(mask))
    assert_close(out, ref_out, atol=atol, rtol=rtol, what=f"{config} outputs:")
    assert_close(probs, ref_probs, atol=atol, rtol=rtol, what=f"{config} probabilities:")
    qt, kt = _tensors(q, k)
    np.testing.assert_array_equal(batched.keys_used(qt, kt, draws.to_torch(), **params, **_masked(mask)).numpy(),
                                  reference.keys_used(q, k, draws, **params, **_masked(mask)))
    np.testing.assert_array_equal(batched.select(qt, kt, draws.to_torch(), **params, **_masked(mask)).sample_sizes,
                                  reference.select(q, k, draws, **params, **_masked(mask)).sample_sizes)
    assert_close(batched.log_denominator(qt, kt, draws.to_torch(), **params, **_masked(mask)),
                 reference.log_denominator(q, k, draws, **params, **_masked(mask)), atol=atol, rtol=0.0,
                 what=f"{config} log D_hat:")


@pytest.mark.parametrize("mask", MASKS, ids=["none", "causal", "sliding:6"])
def test_heavy_set_covering_every_key_is_softmax(mask):
    """sinks = 1.0 (every visible key) or top_k = 1.0: softmax attention written out here, to 1e-10."""
    rng = np.random.default_rng(5)
    q, k, v = rng.normal(size=(3, 8)), rng.normal(size=(40, 8)), rng.normal(size=(40, 4))
    logits = q @ k.T / math.sqrt(8)
    own, keys = np.arange(3)[:, None] + 37, np.arange(40)[None, :]
    if mask is not None:
        width = int(mask.split(":")[1]) if mask.startswith("sliding:") else 40
        logits = np.where((keys <= own) & (keys > own - width), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    exact = weights / weights.sum(-1, keepdims=True) @ v
    # sinks=1.0 is every visible key only where the visible keys start at key 0 (not under a window: the sinks
    # are the sequence's first keys); local=1.0 is every visible key under every mask
    heavy = [_params(budget="fixed", sinks=0, local=0, top_k=1.0), _params(local=1.0)]
    for params in heavy if mask and mask.startswith("sliding:") else [_params(sinks=1.0), *heavy]:
        draws = _draws(q.shape, k.shape, params, mask=mask)
        assert_close(reference.estimate(q, k, v, draws, **params, **_masked(mask)), np.broadcast_to(exact, (3, 3, 4)),
                     atol=1e-10, rtol=1e-10, what="heavy set = every key:")


@pytest.mark.parametrize("config", ["fixed-small", "adaptive-small", "default"])
def test_a_window_past_the_sinks_is_vattention_on_its_keys_alone(config):
    """Under ``sliding:W`` a query whose window has passed the sinks is unmasked vAttention over its W keys with no
    sinks (fractions taken of the same W visible keys), given the same uniforms: the first W of its adaptive
    sample's and the first B(W) of its base sample's, as that sub-problem's own draw would make them."""
    from randattn.estimators.vattention.rules import base_uniform_count

    params = _params(**CONFIGS[config])
    rng = np.random.default_rng(31)
    num_queries, num_keys, width = 4, 60, 20
    q, k, v = rng.normal(size=(2, num_queries, 6)), rng.normal(size=(2, num_keys, 6)), rng.normal(size=(2, num_keys, 3))
    mask = f"sliding:{width}"
    draws = _draws(q.shape, k.shape, params, samples=5, replicates=3, seed=32, mask=mask)
    windowed = reference.estimate(q, k, v, draws, **params, mask=mask)
    for n in range(num_queries):
        last = n + num_keys - num_queries
        keys = slice(last - width + 1, last + 1)
        arrays = {name: a[:, :, n:n + 1] for name, a in draws.arrays.items()}
        if params["budget"] == "adaptive":
            arrays["residual_uniforms"] = arrays["residual_uniforms"][..., :width]
            arrays["base_uniforms"] = arrays["base_uniforms"][..., :base_uniform_count(params["base_rate"], width)]
        alone = reference.estimate(q[:, n:n + 1], k[:, keys], v[:, keys], Draws(arrays, 3), **{**params, "sinks": 0})
        assert_close(windowed[..., n, :], alone[..., 0, :], atol=1e-14, rtol=1e-12, what=f"{config}, query {n}:")


@pytest.mark.parametrize("mask, main, base", [(None, 60, 3), ("causal", 60, 3), ("sliding:20", 20, 2),
                                              ("sliding:100", 60, 3)])
def test_adaptive_draws_hold_as_many_uniforms_as_a_query_sees_at_most(mask, main, base):
    """4 queries over 60 keys: every query sees 60 without a mask, the last one 60 under ``causal``, at most 20 under
    ``sliding:20`` and 60 under a window wider than the keys. The default base rate 0.05 gives floor(0.05 V) base
    draws, at least 2: 3 of 60, 2 of 20 (floor(1.0) = 1)."""
    draws = draw((2, 4, 6), (2, 60, 6), num_samples=None, replicates=3, rng=np.random.default_rng(0), mask=mask)
    assert draws["residual_uniforms"].shape == (3, 2, 4, main)
    assert draws["base_uniforms"].shape == (3, 2, 4, base)


def test_adaptive_draws_made_under_another_mask_are_refused_naming_it():
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(2, 4, 6)), rng.normal(size=(2, 60, 6)), rng.normal(size=(2, 60, 3))
    causal = draw(q.shape, k.shape, num_samples=None, replicates=3, rng=rng, mask="causal")
    for form in (reference.estimate, batched.estimate):
        with pytest.raises(ValueError, match=r"the 20 keys that a query sees at most under mask='sliding:20'"):
            form(q, k, v, causal, mask="sliding:20")


# ------------------------------------------------------------------------------------------------ statistics
def _residual_sums(q, k, v, draws, params, mask, reweight=1.0):
    """``(estimated (R, K), exact (K,))`` residual denominators and numerators of every query, stacked.

    The estimates come from the library's weights; the sums are formed here, shifted by each query's largest
    visible logit (a constant, so unbiasedness is unchanged). ``reweight`` multiplies the residual weights (the
    negative controls).
    """
    chosen = batched.select(*_tensors(q, k), draws.to_torch(), **params, **_masked(mask))
    logits, heavy = chosen.logits.numpy(), chosen.heavy.numpy()
    residual = np.isfinite(logits) & ~heavy
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    estimated = np.where(residual, np.exp(chosen.log_weights.numpy()) * reweight, 0.0) * shifted
    exact = np.where(residual, shifted, 0.0)
    stack = lambda w: np.concatenate([w.sum(-1).reshape(*w.shape[:-2], -1),  # noqa: E731
                                      (w @ v).reshape(*w.shape[:-2], -1)], axis=-1)
    return stack(estimated), stack(exact)


def _max_abs_z(estimated, exact):
    """The largest |z| of the mean over replicates against the exact sums, and the two-sided limit at alpha = 1e-6
    split over the components (Bonferroni)."""
    replicates = estimated.shape[0]
    se = estimated.std(0, ddof=1) / math.sqrt(replicates)
    z = (estimated.mean(0) - exact) / se
    return float(np.abs(z).max()), float(norm.isf(1e-6 / (2 * z.size))), z


_Z_INPUTS = {"seed": 6, "q": (2, 4), "k": (12, 4), "v": (12, 3)}


def _z_inputs():
    rng = np.random.default_rng(_Z_INPUTS["seed"])
    return (rng.normal(0, 0.7, _Z_INPUTS["q"]), rng.normal(0, 0.7, _Z_INPUTS["k"]), rng.normal(size=_Z_INPUTS["v"]))


@pytest.mark.parametrize("config", ["fixed", "adaptive"])
def test_residual_sums_are_unbiased(config):
    """Decode (N=2 over M=12, residuals of 6 and 7 keys, 3 draws or the adaptive size): the mean over 4000 seeded
    replicates of each estimated residual sum (denominator; numerator per value dim) is within the two-sided
    z limit at alpha = 1e-6 (Bonferroni over the 8 components) of the exact sum, z = difference / standard error
    of the mean. The negative controls, weights n_s - 1 over b or n_s over b + 1 (off by one), must be rejected
    on the same draws."""
    params = _params(**(SMALL_FIXED if config == "fixed" else {**SMALL_ADAPTIVE, "base_rate": 2}))
    q, k, v = _z_inputs()
    draws = _draws(q.shape, k.shape, params, samples=3, replicates=4000, seed=7, mask="causal")
    estimated, exact = _residual_sums(q, k, v, draws, params, "causal")
    worst, limit, _ = _max_abs_z(estimated, exact)
    assert worst < limit, f"residual sums biased: max |z| = {worst:.2f} >= {limit:.2f}"
    residual_sizes = np.array([6.0, 7.0])  # visible 11 and 12, minus 1 sink, 2 local, 2 top-k
    sizes = batched.select(*_tensors(q, k), draws.to_torch(), **params, mask="causal").sample_sizes.numpy()
    for label, factor in (("n_s - 1", ((residual_sizes - 1) / residual_sizes)[:, None]),
                          ("b + 1", (sizes / (sizes + 1))[..., None])):
        wrong, _ = _residual_sums(q, k, v, draws, params, "causal", reweight=factor)
        worst_wrong, _, _ = _max_abs_z(wrong, exact)
        assert worst_wrong > limit, f"the z-test does not reject weights off by one ({label}): {worst_wrong:.2f}"


def test_official_code_duplicates_bias_the_residual_low():
    """The official code's merged duplicates (a key drawn twice counts once) bias the residual denominator low:
    with 3 draws from 6 or 7 keys the expected share of distinct draws is below 0.87, so the z-test rejects,
    every query below the truth."""
    params = _params(**{**SMALL_FIXED, "duplicates": "merge"})
    q, k, v = _z_inputs()
    draws = _draws(q.shape, k.shape, params, samples=3, replicates=4000, seed=8, mask="causal")
    estimated, exact = _residual_sums(q, k, v, draws, params, "causal")
    _, limit, z = _max_abs_z(estimated, exact)
    assert (z[:2] < -limit).all(), f"merged duplicates should bias the denominators low: z = {z[:2]}"


# ------------------------------------------------------------------------------------------------ by hand
_LOGITS = [0.0, 2.0, 0.3, -0.5, 1.1, 0.7, -1.0, 0.2]  # key 0 sink, key 7 local, key 1 the top-1 of the rest


def _one_query(**params):
    """One query over the 8 logits above (D = 1, q = 1, scale = 1), with sinks = local = top_k = 1."""
    q, k = np.ones((1, 1)), np.array(_LOGITS)[:, None]
    return q, k, _params(sinks=1, local=1, top_k=1, **params)


def test_adaptive_sample_size_by_hand():
    """The budget formula of the paper (two-sided) and of the official code (one-sided, window, merged
    duplicates, floor), written out for one query and compared with the library's bound and sample size."""
    e = [math.exp(s - 2.0) for s in _LOGITS]  # shifted by the largest logit
    # paper: residual = keys 2..6 (5 keys); base draws slots floor(u * 5) = 0, 2, 4 -> keys 2, 4, 6
    q, k, params = _one_query(epsilon=0.4, delta=0.05, base_rate=3)
    main = np.linspace(0.01, 0.99, 8)[None, None, :]
    draws = Draws({"residual_uniforms": main, "base_uniforms": np.array([[[0.05, 0.45, 0.85]]])}, 1)
    values = [e[2], e[4], e[6]]
    mean = sum(values) / 3
    sigma = math.sqrt(sum((x - mean) ** 2 for x in values) / 2)
    den = e[0] + e[7] + e[1] + 5 / 3 * sum(values)
    bound = (1.959963984540054 * 5 * sigma / (0.4 * den)) ** 2
    chosen = reference.select(q, k, draws, scale=1.0, **params)
    assert chosen.bounds[0, 0] == pytest.approx(bound, rel=1e-12)
    assert 3 < bound < 4 and chosen.sample_sizes[0, 0] == 4  # ceil(bound) above the 3 base draws
    assert torch.equal(batched.select(*_tensors(q, k), draws.to_torch(), scale=1.0, **params).sample_sizes,
                       torch.tensor([[4.0]], dtype=torch.float64))
    # official code: window = keys 1..6 (6 keys, the top-k key 1 in it); slots floor(u * 6) = 0, 0, 5 -> keys 1,
    # 1, 6; the standard deviation over the three draws, the denominator over the two distinct keys
    q, k, params = _one_query(epsilon=0.75, delta=0.05, base_rate=3, **OFFICIAL_CODE)
    draws = Draws({"residual_uniforms": main, "base_uniforms": np.array([[[0.1, 0.12, 0.9]]])}, 1)
    values = [e[1], e[1], e[6]]
    mean = sum(values) / 3
    sigma = math.sqrt(sum((x - mean) ** 2 for x in values) / 2)
    den = e[0] + e[7] + e[1] + 6 / 3 * (e[1] + e[6])
    bound = (1.6448536269514722 * 6 * sigma / (0.75 * den)) ** 2
    chosen = reference.select(q, k, draws, scale=1.0, **params)
    assert chosen.bounds[0, 0] == pytest.approx(bound, rel=1e-12)
    assert 4 < bound < 5 and chosen.sample_sizes[0, 0] == 4  # the floor (the paper's ceil would give 5)


def test_keys_used_and_weights_by_hand():
    """Fixed budget S = 4, residual keys 2..6: draws at slots floor(u * 5) = 0, 0, 3, 4 read keys 2, 5, 6 besides
    the heavy keys 0, 1, 7 (6 keys); key 2, drawn twice, weighs 2 * 5/4 (paper) or 5/4 (merged). The official
    window (keys 1..6): slots floor(u * 6) = 0, 0, 4, 5 hit the top-k key 1 twice (adding nothing) and read keys
    5, 6 (5 keys, each sampled one weighing 6/4)."""
    uniforms = np.array([[[0.05, 0.15, 0.7, 0.85]]])
    expected = {  # params -> (keys used, {key: weight})
        "paper": ({}, 6, {0: 1.0, 1: 1.0, 7: 1.0, 2: 2.5, 5: 1.25, 6: 1.25}),
        "merge": ({"duplicates": "merge"}, 6, {0: 1.0, 1: 1.0, 7: 1.0, 2: 1.25, 5: 1.25, 6: 1.25}),
        "official": (OFFICIAL_CODE, 5, {0: 1.0, 1: 1.0, 7: 1.0, 5: 1.5, 6: 1.5}),
    }
    for label, (conventions, used, weights) in expected.items():
        q, k, params = _one_query(budget="fixed", **conventions)
        draws = Draws({"residual_uniforms": uniforms}, 1)
        assert reference.keys_used(q, k, draws, scale=1.0, **params)[0, 0] == used, label
        assert batched.keys_used(*_tensors(q, k), draws.to_torch(), scale=1.0, **params)[0, 0] == used, label
        log_weights = reference.select(q, k, draws, scale=1.0, **params).log_weights[0, 0]
        want = np.full(8, -np.inf)
        for key, weight in weights.items():
            want[key] = math.log(weight)
        np.testing.assert_allclose(log_weights, want, rtol=1e-15, err_msg=label)


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("mask", MASKS, ids=["none", "causal", "sliding:6"])
def test_finite_at_large_norms(mask):
    """|q|, |k| in [100, 200] (logits spread over thousands): finite, batched float64 == reference; also with an
    empty heavy set, where the base sample's terms underflow and the bound is infinite (b = n_s)."""
    rng = np.random.default_rng(9)
    q, k = rng.normal(size=(3, 16)), rng.normal(size=(40, 16))
    q *= rng.uniform(100, 200, (3, 1)) / np.linalg.norm(q, axis=-1, keepdims=True)
    k *= rng.uniform(100, 200, (40, 1)) / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(40, 4))
    for params in [*(CONFIGS.values()), {"sinks": 0, "local": 0, "top_k": 0}]:
        params = _params(**params)
        draws = _draws(q.shape, k.shape, params, samples=6, seed=10, mask=mask)
        ref = reference.estimate(q, k, v, draws, **params, **_masked(mask))
        assert np.isfinite(ref).all(), params
        out = batched.estimate(*_tensors(q, k, v), draws.to_torch(), **params, **_masked(mask))
        assert_close(out, ref, atol=1e-10 * np.abs(v).max(), rtol=1e-10, what=f"large norms {params}:")
        log_den = reference.log_denominator(q, k, draws, **params, **_masked(mask))  # D_hat itself overflows here
        assert np.isfinite(log_den).all() and log_den.max() > 709, params
        assert_close(batched.log_denominator(*_tensors(q, k), draws.to_torch(), **params, **_masked(mask)), log_den,
                     atol=1e-10, rtol=0.0, what=f"large norms log D_hat {params}:")


# ------------------------------------------------------------------------------------------------ facts, errors
def test_promise_presets_and_convergence():
    assert SPEC.promise_of(SPEC.resolve_params({})) == (0.05, 0.05)
    assert SPEC.promise_of(SPEC.resolve_params({"epsilon": 0.1, "delta": 0.2})) == (0.1, 0.2)
    assert SPEC.promise_of(SPEC.resolve_params({"budget": "fixed"})) is None
    official = SPEC.resolve_params({"preset": "official-code"})
    assert {name: official[name] for name in OFFICIAL_CODE} == OFFICIAL_CODE
    assert SPEC.convergence_of(SPEC.resolve_params(SMALL_FIXED)) == "consistent"
    assert SPEC.convergence_of(SPEC.resolve_params({})) == "none"
    draws = _draws((2, 3, 4), (2, 10, 4), _params(base_rate=0.2), samples=7, replicates=2)
    assert draws["residual_uniforms"].shape == (2, 2, 3, 10) and draws["base_uniforms"].shape == (2, 2, 3, 2)
    assert _draws((3, 4), (10, 4), _params(budget="fixed"), samples=7)["residual_uniforms"].shape == (3, 3, 7)
    # the ends of the fractions: a base rate of 1.0 (every key sampled from) and sizes of 0.0 and 1.0 are allowed
    whole = _draws((2, 3, 4), (2, 10, 4), _params(base_rate=1.0), samples=7, replicates=2)
    assert whole["base_uniforms"].shape == (2, 2, 3, 10)  # 1.0 x the 10 keys
    _draws((3, 4), (10, 4), _params(sinks=0.0, local=1.0, top_k=0.0), samples=7)


@pytest.mark.parametrize(("params", "samples", "error", "words"), [
    ({"epsilon": 0.0}, 3, ValueError, "epsilon must be in (0, 1)"),
    ({"epsilon": 1.0}, 3, ValueError, "epsilon must be in (0, 1)"),
    ({"delta": 1.5}, 3, ValueError, "delta must be in (0, 1)"),
    ({"delta": -0.1}, 3, ValueError, "delta must be in (0, 1)"),
    ({"sinks": -1}, 3, ValueError, "sinks must be a count >= 0 (int) or a fraction of the visible keys in [0, 1] "
                                   "(float), got -1"),
    ({"local": -2}, 3, ValueError, "local must be a count >= 0"),
    ({"top_k": 1.5}, 3, ValueError, "top_k must be a count >= 0 (int) or a fraction of the visible keys in [0, 1]"),
    ({"top_k": True}, 3, TypeError, "top_k must be an int"),
    ({"base_rate": 1}, 3, ValueError, "base_rate must be a count >= 2 (int; the base sample estimates a standard "
                                      "deviation)"),
    # the base rate's fraction excludes 0 (the base sample needs a draw), the sizes' fraction does not
    ({"base_rate": 0.0}, 3, ValueError, "base_rate must be a count >= 2 (int) or a fraction of the keys sampled "
                                        "from in (0, 1] (float), got 0.0"),
    ({"base_rate": 1.5}, 3, ValueError, "fraction of the keys sampled from in (0, 1]"),
    ({"base_rate": True}, 3, TypeError, "base_rate must be an int (a count) or a float (a fraction of the keys "
                                        "sampled from), got bool True"),
    ({"sinks": 0.0, "local": 0.0}, 0, ValueError, "num_samples must be >= 1, got 0"),
    ({"budget": "fixed"}, 0, ValueError, "num_samples must be >= 1, got 0"),
    ({}, -2, ValueError, "num_samples must be >= 1, got -2"),
    ({"duplicates": "sometimes"}, 3, ValueError, "duplicates='sometimes' is not allowed"),
])
def test_bad_inputs_name_the_parameter(params, samples, error, words):
    """draw refuses before any work, both estimate forms refuse too, and so does randattn.estimate."""
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(9, 4)), rng.normal(size=(9, 2))
    full = {**_params(), **params}
    with pytest.raises(error) as caught:
        draw(q.shape, k.shape, num_samples=samples, replicates=1, rng=rng, **full)
    assert words in str(caught.value)
    with pytest.raises(error) as caught:
        randattn.estimate(SPEC, q, k, v, num_samples=samples, seed=0, **params)
    assert words in str(caught.value)
    if samples > 0:
        draws = _draws(q.shape, k.shape, _params(), samples=samples)
        for form, arrays in ((reference.estimate, (q, k, v)), (batched.estimate, _tensors(q, k, v))):
            with pytest.raises(error) as caught:
                form(*arrays, draws, **full)
            assert words in str(caught.value)


def test_the_adaptive_budget_takes_no_s_and_the_fixed_one_needs_it():
    """The adaptive budget sets its own sample size: ``randattn.estimate`` needs no S, and an S given changes
    nothing (bit for bit); the fixed budget's S is its sample size and must be given."""
    rng = np.random.default_rng(35)
    q, k, v = rng.normal(size=(3, 2, 24, 8))
    assert not SPEC.needs_samples_of() and SPEC.needs_samples_of({"budget": "fixed"})
    alone = randattn.estimate(SPEC, q, k, v, seed=3, mask="causal")
    assert np.array_equal(alone, randattn.estimate(SPEC, q, k, v, num_samples=7, seed=3, mask="causal"))
    with pytest.raises(ValueError, match="estimator 'vattention' needs num_samples"):
        randattn.estimate(SPEC, q, k, v, seed=3, budget="fixed")
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        draw(q.shape, k.shape, num_samples=0, rng=np.random.default_rng(0))


def test_draws_of_the_other_budget_are_refused():
    rng = np.random.default_rng(12)
    q, k, v = rng.normal(size=(3, 4)), rng.normal(size=(9, 4)), rng.normal(size=(9, 2))
    fixed = _draws(q.shape, k.shape, _params(budget="fixed"), samples=4)
    with pytest.raises(ValueError, match="budget='adaptive' needs the draws' 'base_uniforms'"):
        reference.estimate(q, k, v, fixed, **_params())
    with pytest.raises(ValueError, match="budget='adaptive' needs the draws' 'base_uniforms'"):
        batched.estimate(*_tensors(q, k, v), fixed, **_params())


def test_the_batched_position_sets_are_the_references_made_on_the_device():
    """The (N,) sizes by interval arithmetic and the (N, M) sets made from them with torch (no host N x M array
    uploaded per call) equal the reference's numpy sets: every mask kind (windows of 1 and 4 keys, where the sinks
    pass out of view), N < M and N > M without a mask, counts and
    fractions for the sinks, the local window and the top-k, both places to sample from."""
    from randattn.estimators.vattention.rules import query_sets, query_sizes

    cases = 0
    for mask in (None, "causal", "sliding:1", "sliding:4"):
        for n, m in ((1, 1), (3, 3), (5, 9), (2, 17), (9, 4)):
            if mask is not None and n > m:
                continue
            for sinks, local, top_k in ((0, 0, 0), (1, 4, 2), (3, 1, 0.5), (0.25, 0.3, 0.1), (0.5, 1.0, 2)):
                for sample_from in ("window", "residual"):
                    params = SPEC.resolve_params({"sinks": sinks, "local": local, "top_k": top_k,
                                                  "sample_from": sample_from})
                    sets, sizes = query_sets(n, m, mask, params), query_sizes(n, m, mask, params)
                    for name in ("top_k", "sampled_size", "base_draws"):
                        np.testing.assert_array_equal(getattr(sizes, name), getattr(sets, name), err_msg=name)
                    visible, fixed, candidates = batched._position_sets(sizes, m, mask, "cpu")
                    np.testing.assert_array_equal(visible.numpy(), sets.visible)
                    np.testing.assert_array_equal(fixed.numpy(), sets.sinks | sets.local)
                    np.testing.assert_array_equal(candidates.numpy(), sets.candidates)
                    cases += 1
    assert cases == 170


# ------------------------------------------------------------------------------ the batched selection's set helpers
@pytest.mark.parametrize("seed", range(4))
def test_top_k_and_pool_order_are_the_literal_per_row_choices(seed):
    """Each query's ``counts[n]`` candidates of largest logit, ties to the lower index, and each row's pool keys
    first: against a Python loop that sorts every row by (-logit, index). Integer logits make ties common; counts
    run from 0 (all rows 0 in one case) to more than the row's candidates."""
    rng = np.random.default_rng(seed)
    n, m = 5, 17
    logits = torch.tensor(rng.integers(-2, 3, (2, 3, n, m)).astype(np.float64 if seed % 2 else np.float32))
    candidates = torch.tensor(rng.random((n, m)) < 0.7)
    counts = np.zeros(n, dtype=np.int64) if seed == 3 else rng.integers(0, m + 3, n)
    if seed != 3:
        counts[seed] = m + 2  # more than the row holds
    chosen = batched._top_k(logits, candidates, torch.as_tensor(counts), int(counts.max()))
    pool = torch.tensor(rng.random((2, 3, n, m)) < 0.4)
    order = batched._pool_first(pool)
    assert chosen.shape == logits.shape and order.shape == pool.shape
    for index in np.ndindex(*logits.shape[:-1]):
        row = logits[index].tolist()
        ranked = sorted((j for j in range(m) if candidates[index[-1], j]), key=lambda j: (-row[j], j))
        assert set(np.flatnonzero(chosen[index].numpy())) == set(ranked[:counts[index[-1]]]), index
        members = pool[index].tolist()
        want = [j for j in range(m) if members[j]] + [j for j in range(m) if not members[j]]
        assert order[index].tolist() == want, index
