"""MagicPIG in torch (the batched form of :mod:`.reference`, same draws, same layout).

The projections :math:`y_m^\\top w_{lk}` of the keys, :math:`\\mu_n^\\top w_{lk}` of the queries' centring means
and :math:`x_n^\\top w_{lk}` of the queries are formed in one product per replicate and batch element; a centred key
has bit 1 where :math:`y_m^\\top w > \\mu_n^\\top w` (:math:`\\iff (y_m - \\mu_n)^\\top w > 0`). The sampler has
two forms that take the same sample (each is tested against the reference and the paper's loop):

- **on the CPU** (:data:`BUCKETED_DEVICES`), from hash buckets: for each group of :data:`QUERY_GROUP` queries the
  keys' codes go into each table's buckets (a sort) and a query collides with the keys of its code's bucket, so
  the work is O(M L K) comparisons and O(L M log M) to sort per group, plus the matches; the few (table, key)
  pairs whose bit differs between the group's queries are compared per query (:func:`_sample_in_buckets`). The
  tables are projected and read :data:`TABLES_PER_PASS` at a time and each (query, key)'s collisions summed over
  the passes, so the memory held is O(K M) projections and an int16 N x M count, whatever L is;
- **elsewhere** (an accelerator), densely: every (query, key, table, bit) is compared, O(N M L K), in chunks of
  queries whose ``(C, M, L)`` agreement stays near :data:`CHUNK_ELEMENTS` elements, reading nothing back from the
  device (:func:`_sample_densely`).

``log u`` depends on the angle alone, so it is formed once for all replicates: at the sampled pairs on the CPU (and
there the L-term upper sum of the binomial tail only where u < 1/2), at every candidate pair elsewhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.magicpig.reference import MagicpigOptions, tail_terms
from randattn.estimators.masks import check_causal_shapes
from randattn.estimators.sparse import batched as sparse_batched
from randattn.estimators.sparse.batched import masked_logits, visible_keys
from randattn.estimators.sparse.forms import WeightedKeysForms, no_values

__all__ = ["CHUNK_ELEMENTS", "estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used",
           "exact_and_candidate_keys", "keys_used", "log_weights", "probabilities", "sample_counts"]

#: about how many elements one chunk of the sampler's work holds (the dense form's agreement, the band's codes,
#: the binomial tails' terms)
CHUNK_ELEMENTS = 1 << 22
#: device types on which the sampler reads hash buckets (:func:`_sample_in_buckets`: their sizes come from the
#: data, so they are read on the host); elsewhere (an accelerator) it compares every (query, key, table, bit),
#: which reads nothing back
BUCKETED_DEVICES = ("cpu",)
#: the longest code that one int64 holds; longer codes are compared densely
MAX_CODE_BITS = 62
#: queries whose thresholds share one set of bucket codes (the decode-time runs' last 64 queries are one group)
QUERY_GROUP = 64
#: about how many (table, query, key) matches one piece of :func:`_bucket_matches` lists
BUCKET_PIECE = 1 << 20
#: tables whose projections the buckets form and read in one pass (K x 32 x M of them, 168 MB in float32 at K = 10
#: and 131,072 keys), so that no (K, L, M) projections are held whatever the number of tables; 32 measured as fast as
#: one pass at L = 150 on SmolLM2's 8,192-token capture, 16 up to 13 % slower (ten passes' launches)
TABLES_PER_PASS = 32


def _angle(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kahan's ``2 atan2(|a^ - b^|, |a^ + b^|)`` along the last axis; a zero vector's unit vector is 0 (reference
    :func:`~randattn.estimators.magicpig.reference.angle`)."""
    def unit(w: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(w, dim=-1, keepdim=True)
        return w / torch.where(norm > 0, norm, torch.ones_like(norm))

    ua, ub = unit(a), unit(b)
    return 2.0 * torch.atan2(torch.linalg.vector_norm(ua - ub, dim=-1), torch.linalg.vector_norm(ua + ub, dim=-1))


def _log_inclusion(log_table_probability: torch.Tensor, tables: int, min_collisions: int) -> torch.Tensor:
    """``log u``, the binomial tail in log space: the upper sum where u < 1/2, ``log1p`` of minus the lower sum
    where u >= 1/2 (reference :func:`~randattn.estimators.magicpig.reference.log_inclusion_probability`); both sums
    at every pair, so that nothing is read back from an accelerator."""
    like = log_table_probability
    j, log_binomial = (torch.as_tensor(a, dtype=like.dtype, device=like.device)
                       for a in tail_terms(tables, min_collisions))
    lower = _log_binomial_sum(like, j[:min_collisions], log_binomial[:min_collisions], tables)
    upper = _log_binomial_sum(like, j[min_collisions:], log_binomial[min_collisions:], tables)
    return torch.where(lower <= -math.log(2.0), torch.log1p(-torch.exp(lower)), upper)


def _log_inclusion_where_needed(log_table_probability: torch.Tensor, tables: int,
                                min_collisions: int) -> torch.Tensor:
    """:func:`_log_inclusion`, the same numbers, with the L - c + 1 terms of the upper sum formed only at the pairs
    whose u is below 1/2 (the lower sum has c terms; a host-side selection)."""
    like = log_table_probability
    j, log_binomial = (torch.as_tensor(a, dtype=like.dtype, device=like.device)
                       for a in tail_terms(tables, min_collisions))
    lower = _log_binomial_sum(like, j[:min_collisions], log_binomial[:min_collisions], tables)
    log_u = torch.log1p(-torch.exp(lower))
    small = lower > -math.log(2.0)
    log_u[small] = _log_binomial_sum(like[small], j[min_collisions:], log_binomial[min_collisions:], tables)
    return log_u


def _log_binomial_sum(log_table_probability: torch.Tensor, j: torch.Tensor, log_binomial: torch.Tensor,
                      tables: int) -> torch.Tensor:
    """:math:`\\log \\sum_j \\binom{L}{j} P^j (1 - P)^{L - j}` over the collision counts ``j`` with their
    ``log_binomial`` coefficients, from :math:`\\log P`; :math:`0 \\log 0 = 0`, so the j = 0 and j = L terms hold
    where P is 0 or 1."""
    log_p = log_table_probability.unsqueeze(-1)
    log_q = torch.log1p(-torch.exp(log_p))  # log(1 - P), once per pair (not once per term)
    terms = (log_binomial + torch.where(j > 0, j * log_p, torch.zeros_like(log_p))
             + torch.where(j < tables, (tables - j) * log_q, torch.zeros_like(log_q)))
    return torch.logsumexp(terms, dim=-1)


def exact_and_candidate_keys(num_queries: int, num_keys: int, sinks: int, local: int, mask: str | None,
                             device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, candidates)``, each ``(N, M)`` boolean, made on ``device`` from the positions alone (reference
    :func:`~randattn.estimators.magicpig.reference.exact_and_candidate_keys`): a host array uploaded would move
    2 N M bytes per call."""
    keys = torch.arange(num_keys, device=device)
    last = (torch.arange(num_queries, device=device) + num_keys - num_queries if mask is not None
            else torch.full((num_queries,), num_keys - 1, device=device))  # t_n: the most recent key query n sees
    exact = (keys < sinks).unsqueeze(0) | (keys.unsqueeze(0) > (last - local).unsqueeze(1))
    visible = visible_keys(num_queries, num_keys, mask, device)
    if visible is None:
        return exact, ~exact
    exact &= visible
    return exact, visible & ~exact


def _has_candidates(num_keys: int, sinks: int, local: int) -> bool:
    """Whether any query has a key that is neither a sink nor local, from the shapes alone (no device read): the
    query seeing the most keys sees keys ``0..M-1``, of which ``sinks..M-1-local`` are candidates."""
    return num_keys - local > sinks


def _centering_means(y: torch.Tensor, visible: torch.Tensor, candidates: torch.Tensor, center: str) -> torch.Tensor:
    """``(..., N, D)``: the mean of each query's visible keys / candidates (0 for none, or for ``center="none"``);
    in a channel where every key averaged holds one value, that value exactly (reference
    :func:`~randattn.estimators.magicpig.reference.centering_means`).

    Each query averages a run of consecutive keys (its visible keys, or those between the sinks and the local window
    among them), so a channel is constant over the run when no two neighbours in it differ: one product of the
    neighbour pairs in each run with the changes between neighbours counts the changes (a sum of counts >= 0 is 0
    only when each is, whatever its rounding), and the value is the run's first key."""
    if center == "none":
        return y.new_zeros((*y.shape[:-2], visible.shape[0], y.shape[-1]))
    rows = visible if center == "all-keys" else candidates
    weights = rows.to(y.dtype)
    counts = weights.sum(-1, keepdim=True)
    means = (weights @ y) / torch.where(counts > 0, counts, torch.ones_like(counts))
    changes = (y[..., 1:, :] != y[..., :-1, :]).to(y.dtype)  # (..., M - 1, D)
    varies = ((rows[:, 1:] & rows[:, :-1]).to(y.dtype) @ changes) > 0  # (..., N, D)
    first = y[..., weights.argmax(-1), :]  # each run's first key (argmax: the first of the maxima)
    return torch.where(varies | (counts == 0), means, first)


def log_weights(x: torch.Tensor, y: torch.Tensor, hyperplanes: torch.Tensor, *, min_collisions: int, sinks: int,
                local: int, center: str, mask: str | None = None) -> torch.Tensor:
    """``(R, ..., N, M)``: 0 for exact keys, ``-log u`` for sampled keys, ``-inf`` for the rest (and hidden keys).

    ``x (..., N, D)``, ``y (..., M, D)`` scaled; ``hyperplanes (R, ..., L, K, D)`` in their dtype and device.
    """
    return _hash_and_sample(x, y, hyperplanes, min_collisions=min_collisions, sinks=sinks, local=local,
                            center=center, mask=mask, weights=True)


def sample_counts(x: torch.Tensor, y: torch.Tensor, hyperplanes: torch.Tensor, *, min_collisions: int, sinks: int,
                  local: int, center: str, mask: str | None = None) -> torch.Tensor:
    """``(R, ..., N)`` float64: the exact keys plus the sampled keys of each query, the keys with a finite weight in
    :func:`log_weights` (from the same hashes; without the inclusion probabilities, which counting does not need)."""
    return _hash_and_sample(x, y, hyperplanes, min_collisions=min_collisions, sinks=sinks, local=local,
                            center=center, mask=mask, weights=False)


def _hash_and_sample(x: torch.Tensor, y: torch.Tensor, hyperplanes: torch.Tensor, *, min_collisions: int, sinks: int,
                     local: int, center: str, mask: str | None, weights: bool) -> torch.Tensor:
    """:func:`log_weights` (``weights``) or :func:`sample_counts`: one hashing loop serves both."""
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    replicates, tables, hash_bits = hyperplanes.shape[0], hyperplanes.shape[-3], hyperplanes.shape[-2]
    exact, candidates = exact_and_candidate_keys(num_queries, num_keys, sinks, local, mask, x.device)
    if weights:
        out = x.new_full((replicates, *x.shape[:-2], num_queries, num_keys), float("-inf"))
    else:  # every query's exact keys, to which its sampled keys are added
        out = exact.sum(-1).to(torch.float64).expand(replicates, *x.shape[:-2], num_queries).clone()
    if not _has_candidates(num_keys, sinks, local):  # sinks and local window hold every visible key: nothing to hash
        return out.masked_fill(exact, 0.0) if weights else out
    means = _centering_means(y, exact | candidates, candidates, center)  # (..., N, D)
    # one (replicate, batch element) at a time, never an (R, ..., M, L, K) tensor (9 heads x 4 replicates x 4,096
    # keys x 150 tables would be 0.9 GB in float32)
    batch = x.shape[:-2]
    # the directions in (bit, table) order: the product with the keys is each bit's (L, M) projections in one block
    planes = hyperplanes.expand(replicates, *batch, *hyperplanes.shape[-3:]).transpose(-3, -2).reshape(
        replicates, -1, hash_bits, tables, hyperplanes.shape[-1])
    xs, ys, ms = x.reshape(-1, num_queries, x.shape[-1]), y.reshape(-1, num_keys, y.shape[-1]), \
        means.reshape(-1, num_queries, means.shape[-1])
    flat_out = out.view(replicates, -1, num_queries, num_keys) if weights else out.view(replicates, -1, num_queries)
    in_buckets = x.device.type in BUCKETED_DEVICES and hash_bits <= MAX_CODE_BITS
    sample, pair_log_inclusion = ((_sample_in_buckets, _sampled_pairs_log_inclusion) if in_buckets
                                  else (_sample_densely, _candidate_pairs_log_inclusion))
    for b in range(xs.shape[0]):
        sampled = torch.empty((replicates, num_queries, num_keys), dtype=torch.bool, device=x.device)
        # keys, means and queries in one product: a key equal to its query's mean projects to the same numbers, so
        # the tie y.w = mu.w is exact, and the bit 0, as (y - mu).w = 0 is in the reference
        stacked = torch.cat([ys[b], ms[b], xs[b]]).T  # (D, M + 2 N)
        for r in range(replicates):
            sample(planes[r, b], stacked, candidates, min_collisions, out=sampled[r])
        if not weights:
            flat_out[:, b] += sampled.sum(-1)
            continue
        # log u of the pairs: the same in every replicate (it depends on the angle alone)
        log_u = pair_log_inclusion(xs[b], ys[b], ms[b], candidates, sampled, hash_bits, tables, min_collisions)
        for r in range(replicates):
            sample_weights = torch.where(sampled[r], -log_u, torch.full_like(log_u, float("-inf")))
            flat_out[r, b] = torch.where(exact, torch.zeros_like(sample_weights), sample_weights)
    return out


def _projections(planes: torch.Tensor, stacked: torch.Tensor,
                 num_keys: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(key_proj (K, L', M), thresholds (K, L', N), query_bits (K, L', N))`` of the tables of ``planes (K, L', D)``:
    :math:`y_m^\\top w_{lk}`, :math:`\\mu_n^\\top w_{lk}` and :math:`[x_n^\\top w_{lk} > 0]`, from one product with
    ``stacked (D, M + 2 N)``, the keys, the means and the queries as columns."""
    hash_bits, tables, dim = planes.shape
    projections = (planes.reshape(hash_bits * tables, dim) @ stacked).unflatten(0, (hash_bits, tables))
    num_queries = (stacked.shape[-1] - num_keys) // 2
    key_proj, thresholds, query_proj = projections.split([num_keys, num_queries, num_queries], dim=-1)
    return key_proj, thresholds, query_proj > 0


def _sample_densely(planes: torch.Tensor, stacked: torch.Tensor, candidates: torch.Tensor, min_collisions: int, *,
                    out: torch.Tensor) -> None:
    """``out (N, M)``: the candidates that share the query's code in at least ``min_collisions`` tables, found by
    comparing every (query, key, table, bit) of the projections (:func:`_projections`) on the directions ``planes
    (K, L, D)``. Queries go in chunks whose ``(C, M, L)`` agreement stays near :data:`CHUNK_ELEMENTS`; nothing is
    read back from the device."""
    num_queries, num_keys = candidates.shape
    # (K, M, L), (K, N, L): each bit's keys by tables in one block, the tables last (as each query's code is)
    key_proj, thresholds, query_bits = (a.transpose(-2, -1).contiguous()
                                        for a in _projections(planes, stacked, num_keys))
    hash_bits, tables = planes.shape[:2]
    for rows in _pieces(num_queries, CHUNK_ELEMENTS // max(1, num_keys * tables)):
        shape = (rows.stop - rows.start, num_keys, tables)
        agree, key_bit = (torch.empty(shape, dtype=torch.bool, device=key_proj.device) for _ in range(2))
        for bit in range(hash_bits):  # the tables where the centred key's code equals the query's
            torch.gt(key_proj[bit].unsqueeze(0), thresholds[bit, rows].unsqueeze(1), out=key_bit)
            if bit == 0:
                torch.eq(key_bit, query_bits[bit, rows].unsqueeze(1), out=agree)
            else:
                agree.logical_and_(key_bit.eq_(query_bits[bit, rows].unsqueeze(1)))
        torch.logical_and(candidates[rows], agree.sum(dim=-1) >= min_collisions, out=out[rows])


def _sample_in_buckets(planes: torch.Tensor, stacked: torch.Tensor, candidates: torch.Tensor, min_collisions: int,
                       *, out: torch.Tensor) -> None:
    """:func:`_sample_densely`, the same sample from the same arguments, read from hash buckets: O(M L K)
    comparisons and a sort per group of :data:`QUERY_GROUP` queries in place of O(N M L K) comparisons, on the
    host (the buckets' sizes are read).

    The tables go :data:`TABLES_PER_PASS` at a time, each pass projecting its own tables, so that the projections
    held are O(K M) whatever L is; the collisions of every query with every key are counted across the passes.
    """
    hash_bits, tables = planes.shape[:2]
    num_queries, num_keys = candidates.shape
    code_type = torch.int32 if hash_bits < 31 else torch.int64
    collisions = torch.zeros((num_queries, num_keys), dtype=torch.int16 if tables < 2 ** 15 else torch.int32,
                             device=planes.device)
    for tabs in _pieces(tables, TABLES_PER_PASS):
        key_proj, thresholds, query_bits = _projections(planes[:, tabs], stacked, num_keys)
        for rows in _pieces(num_queries, QUERY_GROUP):
            _count_group_collisions(key_proj, thresholds[..., rows], query_bits[..., rows], code_type,
                                    out=collisions[rows])
    torch.logical_and(candidates, collisions >= min_collisions, out=out)


def _count_group_collisions(key_proj: torch.Tensor, thresholds: torch.Tensor, query_bits: torch.Tensor,
                            code_type: torch.dtype, *, out: torch.Tensor) -> None:
    """Add to ``out (C, M)`` the tables in which each key's centred code equals each query's, for one group of
    queries: ``key_proj (K, L', M)``, ``thresholds`` and ``query_bits (K, L', C)`` as from :func:`_projections`.

    A key's bit :math:`[y_m^\\top w > \\mu_n^\\top w]` is the same for every query of a group unless
    :math:`y_m^\\top w` lies between the group's least and greatest threshold. Outside those bands each (table,
    key) has one K-bit code, shared by the group's queries: it is put in its table's bucket, and a query
    collides in table l with exactly the keys of its code's bucket there. The (table, key) pairs with a bit inside a
    band (2 % of them for the last 64 queries of SmolLM2's 8,192-token capture, whose means barely move) are
    compared bit by bit, as the dense form compares every pair.
    """
    hash_bits, tables, num_keys = key_proj.shape
    group_size = thresholds.shape[-1]
    thresholds = thresholds.contiguous()
    highest, lowest = thresholds.amax(-1, keepdim=True), thresholds.amin(-1, keepdim=True)
    key_codes = torch.zeros((tables, num_keys), dtype=code_type, device=key_proj.device)
    query_codes = torch.zeros(thresholds.shape[1:], dtype=code_type, device=key_proj.device)
    in_band = torch.zeros((tables, num_keys), dtype=torch.bool, device=key_proj.device)
    for bit in range(hash_bits):
        above = key_proj[bit] > highest[bit]  # (L', M): every query's bit, outside the band
        in_band |= (key_proj[bit] > lowest[bit]) ^ above
        key_codes |= above.to(code_type) << bit
        query_codes |= query_bits[bit].to(code_type) << bit
    _bucket_matches(key_codes.masked_fill_(in_band, -1), query_codes, out=out)  # -1: in no bucket
    band_tables, band_keys = in_band.nonzero(as_tuple=True)
    for part in _pieces(band_keys.numel(), CHUNK_ELEMENTS // group_size):
        tabs, keys = band_tables[part], band_keys[part]
        own_codes = torch.zeros((keys.numel(), group_size), dtype=code_type, device=key_proj.device)
        for bit in range(hash_bits):  # each query's own code of these (table, key) pairs: (A, C)
            own_codes |= (key_proj[bit, tabs, keys].unsqueeze(1) > thresholds[bit, tabs]).to(code_type) << bit
        out.index_add_(1, keys, (own_codes == query_codes[tabs]).T.to(out.dtype))


def _bucket_matches(key_codes: torch.Tensor, query_codes: torch.Tensor, *, out: torch.Tensor) -> None:
    """Add to ``out (C, M)``, for ``key_codes (L', M)`` and ``query_codes (L', C)``, the tables in which key m's code
    equals query n's, from each table's keys sorted by code (a query's matches are one run of the sort, found by
    :func:`torch.searchsorted`); the matches are listed about :data:`BUCKET_PIECE` at a time."""
    tables, num_queries = query_codes.shape
    num_keys = key_codes.shape[-1]
    sorted_codes, order = key_codes.sort(dim=1)
    starts = torch.searchsorted(sorted_codes, query_codes)  # (L', C)
    sizes = (torch.searchsorted(sorted_codes, query_codes, right=True) - starts).flatten()
    starts, ends = starts.flatten(), sizes.cumsum(0)
    flat = out.view(-1)
    for part in _runs_in_pieces(ends.tolist(), BUCKET_PIECE):  # whole (table, query) runs
        run = torch.arange(part.start, part.stop, device=key_codes.device).repeat_interleave(sizes[part])
        offset = torch.arange(run.numel(), device=key_codes.device) + (ends[part.start] - sizes[part.start]) \
            - (ends[run] - sizes[run])
        keys = order[run // num_queries, starts[run] + offset]
        flat.index_add_(0, run % num_queries * num_keys + keys, torch.ones_like(keys, dtype=out.dtype))


def _pieces(total: int, size: int) -> list[slice]:
    """``[0, total)`` in slices of ``size`` (at least 1)."""
    size = max(1, size)
    return [slice(start, min(start + size, total)) for start in range(0, total, size)]


def _runs_in_pieces(ends: list[int], size: int) -> list[slice]:
    """Consecutive runs, whole, grouped so that a group holds at most ``size`` items unless one run alone holds
    more; ``ends`` are the runs' cumulative sizes."""
    groups, first, base = [], 0, 0
    for i, end in enumerate(ends):
        if end - base > size and i > first:
            groups.append(slice(first, i))
            first, base = i, ends[i - 1]
    if ends:
        groups.append(slice(first, len(ends)))
    return groups


def _candidate_pairs_log_inclusion(x: torch.Tensor, y: torch.Tensor, means: torch.Tensor, candidates: torch.Tensor,
                                   sampled: torch.Tensor, hash_bits: int, tables: int,
                                   min_collisions: int) -> torch.Tensor:
    """``(N, M)``: ``log u`` of every candidate (query, key) pair, 0 elsewhere, from ``x (N, D)``, ``y (M, D)`` and the
    queries' centring means ``(N, D)``; dense over the pairs, in chunks of queries, so that no value is read back
    from an accelerator (``sampled`` is not read)."""
    num_queries, num_keys = candidates.shape
    log_u = []
    for rows in _pieces(num_queries, CHUNK_ELEMENTS // max(1, num_keys * tables)):
        theta = _angle(x[rows].unsqueeze(-2), y.unsqueeze(-3) - means[rows].unsqueeze(-2))  # (C, M)
        chunk = _log_inclusion(hash_bits * torch.log1p(-theta / math.pi), tables, min_collisions)
        log_u.append(torch.where(candidates[rows], chunk, torch.zeros_like(chunk)))
    return torch.cat(log_u, dim=0)


def _sampled_pairs_log_inclusion(x: torch.Tensor, y: torch.Tensor, means: torch.Tensor, candidates: torch.Tensor,
                                 sampled: torch.Tensor, hash_bits: int, tables: int,
                                 min_collisions: int) -> torch.Tensor:
    """:func:`_candidate_pairs_log_inclusion` at the pairs some replicate of ``sampled (R, N, M)`` sampled alone, 0
    elsewhere (the weights read no other): the same values, on the host, for a few percent of the pairs."""
    log_u = x.new_zeros(candidates.shape)
    queries, keys = sampled.any(0).nonzero(as_tuple=True)
    for part in _pieces(queries.numel(), CHUNK_ELEMENTS // (tables + 1)):
        n, m = queries[part], keys[part]
        theta = _angle(x[n], y[m] - means[n])
        log_u[n, m] = _log_inclusion_where_needed(hash_bits * torch.log1p(-theta / math.pi), tables,
                                                  min_collisions)
    return log_u


def _prepared(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions):
    """``(x, y, v, hyperplanes)`` after every check (the reference's checks, same messages)."""
    x, y, v, _, batch = prepare_batched(q, k, v, options.scale)
    if options.mask is not None:
        check_causal_shapes(x.shape[-2], y.shape[-2])
    hyperplanes = check_draw_array(to_torch_draws(draws, x), "hyperplanes", batch, (None, None, x.shape[-1]))
    options.check_hyperplanes(tuple(hyperplanes.shape))
    return x, y, v, hyperplanes


def _weighted_scores(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits, log_weights, v)`` of one hashing of the keys, as the reference's."""
    x, y, v, hyperplanes = _prepared(q, k, v, draws, options)
    return masked_logits(x, y, options.mask), log_weights(x, y, hyperplanes, **options.selection_keywords), v


estimate, estimate_with_probabilities, estimate_with_probabilities_and_keys_used, probabilities = WeightedKeysForms(
    MagicpigOptions, _weighted_scores, sparse_batched).entries(
    "estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used", "probabilities")


@keyword_entry(MagicpigOptions)
def keys_used(q: Any, k: Any, draws: Draws, options: MagicpigOptions) -> torch.Tensor:
    """``(R, ..., N)`` float64: the distinct keys each query reads, exact plus sampled (reference ``keys_used``)."""
    x, y, _, hyperplanes = _prepared(q, k, no_values(k), draws, options)
    return sample_counts(x, y, hyperplanes, **options.selection_keywords)
