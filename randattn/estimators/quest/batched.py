"""Quest's page selection in torch (the batched form of :mod:`randattn.estimators.quest.reference`).

Whole pages are bounded with two products, ``max(x, 0) @ M_p + min(x, 0) @ m_p`` (per channel this is
``max(x_i m_pi, x_i M_pi)``, since ``m_pi <= M_pi``); under the causal mask the query's own page is bounded over
its keys up to the query's token from running (cumulative) extremes, and under a sliding window the page of the
window's first key over its keys from there on (one gather of ``page_size`` keys per query).
"""

from __future__ import annotations

import torch

from randattn.estimators.masks import Mask
from randattn.estimators.quest.reference import QuestOptions
from randattn.estimators.sparse.batched_selection import KeptKeysBatched, top_ranked

__all__ = ["estimate", "estimate_with_probabilities", "estimate_with_probabilities_and_keys_used", "keys_used",
           "kept_keys", "page_upper_bounds", "probabilities"]


def _running_page_extremes(y: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(..., M, D)`` twice: per channel, the min and the max of the keys from the start of key m's page to m."""
    num_keys, dim = y.shape[-2:]
    num_pages = -(-num_keys // page_size)
    pad = num_pages * page_size - num_keys
    paged_shape = (*y.shape[:-2], num_pages, page_size, dim)

    def running(fill: float, cumulative) -> torch.Tensor:
        padded = torch.cat([y, y.new_full((*y.shape[:-2], pad, dim), fill)], dim=-2).reshape(paged_shape)
        return cumulative(padded, dim=-2).values.reshape(*y.shape[:-2], num_pages * page_size, dim)[..., :num_keys, :]

    return running(float("inf"), torch.cummin), running(float("-inf"), torch.cummax)


def _bound(x: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor) -> torch.Tensor:
    """``sum_i max(x_i lower_i, x_i upper_i)`` for ``x, lower, upper : (..., D)`` with ``lower <= upper``."""
    return (x.clamp(min=0) * upper + x.clamp(max=0) * lower).sum(dim=-1)


def page_upper_bounds(x: torch.Tensor, y: torch.Tensor, page_size: int, mask: str | None = None) -> torch.Tensor:
    """``(..., N, P)``: Quest's page bound over the keys each query sees; ``-inf`` for pages it does not see."""
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    num_pages = -(-num_keys // page_size)
    running_min, running_max = _running_page_extremes(y, page_size)
    page_last = (torch.arange(1, num_pages + 1, device=y.device) * page_size).clamp(max=num_keys) - 1
    page_min, page_max = running_min[..., page_last, :], running_max[..., page_last, :]  # (..., P, D)
    bounds = x.clamp(min=0) @ page_max.transpose(-1, -2) + x.clamp(max=0) @ page_min.transpose(-1, -2)
    window = Mask.parse(mask)
    if not window.masked:
        return bounds
    token = torch.arange(num_queries, device=x.device) + (num_keys - num_queries)  # last visible key t_n
    own = _bound(x, running_min[..., token, :], running_max[..., token, :])  # (..., N): own page, keys <= t_n
    pages = torch.arange(num_pages, device=x.device)[None, :]
    own_page = (token // page_size)[:, None]
    bounds = torch.where(pages == own_page, own.unsqueeze(-1), bounds).masked_fill(pages > own_page, float("-inf"))
    if window.window is None:
        return bounds
    first_seen = (token - window.window + 1).clamp(min=0)
    first_page = (first_seen // page_size)[:, None]
    cut = _bound(x, *_first_page_extremes(y, first_seen, token, page_size))  # (..., N)
    bounds = torch.where(pages == first_page, cut.unsqueeze(-1), bounds)
    return bounds.masked_fill(pages < first_page, float("-inf"))


def _first_page_extremes(y: torch.Tensor, first_seen: torch.Tensor, last_seen: torch.Tensor,
                         page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(..., N, D)`` twice: the per-channel min and max of the keys each query sees on its first visible key's
    page (reference ``_first_page_extremes``)."""
    start = first_seen // page_size * page_size
    keys = start[:, None] + torch.arange(page_size, device=y.device)[None, :]  # (N, page_size)
    in_view = ((keys >= first_seen[:, None]) & (keys <= torch.minimum(last_seen, start + page_size - 1)[:, None]))
    page_keys = y[..., keys.clamp(max=y.shape[-2] - 1), :]  # (..., N, page_size, D)
    hidden = ~in_view.unsqueeze(-1)
    return (page_keys.masked_fill(hidden, float("inf")).amin(dim=-2),
            page_keys.masked_fill(hidden, float("-inf")).amax(dim=-2))


def kept_keys(x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor, budget: torch.Tensor,
              options: QuestOptions) -> torch.Tensor:
    """``(..., N, M)`` boolean: the keys of the ``S / page_size`` pages of largest bound (S a 0-d tensor)."""
    mask, page_size, current_page = options.mask, options.page_size, options.current_page
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    bounds = page_upper_bounds(x, y, page_size, mask)
    if current_page == "keep":  # the query's own page ranks first whatever its bound
        token = (torch.arange(num_queries, device=x.device) + (num_keys - num_queries)).clamp(0, num_keys - 1)
        own_page = torch.arange(bounds.shape[-1], device=x.device)[None, :] == (token // page_size)[:, None]
        bounds = bounds.masked_fill(own_page, float("inf"))
    kept_pages = top_ranked(bounds, torch.div(budget, page_size, rounding_mode="floor"))
    return kept_pages[..., torch.arange(num_keys, device=x.device) // page_size]


(estimate, estimate_with_probabilities, probabilities, keys_used,
 estimate_with_probabilities_and_keys_used) = KeptKeysBatched(QuestOptions, kept_keys).forms()
