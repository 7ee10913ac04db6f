r"""Quest's query-aware page selection (Tang et al. 2024, sec. 3.4, Alg. 1), numpy float64 (the reference form).

The keys are split into pages of ``page_size`` consecutive keys starting at key 0 (the last page holds the
remainder). For query :math:`n` and page :math:`p`, with :math:`m_{p}` and :math:`M_{p}` the per-channel minimum and
maximum of the page's keys that the query sees, the page's criticality is the upper bound of Alg. 1

.. math::
    U_{np} = \sum_{i=1}^{D} \max\left(x_{ni}\, m_{pi},\ x_{ni}\, M_{pi}\right) \;\ge\; x_n^\top y_m
    \quad \text{for every key } m \text{ of page } p \text{ the query sees}

(the bound holds channel by channel, :math:`m_{pi} \le y_{mi} \le M_{pi}`). The query keeps the top
``S / page_size`` pages by :math:`U_{np}` (ties to the lower page index) and attends exactly to their keys.

Conventions:

- **Current page.** Query :math:`n` is token :math:`t_n = n + M - N`; its page holds the keys up to
  :math:`t_n`. Under ``mask="causal"`` the bound of that partially visible page is over its keys
  :math:`\le t_n` only: at decode time Quest's last page holds just the tokens so far (its metadata is updated as
  they arrive), and the output must not depend on keys the query may not see. Pages after it have no visible key
  and do not compete. Without a mask every page is whole.
- **Sliding window.** Under ``mask="sliding:W"`` the same rule holds at the window's lower edge: the page holding
  the window's first key :math:`t_n - W + 1` is bounded over its keys from there on (its metadata over hidden keys
  would make the choice depend on keys the layer hides), and pages before it have no visible key and do not
  compete. A window inside one page bounds that page over the window's keys alone.
- ``current_page="compete"`` (default, the paper: "we choose the top K pages"; also the code's accuracy
  evaluation, ``evaluation/quest_attention.py``): the current page competes like any other.
  ``current_page="keep"`` (the code's kernels, ``quest/utils/controller.py``): the current page is always kept and
  the other pages compete for the remaining ``S / page_size - 1`` slots. Without a mask and with N > M, a query
  before the first key (:math:`t_n < 0`) has page 0 as its current page.
- A query that sees at most ``S / page_size`` pages keeps all of them (all its visible keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from randattn._validation import check_choice, check_positive_int
from randattn.estimators.base import option
from randattn.estimators.masks import DECLARABLE_MASKS, Mask, last_visible_key
from randattn.estimators.sparse.selection import (
    KeptKeysOptions, KeptKeysReference, deprecated_check_params, top_ranked,
)

__all__ = ["CURRENT_PAGE", "QuestOptions", "estimate", "keys_used", "kept_keys", "page_upper_bounds",
           "probabilities", "query_tokens", "seen_range"]

#: how the page holding the query's own token is treated (module docstring)
CURRENT_PAGE = ("compete", "keep")


@dataclass(frozen=True, kw_only=True)
class QuestOptions(KeptKeysOptions):
    """Quest's keyword options, declared once: the spec's ``params``, ``draw``'s and every form's keywords.

    ``page_size >= 1``, ``current_page`` in :data:`CURRENT_PAGE`, and S a multiple of ``page_size`` (S = pages kept
    x page_size; :meth:`check_budget`).
    """

    #: a window's cut page is bounded over its visible keys, as the causal mask's own page (module docstring)
    declared_masks: ClassVar[tuple[str | None, ...]] = DECLARABLE_MASKS

    page_size: int = option(16, "keys per page (16 in the paper's kernels and evaluation); S must be a multiple",
                            kind=int)
    current_page: str = option("compete", "the query's own (last, partial) page: 'compete' like the others (the "
                               "paper), or 'keep' it always, the others competing for the rest (the code's kernels)",
                               choices=CURRENT_PAGE)

    def check(self) -> None:
        super().check()
        check_positive_int("page_size", self.page_size)
        check_choice("current_page", self.current_page, CURRENT_PAGE)

    def check_budget(self, budget: Any) -> int:
        budget = super().check_budget(budget)
        page_size = self.page_size
        if budget % page_size:
            raise ValueError(f"num_samples S={budget} must be a multiple of page_size={page_size}: Quest keeps whole "
                             f"pages, S = pages kept x page_size (e.g. S={max(page_size, budget - budget % page_size)})")
        return budget


def query_tokens(num_queries: int, num_keys: int) -> np.ndarray:
    """``(N,)`` the token of each query, :math:`t_n = n + M - N`, clipped to ``[0, M - 1]`` (N > M, no mask)."""
    return np.clip(np.arange(num_queries) + (num_keys - num_queries), 0, num_keys - 1)


def _running_page_extremes(y: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(..., M, D)`` twice: per channel, the min and the max of the keys from the start of key m's page to m."""
    num_keys, dim = y.shape[-2:]
    num_pages = -(-num_keys // page_size)
    extremes = []
    for accumulate, fill in ((np.minimum.accumulate, np.inf), (np.maximum.accumulate, -np.inf)):
        padding = np.full((*y.shape[:-2], num_pages * page_size - num_keys, dim), fill)
        paged = np.concatenate([y, padding], axis=-2).reshape(*y.shape[:-2], num_pages, page_size, dim)
        running = accumulate(paged, axis=-2).reshape(*y.shape[:-2], num_pages * page_size, dim)
        extremes.append(running[..., :num_keys, :])
    return extremes[0], extremes[1]


def seen_range(num_queries: int, num_keys: int, mask: str | None) -> tuple[np.ndarray, np.ndarray]:
    """``(first, last)``, each ``(N,)``: the first and the last key each query sees (``0`` and ``M - 1`` without a
    mask; ``0`` and ``t_n = n + M - N`` causal; ``max(0, t_n - W + 1)`` and ``t_n`` under ``"sliding:W"``)."""
    parsed = Mask.parse(mask)
    if not parsed.masked:
        return np.zeros(num_queries, dtype=np.int64), np.full(num_queries, num_keys - 1)
    last = last_visible_key(num_queries, num_keys)
    return last + 1 - parsed.visible_counts(num_queries, num_keys), last


def _first_page_extremes(y: np.ndarray, first_seen: np.ndarray, last_seen: np.ndarray,
                         page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(..., N, D)`` twice: per channel, the min and the max of the keys query n sees on the page of its first
    visible key (``first_seen`` to the page's end or ``last_seen``, whichever comes first)."""
    start = first_seen // page_size * page_size
    keys = start[:, None] + np.arange(page_size)[None, :]  # (N, page_size)
    in_view = (keys >= first_seen[:, None]) & (keys <= np.minimum(last_seen, start + page_size - 1)[:, None])
    page_keys = y[..., np.minimum(keys, y.shape[-2] - 1), :]  # (..., N, page_size, D)
    return (np.where(in_view[..., None], page_keys, np.inf).min(axis=-2),
            np.where(in_view[..., None], page_keys, -np.inf).max(axis=-2))


def page_upper_bounds(x: np.ndarray, y: np.ndarray, page_size: int, mask: str | None = None) -> np.ndarray:
    r"""``(..., N, P)``: Quest's bound :math:`U_{np}` (Alg. 1) over the keys of page p that query n sees.

    ``-inf`` for a page with no visible key (under ``mask="causal"``, the pages after the query's own; under a
    sliding window also those before the window's first key).

    Parameters
    ----------
    x : (..., N, D)
    y : (..., M, D)
    page_size : int
    mask : {None, "causal", "sliding:W"}
    """
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    num_pages = -(-num_keys // page_size)
    running_min, running_max = _running_page_extremes(y, page_size)
    first_seen, last_seen = seen_range(num_queries, num_keys, mask)
    windowed = Mask.parse(mask).window is not None
    if windowed:
        cut_min, cut_max = _first_page_extremes(y, first_seen, last_seen, page_size)
    bounds = np.empty((*np.broadcast_shapes(x.shape[:-2], y.shape[:-2]), num_queries, num_pages))
    for page in range(num_pages):
        first, last = page * page_size, min((page + 1) * page_size, num_keys) - 1
        seen = np.minimum(last, last_seen)  # (N,) the page's last key each query sees
        lower, upper = running_min[..., seen, :], running_max[..., seen, :]  # (..., N, D): m_p, M_p per query
        if windowed:  # the page the window's lower edge cuts: its keys from the window's first key on
            cut = (first_seen // page_size == page)[:, None]
            lower, upper = np.where(cut, cut_min, lower), np.where(cut, cut_max, upper)
        bound = np.maximum(x * lower, x * upper).sum(axis=-1)
        bounds[..., page] = np.where((last_seen >= first) & (first_seen <= last), bound, -np.inf)
    return bounds


def kept_keys(x: np.ndarray, y: np.ndarray, logits: np.ndarray, budget: int, options: QuestOptions) -> np.ndarray:
    """``(..., N, M)`` boolean: the keys of the ``budget // page_size`` pages of largest bound (module docstring).

    The ``select`` of :class:`~randattn.estimators.sparse.selection.KeptKeysReference` (its arguments there), with
    ``budget`` S = pages kept x ``page_size``; ``logits`` is unused: pages are ranked by their bound (the mask's
    hidden keys drop out afterwards).
    """
    mask, page_size, current_page = options.mask, options.page_size, options.current_page
    num_queries, num_keys = x.shape[-2], y.shape[-2]
    bounds = page_upper_bounds(x, y, page_size, mask)
    if current_page == "keep":  # ranked first whatever its bound
        own_page = query_tokens(num_queries, num_keys) // page_size
        bounds[..., np.arange(num_queries), own_page] = np.inf
    kept_pages = top_ranked(bounds, budget // page_size)
    return kept_pages[..., np.arange(num_keys) // page_size]


estimate, probabilities, keys_used = KeptKeysReference(QuestOptions, kept_keys).forms()


def __getattr__(name: str) -> Any:
    if name == "check_params":  # deprecated: the options check themselves
        return deprecated_check_params(QuestOptions, "quest")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
