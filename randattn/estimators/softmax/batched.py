"""Exact softmax attention in torch (batched form of ``softmax.reference``)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators._prepare import prepare_batched
from randattn.estimators.base import Draws, keyword_entry
from randattn.estimators.masks import Mask
from randattn.estimators.softmax.reference import SoftmaxOptions

__all__ = ["estimate", "estimate_with_probabilities", "probabilities"]


def _attention_probabilities(x: torch.Tensor, y: torch.Tensor, mask: str | None) -> torch.Tensor:
    """``softmax_m(x_n . y_m)`` : (..., N, M), the hidden logits (under ``"causal"``, ``"sliding:W"``) set to -inf
    first, so that their probabilities are exact zeros; M >= N keeps every row non-empty (its own key)."""
    logits = x @ y.transpose(-1, -2)
    visible = Mask.parse(mask).visible_tensor(x.shape[-2], y.shape[-2], x.device)
    if visible is not None:
        logits.masked_fill_(~visible, -torch.inf)
    return torch.softmax(logits, dim=-1)


def _replicated(tensor: torch.Tensor, draws: Draws | None) -> torch.Tensor:
    return tensor if draws is None else tensor.unsqueeze(0).expand(draws.replicates, *tensor.shape).clone()


@keyword_entry(SoftmaxOptions)
def estimate(q: Any, k: Any, v: Any, draws: Draws | None = None, *, options: SoftmaxOptions) -> torch.Tensor:
    """Softmax attention; (R, ..., N, Dv) with draws, else (..., N, Dv). See ``softmax.reference``.

    Under a mask (``"causal"``, ``"sliding:W"``) the logits of the hidden keys are set to -inf before
    ``torch.softmax`` (which subtracts the row max); M >= N keeps every row non-empty (its own key).
    """
    x, y, v, _, _ = prepare_batched(q, k, v, options.scale)
    return _replicated(_attention_probabilities(x, y, options.mask) @ v, draws)


@keyword_entry(SoftmaxOptions)
def probabilities(q: Any, k: Any, draws: Draws | None = None, *, options: SoftmaxOptions) -> torch.Tensor:
    """The attention probabilities ``(R, ..., N, M)`` (without draws ``(..., N, M)``): :func:`estimate` with
    ``v = I_M``, without the ``(N, M) x (M, M)`` product the identity would cost; exact zeros where hidden."""
    x, y, _, _, _ = prepare_batched(q, k, k[..., :1], options.scale)
    return _replicated(_attention_probabilities(x, y, options.mask), draws)


@keyword_entry(SoftmaxOptions)
def estimate_with_probabilities(q: Any, k: Any, v: Any, draws: Draws | None = None, *,
                                options: SoftmaxOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """``(estimate(q, k, v, ...), probabilities(q, k, ...))``, the same bits, from one softmax."""
    x, y, v, _, _ = prepare_batched(q, k, v, options.scale)
    weights = _attention_probabilities(x, y, options.mask)
    return _replicated(weights @ v, draws), _replicated(weights, draws)
