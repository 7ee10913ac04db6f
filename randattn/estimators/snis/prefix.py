r"""The causal log-space SNIS skeleton in torch: chunked prefix sums, no epsilon, no look at the future.

Under ``mask="causal"`` query n sees the keys :math:`m \le n + (M - N)` (ARCHITECTURE sec. 12,
:mod:`randattn.estimators.masks`). With query log-features :math:`\ell^q_{nj}` (and signs
:math:`\sigma^q_{nj}`), key log-features :math:`\ell^k_{mj}` (signs :math:`\sigma^k_{mj}`) over a shared
feature index j (J = S L), the estimate of ``snis.reference.feature_attention(..., mask="causal")`` is

.. math::
    y_n = \frac{\sum_j \sum_{m \le n + M - N} \sigma^q_{nj}\sigma^k_{mj}\, e^{\ell^q_{nj} + \ell^k_{mj}} v_m}
               {\sum_j \sum_{m \le n + M - N} \sigma^q_{nj}\sigma^k_{mj}\, e^{\ell^q_{nj} + \ell^k_{mj}}},

the unidirectional FAVOR+ of Performer App. B.1 eq. 11 (Algorithm 1) written as the SNIS of
ARCHITECTURE sec. 4. :func:`causal_feature_attention` computes it in O((N + M) J (D + Dv + C + T / C)) time
and O(T J (1 + Dv / C)) memory beyond its inputs and output (C the chunk size, T the tokens of one vectorized
group, set by a memory budget: a hundred or so on the CPU, a few thousand on a GPU); it never holds an
N x M, an N x J or an N x J x Dv array. The log-features it
takes are base-2 logarithms (:math:`\log_2 e\,\ell`): ``exp2`` is the faster exponential on CPU, and
every step below is the same in either base.

How, and why it is stable
-------------------------
Each query's terms are taken relative to its own reference

.. math:: r_n = \max_j \big(\ell^q_{nj} + c_j(n)\big), \qquad c_j(n) = \max_{m \text{ visible to } n} \ell^k_{mj},

a running maximum over the keys n may see, never over later ones (a per-feature maximum over the
carried keys, then a dyadic prefix-max scan inside each chunk). The causal triangle is cut into
*fully visible* blocks (a set of keys K every query of a set Q sees); a block contributes
:math:`A B^\top V_K` with

.. math::
    A_{nj} = \sigma^q_{nj} e^{\ell^q_{nj} - r_n + s_j} ,\qquad B_{mj} = \sigma^k_{mj} e^{\ell^k_{mj} - s_j},
    \qquad \max_{m \in K} \ell^k_{mj} \le s_j \le \min_{n \in Q} c_j(n),

so both factors lie in [-1, 1]: nothing overflows, and a product is never smaller than either factor's
share of it, so a term lost to underflow is below ``2 * tiny`` of the largest term, which is 1 (for
positive features the denominator is then at least 1: no epsilon, no 0/0). The blocks are

- the diagonal: each query with its own key (no shift: :math:`\ell^k_{nj} \le c_j(n)`);
- inside a chunk of C tokens, a dyadic split of the triangle: in every aligned block of 2h tokens the
  first half's keys for the second half's queries, h = C/2, C/4, ..., 1, with :math:`s_j` the running
  maximum at the end of the first half;
- the keys of all earlier chunks (and of the M - N prefix keys, which every query sees) for the queries
  of a chunk: their sums, an S L x (Dv + 1) state relative to :math:`s_j` = the running maximum before
  the chunk (:math:`M_g`, a cummax of the chunks' own maxima). Chunkwise-parallel: each chunk's key sums
  :math:`u_i` (relative to :math:`M_i`, the running maximum through it) come from one batched product,
  and the state of every chunk at once from one masked product per feature,
  :math:`U_g = \sum_{i \le g} 2^{M_i - M_g} u_i` (a cumulative sum with a running-max rescale; each
  factor one exponential of visible maxima, at most 1; the entries i > g exact zeros).

Stabilizers therefore only ever come from keys every query of the block sees: a key beyond query n
changes none of query n's bits (``tests/estimators/test_causal_rfa.py``). Every step runs on all chunks
of a group at once (no Python loop over chunks: the only loop is over the log2 C dyadic levels); the
groups, which a memory budget sizes, pass their last state on.

Signed features (the trigonometric map) keep their signs in A and B; their denominators can be zero
or negative, which :func:`causal_feature_attention` returns as the denominator's sign for the caller
to report (``snis.warn_non_positive``), as the bidirectional form does.

References
----------
Choromanski et al., "Rethinking attention with Performers", ICLR 2021: Algorithm 1 and App. B.1
eq. 11 (prefix sums). ARCHITECTURE sec. 4 (the SNIS in log space) and sec. 12 (causal masks).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "FeatureSlice",
    "causal_feature_attention",
    "causal_feature_weights",
    "check_chunk_size",
]

#: ``features(tokens) -> (log2_magnitude, sign)``: the base-2 log-features of a slice of the tokens as
#: ``(P, T, J)`` tensors (P = replicates x batch elements), ``sign`` None for positive features; fresh
#: tensors (the query's are overwritten).
FeatureSlice = Callable[[slice], "tuple[torch.Tensor, torch.Tensor | None]"]

#: tokens per chunk: 64 measured faster than 32 (1 CPU thread, 6 heads, S = 256, D = Dv = 64, N = 4096, time
#: relative to an equal-FLOP matrix product: 4.5x against 5.2x, on a loaded machine): the exponentials grow like
#: log2 C (one pass per dyadic level), the per-chunk key sums, (N / C) J (Dv + 1) elements, like 1 / C
DEFAULT_CHUNK_SIZE = 64
#: elements (not bytes) of one vectorized group's five (P, T, J) temporaries, two (P, T, Dv + 1) sums and the
#: per-chunk key sums (three copies of (P, T / C, J, Dv + 1) at most): on the CPU small enough to stay in cache
#: (2^21 measured faster than 2^22..2^24 on 2 cores), large enough that Python's per-operator cost stays small
_GROUP_ELEMENTS = 2**21
#: the same on a GPU, where a group costs about 90 kernel launches whatever its size, so that groups must be few:
#: 2^25 elements (128 MiB in float32) hold 2,496 tokens of 6 heads at S = 256, Dv = 64 (7 groups at N = 16,384)
_GPU_GROUP_ELEMENTS = 2**25
#: up to this many elements (chunks of a group, and the state) their prefix sums are one broadcast product
_BROADCAST_ELEMENTS = 4


def check_chunk_size(chunk_size: int) -> int:
    """``chunk_size`` if it is a positive power of two (the intra-chunk split halves it), else ValueError."""
    power_of_two = isinstance(chunk_size, int) and chunk_size >= 1 and not chunk_size & (chunk_size - 1)
    if isinstance(chunk_size, bool) or not power_of_two:
        raise ValueError(f"chunk_size must be a positive power of two (1, 2, 4, ..., 64, ...), got {chunk_size!r}")
    return chunk_size


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` with -inf (a feature no key has mass in yet, e.g. an exact zero of sin) replaced by 0, to shift by."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def _exp2_(t: torch.Tensor) -> torch.Tensor:
    """``2 ** t`` in place, arguments first raised to ``log2(tiny) + 1`` (-125 in float32, -1021 in float64).

    Every argument here is a base-2 log-ratio to a term of at most 1 (module notes), so a raised one stands
    for a term below ``2 * tiny`` (2e-38 in float32), which it now counts as that: a change of at most
    ``2 * tiny`` per term, relative to a largest term of 1. Why: torch's CPU ``exp``/``exp2`` run 3-45 times
    slower (measured up to 76 ns instead of 0.7 per float32) on arguments whose result underflows or lands at
    the smallest normal number, and most features of most tokens are that far below the maximum at real key
    norms; ``exp2`` itself is about twice as fast as ``exp`` (0.7 vs 1.7 ns per float32 on 1 core), hence
    base-2 log-features. A -inf argument (no mass) is raised too; it only ever multiplies a zero sign or a
    zero value here.
    """
    return t.clamp_(min=math.log2(torch.finfo(t.dtype).tiny) + 1.0).exp2_()


def _merge(c: torch.Tensor | None, u: torch.Tensor | None, c2: torch.Tensor, u2: torch.Tensor):
    """Two key sums ``u = sum_m 2^(l_mj - c_j) [v_m, 1]`` (relative to ``_finite(c)``) as one, relative to the larger
    maximum.

    ``c, c2 : (P, J)`` per-feature maxima of their keys' base-2 log-features, ``u, u2 : (P, J, Dv + 1)``; a
    factor ``2^(c - max)`` takes the raw ``c``, so a feature with no mass yet (-inf, whose sum is 0) stays 0.
    """
    if c is None:
        return c2, u2
    top = torch.maximum(c, c2)
    safe = _finite(top)
    u = u * _exp2_(c - safe).unsqueeze(-1)
    return top, u.addcmul_(u2, _exp2_(c2 - safe).unsqueeze(-1))


class _Buffers:
    """Scratch tensors reused by every group of one call: fresh multi-megabyte tensors cost page faults on CPU
    (measured: an out-of-place ``exp`` of 25M floats took 3x the in-place one), so the hot loops write in place."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        size = math.prod(shape)
        t = self.tensors.get(name)
        if t is None or t.numel() < size:
            t = self.tensors[name] = like.new_empty(size)
        return t[:size].view(shape)


def _group(lq, sq, lk, sk, va, chunk: int, state_c, state_u, buffers: _Buffers):
    """Numerators and denominators ``(P, T, Dv + 1)`` of T = G C aligned tokens, and the state after them.

    ``lq, lk : (P, T, J)`` (query n at position t sees the keys at positions <= t and the state; ``lq`` is
    overwritten), ``va : (P, T, Dv + 1)``; ``state_c : (P, J)`` and ``state_u : (P, J, Dv + 1)`` (or None: no
    earlier key), all log-features base 2. Each result row is relative to ``2^r_n`` (module notes); its ratio
    is the estimate. Chunkwise-parallel: every step runs on all G chunks at once; the only loop is over the
    log2 C dyadic levels inside a chunk.
    """
    flat, tokens, feats = lq.shape
    dva = va.shape[-1]
    chunks = tokens // chunk
    signed = sq is not None
    # positive features: every chunk's maximum is finite (each chunk starts with a real key); only the state's
    # may be -inf (no earlier key), whose sums are 0
    finite = _finite if signed else (lambda t: t)
    work = buffers.get("work", (flat, tokens, feats), lq)
    by_chunk = lambda t: t.view(flat, chunks, chunk, *t.shape[2:])  # noqa: E731

    # element 0 the carried state (earlier groups and the prompt keys), element g + 1 chunk g. state_max[:, i]: the
    # per-feature maximum over the keys of elements 0..i, a running maximum over visible keys only (a cummax over
    # the chunks' own maxima); state_max[:, g] is what every query of chunk g sees before its chunk
    state_max = lq.new_empty((flat, chunks + 1, feats))
    state_max[:, 0] = -math.inf if state_c is None else state_c
    torch.amax(by_chunk(lk), dim=2, out=state_max[:, 1:])
    state_max = torch.cummax(state_max, dim=1).values
    safe = finite(state_max)
    # each chunk's key sums [v, 1], relative to the running maximum through it: one batched product for all chunks
    e = _exp2_(torch.sub(by_chunk(lk), safe[:, 1:].unsqueeze(-2), out=by_chunk(work)))
    if signed:
        e.mul_(by_chunk(sk))
    chunk_sums = e.transpose(-1, -2) @ by_chunk(va)  # (P, G, J, Dv + 1), elements 1..G
    del e
    # the prefix sums of the elements, each rescaled to the running maximum of the prefix: a cumulative sum with a
    # running-max rescale, as one masked product per feature, U_g = sum_{i <= g} 2^(M_i - M_g) u_i. Each factor is
    # one exponential of a difference of visible maxima (at most 1, no product of factors rounds); the entries
    # i > g are set to exact zeros after the exponential, so a later chunk adds +0 whatever its keys
    # (P, g, i, J); _finite: the state's maximum is -inf when there is no earlier key, of any map
    rescale = _exp2_(state_max.unsqueeze(1) - _finite(state_max).unsqueeze(2))
    later = torch.ones(chunks + 1, chunks + 1, dtype=torch.bool, device=lq.device).triu_(1)
    rescale.masked_fill_(later.unsqueeze(-1), 0.0)
    if chunks + 1 <= _BROADCAST_ELEMENTS:
        # a few elements (the CPU's cache-sized groups): a broadcast product summed over i, at most 4x the sums; a
        # batch of P J tiny (G + 1)^2 matrix products and the transposed copies it needs measured 5x slower
        prefix = (rescale[:, :, 1:].unsqueeze(-1) * chunk_sums.unsqueeze(1)).sum(2)  # (P, G + 1, J, Dv + 1)
        if state_u is not None:
            prefix.addcmul_(rescale[:, :, 0].unsqueeze(-1), state_u.unsqueeze(1))
    else:
        sums = torch.cat([lq.new_zeros((flat, 1, feats, dva)) if state_u is None else state_u.unsqueeze(1),
                          chunk_sums], dim=1)  # (P, G + 1, J, Dv + 1)
        prefix = (rescale.permute(0, 3, 1, 2) @ sums.transpose(1, 2)).transpose(1, 2)
        del sums
    del rescale, chunk_sums

    # c_j(n): the running maximum over every key query n sees, by a dyadic scan within each chunk started from the
    # state's maximum; after step h every aligned block of 2h tokens holds its prefix maxima
    run_max = buffers.get("run_max", (flat, tokens, feats), lq).copy_(lk)
    starts = by_chunk(run_max)[:, :, 0]
    torch.maximum(starts, state_max[:, :-1], out=starts)
    h = 1
    while h < chunk:
        blocks = run_max.view(flat, tokens // (2 * h), 2, h, feats)
        torch.maximum(blocks[:, :, 1], blocks[:, :, 0, h - 1 : h], out=blocks[:, :, 1])
        h *= 2
    # r_n = max_j (l^q_nj + c_j(n)); from here on the query log-features are taken relative to it
    lq.sub_(torch.add(lq, run_max, out=work).amax(-1, keepdim=True))

    # the diagonal: each query with its own key
    diag = _exp2_(torch.add(lq, lk, out=work))
    if signed:
        diag.mul_(sq).mul_(sk)
    num = va * diag.sum(-1, keepdim=True)  # (P, T, Dv + 1)
    # the dyadic blocks: in every aligned block of 2h tokens, the first half's keys for the second half's queries
    halves = buffers.get("halves", (2, flat, tokens // 2, feats), lq)
    h = chunk // 2
    while h >= 1:
        nb = tokens // (2 * h)
        split = lambda t: t.view(flat, nb, 2, h, *t.shape[2:])  # noqa: E731
        shift = split(run_max)[:, :, 0, h - 1].unsqueeze(-2)  # (P, nb, 1, J): the running max at the key half's end
        a = _exp2_(torch.add(split(lq)[:, :, 1], shift, out=halves[0].view(flat, nb, h, feats)))
        b = _exp2_(torch.sub(split(lk)[:, :, 0], finite(shift), out=halves[1].view(flat, nb, h, feats)))
        if signed:
            a.mul_(split(sq)[:, :, 1])
            b.mul_(split(sk)[:, :, 0])
        if h == 1:  # one query and one key per block: a dot product, not a batch of 1 x 1 matrix products
            split(num)[:, :, 1].addcmul_(split(va)[:, :, 0], a.mul_(b).sum(-1, keepdim=True))
        elif h == 2:  # 2 x 2 weights: two broadcast products, not a batch of (2, 2) @ (2, Dv + 1) products
            weights, keys, queries = a @ b.transpose(-1, -2), split(va)[:, :, 0], split(num)[:, :, 1]
            queries.addcmul_(weights[..., 0:1], keys[:, :, 0:1]).addcmul_(weights[..., 1:2], keys[:, :, 1:2])
        else:
            split(num)[:, :, 1] += (a @ b.transpose(-1, -2)) @ split(va)[:, :, 0]
        h //= 2

    # the earlier chunks' keys (and the state) for every query of a chunk, one batched product: their sums are
    # relative to state_max[:, g], which r_n covers, so these factors are at most 1
    a = _exp2_(torch.add(by_chunk(lq), state_max[:, :-1].unsqueeze(-2), out=by_chunk(work)))
    if signed:
        a.mul_(by_chunk(sq))
    by_chunk(num).add_(a @ prefix[:, :-1])
    return num.view(flat, tokens, dva), state_max[:, -1].clone(), prefix[:, -1].clone()


def causal_feature_attention(
    query_features: FeatureSlice,
    key_features: FeatureSlice,
    v: torch.Tensor,
    *,
    num_queries: int,
    replicates: int,
    num_features: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Causal normalized linear attention from log-features, as chunked prefix sums (module notes).

    Parameters
    ----------
    query_features : callable
        ``query_features(tokens) -> (log2_magnitude, sign)`` for a slice of the N queries: base-2
        log-magnitudes, each ``(P, T, J)`` with P = R x batch elements in that order (replicates
        first), fresh tensors (overwritten here); ``sign`` None for positive features. They may leave
        out a per-query constant (it cancels in the ratio; e.g. :math:`-\|x_n\|^2/2`), which spares
        float32 the rounding of a large one.
    key_features : callable
        The same for a slice of the M keys, with exact log-magnitudes (per-key terms do not cancel).
    v : (..., M, Dv)
        Values; ``...`` the batch dims (P / R elements).
    num_queries : int
        N; requires M >= N (the queries are the last N of M tokens).
    replicates : int
        R.
    num_features : int
        J, the feature count the callables return (sizes the vectorized groups).
    chunk_size : int
        C, a power of two; changes the rounding only.

    Returns
    -------
    out : (R, ..., N, Dv)
    denominator_sign : (R, ..., N)
        +1 for positive features; 0 or -1 flags a query whose signed-feature denominator vanished
        or turned negative (its output is not meaningful; callers warn).
    """
    chunk = check_chunk_size(chunk_size)
    batch, num_keys, dv = tuple(v.shape[:-2]), v.shape[-2], v.shape[-1]
    if num_keys < num_queries:
        raise ValueError(f"a causal mask needs at least as many keys as queries, got N={num_queries}, M={num_keys}")
    offset = num_keys - num_queries
    flat = replicates * math.prod(batch)
    # tokens per vectorized group: its five (P, T, J) log-feature and scratch tensors, two (P, T, Dv + 1) sums and
    # the per-chunk key sums within budget (on the CPU so that they stay in cache; on a GPU so that groups are few)
    per_token = flat * (5 * num_features + 2 * (dv + 1) + -(-3 * num_features * (dv + 1) // chunk))
    budget = _GROUP_ELEMENTS if v.device.type == "cpu" else _GPU_GROUP_ELEMENTS
    group = max(chunk, int(budget // per_token) // chunk * chunk)

    def values(tokens: slice) -> torch.Tensor:  # (P, T, Dv + 1): the values and a ones column (the denominators)
        part = v[..., tokens, :]
        part = torch.cat([part, part.new_ones(*part.shape[:-1], 1)], dim=-1)
        return part.unsqueeze(0).expand(replicates, *part.shape).reshape(flat, part.shape[-2], dv + 1)

    state_c = state_u = None
    # the M - N keys before the first query: every query sees them, so they only enter the initial state
    for start in range(0, offset, group):
        tokens = slice(start, min(start + group, offset))
        lk, sk = key_features(tokens)
        block_max = lk.amax(-2)  # (P, J)
        e = _exp2_(lk - _finite(block_max).unsqueeze(-2))
        if sk is not None:
            e.mul_(sk)
        state_c, state_u = _merge(state_c, state_u, block_max, e.transpose(-1, -2) @ values(tokens))
        del e

    buffers = _Buffers()
    out = v.new_empty((flat, num_queries, dv))
    sign = v.new_empty((flat, num_queries))
    for start in range(0, num_queries, group):
        stop = min(start + group, num_queries)
        length = stop - start
        lq, sq = query_features(slice(start, stop))
        keys = slice(offset + start, offset + stop)
        lk, sk = key_features(keys)
        va = values(keys)
        pad = -length % chunk
        if pad:
            # a last chunk filled up with keys of no mass (-inf) after every real one and queries that are dropped
            padding = lambda t, value: torch.nn.functional.pad(t, (0, 0, 0, pad), value=value)  # noqa: E731
            lq, lk, va = padding(lq, 0.0), padding(lk, -math.inf), padding(va, 0.0)
            sq = None if sq is None else padding(sq, 1.0)
            sk = None if sk is None else padding(sk, 1.0)
        num, state_c, state_u = _group(lq, sq, lk, sk, va, chunk, state_c, state_u, buffers)
        num = num[:, :length]
        torch.div(num[..., :dv], num[..., dv:], out=out[:, start:stop])
        torch.sign(num[..., dv], out=sign[:, start:stop])
    return out.view(replicates, *batch, num_queries, dv), sign.view(replicates, *batch, num_queries)


def causal_feature_weights(
    lq: torch.Tensor,
    sq: torch.Tensor | None,
    lk: torch.Tensor,
    sk: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""The causal attention weights the features imply, ``(P, N, M)``, each row relative to its largest term.

    .. math::
        W_{nm} = \sum_j \sigma^q_{nj}\sigma^k_{mj}\, 2^{\ell^q_{nj} + \ell^k_{mj} - r_n}
        \quad (m \le n + M - N), \qquad W_{nm} = 0 \text{ otherwise},

    with :math:`r_n` and the blocks of the module notes, over the whole sequence instead of one chunk:
    the M - N prefix keys (seen by every query) are one block stabilized by their own per-feature maximum;
    the N x N triangle is the diagonal plus, at every level h = 1, 2, 4, ..., the first half's keys of each
    aligned block of 2h tokens for its second half's queries, stabilized by the running maximum at the
    key half's end. Every factor lies in [-1, 1] and a weight of query n depends on no key after
    :math:`n + M - N`. ``W / W.sum(-1)`` are the implied probabilities and ``(W @ v) / W.sum(-1)`` the causal
    estimate of :func:`causal_feature_attention` (to rounding: the sums are grouped differently).

    Cost: O(N M J) multiply-adds in matrix products (the triangle's half of them) and O((N + M) J log N)
    exponentials, O(P N M) memory for the result: what a dense probability matrix needs anyway, without
    the S J x M prefix state that ``causal_feature_attention`` with identity values would carry.

    Parameters
    ----------
    lq : (P, N, J)
        Base-2 query log-features (a per-query constant may be left out; it cancels in the ratio).
    sq : (P, N, J) or None
        Their signs; None for positive features.
    lk : (P, M, J)
        Base-2 key log-features, M >= N (the queries are the last N of the M tokens).
    sk : (P, M, J) or None
    out : (P, N, M), optional
        Where to write W (contiguous, the dtype of ``lq``); every entry is written, none is read.

    Returns
    -------
    (P, N, M)
        W; rows of positive features sum to at least 1 (the largest term is 1).
    """
    flat, num_queries, feats = lq.shape
    num_keys = lk.shape[1]
    if num_keys < num_queries:
        raise ValueError(f"a causal mask needs at least as many keys as queries, got N={num_queries}, M={num_keys}")
    weights = lq.new_empty((flat, num_queries, num_keys)) if out is None else out
    size = 1 << max(num_queries - 1, 0).bit_length()  # the triangle padded to a power of two for the dyadic split
    # replicates x heads a group: its log-features and weights about the last-level cache (measured on 2 cores)
    per_slice = 4 * size * feats + size * (num_keys - num_queries + size)
    group = max(1, _GROUP_ELEMENTS // per_slice)
    for start in range(0, flat, group):
        part = slice(start, min(start + group, flat))
        _causal_weights_group(lq[part], None if sq is None else sq[part], lk[part], None if sk is None else sk[part],
                              size, weights[part])
    return weights


def _causal_weights_group(lq, sq, lk, sk, size: int, out: torch.Tensor) -> None:
    """:func:`causal_feature_weights` of a few (replicate, head) slices into ``out``, the triangle padded to
    ``size`` (written in place when it needs no padding)."""
    flat, num_queries, feats = lq.shape
    offset = lk.shape[1] - num_queries
    signed = sq is not None
    finite = _finite if signed else (lambda t: t)
    pad = size - num_queries
    padded = lambda t, value: torch.nn.functional.pad(t, (0, 0, 0, pad), value=value) if pad else t  # noqa: E731
    lk_sq = padded(lk[:, offset:], -math.inf)
    # c_j(n): the per-feature running maximum over the keys query n sees, by a dyadic scan (torch's cummax is
    # measured 10x slower), then raised to the prefix keys' maximum (every query sees them)
    run_max = lk_sq.clone()
    h = 1
    while h < size:
        blocks = run_max.view(flat, size // (2 * h), 2, h, feats)
        torch.maximum(blocks[:, :, 1], blocks[:, :, 0, h - 1 : h], out=blocks[:, :, 1])
        h *= 2
    if offset:
        prefix_max = lk[:, :offset].amax(1, keepdim=True)  # (P, 1, J)
        torch.maximum(run_max, prefix_max, out=run_max)
    lq_sq = padded(lq, 0.0)
    # l^q_nj - r_n with r_n = max_j (l^q_nj + c_j(n)): every term below is relative to query n's largest
    lq_sq = lq_sq.sub_(torch.add(lq_sq, run_max).amax(-1, keepdim=True)) if pad else lq - (lq + run_max).amax(
        -1, keepdim=True)
    sq_sq = None if sq is None else padded(sq, 1.0)
    sk_sq = None if sk is None else padded(sk[:, offset:], 1.0)

    # unpadded, the weights are written in place: every entry below is set, the upper triangle by its dyadic blocks
    weights = out if not pad else lq.new_zeros((flat, size, offset + size))
    square = weights[:, :, offset:]
    if offset:
        prefix = _exp2_(lk[:, :offset] - finite(prefix_max))
        a = _exp2_(lq_sq + finite(prefix_max))
        if signed:
            prefix.mul_(sk[:, :offset])
            a.mul_(sq_sq)
        weights[:, :, :offset] = a @ prefix.transpose(-1, -2)
    # the diagonal: each query with its own key
    diag = _exp2_(lq_sq + lk_sq)
    if signed:
        diag.mul_(sq_sq).mul_(sk_sq)
    torch.diagonal(square, dim1=1, dim2=2).copy_(diag.sum(-1))
    del diag
    h = 1
    while h < size:
        used = -(-(num_queries - h) // (2 * h))  # blocks whose query half holds a real query
        split = lambda t: t.view(flat, size // (2 * h), 2, h, *t.shape[2:])[:, :used]  # noqa: E731
        shift = finite(split(run_max)[:, :, 0, h - 1].unsqueeze(-2))  # (P, used, 1, J)
        a = _exp2_(split(lq_sq)[:, :, 1] + shift)
        b = _exp2_(split(lk_sq)[:, :, 0] - shift)
        if signed:
            a.mul_(split(sq_sq)[:, :, 1])
            b.mul_(split(sk_sq)[:, :, 0])
        # the (query half, key half) block of each aligned 2h block, as a strided view of the weights
        blocks = torch.diagonal(square.view(flat, size // (2 * h), 2 * h, size // (2 * h), 2 * h), dim1=1, dim2=3)
        blocks[:, h:, :h, :used].copy_((a @ b.transpose(-1, -2)).permute(0, 2, 3, 1))
        if not pad:  # the mirrored block: keys after the queries, 0 (the strict upper triangle, once per entry)
            blocks[:, :h, h:].zero_()
        h *= 2
    if pad:
        out.copy_(weights[:, :num_queries, : offset + num_queries])
