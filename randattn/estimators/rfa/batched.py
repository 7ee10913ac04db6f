"""RFA / Performer in torch (batched form of ``rfa.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.features import POSITIVE_MAPS
from randattn.estimators.features.batched import affine_directions, data_params, log_features
from randattn.estimators.snis import warn_non_positive
from randattn.estimators.snis.batched import affine_feature_attention, feature_attention

__all__ = ["estimate"]


def _add_replicate_dim(value):
    """A fitted parameter (array, or a tuple of arrays such as SderfParams) with a leading replicate dim."""
    if isinstance(value, tuple):
        return type(value)(*(v[None] for v in value))
    return value[None]


def estimate(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws,
    *,
    scale: float | None = None,
    feature_map: str = "positive",
    coupling: str = "iid",
) -> torch.Tensor:
    """RFA over (R, ..., N, Dv); same signature and layout as ``rfa.reference.estimate``."""
    x, y, v, _, batch = prepare_batched(q, k, v, scale)
    draws = to_torch_draws(draws, x)
    omega = check_draw_array(draws, "omega", batch, (None, x.shape[-1]))
    fitted = {key: _add_replicate_dim(val) for key, val in data_params(feature_map, x, y).items()}
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
