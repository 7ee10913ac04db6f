r"""RFA / Performer under ``mask="causal"``: validation and the batched prefix-sum form.

Query n sees the keys :math:`m \le n + M - N` (ARCHITECTURE sec. 12). The batched form feeds the
features of :mod:`randattn.estimators.features.batched`, computed a group of tokens at a time, to the
chunked prefix sums of :mod:`randattn.estimators.snis.prefix` (Performer App. B.1 eq. 11 as the SNIS
of ARCHITECTURE sec. 4); the reference form (``rfa.reference``) is the literal masked sum.

The data-dependent maps (``oprf``, ``sderf``) are refused
(:func:`~randattn.estimators.rfa.masking.check_rfa_mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, to_torch_draws, unscaled_batched
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.features import POSITIVE_MAPS
from randattn.estimators.features.batched import affine_directions
from randattn.estimators.masks import check_causal_shapes
from randattn.estimators.rfa.masking import check_rfa_mask
from randattn.estimators.rfa.options import FeatureOptions
from randattn.estimators.snis import warn_non_positive
from randattn.estimators.snis.prefix import (
    DEFAULT_CHUNK_SIZE,
    FeatureSlice,
    causal_feature_attention,
    causal_feature_weights,
)

__all__ = ["causal_estimate", "causal_estimate_with_probabilities", "causal_feature_slices", "CausalRfaOptions",
           "ChunkedCausalRfaOptions"]

#: log2(e): the prefix sums take base-2 log-features (``exp2`` is the faster exponential on CPU)
LOG2_E = 1.0 / math.log(2.0)


@dataclass(frozen=True, kw_only=True)
class CausalRfaOptions(FeatureOptions):
    """The options of the causal prefix-sum forms: a map with a causal form (:func:`check_rfa_mask`)."""

    def check(self) -> None:
        check_rfa_mask("causal", self.feature_map)


@dataclass(frozen=True, kw_only=True)
class ChunkedCausalRfaOptions(CausalRfaOptions):
    """:class:`CausalRfaOptions` and the tokens per chunk of the prefix sums (a power of two, checked where used)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE


def causal_feature_slices(
    feature_map: str, q: torch.Tensor, k: torch.Tensor, omega: torch.Tensor, scale: float
) -> tuple[FeatureSlice, FeatureSlice, int]:
    r"""``(query_features, key_features, J)`` of one map for the causal prefix sums.

    What :func:`~randattn.estimators.snis.prefix.causal_feature_attention` takes.

    ``q : (..., N, D)``, ``k : (..., M, D)`` as captured, ``omega : (R, ..., S, D)``, ``scale`` the
    temperature; each callable returns the base-2 log-features of a slice of tokens as ``(R x batch, T, J)``
    (and the signs, or None), i.e. :math:`\log_2 e` times, with :math:`x = \sqrt{s}\, q`, :math:`y = \sqrt{s}\, k`,

    - positive maps (:func:`~randattn.estimators.features.batched.affine_directions`):
      :math:`\ell^q_{nj} = x_n \cdot W_j + a_j`, :math:`\ell^k_{mj} = y_m \cdot W_j + a_j - \|y_m\|^2/2`;
    - trigonometric: :math:`\ell^q_{nj} = \log|\mathrm{trig}(\omega_s \cdot x_n)|`,
      :math:`\ell^k_{mj} = \log|\mathrm{trig}(\omega_s \cdot y_m)| + \|y_m\|^2/2`, with the signs.

    The query's row term (:math:`-\|x_n\|^2/2`, or :math:`+\|x_n\|^2/2`) is left out: a per-query
    constant cancels in the ratio, and in float32 it would round the query's logits by up to
    :math:`\|x_n\|^2 \epsilon`. The temperature rides in the feature weights (:math:`\sqrt{s}\, W_j`,
    :math:`s \|k_m\|^2 / 2`): no scaled copy of q and k is made.
    """
    replicates, num_features, dim = omega.shape[0], omega.shape[-2], q.shape[-1]
    flat_batch = math.prod(q.shape[:-2])
    root = math.sqrt(scale)
    x_flat = q.reshape(flat_batch, q.shape[-2], dim)  # (B, N, D), a view of contiguous inputs
    y_flat = k.reshape(flat_batch, k.shape[-2], dim)

    def per_replicate(t: torch.Tensor) -> torch.Tensor:  # (B, T, F) -> (R B, T, F); a view when R = 1
        return t if replicates == 1 else t.unsqueeze(0).expand(replicates, *t.shape).reshape(-1, *t.shape[1:])

    def with_columns(part: torch.Tensor, *columns: torch.Tensor) -> torch.Tensor:
        return torch.cat([part, *columns], dim=-1)

    if feature_map in POSITIVE_MAPS:
        directions, offset = affine_directions(feature_map, omega)  # (R, ..., J, D), (R, ..., J)
        num_features = directions.shape[-2]
        w_t = directions.reshape(-1, num_features, dim).transpose(-1, -2) * root  # (P, D, J), acting on q
        offset = offset.reshape(-1, 1, num_features)
        # the offset a_j and the key's row term -|y|^2/2 ride in the product as extra coordinates,
        # [x, 1] . [W_j; a_j] and [y, 1, -|y|^2/2] . [W_j; a_j; 1], and the whole product is scaled to base 2
        # (log2 e): no separate passes over the (T, J) results
        query_weights = torch.cat([w_t, offset], dim=-2).mul_(LOG2_E)
        key_weights = torch.cat([w_t, offset, torch.ones_like(offset)], dim=-2).mul_(LOG2_E)

        def query_features(tokens: slice):
            part = x_flat[:, tokens]
            return torch.bmm(per_replicate(with_columns(part, part.new_ones(*part.shape[:-1], 1))), query_weights), None

        def key_features(tokens: slice):
            part = y_flat[:, tokens]
            row = (part * part).sum(-1, keepdim=True).mul_(-0.5 * scale)
            return torch.bmm(per_replicate(with_columns(part, torch.ones_like(row), row)), key_weights), None

        return query_features, key_features, num_features

    omega_t = omega.reshape(-1, num_features, dim).transpose(-1, -2) * root  # (P, D, S), acting on q

    def trigonometric(part: torch.Tensor, row: torch.Tensor | None):
        proj = torch.bmm(per_replicate(part), omega_t)  # (P, T, S)
        trig = torch.stack([torch.sin(proj), torch.cos(proj)], dim=-1).flatten(-2)  # j = 2 s + l, as the reference
        log_mag = torch.log2(trig.abs())
        if row is not None:
            log_mag.add_(per_replicate(row), alpha=LOG2_E)
        return log_mag, torch.sign(trig)

    def query_features(tokens: slice):
        return trigonometric(x_flat[:, tokens], None)

    def key_features(tokens: slice):
        part = y_flat[:, tokens]
        return trigonometric(part, (part * part).sum(-1, keepdim=True).mul_(0.5 * scale))

    return query_features, key_features, 2 * num_features


def _prepared(q: Any, k: Any, v: Any, draws: Draws, options: CausalRfaOptions):
    """``(q, k, v, scale, batch, omega)``: the inputs validated but not multiplied by ``sqrt(scale)`` (the
    features take the temperature in their weights, sparing two copies of the inputs), the checked draws."""
    q, k, v, scale, batch = unscaled_batched(q, k, v, options.scale)
    check_causal_shapes(q.shape[-2], k.shape[-2])
    omega = check_draw_array(to_torch_draws(draws, q), "omega", batch, (None, q.shape[-1]))
    return q, k, v, scale, batch, omega


@keyword_entry(ChunkedCausalRfaOptions)
def causal_estimate(q: Any, k: Any, v: Any, draws: Draws, options: ChunkedCausalRfaOptions) -> torch.Tensor:
    r"""Causal RFA over ``(R, ..., N, Dv)``: the batched form of ``rfa.reference.estimate(..., mask="causal")``.

    .. math::
        \mathrm{RFA}(q_n) = \frac{\sum_s \xi(x_n, \omega_s)^\top \sum_{m \le n + M - N} \xi(y_m, \omega_s) v_m}
                                 {\sum_s \xi(x_n, \omega_s)^\top \sum_{m \le n + M - N} \xi(y_m, \omega_s)}

    (Performer App. B.1 eq. 11), by the chunkwise-parallel prefix sums of :mod:`randattn.estimators.snis.prefix`
    (no Python loop over chunks): O((N + M) S L (D + Dv + C + T / C)) time, O(T S L (1 + Dv / C)) memory beyond
    the inputs and output (T the tokens of one group, a hundred or so on the CPU, a few thousand on a GPU), no
    epsilon, and no stabilizer taken over a later key. The default chunk size and the timings
    against an equal-FLOP matrix product and performer-pytorch: ``benchmarks/bench_causal.py``.

    Parameters
    ----------
    q, k, v : array_like
        Queries (..., N, D), keys (..., M, D), values (..., M, Dv); M >= N: the queries are the last
        N of the M tokens.
    draws : Draws
        ``omega : (R, ..., S, D)``.
    scale : float, optional
        Temperature; default ``D ** -0.5``.
    feature_map : {"positive", "hyperbolic", "trigonometric", "regularized"}
        The data-dependent ``oprf`` and ``sderf`` are refused (:func:`~randattn.estimators.rfa.masking.check_rfa_mask`).
    coupling : str
        Only used by ``draw``.
    chunk_size : int
        Tokens per chunk (a power of two); changes the rounding, not the estimate.

    Returns
    -------
    (R, ..., N, Dv)

    Warns
    -----
    NonPositiveDenominatorWarning
        Trigonometric features whose causal denominator is zero or negative for some queries.
    """
    q, k, v, scale, batch, omega = _prepared(q, k, v, draws, options)
    query_features, key_features, num_features = causal_feature_slices(options.feature_map, q, k, omega, scale)
    out, sign = causal_feature_attention(query_features, key_features, v, num_queries=q.shape[-2],
                                         replicates=draws.replicates, num_features=num_features,
                                         chunk_size=options.chunk_size)
    if options.feature_map not in POSITIVE_MAPS:
        warn_non_positive(sign, "signed trigonometric features")
    return out


@keyword_entry(CausalRfaOptions)
def causal_estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws,
                                       options: CausalRfaOptions) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Causal RFA and the probabilities it implies, ``((R, ..., N, Dv), (R, ..., N, M))``, from one dense pass.

    The probabilities are :math:`\hat P_{nm} = W_{nm} / \sum_{m'} W_{nm'}` with the weights of
    :func:`~randattn.estimators.snis.prefix.causal_feature_weights` (exactly 0 at the keys query n may not
    see) and the estimate is :math:`\hat P v`: the same numbers as :func:`causal_estimate` to rounding
    (its prefix sums group the additions differently), at the cost of the N x M product a probability
    matrix needs anyway, O(N M (S L + Dv)), instead of prefix sums carrying an S L x M state.

    Parameters and warnings as :func:`causal_estimate`.
    """
    q, k, v, scale, batch, omega = _prepared(q, k, v, draws, options)
    query_features, key_features, _ = causal_feature_slices(options.feature_map, q, k, omega, scale)
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    lq, sq = query_features(slice(0, num_queries))
    lk, sk = key_features(slice(0, num_keys))
    weights = causal_feature_weights(lq, sq, lk, sk)
    del lq, sq, lk, sk
    total = weights.sum(-1, keepdim=True)
    if options.feature_map not in POSITIVE_MAPS:
        warn_non_positive(torch.sign(total[..., 0]).view(draws.replicates, *batch, num_queries),
                          "signed trigonometric features")
    probs = weights.div_(total).view(draws.replicates, *batch, num_queries, num_keys)
    return probs @ v, probs
