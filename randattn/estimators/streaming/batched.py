"""StreamingLLM's sinks + recent window in torch (batched form of :mod:`randattn.estimators.streaming.reference`)."""

from __future__ import annotations

import torch

from randattn.estimators.sparse.batched_selection import KeptKeysBatched
from randattn.estimators.streaming.reference import StreamingOptions

__all__ = ["estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used", "keys_used",
           "kept_keys", "probabilities"]


def kept_keys(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, budget: torch.Tensor,
              options: StreamingOptions) -> torch.Tensor:
    """``(N, M)`` boolean: key m is a sink (``m < sinks``) or in the window ``e_n - window < m <= e_n``, with
    ``e_n = max(t_n, min(S, M) - 1)``; ``budget`` S is a 0-d tensor (no host read)."""
    sinks = options.sinks
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    keys = torch.arange(num_keys, device=x.device)
    token = torch.arange(num_queries, device=x.device) + (num_keys - num_queries)
    end = torch.maximum(token, budget.clamp(max=num_keys) - 1)[:, None]
    in_window = (keys[None, :] > end - (budget - sinks)) & (keys[None, :] <= end)
    return in_window | (keys < sinks)[None, :]


(estimate, estimate_with_probabilities, probabilities, keys_used,
 estimate_with_probabilities_and_keys_used) = KeptKeysBatched(StreamingOptions, kept_keys).forms()
