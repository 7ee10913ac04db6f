"""Oracle top-k attention: each query attends exactly to the S visible keys with the largest logits.

The ideal that the decode-time sparse estimators (Quest, MagicPIG, vAttention; ARCHITECTURE sec. 14) approximate:
it reads every logit to choose, so it saves nothing, but it shows the error of the best S keys.

Budget: **S = keys kept per query** (``num_samples``); a query that sees fewer than S keys keeps all of them, so
``keys_used = min(S, visible keys)``. Ties between equal logits go to the lower key index (a stable sort of the
negated logits, in both forms). Equal means equal as computed: a logit is the product of ``q sqrt(scale)`` and
``k sqrt(scale)``, which rounds, and numpy and torch sum it in different orders, so logits equal in exact
arithmetic (integer-valued test inputs, say) may differ in their last bit and be ordered differently by the two
forms, whose outputs then differ by that choice; inputs whose products are exact (``scale=1``, or ``scale=1/4``
with small integers) keep such ties, and the forms agree. Under a mask the S keys are chosen among the visible keys
only: ``m <= n + M - N`` under ``mask="causal"``, the last W of those under ``mask="sliding:W"`` (a sliding-window
layer), so that ``keys_used = min(S, W)`` once W keys precede the query. Deterministic: the draws carry S alone.
"""

from __future__ import annotations

from randattn.estimators.base import ExactLimit
from randattn.estimators.sparse.selection import budget_draw, kept_keys_spec
from randattn.estimators.topk import batched, reference
from randattn.estimators.topk.reference import TopkOptions

#: ``budget : (R, ...)`` holding S; no random variables (``rng`` and ``mask`` do not change the draws)
draw = budget_draw(TopkOptions)

SPEC = kept_keys_spec(
    name="topk",
    summary="oracle top-k attention: exact softmax over each query's S largest-logit visible keys",
    source="top-k attention (Gupta et al. 2021, arXiv 2106.06899); the oracle sparsity of Quest (Tang et al. "
           "2024, arXiv 2406.10774, fig. 3)",
    complexity="O(N M D + N M log M) to choose the keys; O(N M Dv) here (dense masked product; O(N S Dv) sparse)",
    options_type=TopkOptions,
    draw=draw,
    reference=reference,
    batched=batched,
    display_name="Top-k attention (oracle)",
    selection="discrete",
    exact_limits=(ExactLimit("S >= M: every key is kept, top-k attention is softmax attention",
                             num_samples=lambda n, m: m),),
    memory_hint="the N x M logits and their sort per batch element",
)
