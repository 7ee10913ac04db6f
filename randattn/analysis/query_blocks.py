r"""Every query of a long layer, a block of queries at a time: estimators that form a K x M array at 8k-128k tokens.

The selection estimators (top-k, StreamingLLM, Quest, MagicPIG, vAttention), RA and softmax itself score every
key for every query: one head and replicate of a 32,768-token layer holds K x M = 2^30 scores per array, 8 GiB in
float64, several times over. A unit whose measured queries and keys exceed :data:`QUERY_BLOCKED_ABOVE` pairs is
therefore estimated a block of :func:`query_block_rows` queries at a time, each block given the keys it can see:

- **under a mask** (causal, ``sliding:W``) the measured queries are the last K of the M tokens (key m visible to
  row i iff :math:`m \le i + M - K`), so the rows :math:`[a, b)` see no key after :math:`b + M - K`. The block is
  called with ``q[..., a:b, :]`` and ``k, v[..., :b + M - K, :]``: the mask's convention puts its queries at their own
  tokens again (row :math:`i - a` of :math:`b - a` queries over :math:`b + M - K` keys is token :math:`i + M - K`),
  the keys keep their positions from the first (sinks stay the sequence's first tokens), and a window is where it
  was. The last block holds ``rows x M`` scores, never ``K x M``.
- **without a mask**, every block is given every key.

Each block draws its own random variables (:func:`randattn.analysis.plan.replicate_rng` with the block's index),
so a query's estimate is a draw of the same distribution as in one call over every query, for an estimator whose
estimate of query n depends on :math:`q_n`, its position, the keys it sees, the values and the draws alone: its
``query_placement`` is ``independent``, or ``last-n-of-m`` under a mask (a window ending at the query's own token,
which the cut keeps). What differs is only how queries share draws (MagicPIG's hyperplanes are shared within a
block, independent between blocks), which no per-query metric sees. A ``proportional`` placement (LARA's, EVA's
and Scatterbrain's landmarks pool the queries present) would be another estimator in blocks, and a ``linear`` cost
forms no K x M array (causal RFA would sum its prefixes again for every block): both run whole, as before.

Whether and how a unit is blocked depends on its shape, mask and configuration alone, never on the memory budget,
so a table's rows are the same whatever ``--max-memory``; a unit of at most :data:`QUERY_BLOCKED_ABOVE` query-key
pairs (every query of 8,192 tokens) runs in one call.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from randattn.estimators.masks import Mask

__all__ = ["QUERY_BLOCKED_ABOVE", "QUERY_BLOCK_PAIRS", "QUERY_BLOCKS_TIMED", "QueryBlock", "blocks_queries",
           "largest_first", "query_block_rows", "query_blocks", "timed_block_indices"]

#: a unit is estimated in query blocks where its measured queries times keys exceed this (8,192 x 8,192: one
#: float64 K x M array is 512 MiB). At or below it a unit runs in one call, as the tables of shorter contexts were made
QUERY_BLOCKED_ABOVE = 2**26
#: the query-key pairs of a block's widest call (its last, which sees every key): 1,024 queries at 32,768 keys,
#: 256 at 131,072; one float64 array of them is 256 MiB
QUERY_BLOCK_PAIRS = 2**25


#: the query blocks of a unit that the dry run computes to time it (evenly spaced, :func:`timed_block_indices`):
#: 4 of the 32 of every query of 32,768 tokens
QUERY_BLOCKS_TIMED = 4


class QueryBlock(NamedTuple):
    """One block of a unit's measured queries: ``rows`` of the K, given the first ``keys`` keys; ``index`` names
    its draws' stream (:func:`randattn.analysis.plan.replicate_rng`)."""

    index: int
    rows: slice
    keys: int


def query_block_rows(keys: int) -> int:
    """Queries per block for a unit of ``keys`` keys: :data:`QUERY_BLOCK_PAIRS` over M, at least 1."""
    return max(1, QUERY_BLOCK_PAIRS // int(keys))


def blocks_queries(spec: Any, params: Mapping[str, Any], mask: Mask, queries: int, keys: int) -> bool:
    """Whether a unit of ``queries`` measured rows and ``keys`` keys of this configuration is estimated in query
    blocks (module docstring): above :data:`QUERY_BLOCKED_ABOVE` pairs, more rows than one block, a ``quadratic``
    cost, and a placement that blocks keep (``independent``; ``last-n-of-m`` under a mask)."""
    if queries * keys <= QUERY_BLOCKED_ABOVE or queries <= query_block_rows(keys):
        return False
    if spec.cost_of(params) != "quadratic":
        return False
    placement = spec.query_placement_of(params)
    return placement == "independent" or (placement == "last-n-of-m" and mask.masked)


def query_blocks(queries: int, keys: int, mask: Mask) -> list[QueryBlock]:
    """The blocks of ``queries`` measured rows (the last of ``keys`` tokens under a mask) in order: rows of
    :func:`query_block_rows` each (the last may have fewer), each with the keys its rows can see (every key without
    a mask)."""
    step = query_block_rows(keys)
    blocks = []
    for index, start in enumerate(range(0, queries, step)):
        stop = min(start + step, queries)
        blocks.append(QueryBlock(index, slice(start, stop), stop + keys - queries if mask.masked else keys))
    return blocks


def largest_first(blocks: list[QueryBlock]) -> list[int]:
    """The order in which a unit computes its query blocks: indices of ``blocks``, the most query-key pairs first
    (ties in their order).

    Under a mask the blocks' keys grow with their index. A computing process keeps freed memory in its heap
    (:func:`randattn._process.retain_freed_memory`), where a block's arrays fit in the pages that a larger block
    freed but not in a smaller one's: computed first to last, each block grew the heap past the last, and every
    query of a 32,768-token window head (vAttention, R = 4) held 9.0 GiB for a widest block of 5.1 GiB. Widest
    first, later blocks reuse its pages. The results do not depend on the order: each block has its own draws
    and rows, and what is summed over the blocks is summed in index order.
    """
    return sorted(range(len(blocks)), key=lambda i: -(blocks[i].rows.stop - blocks[i].rows.start) * blocks[i].keys)


def timed_block_indices(blocks: int, timed: int) -> list[int]:
    """``timed`` indices of ``blocks`` query blocks, evenly spaced from the first to the last (all where there are
    no more): under a mask a block's keys, and so its cost, grow linearly with its index, and the mean cost of
    evenly spaced blocks from first to last is the mean of all of them."""
    if timed >= blocks:
        return list(range(blocks))
    if timed < 2:
        return [blocks - 1]  # the widest block: an upper bound
    return sorted({round(i * (blocks - 1) / (timed - 1)) for i in range(timed)})
