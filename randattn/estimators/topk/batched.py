"""Oracle top-k attention in torch (the batched form of :mod:`randattn.estimators.topk.reference`)."""

from __future__ import annotations

import torch

from randattn.estimators.sparse.batched_selection import KeptKeysBatched, top_ranked
from randattn.estimators.topk.reference import TopkOptions

__all__ = ["estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used", "keys_used",
           "kept_keys", "probabilities"]


def kept_keys(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, budget: torch.Tensor,
              options: TopkOptions) -> torch.Tensor:
    """``(..., N, M)`` boolean: the ``budget`` (0-d tensor) largest logits per query, ties to the lower index."""
    return top_ranked(logits, budget)


(estimate, estimate_with_probabilities, probabilities, keys_used,
 estimate_with_probabilities_and_keys_used) = KeptKeysBatched(TopkOptions, kept_keys).forms()
