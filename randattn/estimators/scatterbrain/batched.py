"""Scatterbrain in torch (batched form of ``scatterbrain.reference``).

Evaluated through EVA's batched chunk machinery with one chunk, the N(0, I) proposal and
``chunk_weight="rfa"`` (EVA app. G.5): identical equations; the reference is written
independently from eq. 30.
"""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import check_draw_array, prepare_batched, to_torch_draws
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.eva.batched import eva_attention
from randattn.estimators.eva.partition import PaddedPartition, eva_partition
from randattn.estimators.scatterbrain.reference import ScatterbrainOptions

__all__ = ["estimate"]


@keyword_entry(ScatterbrainOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws, options: ScatterbrainOptions) -> torch.Tensor:
    """Scatterbrain over (R, ..., N, Dv); same signature and layout as ``scatterbrain.reference.estimate`` (``mask``
    included: causal EVA's partition with one chunk, the keys before the block)."""
    x, y, v, _, batch = prepare_batched(q, k, v, options.scale)
    draws = to_torch_draws(draws, x)
    omega = check_draw_array(draws, "omega", batch, (None, x.shape[-1]))
    pad = PaddedPartition.of(eva_partition(
        x.shape[-2], y.shape[-2], window=options.window, prefix_tokens=options.prefix_tokens, num_chunks=1,
        partition="paper", grid=options.resolved_grid, mask=options.mask,
    ))
    # omega ~ N(0, I) is EVA's eps with mu = 0 and sigma = 1: one chunk holding all S samples
    return eva_attention(
        x, y, v, omega.unsqueeze(-3), pad, replicates=draws.replicates, sigma=1.0,
        chunk_weight="rfa", add_log_chunk_size=False, proposal_mean="standard",
    )
