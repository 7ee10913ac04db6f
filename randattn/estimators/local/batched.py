"""Block-local exact attention in torch (batched form of ``local.reference``): one product per block."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws
from randattn.estimators.eva.batched import block_exact_attention
from randattn.estimators.eva.partition import check_mask_layout, padded_partition
from randattn.estimators.grid import resolve_grid
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
    layout: str = "grid",
    grid: Any = None,
    mask: str | None = None,
) -> torch.Tensor:
    """Local attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``local.reference`` (``mask`` included)."""
    grid = resolve_grid(layout, grid)
    check_mask_layout(mask, grid=grid)  # before any computation
    x, y, v, _, _ = prepare_batched(q, k, v, scale)
    local_layout(x.shape[-2], y.shape[-2], window, prefix_tokens, grid, mask)  # validates: no empty block
    # local attention uses the blocks only: no chunks (padding every block's complement into chunks would be
    # O(M^2 / W) index memory for nothing)
    pad = padded_partition(x.shape[-2], y.shape[-2], window=window, prefix_tokens=prefix_tokens, num_chunks=1,
                           grid=grid, mask=mask, chunks=False)
    out = block_exact_attention(x, y, v, pad)
    if draws is None:
        return out
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
