"""Block-local exact attention in torch (batched form of ``local.reference``): one product per block."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.eva.batched import block_exact_attention
from randattn.estimators.eva.partition import PaddedPartition, eva_partition
from randattn.estimators.local.reference import LocalOptions, local_layout

__all__ = ["estimate"]


@keyword_entry(LocalOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, options: LocalOptions) -> torch.Tensor:
    """Local attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``local.reference`` (``mask`` included)."""
    x, y, v, _, _ = prepare_batched(q, k, v, options.scale)
    window, prefix_tokens, grid, mask = options.window, options.prefix_tokens, options.resolved_grid, options.mask
    local_layout(x.shape[-2], y.shape[-2], window, prefix_tokens, grid, mask)  # validates: no empty block
    # local attention uses the blocks only: no chunks (padding every block's complement into chunks would be
    # O(M^2 / W) index memory for nothing)
    pad = PaddedPartition.of(eva_partition(x.shape[-2], y.shape[-2], window=window, prefix_tokens=prefix_tokens,
                                           num_chunks=1, grid=grid, mask=mask, chunks=False))
    out = block_exact_attention(x, y, v, pad)
    if draws is None:
        return out
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
