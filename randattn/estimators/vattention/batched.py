r"""vAttention in torch (the batched form of :mod:`.reference`): every query and replicate at once.

The same steps as the reference (see its module docstring): the heavy set by a stable descending sort of the
candidates' logits (ties: the lower key index first, as ``numpy.argsort(-logits, kind="stable")``), the keys to
sample from put first in ascending order by a stable sort, draws :math:`\lfloor u\, n_s \rfloor` gathered from
them, counts by ``scatter_add``. The adaptive budget's statistics (:math:`\hat\sigma`, :math:`\hat D`) are formed
in float64 whatever the input dtype, so that float32 inputs round only the logits and the sample size rarely
differs from the reference's; draw indices are computed in float64 too (a float32 uniform may round up to 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from randattn.estimators._prepare import prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.sparse import batched as sparse_batched
from randattn.estimators.sparse.batched import masked_logits, visible_keys
from randattn.estimators.sparse.forms import WeightedKeysForms
from randattn.estimators.vattention.rules import (QuerySizes, VattentionOptions, checked_uniforms, normal_quantile,
                                                  query_sizes)

__all__ = ["Selection", "estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used",
           "estimate_with_probabilities_keys_used_and_log_denominator", "keys_used", "log_denominator",
           "probabilities", "select"]


@dataclass(frozen=True)
class Selection:
    """:class:`randattn.estimators.vattention.reference.Selection` as tensors (``sample_sizes`` and ``bounds``
    float64)."""

    logits: torch.Tensor
    heavy: torch.Tensor
    log_weights: torch.Tensor
    sample_sizes: torch.Tensor
    bounds: torch.Tensor


def _prepare_qk(q: Any, k: Any, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(x, y, batch)`` from q and k alone (a one-column zero v stands in for the shape checks)."""
    k_tensor = k if isinstance(k, torch.Tensor) else torch.as_tensor(np.asarray(k))
    dummy = torch.zeros((*k_tensor.shape[:-1], 1), dtype=k_tensor.dtype, device=k_tensor.device)
    x, y, _, _, batch = prepare_batched(q, k_tensor, dummy, scale)
    return x, y, batch


def _pick(pool_order: torch.Tensor, sizes: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Keys ``pool[floor(u * n)]`` for uniforms ``(R, ..., N, U)``; ``pool_order (..., N, M)`` lists each query's
    pool first, ascending; ``sizes (N,)`` the pool sizes."""
    slots = torch.floor(uniforms.to(torch.float64) * sizes.to(torch.float64)[:, None]).to(torch.long)
    slots = torch.minimum(slots, (sizes - 1)[:, None]).clamp(min=0)
    expanded = pool_order.expand(*uniforms.shape[:-1], pool_order.shape[-1])
    return torch.gather(expanded, -1, slots)


def _top_k(logits: torch.Tensor, candidates: torch.Tensor, counts: torch.Tensor, most: int) -> torch.Tensor:
    """``(..., N, M)`` bool: each query's ``counts[n]`` candidates of largest logit (ties: lower index first);
    ``most``, the largest count, is given from the host so that nothing is read back from the device.

    The ``counts[n]``-th largest score is each row's threshold: every candidate above it is taken, and of those
    equal to it the first ones by index until ``counts[n]`` are -- the set a stable descending sort would rank
    first, from ``topk`` of the largest count and cumulative sums: O(M log k) where sorting every row was
    O(M log M) (with the pool's sort, 3 s of vAttention's 24 s estimate phase at 113,108 keys).
    """
    score = logits.masked_fill(~candidates, float("-inf"))
    most = min(most, score.shape[-1])
    if most == 0:
        return torch.zeros_like(score, dtype=torch.bool)
    wanted = counts[:, None]
    largest = torch.topk(score, most, dim=-1).values  # (..., N, most), descending
    at = (wanted - 1).clamp(0, most - 1).expand(*largest.shape[:-1], 1)
    threshold = largest.gather(-1, at)
    above = score > threshold
    tied = score == threshold
    room = wanted - above.sum(-1, keepdim=True)
    return candidates & (above | (tied & (tied.cumsum(-1) <= room)))


def _pool_first(pool: torch.Tensor) -> torch.Tensor:
    """``(..., N, M)`` key indices: each row's pool keys ascending, then the others ascending -- the permutation a
    stable ascending sort of ``~pool`` gives, placed by cumulative sums in O(M)."""
    member = pool.to(torch.long)
    position = torch.where(pool, member.cumsum(-1) - 1, member.sum(-1, keepdim=True) + (1 - member).cumsum(-1) - 1)
    keys = torch.arange(pool.shape[-1], device=pool.device).expand_as(position)
    return torch.empty_like(position).scatter_(-1, position, keys)


def _sample_sizes(e: torch.Tensor, heavy: torch.Tensor, pool_order: torch.Tensor, pool_sizes: torch.Tensor,
                  base_draws: torch.Tensor, base: torch.Tensor, params: dict[str, Any]) -> tuple[torch.Tensor,
                                                                                                   torch.Tensor]:
    """``(b, bound)`` of the adaptive budget, ``(R, ..., N)`` float64 (reference ``sample_size``, vectorized)."""
    in_base = torch.arange(base.shape[-1], device=base.device) < base_draws[:, None]  # (N, B)
    keys = _pick(pool_order, pool_sizes, base)
    values = torch.gather(e.expand(*keys.shape[:-1], e.shape[-1]), -1, keys) * in_base
    b0 = base_draws.to(torch.float64)
    mean = values.sum(-1) / b0
    sigma = torch.sqrt(((values - mean[..., None]) ** 2 * in_base).sum(-1) / (b0 - 1))
    if params["duplicates"] == "count":
        base_sum = values.sum(-1)
    else:
        hits = torch.zeros(*keys.shape[:-1], e.shape[-1], dtype=torch.float64, device=e.device)
        hits.scatter_add_(-1, keys, in_base.to(torch.float64).expand_as(keys))
        base_sum = (e * (hits > 0)).sum(-1)
    n = pool_sizes.to(torch.float64)
    denominator = (e * heavy).sum(-1) + n / b0 * base_sum
    z = normal_quantile(params["delta"], params["quantile"])
    positive = denominator > 0
    ratio = sigma / torch.where(positive, denominator, torch.ones_like(denominator))
    bound = torch.where(positive, (z * n * ratio / params["epsilon"]) ** 2,
                        torch.full_like(denominator, float("inf")))
    rounded = torch.ceil(bound) if params["rounding"] == "ceil" else torch.floor(bound)
    return torch.minimum(torch.maximum(rounded, b0), n), bound


def _position_sets(sizes: QuerySizes, num_keys: int, mask: str | None,
                   device: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(visible, sinks | local, candidates)``, each ``(N, M)`` boolean, made on ``device`` from the ``(N,)`` sizes
    (the reference's :func:`~randattn.estimators.vattention.rules.query_sets`): uploading host sets moved three
    ``N x M`` arrays per call (805 MB at 16,384 tokens of full causal context)."""
    as_tensor = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    num_queries = len(sizes.own)
    keys = torch.arange(num_keys, device=device)
    own = as_tensor(sizes.own).unsqueeze(1)
    visible = visible_keys(num_queries, num_keys, mask, device)
    if visible is None:
        visible = torch.ones((num_queries, num_keys), dtype=torch.bool, device=device)
    fixed = (keys < as_tensor(sizes.sinks).unsqueeze(1)) | (
        (keys <= own) & (keys > own - as_tensor(sizes.local).unsqueeze(1)))
    fixed &= visible
    return visible, fixed, visible & ~fixed


@keyword_entry(VattentionOptions)
def select(q: Any, k: Any, draws: Draws, options: VattentionOptions) -> Selection:
    """The heavy set, the sample and the weights of every query (reference ``select``, vectorized)."""
    params, mask = options.parameters, options.mask
    x, y, batch = _prepare_qk(q, k, options.scale)
    draws = to_torch_draws(draws, x)
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    replicates, device = draws.replicates, x.device
    per_query = query_sizes(num_queries, num_keys, mask, params)
    main, base = checked_uniforms(draws, batch, num_queries, num_keys, params, mask)
    as_tensor = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    visible, fixed, candidates = _position_sets(per_query, num_keys, mask, device)
    pool_sizes = as_tensor(per_query.sampled_size)

    logits = masked_logits(x, y, mask)
    heavy = fixed | _top_k(logits, candidates, as_tensor(per_query.top_k), int(np.max(per_query.top_k, initial=0)))
    pool = candidates.expand_as(heavy) if params["sample_from"] == "window" else visible & ~heavy
    pool_order = _pool_first(pool)
    # the official code's full mask when its window holds fewer than two keys
    full = (as_tensor(per_query.sampled_size < 2) if params["sample_from"] == "window"
            else torch.zeros_like(pool_sizes, dtype=torch.bool))
    sampling = (pool_sizes > 0) & ~full  # (N,)
    shape = (replicates, *logits.shape[:-1])
    if base is None:
        sizes = torch.full(shape, float(main.shape[-1]), dtype=torch.float64, device=device)
        bounds = torch.full(shape, float("nan"), dtype=torch.float64, device=device)
    else:
        shifted = torch.exp((logits - logits.amax(-1, keepdim=True)).to(torch.float64))  # e^{s - c}, hidden 0
        sizes, bounds = _sample_sizes(shifted, heavy, pool_order, pool_sizes, as_tensor(per_query.base_draws), base,
                                      params)
    sizes = torch.where(sampling, sizes, torch.zeros_like(sizes))
    bounds = torch.where(sampling, bounds, torch.full_like(bounds, float("nan")))

    if base is not None:
        # adaptive: no query samples more keys than its pool holds, so the uniforms past the largest pool are never
        # read (the heavy set leaves fewer than the V drawn); the same bits, the scatter below adding no 0 it would
        # have added
        main = main[..., : max(int(np.max(per_query.sampled_size, initial=0)), 1)]
    in_sample = torch.arange(main.shape[-1], device=device) < sizes[..., None]
    counts = torch.zeros((*shape, num_keys), dtype=logits.dtype, device=device)
    counts.scatter_add_(-1, _pick(pool_order, pool_sizes, main), in_sample.to(logits.dtype))
    sampled = (counts > 0) & ~heavy  # a draw on a heavy key (window) adds nothing: its weight stays 1
    multiplicity = counts if params["duplicates"] == "count" else torch.ones_like(counts)
    scale_up = (pool_sizes.to(torch.float64) / torch.where(sizes > 0, sizes, torch.ones_like(sizes)))
    weights = scale_up[..., None].to(logits.dtype) * multiplicity
    log_weights = torch.where(sampled, torch.log(torch.where(sampled, weights, torch.ones_like(weights))),
                              torch.full_like(weights, float("-inf")))
    exact = heavy | (full[:, None] & visible)
    log_weights = log_weights.masked_fill(exact, 0.0)
    return Selection(logits, heavy, log_weights, sizes, bounds)


(estimate, estimate_with_probabilities, estimate_with_probabilities_and_keys_used,
 estimate_with_probabilities_keys_used_and_log_denominator, probabilities, keys_used,
 log_denominator) = WeightedKeysForms.of_selection(
    VattentionOptions, select.on_options, prepare_batched, sparse_batched).entries(
    "estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used",
    "estimate_with_probabilities_keys_used_and_log_denominator", "probabilities", "keys_used", "log_denominator")
