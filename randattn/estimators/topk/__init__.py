"""Oracle top-k attention: each query attends exactly to the S visible keys with the largest logits.

The ideal that the decode-time sparse estimators (Quest, MagicPIG, vAttention; ARCHITECTURE sec. 14) approximate:
it reads every logit to choose, so it saves nothing, but it shows the error of the best S keys.

Budget: **S = keys kept per query** (``num_samples``); a query that sees fewer than S keys keeps all of them, so
``keys_used = min(S, visible keys)``. Ties between equal logits go to the lower key index (a stable sort of the
negated logits, in both forms). Under ``mask="causal"`` the S keys are chosen among the visible keys
(``m <= n + M - N``) only. Deterministic: the draws carry S alone.
"""

from __future__ import annotations

from typing import Any, Sequence

from randattn.estimators.base import BatchedForms, Draws, EstimatorSpec, ExactLimit
from randattn.estimators.sparse.selection import budget_draws
from randattn.estimators.topk import batched, reference


def draw(q_shape: Sequence[int], k_shape: Sequence[int], *, num_samples: int, replicates: int = 1, rng: Any = None,
         mask: str | None = None) -> Draws:
    """``budget : (R, ...)`` holding S; no random variables (``rng`` and ``mask`` do not change the draws)."""
    reference.check_params(num_samples)
    return budget_draws(q_shape, num_samples, replicates)


SPEC = EstimatorSpec(
    name="topk",
    summary="oracle top-k attention: exact softmax over each query's S largest-logit visible keys",
    source="top-k attention (Gupta et al. 2021, arXiv 2106.06899); the oracle sparsity of Quest (Tang et al. "
           "2024, arXiv 2406.10774, fig. 3)",
    complexity="O(N M D + N M log M) to choose the keys; O(N M Dv) here (dense masked product; O(N S Dv) sparse)",
    params={},
    draw=draw,
    reference=reference.estimate,
    forms=BatchedForms(
        estimate=batched.estimate,
        probabilities=batched.probabilities,
        estimate_with_probabilities=batched.estimate_with_probabilities,
    ),
    needs_samples=True,
    is_random=lambda params: False,
    display_name="Top-k attention (oracle)",
    convergence="none",  # biased for S < M, exact at S >= M; no claim as S grows
    cost="quadratic",
    selection="discrete",
    normalized=True,
    masks=(None, "causal"),
    exact_limits=(ExactLimit("S >= M: every key is kept, top-k attention is softmax attention",
                             num_samples=lambda n, m: m),),
    keys_used=batched.keys_used,
    memory_hint="the N x M logits and their sort per batch element",
)
