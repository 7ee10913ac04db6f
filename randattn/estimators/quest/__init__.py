"""Quest: query-aware page selection by a per-channel min/max upper bound (Tang et al. 2024, arXiv 2406.10774).

The keys are split into pages of ``page_size`` consecutive keys from key 0; each query ranks the pages by the
upper bound of Alg. 1 on its logits with the page's keys and attends exactly to the keys of the top pages
(:mod:`randattn.estimators.quest.reference` states every convention: the query's own, partially filled page, its
bound under the causal mask, the page a sliding window cuts, and the ``current_page`` options).

Budget: **S = pages kept x page_size** (``num_samples``, Quest's "token budget"); S must be a multiple of
``page_size`` (ValueError otherwise). ``keys_used`` is the number of visible keys in the kept pages: S when every
kept page is whole and visible, fewer with the partial last page, the query's own page under the causal mask, the
page a sliding window cuts, or a query that sees fewer than ``S / page_size`` pages (it keeps them all).

Ties between equal bounds go to the lower page index, in both forms. Equal means equal as computed, as for top-k's
logits (:mod:`randattn.estimators.topk`): the batched form bounds whole pages by matrix products, which round each
page's sum in an order of their own, and the query's own page under a mask elementwise, so pages whose bounds are
equal in exact arithmetic (copies of the same keys: not a case of real keys, which carry their positions) may
differ in their last bit there and be ranked otherwise than in the reference. One channel-by-channel sum for every
bound would keep such ties, at up to twice the selection's time on one-key pages and 3 D kernel launches a call;
the forms agree wherever the bounds differ by more than their rounding.

Presets: ``official-code`` = ``current_page="keep"``, as Quest's kernels (the last page is always loaded, the
others compete for the remaining slots). Not modelled: the accuracy-evaluation script's floor of 3 pages
(``max(3, budget // page_size)``) and its dense first two layers (a model-level choice).
"""

from __future__ import annotations

from typing import Any, Mapping

from randattn.estimators.base import ExactLimit
from randattn.estimators.quest import batched, reference
from randattn.estimators.quest.reference import QuestOptions
from randattn.estimators.sparse.selection import budget_draw, kept_keys_spec

#: Quest's parameters, declared once as the fields of :class:`~.reference.QuestOptions`
PARAMS = QuestOptions.params()

#: ``budget : (R, ...)`` holding S after checking that it is a multiple of ``page_size``; no random variables
draw = budget_draw(QuestOptions)


def _query_placement(params: Mapping[str, Any]) -> str:
    """``current_page="keep"`` keeps the page of the query's own token, n + M - N, even without a mask: its query
    is placed as the last N of M tokens, and a block of queries estimated alone would keep other pages."""
    return "last-n-of-m" if params.get("current_page") == "keep" else "independent"


def _page_limit(num_queries: int, num_keys: int) -> int:
    """S = every page of 4 keys (the limit's page size)."""
    return 4 * -(-num_keys // 4)


SPEC = kept_keys_spec(
    name="quest",
    summary="Quest: exact softmax over the pages of largest min/max upper bound (S = pages kept x page_size)",
    source="Tang et al. 2024, Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, arXiv 2406.10774, "
           "sec. 3.4, Alg. 1, sec. 3.5; mit-han-lab/Quest",
    complexity="O(N M D / page_size) for the bounds, O(N M D) for the logits here (dense masked product; "
               "O(N S (D + Dv)) sparse)",
    options_type=QuestOptions,
    draw=draw,
    reference=reference,
    batched=batched,
    # page sizes dividing the test suites' S (6, 8, 16); page_size=1 with "compete" is top-k attention
    variants={"page-2": {"page_size": 2}, "page-2-keep": {"page_size": 2, "current_page": "keep"},
              "page-1": {"page_size": 1}},
    presets={"official-code": {"current_page": "keep"}},
    display_name="Quest",
    selection="discrete",
    exact_limits=(ExactLimit("S / page_size >= pages: every page is kept, Quest is softmax attention",
                             params={"page_size": 4}, num_samples=_page_limit),),
    memory_hint="the N x M logits and the N x (M / page_size) page bounds per batch element",
    query_placement=_query_placement,
)
