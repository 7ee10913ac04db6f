"""Block-local exact attention in torch (batched form of ``local.reference``): gathers each query's block."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws
from randattn.estimators.eva.batched import exact_logits
from randattn.estimators.local.reference import local_layout

__all__ = ["estimate"]


def estimate(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws | None = None,
    *,
    scale: float | None = None,
    window: int = 49,
    prefix_tokens: int = 0,
) -> torch.Tensor:
    """Local attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``local.reference``."""
    x, y, v, _, _ = prepare_batched(q, k, v, scale)
    layout = local_layout(x.shape[-2], y.shape[-2], window, prefix_tokens)
    logits, idx = exact_logits(x, y, layout)  # (..., N, E_max), -inf padding
    out = (torch.softmax(logits, dim=-1).unsqueeze(-2) @ v[..., idx, :]).squeeze(-2)
    if draws is None:
        return out
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
