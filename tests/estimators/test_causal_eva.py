"""Causal EVA, local attention and Scatterbrain (EVA sec. 4 "Extension to autoregressive modeling", app. D,
Algorithm 2; ARCHITECTURE sec. 12).

Convention under test (:mod:`randattn.estimators.eva.partition`): query n is token t_n = n + M - N and sees keys
m <= t_n; E^n = the visible prefix keys + the keys b^n..t_n of the block holding t_n; the chunks split the body keys
[P, b^n) before that block into min(C, b^n - P) contiguous chunks (window=0: [P, t_n]), so each lies wholly before
E^n; the query landmarks use the bidirectional map capped at the group's first query.

Tolerances: batched vs reference in float64 1e-10 (ARCHITECTURE sec. 3); the independent loops below compute in
plain exponentials on inputs of norm ~1, where they agree with the log-space reference to ~1e-14, so 1e-10 too.
Prefix invariance is bit-for-bit in the reference (junk keys get weight exp(-inf) = 0, and chunk terms never touch
them).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.base import Draws
from randattn.estimators.eva import reference as eva_ref
from randattn.estimators.eva import batched as eva_bat
from randattn.estimators.eva.partition import eva_partition
from randattn.estimators.local import reference as local_ref
from randattn.estimators.scatterbrain import reference as sb_ref
from randattn.testing import assert_close

ATOL64 = 1e-10
CAUSAL = {"mask": "causal"}

#: representative EVA options under the mask (every chunk weight, S_c > 1, prefix tokens, the expected sample, the
#: other proposal means and noise, no window, a window beyond the sequence)
EVA_VARIANTS = {
    "exact": {"window": 4},
    "mean-key": {"window": 4, "chunk_weight": "mean-key"},
    "mean-key-log-size": {"window": 3, "chunk_weight": "mean-key", "add_log_chunk_size": True},
    "rfa": {"window": 4, "chunk_weight": "rfa"},
    "multi-sample-exact": {"window": 4, "samples_per_chunk": 3},
    "multi-sample-rfa-half": {"window": 3, "samples_per_chunk": 2, "chunk_weight": "rfa", "proposal_mean": "half"},
    "standard-noise-code": {"window": 4, "proposal_mean": "standard", "noise": "reference-code"},
    "cls": {"window": 4, "prefix_tokens": 1},
    "prefix2-mean-key-multi": {"window": 3, "prefix_tokens": 2, "chunk_weight": "mean-key", "samples_per_chunk": 2},
    "sample-mean": {"window": 4, "sample": "mean"},
    "sample-mean-rfa-cls": {"window": 3, "sample": "mean", "chunk_weight": "rfa", "prefix_tokens": 1},
    "no-window": {"window": 0},
    "no-window-cls-rfa": {"window": 0, "prefix_tokens": 1, "chunk_weight": "rfa", "samples_per_chunk": 2},
    "window-1": {"window": 1, "chunk_weight": "mean-key"},
    "window-beyond": {"window": 64},
}
#: (N, M): blocks and chunks that do not divide evenly (13 = 4 + 4 + 4 + 1), M > N (decoding after a prompt), one query
SHAPES = {"N13-M13": (13, 13), "N9-M14": (9, 14), "N1-M7": (1, 7)}
LOCAL_VARIANTS = {"window-4": {"window": 4}, "window-1": {"window": 1}, "cls": {"window": 3, "prefix_tokens": 2},
                  "cls-only": {"window": 0, "prefix_tokens": 1}, "beyond": {"window": 64}}
SB_VARIANTS = {"window-4": {"window": 4}, "cls-orthogonal": {"window": 3, "prefix_tokens": 1, "coupling": "orthogonal"},
               "no-window": {"window": 0}, "beyond": {"window": 64}}


def _params(name: str, params: dict) -> dict:
    return randattn.get_spec(name).resolve_params({"layout": "sequence", **params})


def qkv(n: int, m: int, *, d: int = 4, dv: int = 3, batch=(2,), seed: int = 0, std: float = 0.6):
    rng = np.random.default_rng(seed)
    return std * rng.normal(size=(*batch, n, d)), std * rng.normal(size=(*batch, m, d)), rng.normal(size=(*batch, m, dv))


def t64(*arrays):
    return tuple(torch.as_tensor(a, dtype=torch.float64) for a in arrays)


def _draws(name: str, q, k, params: dict, *, samples: int = 3, replicates: int = 2, seed: int = 1):
    spec = randattn.get_spec(name)
    return spec.draw(q.shape, k.shape, num_samples=samples if spec.needs_samples else None, replicates=replicates,
                     rng=np.random.default_rng(seed), **params, **CAUSAL)


def _both(name: str, q, k, v, draws, params: dict):
    spec = randattn.get_spec(name)
    ref = spec.reference(q, k, v, draws, scale=None, **params, **CAUSAL)
    bat = spec.batched(*t64(q, k, v), draws.to_torch(), scale=None, **params, **CAUSAL)
    return ref, bat


def causal_softmax(q, k, v, *, offset: int = 0):
    """Exact attention over keys m <= n + M - N (+ offset), written out here; a row that sees no key is NaN."""
    n, m = q.shape[-2], k.shape[-2]
    logits = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    visible = np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n) + offset
    logits = np.where(visible, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        w = np.exp(logits - logits.max(-1, keepdims=True))
        return (w / w.sum(-1, keepdims=True)) @ v


# ---------------------------------------------------------------------------------------------------- the partition
PARTITIONS = [(13, 13, 4, 0, 3), (13, 13, 4, 1, 2), (9, 14, 4, 0, 3), (9, 14, 3, 2, 5), (10, 10, 0, 0, 3),
              (10, 10, 0, 2, 4), (6, 10, 1, 0, 8), (5, 5, 64, 1, 2), (4, 4, 2, 6, 2), (1, 7, 4, 0, 2)]


@pytest.mark.parametrize("n,m,window,prefix,chunks", PARTITIONS, ids=lambda x: str(x))
def test_causal_partition_is_disjoint_covers_the_visible_keys_and_chunks_lie_before_the_exact_set(n, m, window, prefix,
                                                                                                  chunks):
    layout = eva_partition(n, m, window=window, prefix_tokens=prefix, num_chunks=chunks, mask="causal")
    pk = min(prefix, m)
    seen = np.zeros(n, dtype=int)
    for group in layout.groups:
        seen[group.queries] += 1
        in_chunks = np.concatenate(group.chunks).tolist() if group.chunks else []
        for query in group.queries.tolist():
            t = query + m - n
            exact = layout.exact_keys[query].tolist()
            assert exact == sorted(exact) and all(e <= t for e in exact), "E^n holds visible keys only"
            assert not set(exact) & set(in_chunks), "chunks disjoint from E^n (EVA sec. 4.1, app. D)"
            assert sorted(set(exact) | set(in_chunks)) == list(range(t + 1)), "E^n and the chunks are the visible keys"
            block = [e for e in exact if e >= pk]
            if block:  # Algorithm 2: every chunk lies wholly before E^n's block, which ends at the query's own token
                assert block == list(range(block[0], t + 1)) and len(block) <= window
                assert not in_chunks or max(in_chunks) < block[0]
            assert len(group.chunks) == min(chunks, len(in_chunks))
        if group.chunks:
            sizes = [len(c) for c in group.chunks]
            assert max(sizes) - min(sizes) <= 1 and in_chunks == sorted(in_chunks)
        for sources in group.chunk_queries:  # no landmark pools a query later than the group's first one
            assert len(sources) and sources.max() <= group.queries.min()
    assert (seen == 1).all()


def test_causal_partition_examples():
    layout = eva_partition(10, 10, window=4, num_chunks=2, mask="causal")
    assert [layout.exact_keys[n].tolist() for n in (0, 3, 4, 6, 9)] == [[0], [0, 1, 2, 3], [4], [4, 5, 6], [8, 9]]
    assert [[c.tolist() for c in g.chunks] for g in layout.groups] == [[], [[0, 1], [2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]]]
    # M > N: query n is token n + 4; its block is that of the token (not the bidirectional floor(n M / N))
    prompt = eva_partition(6, 10, window=3, num_chunks=8, mask="causal")
    assert prompt.exact_keys[5].tolist() == [9] and prompt.exact_keys[0].tolist() == [3, 4]
    assert eva_partition(6, 10, window=3, num_chunks=8).exact_keys[5].tolist() == [6, 7, 8]
    # with a CLS token, its query sees the CLS key only, and the next block starts after it
    cls = eva_partition(7, 7, window=3, prefix_tokens=1, num_chunks=2, mask="causal")
    assert [cls.exact_keys[n].tolist() for n in (0, 1, 3, 5)] == [[0], [0, 1], [0, 1, 2, 3], [0, 4, 5]]


def test_draws_do_not_depend_on_the_mask():
    q, k, _ = qkv(9, 14)
    for name, params in (("eva", _params("eva", {"window": 4, "samples_per_chunk": 2})),
                         ("scatterbrain", _params("scatterbrain", {"window": 4}))):
        spec = randattn.get_spec(name)
        plain = spec.draw(q.shape, k.shape, num_samples=3, replicates=2, rng=np.random.default_rng(5), **params)
        masked = _draws(name, q, k, params, seed=5)
        assert plain.arrays.keys() == masked.arrays.keys()
        assert all(np.array_equal(plain[key], masked[key]) for key in plain.arrays)


# ---------------------------------------------------------------------------------------------------- batched == reference
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("variant", EVA_VARIANTS, ids=str)
def test_eva_causal_batched_matches_reference(variant, shape):
    params = _params("eva", EVA_VARIANTS[variant])
    q, k, v = qkv(*shape, seed=2)
    draws = _draws("eva", q, k, params)
    ref, bat = _both("eva", q, k, v, draws, params)
    assert ref.shape == (2, 2, shape[0], 3)
    assert_close(bat, ref, atol=ATOL64, rtol=ATOL64, what=f"eva {variant} causal {shape}, batched vs reference:")


@pytest.mark.parametrize("shape", [(13, 13), (9, 14)], ids=str)
@pytest.mark.parametrize("name,variant", [*(("local", v) for v in LOCAL_VARIANTS), *(("scatterbrain", v) for v in SB_VARIANTS)])
def test_local_and_scatterbrain_causal_batched_match_reference(name, variant, shape):
    params = _params(name, (LOCAL_VARIANTS if name == "local" else SB_VARIANTS)[variant])
    q, k, v = qkv(*shape, seed=3)
    draws = _draws(name, q, k, params, samples=5)
    ref, bat = _both(name, q, k, v, draws, params)
    assert_close(bat, ref, atol=ATOL64, rtol=ATOL64, what=f"{name} {variant} causal {shape}, batched vs reference:")


@pytest.mark.parametrize("name,params", [("eva", {"window": 4}), ("eva", {"window": 0, "chunk_weight": "mean-key"}),
                                         ("local", {"window": 4, "prefix_tokens": 1}), ("scatterbrain", {"window": 4})],
                         ids=str)
def test_causal_float32_batched_is_within_rounding_of_the_reference(name, params):
    """float32: the package's tolerance (5e-5, a few hundred ulps of outputs of order one), masks included."""
    params = _params(name, params)
    q, k, v = qkv(13, 13, seed=18)
    draws = _draws(name, q, k, params)
    spec = randattn.get_spec(name)
    ref = spec.reference(q, k, v, draws, scale=None, **params, **CAUSAL)
    t32 = lambda a: torch.as_tensor(a, dtype=torch.float32)  # noqa: E731
    bat = spec.batched(t32(q), t32(k), t32(v), draws.to_torch(dtype=torch.float32), scale=None, **params, **CAUSAL)
    assert bat.dtype == torch.float32
    assert_close(bat, ref, atol=5e-5, rtol=5e-5, what=f"{name} {params} float32 causal:")


def test_scatterbrain_causal_is_causal_eva_with_one_chunk_of_rfa():
    """App. G.5 as under the mask: EVA with C = 1, mu = 0, S_c = S samples and chunk_weight=rfa, same omega."""
    q, k, v = qkv(13, 13, seed=4)
    params = _params("scatterbrain", {"window": 4, "prefix_tokens": 1})
    draws = _draws("scatterbrain", q, k, params, samples=6)
    sb = sb_ref.estimate(q, k, v, draws, **params, **CAUSAL)
    eps = Draws({"eps": draws["omega"][..., None, :, :]}, draws.replicates)
    eva = eva_ref.estimate(q, k, v, eps, window=4, prefix_tokens=1, layout="sequence", chunk_weight="rfa",
                           proposal_mean="standard", samples_per_chunk=6, mask="causal")
    assert_close(sb, eva, atol=ATOL64, rtol=ATOL64, what="scatterbrain vs EVA(C=1, rfa, mu=0), causal:")


# ---------------------------------------------------------------------------------------------------- probabilities
@pytest.mark.parametrize("variant", ["exact", "mean-key", "multi-sample-rfa-half", "cls", "no-window", "sample-mean"])
@pytest.mark.parametrize("shape", [(13, 13), (9, 14)], ids=str)
def test_eva_causal_probabilities_are_masked_and_agree_with_the_estimate(variant, shape):
    params = _params("eva", EVA_VARIANTS[variant])
    q, k, v = qkv(*shape, seed=5)
    draws = _draws("eva", q, k, params)
    tq, tk, tv = t64(q, k, v)
    td = draws.to_torch()
    out = eva_bat.estimate(tq, tk, tv, td, **params, **CAUSAL)
    probs = eva_bat.probabilities(tq, tk, td, **params, **CAUSAL)
    hidden = ~torch.as_tensor(np.arange(shape[1])[None, :] <= np.arange(shape[0])[:, None] + shape[1] - shape[0])
    assert bool((probs[..., hidden] == 0).all()), "hidden entries must be exact zeros"
    assert bool((probs >= 0).all())
    assert_close(probs.sum(-1), torch.ones(probs.shape[:-1], dtype=torch.float64), atol=1e-12, what="rows sum to one:")
    assert_close(probs @ tv, out, atol=ATOL64, rtol=ATOL64, what="probabilities @ v vs the estimate:")
    out2, probs2 = eva_bat.estimate_with_probabilities(tq, tk, tv, td, **params, **CAUSAL)
    assert torch.equal(out2, out) and torch.equal(probs2, probs), "one pass gives the same bits as the two calls"


# ---------------------------------------------------------------------------------------------------- independent loops
def _xi(z, w):
    """Positive random feature exp(w.z - |z|^2 / 2) (Performer eq. 7): z (L, D), w (S, D) -> (L, S)."""
    return np.exp(z @ w.T - 0.5 * (z * z).sum(-1, keepdims=True))


def independent_eva(q, k, v, eps, *, window, prefix_tokens=0, num_chunks, chunk_weight="exact", proposal_mean="sum",
                    sample="random", add_log_chunk_size=False, offset=0, double_count=False):
    """Causal EVA written out per query with plain exponentials (EVA eq. 11-16, app. C eq. 26-28, app. D).

    q (N, D), k (M, D), v (M, Dv), eps (R, C, S_c, D). ``offset`` shifts the last visible key (a planted off-by-one);
    ``double_count`` also puts E^n's block keys into the chunks (the official code's overlap).
    """
    n_q, m_k = q.shape[0], k.shape[0]
    x, y = q * q.shape[-1] ** -0.25, k * k.shape[-1] ** -0.25
    pk, pq = min(prefix_tokens, m_k), min(prefix_tokens, n_q)
    out = np.zeros((eps.shape[0], n_q, v.shape[-1]))
    for n in range(n_q):
        t = min(n + m_k - n_q + offset, m_k - 1)  # the last key query n sees
        if t < pk:
            exact, rest, first = list(range(t + 1)), [], n
        elif window == 0:
            exact, rest, first = list(range(pk)), list(range(pk, t + 1)), n
        else:
            start = pk + (t - pk) // window * window  # b^n, the first key of the block holding t
            exact, rest = list(range(pk)) + list(range(start, t + 1)), list(range(pk, start))
            first = max(0, start - (m_k - n_q))  # the group's first query: the one at token b^n (or query 0)
        if double_count:
            rest = sorted(rest + [e for e in exact if e >= pk])
        chunks = np.array_split(np.array(rest, dtype=int), min(num_chunks, len(rest))) if rest else []
        for r in range(eps.shape[0]):
            num = np.exp(x[n] @ y[exact].T) @ v[exact]
            den = np.exp(x[n] @ y[exact].T).sum()
            for c, keys in enumerate(chunks):
                # landmarks (eq. 26, 28): the queries the bidirectional map assigns to the keys, capped at `first`
                sources = [min(pq + (m - pk) * (n_q - pq) // (m_k - pk), first) for m in keys]
                k_land, q_land = y[keys].mean(0), x[sources].mean(0)
                mu = {"sum": q_land + k_land, "half": 0.5 * (q_land + k_land), "standard": 0 * k_land}[proposal_mean]
                omega = mu + eps[r, c] if sample == "random" else mu[None]
                alpha = np.exp(-0.5 * (omega**2).sum(-1) + 0.5 * ((omega - mu) ** 2).sum(-1))  # N(0, I) / N(mu, I)
                qf = alpha * _xi(x[n][None], omega)[0]  # (S,)
                kf = _xi(y[keys], omega)  # (|P_c|, S)
                beta = (qf @ (kf.T @ v[keys])) / (qf @ kf.sum(0))  # SNIS control coefficient (app. C)
                if chunk_weight == "exact":
                    weight = np.exp(x[n] @ y[keys].T).sum()  # eq. 13
                elif chunk_weight == "mean-key":
                    weight = np.exp(x[n] @ k_land) * (len(keys) if add_log_chunk_size else 1)  # eq. 16
                else:
                    weight = (qf @ kf.sum(0)) / len(omega)
                num, den = num + weight * beta, den + weight
            out[r, n] = num / den
    return out


def independent_local(q, k, v, *, window, prefix_tokens=0, offset=0):
    """Causal block-local softmax written out per query: keys of E^n = visible prefix + the block up to t_n."""
    n_q, m_k = q.shape[0], k.shape[0]
    pk = min(prefix_tokens, m_k)
    out = np.zeros((n_q, v.shape[-1]))
    for n in range(n_q):
        t = min(n + m_k - n_q + offset, m_k - 1)
        start = pk + (t - pk) // window * window if t >= pk and window else t + 1
        exact = list(range(min(pk, t + 1))) + list(range(start, t + 1))
        w = np.exp(q[n] @ k[exact].T / math.sqrt(q.shape[-1]))
        out[n] = w @ v[exact] / w.sum()
    return out


def independent_scatterbrain(q, k, v, omega, *, window, prefix_tokens=0):
    """Causal Scatterbrain (EVA eq. 30) per query: exact on E^n, phi(x)^T phi(y) on the visible keys before it."""
    n_q, m_k = q.shape[0], k.shape[0]
    x, y = q * q.shape[-1] ** -0.25, k * k.shape[-1] ** -0.25
    pk = min(prefix_tokens, m_k)
    out = np.zeros((omega.shape[0], n_q, v.shape[-1]))
    for n in range(n_q):
        t = n + m_k - n_q
        start = pk + (t - pk) // window * window if t >= pk and window else t + 1
        exact = list(range(min(pk, t + 1))) + list(range(start, t + 1))
        rest = list(range(pk, start)) if t >= pk else []
        for r in range(omega.shape[0]):
            w_exact = np.exp(x[n] @ y[exact].T)
            w_rest = (_xi(x[n][None], omega[r]) @ _xi(y[rest], omega[r]).T)[0] / len(omega[r]) if rest else np.zeros(0)
            out[r, n] = (w_exact @ v[exact] + w_rest @ v[rest]) / (w_exact.sum() + w_rest.sum())
    return out


INDEPENDENT = [
    ({"window": 3}, (9, 9)),
    ({"window": 3, "chunk_weight": "mean-key", "add_log_chunk_size": True}, (9, 9)),
    ({"window": 4, "chunk_weight": "rfa", "samples_per_chunk": 2, "proposal_mean": "half"}, (10, 10)),
    ({"window": 4, "prefix_tokens": 1, "samples_per_chunk": 3}, (6, 11)),
    ({"window": 0, "prefix_tokens": 2, "chunk_weight": "mean-key"}, (7, 9)),
    ({"window": 3, "sample": "mean", "chunk_weight": "rfa"}, (8, 8)),
]


@pytest.mark.parametrize("params,shape", INDEPENDENT, ids=lambda p: str(p))
def test_eva_causal_reference_matches_an_independent_loop(params, shape):
    params = _params("eva", params)
    q, k, v = qkv(*shape, batch=(), seed=6)
    draws = _draws("eva", q, k, params, samples=2)
    ref = eva_ref.estimate(q, k, v, draws, **params, **CAUSAL)
    kwargs = {key: params[key] for key in ("window", "prefix_tokens", "chunk_weight", "proposal_mean", "sample",
                                           "add_log_chunk_size")}
    loop = independent_eva(q, k, v, draws["eps"], num_chunks=2, **kwargs)
    assert_close(ref, loop, atol=ATOL64, rtol=ATOL64, what=f"reference vs an independent causal loop {params}:")


def test_negative_controls_an_off_by_one_mask_and_double_counting_differ():
    """The loops above are sensitive to the errors they guard against: a mask one key late or early, and chunks that
    also hold E^n's keys (the official code's partition, ARCHITECTURE sec. 10), give other outputs."""
    params = _params("eva", {"window": 3})
    q, k, v = qkv(9, 9, batch=(), seed=7)
    draws = _draws("eva", q, k, params, samples=2)
    ref = eva_ref.estimate(q, k, v, draws, **params, **CAUSAL)
    local = local_ref.estimate(q, k, v, window=3, layout="sequence", mask="causal")
    # one key late: query n sees key n + 1 (the last query has none to add, so compare the others)
    late = independent_eva(q, k, v, draws["eps"], window=3, num_chunks=2, offset=1)
    assert np.abs(late[:, :-1] - ref[:, :-1]).max() > 1e-3
    assert np.abs(independent_local(q, k, v, window=3, offset=1)[:-1] - local[:-1]).max() > 1e-3
    # one key early: query n stops at key n - 1 (query 0 then sees nothing: 0 / 0, skipped)
    with np.errstate(invalid="ignore"):
        early = independent_eva(q, k, v, draws["eps"], window=3, num_chunks=2, offset=-1)
        early_local = independent_local(q, k, v, window=3, offset=-1)
    assert np.abs(early[:, 1:] - ref[:, 1:]).max() > 1e-3
    assert np.abs(early_local[1:] - local[1:]).max() > 1e-3
    # the chunk holding E^n's keys enters too (the code's double counting)
    doubled = independent_eva(q, k, v, draws["eps"], window=3, num_chunks=2, double_count=True)
    assert np.abs(doubled - ref).max() > 1e-3
    # and the unmodified loop agrees, so the differences above are the planted errors'
    assert_close(independent_eva(q, k, v, draws["eps"], window=3, num_chunks=2), ref, atol=ATOL64, rtol=ATOL64)


@pytest.mark.parametrize("window,prefix,shape", [(3, 0, (9, 9)), (4, 2, (7, 12)), (1, 1, (5, 5)), (0, 1, (6, 6))],
                         ids=str)
def test_local_causal_reference_matches_an_independent_masked_softmax(window, prefix, shape):
    q, k, v = qkv(*shape, batch=(), seed=8)
    ref = local_ref.estimate(q, k, v, window=window, prefix_tokens=prefix, layout="sequence", mask="causal")
    assert_close(ref, independent_local(q, k, v, window=window, prefix_tokens=prefix), atol=ATOL64, rtol=ATOL64,
                 what="local causal vs an explicit masked softmax within the block:")


@pytest.mark.parametrize("window,prefix,shape", [(3, 0, (9, 9)), (4, 1, (6, 11)), (0, 2, (7, 7))], ids=str)
def test_scatterbrain_causal_reference_matches_an_independent_loop(window, prefix, shape):
    q, k, v = qkv(*shape, batch=(), seed=9)
    params = _params("scatterbrain", {"window": window, "prefix_tokens": prefix})
    draws = _draws("scatterbrain", q, k, params, samples=4)
    ref = sb_ref.estimate(q, k, v, draws, **params, **CAUSAL)
    assert_close(ref, independent_scatterbrain(q, k, v, draws["omega"], window=window, prefix_tokens=prefix),
                 atol=ATOL64, rtol=ATOL64, what="scatterbrain causal vs an independent loop of eq. 30:")


# ---------------------------------------------------------------------------------------------------- causal facts
PREFIX_CASES = [("eva", "exact"), ("eva", "mean-key-log-size"), ("eva", "multi-sample-rfa-half"), ("eva", "cls"),
                ("eva", "no-window-cls-rfa"), ("eva", "sample-mean"), ("local", "cls"), ("scatterbrain", "cls-orthogonal"),
                ("scatterbrain", "no-window")]


@pytest.mark.parametrize("shape", [(11, 11), (7, 12)], ids=str)
@pytest.mark.parametrize("name,variant", PREFIX_CASES, ids=str)
def test_junk_after_the_last_visible_key_leaves_earlier_outputs_bit_identical(name, variant, shape):
    table = {"eva": EVA_VARIANTS, "local": LOCAL_VARIANTS, "scatterbrain": SB_VARIANTS}[name]
    params = _params(name, table[variant])
    spec = randattn.get_spec(name)
    q, k, v = qkv(*shape, seed=10)
    draws = _draws(name, q, k, params)
    ref = spec.reference(q, k, v, draws, scale=None, **params, **CAUSAL)
    rng = np.random.default_rng(11)
    for cut in sorted({0, 1, shape[0] // 2, shape[0] - 2}):
        last = cut + shape[1] - shape[0]
        k2, v2 = k.copy(), v.copy()
        k2[..., last + 1:, :] = 50 * rng.normal(size=k2[..., last + 1:, :].shape)
        v2[..., last + 1:, :] = 1e3 * rng.normal(size=v2[..., last + 1:, :].shape)
        ref2 = spec.reference(q, k2, v2, draws, scale=None, **params, **CAUSAL)
        assert np.array_equal(ref2[..., : cut + 1, :], ref[..., : cut + 1, :]), f"queries 0..{cut} changed"
        assert not np.array_equal(ref2[..., cut + 1:, :], ref[..., cut + 1:, :]), "later queries do see the junk"


@pytest.mark.parametrize("name,variant", [("eva", "exact"), ("eva", "no-window"), ("eva", "multi-sample-exact"),
                                          ("local", "window-1"), ("scatterbrain", "no-window")], ids=str)
def test_the_first_query_of_self_attention_returns_the_value_of_its_one_visible_key(name, variant):
    table = {"eva": EVA_VARIANTS, "local": LOCAL_VARIANTS, "scatterbrain": SB_VARIANTS}[name]
    params = _params(name, table[variant])
    q, k, v = qkv(8, 8, seed=12)
    draws = _draws(name, q, k, params)
    ref, bat = _both(name, q, k, v, draws, params)
    expected = np.broadcast_to(v[..., 0, :], ref[..., 0, :].shape)
    assert_close(ref[..., 0, :], expected, atol=0.0, rtol=1e-12, what="query 0 (reference):")
    assert_close(bat[..., 0, :], expected, atol=0.0, rtol=1e-12, what="query 0 (batched):")


@pytest.mark.parametrize("variant", ["exact", "mean-key-log-size", "multi-sample-rfa-half", "cls", "no-window",
                                     "no-window-cls-rfa", "sample-mean", "window-1"])
def test_the_last_query_of_self_attention_equals_the_bidirectional_output(variant):
    """N == M only: the last query sees every key, and its causal partition is the bidirectional one (its block is
    the last, so the keys outside it are exactly the keys before it, chunked the same way; the landmark map is the
    identity). With M > N this does not hold in general: the bidirectional form places query n at key position
    floor(n M / N) (its block and its landmarks' queries), the causal form at its token n + M - N, so e.g. with
    window=3, N=6, M=10 the last query's block is keys 6..8 bidirectionally but key 9 under the mask."""
    params = _params("eva", EVA_VARIANTS[variant])
    q, k, v = qkv(13, 13, seed=13)
    draws = _draws("eva", q, k, params)
    causal = eva_ref.estimate(q, k, v, draws, **params, **CAUSAL)
    plain = eva_ref.estimate(q, k, v, draws, **params)
    assert_close(causal[..., -1, :], plain[..., -1, :], atol=ATOL64, rtol=ATOL64, what="last query:")
    assert not np.allclose(causal[..., :-1, :], plain[..., :-1, :]), "the earlier queries are masked"


@pytest.mark.parametrize("shape", [(10, 10), (6, 11)], ids=str)
@pytest.mark.parametrize("name,params", [("eva", {"window": 64}), ("eva", {"window": 64, "prefix_tokens": 2}),
                                         ("eva", {"window": 11, "chunk_weight": "mean-key"}), ("local", {"window": 64}),
                                         ("scatterbrain", {"window": 64, "prefix_tokens": 1})], ids=str)
def test_a_window_covering_the_whole_past_is_causal_softmax(name, params, shape):
    """The exact set then holds every visible key and no chunk is left (EVA sec. 4 with app. D's masks); with the
    mask even the prefix queries are exact (they see only prefix keys, all in E^n)."""
    params = _params(name, params)
    q, k, v = qkv(*shape, seed=14)
    draws = _draws(name, q, k, params)
    ref, bat = _both(name, q, k, v, draws, params)
    exact = np.broadcast_to(causal_softmax(q, k, v), ref.shape)
    assert_close(ref, exact, atol=ATOL64, rtol=ATOL64, what=f"{name} {params} vs causal softmax (reference):")
    assert_close(bat, exact, atol=ATOL64, rtol=ATOL64, what=f"{name} {params} vs causal softmax (batched):")
    assert np.abs(causal_softmax(q, k, v, offset=-1)[..., 1:, :] - exact[0, ..., 1:, :]).max() > 1e-3


def test_causal_through_the_public_api():
    q, k, v = qkv(9, 14, seed=15)
    for name in ("eva", "local", "scatterbrain"):
        kwargs = {"num_samples": 3} if name != "local" else {}
        ref = randattn.estimate(name, q, k, v, seed=3, mask="causal", window=4, layout="sequence", **kwargs)
        bat = randattn.estimate(name, q, k, v, seed=3, mask="causal", window=4, layout="sequence", backend="torch",
                                dtype=torch.float64, **kwargs)
        assert_close(bat, ref, atol=ATOL64, rtol=ATOL64, what=f"{name} through randattn.estimate:")
    with pytest.raises(ValueError, match="at least as many keys as queries"):
        randattn.estimate("eva", k, q, v[..., :9, :], num_samples=2, mask="causal", window=4, layout="sequence")


# ---------------------------------------------------------------------------------------------------- refusals
GRID_ERROR = ("mask='causal' is not supported with layout='grid' and grid=3x4: a 2-D window has no causal meaning "
              "(its keys are not ordered before and after the query); use layout='sequence'")
CODE_ERROR = ("mask='causal' is not supported with partition='reference-code': the paper's causal EVA (app. D, "
              "Algorithm 2) masks whole chunks because they are disjoint from the exact set E^n, but the code's chunks "
              "hold every key, the local window's included, and the paper states no causal rule for them; "
              "use partition='paper'")


def _entry_points(name: str):
    """Every way in: draw, reference, batched (and EVA's probability forms), each called with mask='causal'."""
    spec = randattn.get_spec(name)
    q, k, v = qkv(13, 13, seed=16)
    tq, tk, tv = t64(q, k, v)
    draws = spec.draw(q.shape, k.shape, num_samples=2, replicates=1, rng=np.random.default_rng(0), window=4)
    calls = {
        "draw": lambda p: spec.draw(q.shape, k.shape, num_samples=2, replicates=1, rng=np.random.default_rng(0), **p,
                                    mask="causal"),
        "reference": lambda p: spec.reference(q, k, v, draws, **p, mask="causal"),
        "batched": lambda p: spec.batched(tq, tk, tv, draws.to_torch(), **p, mask="causal"),
        "api": lambda p: randattn.estimate(name, q, k, v, num_samples=None if name == "local" else 2, seed=0,
                                           mask="causal", **p),
    }
    if spec.forms.has("probabilities"):
        probabilities = spec.forms.get("probabilities")
        with_probabilities = spec.forms.get("estimate_with_probabilities")
        calls["probabilities"] = lambda p: probabilities(tq, tk, draws.to_torch(), **p, mask="causal")
        calls["with_probabilities"] = lambda p: with_probabilities(tq, tk, tv, draws.to_torch(), **p, mask="causal")
    return calls


@pytest.mark.parametrize("name", ["eva", "local", "scatterbrain"])
def test_a_grid_layout_is_refused_under_causal_in_every_entry_point(name):
    params = {"window": 4, "prefix_tokens": 1, "grid": "3x4"}
    for entry, call in _entry_points(name).items():
        with pytest.raises(ValueError) as info:
            call(params)
        # the public entry point names the estimator first, then the same reason (the spec's mask note)
        expected = GRID_ERROR if entry != "api" else f"estimator {name!r} does not support mask='causal' " \
            f"(it supports: none): {GRID_ERROR}"
        assert str(info.value) == expected, entry
    # the same grid is fine without the mask, and layout="sequence" ignores the grid under it
    assert randattn.estimate(name, *qkv(13, 13, seed=17), num_samples=None if name == "local" else 2, seed=0,
                             layout="sequence", mask="causal", **params).shape == (2, 13, 3)


def test_the_code_partition_is_refused_under_causal_in_every_entry_point():
    for entry, call in _entry_points("eva").items():
        with pytest.raises(ValueError) as info:
            call({"window": 4, "partition": "reference-code", "layout": "sequence"})
        expected = CODE_ERROR if entry != "api" else f"estimator 'eva' does not support mask='causal' " \
            f"(it supports: none): {CODE_ERROR}"
        assert str(info.value) == expected, entry


@pytest.mark.parametrize("chunk_weight, exact_rows", [("exact", 12), ("mean-key", 12), ("rfa", 4)])
def test_causal_rows_whose_block_starts_within_c_keys_are_exact_softmax(chunk_weight, exact_rows):
    """The module docstring's fact: under the causal mask a query whose block starts at most C keys in has at most
    one key a chunk, and with the exact or mean-key chunk weight its output is exact softmax attention (written out
    here); with W = 4 and C = 8 the blocks starting at 0, 4 and 8 (rows 0-11) are exact and row 12 is not. The rfa
    chunk weight estimates a one-key chunk's mass: only the first block, with no chunk, is exact."""
    rng = np.random.default_rng(47)
    q, k, v = rng.normal(size=(3, 40, 6))
    out = randattn.estimate("eva", q, k, v, num_samples=8, seed=48, mask="causal", replicates=2, window=4,
                            layout="sequence", chunk_weight=chunk_weight)
    logits = q @ k.T / math.sqrt(6)
    logits[np.triu_indices(40, 1)] = -np.inf
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    exact = (weights / weights.sum(-1, keepdims=True)) @ v
    inexact = np.abs(out - exact).max(axis=(0, -1)) > 1e-12
    assert not inexact[:exact_rows].any()
    assert inexact[exact_rows]
