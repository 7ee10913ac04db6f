"""StreamingLLM: attention sinks plus a rolling window of recent keys (Xiao et al. 2023, arXiv 2309.17453).

Each query attends exactly to the first ``sinks`` keys (the attention sinks; 4 in the paper) and to the most recent
keys up to its own (sec. 3.2, fig. 4); the rule, including queries that precede S keys, is in
:mod:`randattn.estimators.streaming.reference`.

Budget: **S = sinks + window** (``num_samples``): the window counts the query's own key, so every query keeps
``min(S, visible keys)`` keys. S must be >= ``sinks`` (S = sinks leaves the sinks alone, window 0). The official
code (mit-han-lab/streaming-llm, ``StartRecentKVCache``) evicts the cache to ``start_size + recent_size`` tokens after
each step and then appends the new token, so it reads S = ``start_size + recent_size + 1`` keys: the same keys.
Under ``mask="causal"`` "recent" means the window ending at the query's last visible key ``n + M - N``; without a
mask the window ends at the same key (the query is token ``n + M - N`` of the cache), so for N <= M the masks differ
only in the sinks and first-S keys a query sees after its own position. Under ``mask="sliding:W"`` the sinks are
still the sequence's first tokens: a query whose window has passed them reads its recent keys alone (the reference
module's docstring), so ``keys_used`` falls to ``min(S - sinks, W)`` there.

Not modelled: StreamingLLM assigns positions within the cache (rolling position ids, sec. 3.2) before RoPE; the
captured q and k here are post-RoPE at their original positions. The keys are chosen by position alone
(``selection="continuous"``: float32 cannot choose other keys).
"""

from __future__ import annotations

from randattn.estimators.base import ExactLimit
from randattn.estimators.sparse.selection import budget_draw, kept_keys_spec
from randattn.estimators.streaming import batched, reference
from randattn.estimators.streaming.reference import StreamingOptions

#: StreamingLLM's parameters, declared once as the fields of :class:`~.reference.StreamingOptions`
PARAMS = StreamingOptions.params()

#: ``budget : (R, ...)`` holding S after checking ``S >= sinks``; no random variables
draw = budget_draw(StreamingOptions)

SPEC = kept_keys_spec(
    name="streaming",
    summary="StreamingLLM: exact softmax over the attention-sink keys and a window of recent keys (S = sinks + window)",
    source="Xiao et al. 2023, Efficient Streaming Language Models with Attention Sinks, arXiv 2309.17453, sec. 3.2, "
           "fig. 4; mit-han-lab/streaming-llm (StartRecentKVCache)",
    complexity="O(N M D) for the logits here (dense masked product; O(N S (D + Dv)) sparse)",
    options_type=StreamingOptions,
    draw=draw,
    reference=reference,
    batched=batched,
    variants={"default": {}, "one-sink": {"sinks": 1}, "window-only": {"sinks": 0}},
    display_name="StreamingLLM",
    selection="continuous",  # the keys are chosen by position alone
    exact_limits=(ExactLimit("S >= M: the sinks and the window hold every key, StreamingLLM is softmax attention",
                             num_samples=lambda n, m: m),),
    memory_hint="the N x M logits per batch element (dense, masked to the sinks and window)",
    query_placement="last-n-of-m",
)
