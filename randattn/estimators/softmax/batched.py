"""Exact softmax attention in torch (batched form of ``softmax.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws

__all__ = ["estimate"]


def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, scale: float | None = None) -> torch.Tensor:
    """Softmax attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``softmax.reference``."""
    x, y, v, _, _ = prepare_batched(q, k, v, scale)
    out = torch.softmax(x @ y.transpose(-1, -2), dim=-1) @ v
    if draws is None:
        return out
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
