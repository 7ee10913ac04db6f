"""RFA / Performer in torch (batched form of ``rfa.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.features.batched import log_features, oprf_optimal_a
from randattn.estimators.snis import warn_non_positive
from randattn.estimators.snis.batched import feature_attention

__all__ = ["estimate"]


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
    a = oprf_optimal_a(x, y).unsqueeze(0) if feature_map == "oprf" else None
    lx, sx = log_features(feature_map, x.unsqueeze(0), omega, oprf_a=a)
    ly, sy = log_features(feature_map, y.unsqueeze(0), omega, oprf_a=a)
    out, sign = feature_attention(lx, ly, v.unsqueeze(0), q_sign=sx, k_sign=sy)
    if sx is not None:
        warn_non_positive(sign, "signed trigonometric features")
    return out
