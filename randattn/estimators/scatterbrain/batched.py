"""Scatterbrain in torch (batched form of ``scatterbrain.reference``).

Evaluated through EVA's batched chunk machinery with one chunk, the N(0, I) proposal and
``chunk_weight="rfa"`` (EVA app. G.5): identical equations; the reference is written
independently from eq. 30.
"""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws
from randattn.estimators.eva.batched import eva_attention
from randattn.estimators.eva.partition import check_mask_layout, padded_partition
from randattn.estimators.grid import resolve_grid

__all__ = ["estimate"]


def estimate(
    q: Any,
    k: Any,
    v: Any,
    draws: Draws,
    *,
    scale: float | None = None,
    window: int = 49,
    prefix_tokens: int = 0,
    layout: str = "grid",
    grid: Any = None,
    coupling: str = "iid",
    mask: str | None = None,
) -> torch.Tensor:
    """Scatterbrain over (R, ..., N, Dv); same signature and layout as ``scatterbrain.reference.estimate`` (``mask``
    included: causal EVA's partition with one chunk, the keys before the block)."""
    grid = resolve_grid(layout, grid)
    check_mask_layout(mask, grid=grid)  # before any computation
    x, y, v, _, batch = prepare_batched(q, k, v, scale)
    draws = to_torch_draws(draws, x)
    omega = check_draw_array(draws, "omega", batch, (None, x.shape[-1]))
    pad = padded_partition(
        x.shape[-2], y.shape[-2], window=window, prefix_tokens=prefix_tokens, num_chunks=1, partition="paper",
        grid=grid, mask=mask,
    )
    # omega ~ N(0, I) is EVA's eps with mu = 0 and sigma = 1: one chunk holding all S samples
    return eva_attention(
        x, y, v, omega.unsqueeze(-3), pad, replicates=draws.replicates, sigma=1.0,
        chunk_weight="rfa", add_log_chunk_size=False, proposal_mean="standard",
    )
