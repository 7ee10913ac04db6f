"""Exact softmax attention in torch (batched form of ``softmax.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.masks import Mask
from randattn.estimators.softmax.reference import SoftmaxOptions

__all__ = ["estimate"]


@keyword_entry(SoftmaxOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, options: SoftmaxOptions) -> torch.Tensor:
    """Softmax attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``softmax.reference``.

    Under a mask (``"causal"``, ``"sliding:W"``) the logits of the hidden keys are set to -inf before
    ``torch.softmax`` (which subtracts the row max); M >= N keeps every row non-empty (its own key).
    """
    x, y, v, _, _ = prepare_batched(q, k, v, options.scale)
    if options.mask is None:
        out = torch.softmax(x @ y.transpose(-1, -2), dim=-1) @ v
    else:
        visible = Mask.parse(options.mask).visible_tensor(x.shape[-2], y.shape[-2], x.device)
        out = torch.softmax((x @ y.transpose(-1, -2)).masked_fill_(~visible, -torch.inf), dim=-1) @ v
    if draws is None:
        return out
    return out.unsqueeze(0).expand(draws.replicates, *out.shape).clone()
