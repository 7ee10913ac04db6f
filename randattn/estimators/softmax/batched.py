"""Exact softmax attention in torch (batched form of ``softmax.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.softmax.reference import SoftmaxOptions

__all__ = ["estimate"]


@keyword_entry(SoftmaxOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, options: SoftmaxOptions) -> torch.Tensor:
    """Softmax attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``softmax.reference``.

    ``mask="causal"``: the logits of keys m > n + M - N are set to -inf before ``torch.softmax``
    (which subtracts the row max); M >= N keeps every row non-empty.
    """
    x, y, v, _, _ = prepare_batched(q, k, v, options.scale)
    if options.mask is None:
        out = torch.softmax(x @ y.transpose(-1, -2), dim=-1) @ v
    else:
        from randattn.estimators.masks import check_causal_shapes

        n, m = x.shape[-2], y.shape[-2]
        check_causal_shapes(n, m)
        # key m hidden from query n iff m > n + (M - N): the strict upper triangle shifted by M - N
        hidden = torch.ones(n, m, dtype=torch.bool, device=x.device).triu_(m - n + 1)
        out = torch.softmax((x @ y.transpose(-1, -2)).masked_fill_(hidden, -torch.inf), dim=-1) @ v
    if draws is None:
        return out
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
