"""Attention over selected, weighted keys in torch (the batched form of :mod:`.reference`)."""

from __future__ import annotations

from typing import Any

import torch

from randattn.estimators.masks import Mask

__all__ = ["attention", "keys_used", "log_denominator", "masked_logits", "repeated", "visible_keys",
           "weighted_attention"]


def visible_keys(num_queries: int, num_keys: int, mask: str | None, device: Any = None) -> torch.Tensor | None:
    """``(N, M)`` boolean on ``device``: the keys each query may see; None without a mask (every key).

    :meth:`~randattn.estimators.masks.Mask.visible_tensor`: a band of ones made on the device (a host array uploaded
    would move N x M bytes per call, 268 MB at 16,384 tokens).
    """
    return Mask.parse(mask).visible_tensor(num_queries, num_keys, device)


def masked_logits(x: torch.Tensor, y: torch.Tensor, mask: str | None) -> torch.Tensor:
    """``x_n . y_m`` : (..., N, M), ``-inf`` where the mask hides key m from query n."""
    logits = x @ y.transpose(-1, -2)
    visible = visible_keys(x.shape[-2], y.shape[-2], mask, x.device)
    if visible is None:
        return logits
    return logits.masked_fill(~visible, float("-inf"))


def weighted_attention(logits: torch.Tensor, log_weights: torch.Tensor, v: torch.Tensor):
    r"""``(out, probabilities)``: :math:`\sum_m p_{nm} v_m`, :math:`p_{nm} \propto w_{nm} e^{l_{nm}}` (max-subtracted)."""
    return attention(logits + log_weights, v)


def attention(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(out, probabilities)`` from the weighted scores :math:`\log w + l` (:func:`weighted_attention`'s sum)."""
    probabilities = torch.softmax(scores, dim=-1)
    return probabilities @ v, probabilities


def keys_used(log_weights: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    """``(..., N)`` float64: the keys each query reads (finite log weight, and visible when ``logits`` is given)."""
    used = torch.isfinite(log_weights)
    if logits is not None:
        used = used & torch.isfinite(logits)
    return used.sum(dim=-1).to(torch.float64)


def log_denominator(scores: torch.Tensor) -> torch.Tensor:
    """``(..., N)`` float64: the log of the weighted softmax normaliser from ``scores = log w + l``; a logsumexp in the
    scores' dtype (a float32 run rounds it by a few ulps of the largest score), returned as float64."""
    return torch.logsumexp(scores, dim=-1).to(torch.float64)


def repeated(tensor: torch.Tensor, replicates: int) -> torch.Tensor:
    """``tensor`` repeated along a new leading replicate dim (a copy, not a view)."""
    return tensor.unsqueeze(0).expand(replicates, *tensor.shape).clone()
