"""Quest: query-aware page selection by a per-channel min/max upper bound (Tang et al. 2024, arXiv 2406.10774).

The keys are split into pages of ``page_size`` consecutive keys from key 0; each query ranks the pages by the
upper bound of Alg. 1 on its logits with the page's keys and attends exactly to the keys of the top pages
(:mod:`randattn.estimators.quest.reference` states every convention: the query's own, partially filled page, its
bound under the causal mask, and the ``current_page`` options).

Budget: **S = pages kept x page_size** (``num_samples``, Quest's "token budget"); S must be a multiple of
``page_size`` (ValueError otherwise). ``keys_used`` is the number of visible keys in the kept pages: S when every
kept page is whole and visible, fewer with the partial last page, the query's own page under the causal mask, or a
query that sees fewer than ``S / page_size`` pages (it keeps them all).

Presets: ``official-code`` = ``current_page="keep"``, as Quest's kernels (the last page is always loaded, the
others compete for the remaining slots). Not modelled: the accuracy-evaluation script's floor of 3 pages
(``max(3, budget // page_size)``) and its dense first two layers (a model-level choice).
"""

from __future__ import annotations

from typing import Any, Sequence

from randattn.estimators.base import BatchedForms, Draws, EstimatorSpec, ExactLimit, Param
from randattn.estimators.quest import batched, reference
from randattn.estimators.sparse.selection import budget_draws

PARAMS = {
    "page_size": Param(16, "keys per page (16 in the paper's kernels and evaluation); S must be a multiple", kind=int),
    "current_page": Param("compete", "the query's own (last, partial) page: 'compete' like the others (the paper), or "
                          "'keep' it always, the others competing for the rest (the code's kernels)",
                          choices=reference.CURRENT_PAGE),
}


def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1, rng: Any = None,
         mask: str | None = None, page_size: int = 16, current_page: str = "compete") -> Draws:
    """``budget : (R, ...)`` holding S after checking that it is a multiple of ``page_size``; no random variables."""
    reference.check_params(num_samples, page_size, current_page)
    return budget_draws(q_shape, num_samples, replicates)


def _page_limit(num_queries: int, num_keys: int) -> int:
    """S = every page of 4 keys (the limit's page size)."""
    return 4 * -(-num_keys // 4)


SPEC = EstimatorSpec(
    name="quest",
    summary="Quest: exact softmax over the pages of largest min/max upper bound (S = pages kept x page_size)",
    source="Tang et al. 2024, Quest: Query-Aware Sparsity for Efficient Long-Context LLM Inference, arXiv 2406.10774, "
           "sec. 3.4, Alg. 1, sec. 3.5; mit-han-lab/Quest",
    complexity="O(N M D / page_size) for the bounds, O(N M D) for the logits here (dense masked product; "
               "O(N S (D + Dv)) sparse)",
    params=PARAMS,
    draw=draw,
    reference=reference.estimate,
    forms=BatchedForms(
        estimate=batched.estimate,
        probabilities=batched.probabilities,
        estimate_with_probabilities=batched.estimate_with_probabilities,
    ),
    needs_samples=True,
    is_random=lambda params: False,
    # page sizes dividing the test suites' S (6, 8, 16); page_size=1 with "compete" is top-k attention
    variants={"page-2": {"page_size": 2}, "page-2-keep": {"page_size": 2, "current_page": "keep"},
              "page-1": {"page_size": 1}},
    presets={"official-code": {"current_page": "keep"}},
    display_name="Quest",
    convergence="none",  # biased for S < M, exact once the pages cover every key; no claim as S grows
    cost="quadratic",
    selection="discrete",
    normalized=True,
    masks=(None, "causal"),
    exact_limits=(ExactLimit("S / page_size >= pages: every page is kept, Quest is softmax attention",
                             params={"page_size": 4}, num_samples=_page_limit),),
    keys_used=batched.keys_used,
    memory_hint="the N x M logits and the N x (M / page_size) page bounds per batch element",
)
