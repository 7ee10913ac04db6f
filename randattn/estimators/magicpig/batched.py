"""MagicPIG in torch (the batched form of :mod:`.reference`, same draws, same layout).

The key projections :math:`y_m^\\top w_{lk}` are formed once per replicate; each query's centred codes compare them
with :math:`\\mu_n^\\top w_{lk}` (:math:`(y_m - \\mu_n)^\\top w > 0 \\iff y_m^\\top w > \\mu_n^\\top w`). Queries go in
chunks so that the ``(R, ..., C, M, L, K)`` bits of one chunk stay near :data:`CHUNK_ELEMENTS` elements: the
sampler is dense over (query, key) pairs, O(N M L K) comparisons (the paper's hash tables avoid that work, not
its result).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.magicpig.reference import MagicpigOptions, tail_terms
from randattn.estimators.masks import check_causal_shapes
from randattn.estimators.sparse.batched import keys_used as count_keys_used
from randattn.estimators.sparse.batched import masked_logits, visible_keys, weighted_attention

__all__ = ["CHUNK_ELEMENTS", "estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used",
           "exact_and_candidate_keys", "keys_used", "log_weights", "probabilities", "sample_counts"]

#: about how many hash bits one chunk of queries compares at once
CHUNK_ELEMENTS = 1 << 22


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
    where u >= 1/2 (reference :func:`~randattn.estimators.magicpig.reference.log_inclusion_probability`)."""
    like = log_table_probability
    j, log_binomial = (torch.as_tensor(a, dtype=like.dtype, device=like.device)
                       for a in tail_terms(tables, min_collisions))
    log_p = log_table_probability.unsqueeze(-1)
    j_log_p = torch.where(j > 0, j * log_p, torch.zeros_like(log_p))
    terms = log_binomial + j_log_p + torch.special.xlog1py(tables - j, -torch.exp(log_p))
    upper = torch.logsumexp(terms[..., min_collisions:], dim=-1)
    lower = torch.logsumexp(terms[..., :min_collisions], dim=-1)
    return torch.where(lower <= -math.log(2.0), torch.log1p(-torch.exp(lower)), upper)


def _pair_log_inclusion(x: torch.Tensor, y: torch.Tensor, means: torch.Tensor, candidates: torch.Tensor,
                        hash_bits: int, tables: int, min_collisions: int) -> torch.Tensor:
    """``(C, M)``: ``log u`` of each candidate (query, key) pair, 0 elsewhere, from ``x (C, D)``, ``y (M, D)`` and the
    queries' centring means ``(C, D)``: the same for every replicate (it depends on the angle alone), so computed
    once per batch element; dense over the pairs, so that no value is read back from an accelerator."""
    theta = _angle(x.unsqueeze(-2), y.unsqueeze(-3) - means.unsqueeze(-2))  # (C, M)
    log_u = _log_inclusion(hash_bits * torch.log1p(-theta / math.pi), tables, min_collisions)
    return torch.where(candidates, log_u, torch.zeros_like(log_u))


def exact_and_candidate_keys(num_queries: int, num_keys: int, sinks: int, local: int, mask: str | None,
                             device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, candidates)``, each ``(N, M)`` boolean, made on ``device`` from the positions alone (reference
    :func:`~randattn.estimators.magicpig.reference.exact_and_candidate_keys`): a host array uploaded would move
    2 N M bytes per call."""
    keys = torch.arange(num_keys, device=device)
    last = (torch.arange(num_queries, device=device) + num_keys - num_queries if mask == "causal"
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
    """``(..., N, D)``: the mean of each query's visible keys / candidates (0 for none, or for ``center="none"``)."""
    if center == "none":
        return y.new_zeros((*y.shape[:-2], visible.shape[0], y.shape[-1]))
    rows = (visible if center == "all-keys" else candidates).to(y.dtype)
    counts = rows.sum(-1, keepdim=True)
    return (rows @ y) / torch.where(counts > 0, counts, torch.ones_like(counts))


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
    # one (replicate, batch element) at a time: its key projections (K, M, L) and one (C, M, L) agreement buffer
    # per chunk of queries, never an (R, ..., M, L, K) tensor (9 heads x 4 replicates x 4,096 keys x 150 tables
    # would be 0.9 GB in float32)
    batch = x.shape[:-2]
    planes = hyperplanes.expand(replicates, *batch, *hyperplanes.shape[-3:]).reshape(
        replicates, -1, tables * hash_bits, hyperplanes.shape[-1])
    xs, ys, ms = x.reshape(-1, num_queries, x.shape[-1]), y.reshape(-1, num_keys, y.shape[-1]), \
        means.reshape(-1, num_queries, means.shape[-1])
    flat_out = out.view(replicates, -1, num_queries, num_keys) if weights else out.view(replicates, -1, num_queries)
    chunk = max(1, CHUNK_ELEMENTS // max(1, num_keys * tables))
    chunks = [slice(start, min(start + chunk, num_queries)) for start in range(0, num_queries, chunk)]
    for b in range(xs.shape[0]):
        if weights:
            # log u of every candidate pair: the same in every replicate (it depends on the angle alone)
            log_u = torch.cat([_pair_log_inclusion(xs[b, rows], ys[b], ms[b, rows], candidates[rows], hash_bits,
                                                   tables, min_collisions) for rows in chunks], dim=0)  # (N, M)
        for r in range(replicates):
            directions = planes[r, b].transpose(0, 1)  # (D, L K)

            def bit_major(vectors: torch.Tensor) -> torch.Tensor:  # (P, D) -> (K, P, L), contiguous per bit
                return (vectors @ directions).unflatten(-1, (tables, hash_bits)).permute(2, 0, 1).contiguous()

            key_proj, mean_proj, query_code = bit_major(ys[b]), bit_major(ms[b]), bit_major(xs[b]) > 0
            for rows in chunks:
                shape = (rows.stop - rows.start, num_keys, tables)
                agree, key_bit = (torch.empty(shape, dtype=torch.bool, device=x.device) for _ in range(2))
                for bit in range(hash_bits):  # the tables where the centred key's code equals the query's
                    torch.gt(key_proj[bit].unsqueeze(0), mean_proj[bit][rows].unsqueeze(1), out=key_bit)
                    if bit == 0:
                        torch.eq(key_bit, query_code[bit][rows].unsqueeze(1), out=agree)
                    else:
                        agree.logical_and_(key_bit.eq_(query_code[bit][rows].unsqueeze(1)))
                sampled = candidates[rows] & (agree.sum(dim=-1) >= min_collisions)  # (C, M)
                if not weights:
                    flat_out[r, b, rows] += sampled.sum(-1)
                    continue
                sample_weights = torch.where(sampled, -log_u[rows], torch.full_like(log_u[rows], float("-inf")))
                flat_out[r, b, rows] = torch.where(exact[rows], torch.zeros_like(sample_weights), sample_weights)
    return out


def _no_values(k: Any) -> Any:
    """``(..., M, 1)`` zeros of ``k``'s kind and dtype: the values the input checks ask for where none are used."""
    if isinstance(k, torch.Tensor):
        return k.new_zeros((*k.shape[:-1], 1))
    k = np.asarray(k)
    return np.zeros((*k.shape[:-1], 1), dtype=k.dtype)


def _prepared(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions):
    """``(x, y, v, hyperplanes)`` after every check (the reference's checks, same messages)."""
    x, y, v, _, batch = prepare_batched(q, k, v, options.scale)
    if options.mask is not None:
        check_causal_shapes(x.shape[-2], y.shape[-2])
    hyperplanes = check_draw_array(to_torch_draws(draws, x), "hyperplanes", batch, (None, None, x.shape[-1]))
    options.check_hyperplanes(tuple(hyperplanes.shape))
    return x, y, v, hyperplanes


@keyword_entry(MagicpigOptions)
def estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws,
                                options: MagicpigOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (R, ..., N, Dv), probabilities (R, ..., N, M))`` from one selection; see :func:`estimate`."""
    x, y, v, hyperplanes = _prepared(q, k, v, draws, options)
    weights = log_weights(x, y, hyperplanes, **options.selection_keywords)
    return weighted_attention(masked_logits(x, y, options.mask), weights, v)


@keyword_entry(MagicpigOptions)
def estimate_with_probabilities_and_keys_used(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions
                                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, probabilities, keys_used)`` from one hashing of the keys, the same bits as the three forms: the keys
    a query reads are those with a finite weight (its exact keys, weight 0, and its sampled keys, ``-log u``)."""
    x, y, v, hyperplanes = _prepared(q, k, v, draws, options)
    weights = log_weights(x, y, hyperplanes, **options.selection_keywords)
    return (*weighted_attention(masked_logits(x, y, options.mask), weights, v), count_keys_used(weights))


@keyword_entry(MagicpigOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: MagicpigOptions) -> torch.Tensor:
    """MagicPIG over ``(R, ..., N, Dv)``; same signature and layout as ``magicpig.reference.estimate``."""
    return estimate_with_probabilities.on_options(q, k, v, draws, options)[0]


@keyword_entry(MagicpigOptions)
def probabilities(q: Any, k: Any, draws: Draws, options: MagicpigOptions) -> torch.Tensor:
    """``(R, ..., N, M)``: the attention probabilities MagicPIG implies (its weighted softmax over the keys)."""
    x, y, _, hyperplanes = _prepared(q, k, _no_values(k), draws, options)
    weights = log_weights(x, y, hyperplanes, **options.selection_keywords)
    return torch.softmax(masked_logits(x, y, options.mask) + weights, dim=-1)


@keyword_entry(MagicpigOptions)
def keys_used(q: Any, k: Any, draws: Draws, options: MagicpigOptions) -> torch.Tensor:
    """``(R, ..., N)`` float64: the distinct keys each query reads, exact plus sampled (reference ``keys_used``)."""
    x, y, _, hyperplanes = _prepared(q, k, _no_values(k), draws, options)
    return sample_counts(x, y, hyperplanes, **options.selection_keywords)
