"""RFA / Performer in torch (batched form of ``rfa.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.features import POSITIVE_MAPS
from randattn.estimators.features.batched import affine_directions, data_params, log_features
from randattn.estimators.rfa.causal import (
    CausalRfaOptions,
    ChunkedCausalRfaOptions,
    causal_estimate,
    causal_estimate_with_probabilities,
)
from randattn.estimators.rfa.options import RfaOptions
from randattn.estimators.snis import warn_non_positive
from randattn.estimators.snis.batched import affine_feature_attention, feature_attention

__all__ = ["estimate", "probabilities", "estimate_with_probabilities", "estimate_with_probability_factors"]


def _add_replicate_dim(value):
    """A fitted parameter (array, or a tuple of arrays such as SderfParams) with a leading replicate dim."""
    if isinstance(value, tuple):
        return type(value)(*(v[None] for v in value))
    return value[None]


def _prepared(q: Any, k: Any, v: Any, draws: Draws, options: RfaOptions):
    """``(x, y, v, omega, fitted)``: scaled inputs, the checked draws and the map's data parameters per replicate."""
    x, y, v, _, batch = prepare_batched(q, k, v, options.scale)
    omega = check_draw_array(to_torch_draws(draws, x), "omega", batch, (None, x.shape[-1]))
    fitted = {key: _add_replicate_dim(val) for key, val in data_params(options.feature_map, x, y).items()}
    return x, y, v, omega, fitted


def _causal(options: RfaOptions, causal_options_type: type[CausalRfaOptions] = CausalRfaOptions) -> CausalRfaOptions:
    """``options`` (with ``mask="causal"``) as the options of the causal prefix-sum forms."""
    return causal_options_type(scale=options.scale, feature_map=options.feature_map, coupling=options.coupling)


@keyword_entry(RfaOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: RfaOptions) -> torch.Tensor:
    """RFA over (R, ..., N, Dv); same signature and layout as ``rfa.reference.estimate``.

    ``mask="causal"``: the chunked prefix sums of :func:`randattn.estimators.rfa.causal.causal_estimate`.
    """
    feature_map = options.feature_map
    if options.mask == "causal":
        return causal_estimate.on_options(q, k, v, draws, _causal(options, ChunkedCausalRfaOptions))
    x, y, v, omega, fitted = _prepared(q, k, v, draws, options)
    if feature_map in POSITIVE_MAPS:
        # every positive map is x.W_j + a_j - |x|^2/2: three matrix products, no log-feature tensors
        directions, offset = affine_directions(feature_map, omega, **fitted)
        return affine_feature_attention(x, y, v, directions, offset)
    lx, sx = log_features(feature_map, x.unsqueeze(0), omega, **fitted)
    ly, sy = log_features(feature_map, y.unsqueeze(0), omega, **fitted)
    out, sign = feature_attention(lx, ly, v.unsqueeze(0), q_sign=sx, k_sign=sy)
    if sx is not None:
        warn_non_positive(sign, "signed trigonometric features")
    return out


@keyword_entry(RfaOptions)
def probabilities(q: Any, k: Any, draws: Draws, options: RfaOptions) -> torch.Tensor:
    r"""The attention probabilities RFA implies, ``(R, ..., N, M)``: :func:`estimate` with ``v = I_M``.

    For the positive maps without forming the identity (the key side's normalized
    exponentials are the values' weights themselves, see :func:`affine_feature_attention`);
    the other maps go through :func:`estimate` with ``v = I_M``. Under ``mask="causal"`` every
    map takes the dense causal weights of
    :func:`~randattn.estimators.rfa.causal.causal_estimate_with_probabilities`: exactly 0 at the keys
    a query may not see, and ``probabilities @ v`` equals the causal estimate to rounding.
    """
    if options.mask == "causal":
        return causal_estimate_with_probabilities.on_options(q, k, k[..., :1], draws, _causal(options))[1]
    if options.feature_map not in POSITIVE_MAPS:
        eye = torch.eye(k.shape[-2], dtype=k.dtype, device=k.device).expand(*k.shape[:-1], k.shape[-2])
        return estimate.on_options(q, k, eye, draws, options)
    x, y, _, omega, fitted = _prepared(q, k, k, draws, options)
    directions, offset = affine_directions(options.feature_map, omega, **fitted)
    return affine_feature_attention(x, y, None, directions, offset)


@keyword_entry(RfaOptions)
def estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws, options: RfaOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate(q, k, v, ...), probabilities(q, k, ...))``, the same bits as the two calls.

    For the positive maps the features, both softmaxes and the logits are computed once (see
    :func:`affine_feature_attention`); the other maps make the two calls. Under ``mask="causal"``
    the probabilities come from one dense pass
    (:func:`~randattn.estimators.rfa.causal.causal_estimate_with_probabilities`) and the estimate from
    :func:`estimate`'s prefix sums (linear in N), so that the output does not depend on whether the
    probabilities were asked for.
    """
    if options.mask == "causal":
        _, probs = causal_estimate_with_probabilities.on_options(q, k, v[..., :1], draws, _causal(options))
        return estimate.on_options(q, k, v, draws, options), probs
    if options.feature_map not in POSITIVE_MAPS:
        return estimate.on_options(q, k, v, draws, options), probabilities.on_options(q, k, draws, options)
    x, y, v, omega, fitted = _prepared(q, k, v, draws, options)
    directions, offset = affine_directions(options.feature_map, omega, **fitted)
    return affine_feature_attention(x, y, v, directions, offset, with_probabilities=True)


@keyword_entry(RfaOptions)
def estimate_with_probability_factors(q: Any, k: Any, v: Any, draws: Draws, options: RfaOptions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(estimate(q, k, v, ...), L, R)`` with ``probabilities(q, k, ...) = L @ R``, or None for signed features.

    For the positive maps the implied probabilities have rank J (the features): ``L (R, ..., N, J)``
    is the query softmax over the features and ``R (R, ..., J, M)`` the key softmax of
    :func:`~randattn.estimators.snis.batched.affine_feature_attention`; the estimate is the same bits
    as :func:`estimate`. The trigonometric map's features are signed: None (no such factors here).
    Under ``mask="causal"``: None too -- each query's key softmax runs over its own visible keys, so
    the masked probabilities are no product of an (N, J) and a (J, M) matrix; callers fall back to
    :func:`estimate_with_probabilities`.
    """
    if options.mask == "causal" or options.feature_map not in POSITIVE_MAPS:
        return None
    x, y, v, omega, fitted = _prepared(q, k, v, draws, options)
    directions, offset = affine_directions(options.feature_map, omega, **fitted)
    return affine_feature_attention(x, y, v, directions, offset, with_probabilities=True, probability_factors=True)
