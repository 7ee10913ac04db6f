r"""Local blocks ``E^n`` and chunk partitions ``P_1^n .. P_C^n`` of EVA, Scatterbrain and local attention.

One integer layout, computed from the shapes alone (numpy, no data), shared by the reference
and batched forms of ``eva``, ``scatterbrain`` and ``local`` so that they partition the keys
identically (EVA sec. 4.2 "Parameterization Details", app. C "Partitioning Strategy").

Layout (the choices the paper leaves open are marked *choice*):

- **Prefix tokens** (a ViT's CLS token; ``prefix_tokens = P``, default 0). The first
  ``P_k = min(P, M)`` keys are in every query's exact set ``E^n``. The first ``P_q = min(P, N)``
  queries ("prefix queries") have no local block: their ``E^n`` is the prefix keys alone and
  the rest of the keys are chunked for them like for any other query. *Choice*: the paper's
  vision models handle the CLS token outside the 2D windows; this keeps the CLS key exact
  for everyone and keeps the CLS query linear (it is estimated, not computed exactly).
- **Local blocks** (``window = W``). The remaining "body" keys ``P_k .. M-1`` are cut into
  contiguous blocks of exactly ``W`` keys, the last one shorter (*choice*: ceil-sized
  blocks, as "chunk the whole sequence into contiguous blocks of size K", app. C; a window
  larger than the sequence is one block, i.e. it is clipped). ``W = 0`` means no local
  blocks: ``E^n`` is the prefix keys only (the RFA end of EVA, app. G.1).
- **Query -> block** (*choice* for N != M). Body query ``i`` (``0 <= i < N_b = N - P_q``)
  sits at body-key position ``floor(i M_b / N_b)`` (``M_b = M - P_k``) and takes that key's
  block: the identity for self-attention (N = M), proportional position otherwise.
- **Chunks**. ``partition="paper"``: the keys outside ``E^n`` (the body keys outside the
  query's block), in index order, are split into ``min(C, |[M] \ E^n|)`` contiguous chunks
  whose sizes differ by at most one (``segments.segment_bounds``, the first ones longer).
  A chunk may straddle the block: it is contiguous in the complement. ``C`` larger than the
  complement degrades to single-key chunks. ``partition="reference-code"``: the official
  code's chunks of *all* body keys, the same for every query, so the query's own block is
  counted again inside the chunks (ARCHITECTURE sec. 10; prefix keys are never chunked).
- **Query landmarks** ``q~_c`` (EVA eq. 28) pool the queries at the chunk's key positions:
  body key ``m`` maps to body query ``P_q + floor((m - P_k) N_b / M_b)`` (the identity when
  N = M). When there are no body queries (all queries are prefix tokens) a chunk pools all
  queries.

**Grid layout** (``grid=(h, w)``, from ``layout="grid"`` and a known patch grid; EVA sec. 4.2 /
app. C: "the input sequence is first chunked into multiple blocks (or 2D windows for images)").
The tokens are ``P`` prefix tokens then the ``h x w`` patches in raster order (the convention of
:mod:`randattn.activations.io`), and ``N = M = P + h w`` (self-attention; anything else is a
ValueError naming ``grid``). Tiles are cut by :mod:`randattn.estimators.grid`:

- **Local windows**: ``s x s`` tiles of the patch grid with ``W = s^2`` (``window`` must be a
  perfect square: 49 = 7x7, the DeiT setting of EVA sec. 5.1); tiles start at the top-left and
  the last tile row/column is smaller when ``s`` does not divide ``h``/``w`` (*choice*: the
  official code asserts divisibility). Body query ``i`` is body key ``i``'s patch and takes its
  window. ``s >= max(h, w)`` is one window (clipped).
- **Chunks**: ``t x t`` tiles with the smallest ``t`` giving at most ``C`` tiles
  (:func:`randattn.estimators.grid.tile_side_for_count`; the official code's
  ``rf_win_size = int(sqrt(N / num_landmarks))`` in ``efficient_attention/eva.py`` of
  HKUNLP/efficient-attention, which gives the same ``t`` on divisible grids, e.g. 2x2 chunks for
  C = 49 on 14x14). ``partition="paper"``: the chunks of a query are the tiles minus its own
  window (tiles left empty are dropped, so ``C_g <= C``; *choice*: a 2-D complement cannot be
  re-split into equal contiguous pieces); ``"reference-code"``: the tiles of all patches, as the
  official code.
- **Prefix tokens**: as in 1-D (exact for every query; prefix queries have no window and are
  estimated from the chunks). *Choice*: the official vision models have no CLS token
  (``vit/models/efficient_vit.py`` comments it out and mean-pools), so the paper states none.

Queries that share their chunks form a :class:`ChunkGroup` (one per block for the paper's
partition, a single group for ``reference-code``): the per-chunk coefficients and proposals
are computed once per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from randattn._validation import check_choice, check_positive_int
from randattn.estimators.grid import parse_grid, tile_of_tokens, tile_side_for_count, tiles, window_side
from randattn.estimators.segments import segment_bounds

__all__ = [
    "PARTITIONS", "ChunkGroup", "Partition", "PaddedPartition", "eva_partition", "padded_partition",
    "check_layout_params", "pad_index_lists",
]

#: ``paper``: chunks of [M] \ E^n (disjoint from the exact set); ``reference-code``: chunks of all body keys
PARTITIONS = ("paper", "reference-code")


def check_layout_params(window: int, prefix_tokens: int) -> tuple[int, int]:
    """``window >= 0`` and ``prefix_tokens >= 0`` as ints; ValueError/TypeError naming the argument."""
    return check_positive_int("window", window, minimum=0), check_positive_int("prefix_tokens", prefix_tokens, minimum=0)


@dataclass(frozen=True)
class ChunkGroup:
    """Queries that share one chunk partition of the keys.

    Attributes
    ----------
    queries : (n_g,) int array
        Query indices of the group, increasing.
    chunks : tuple of int arrays
        Key indices of each chunk ``P_c``, increasing; ``C_g = len(chunks)`` may be 0.
    chunk_queries : tuple of int arrays
        Query indices pooled into the landmark ``q~_c`` of each chunk.
    """

    queries: np.ndarray
    chunks: tuple[np.ndarray, ...]
    chunk_queries: tuple[np.ndarray, ...]


@dataclass(frozen=True, eq=False)  # identity hash: cached per shape, arrays are not hashable
class Partition:
    """The exact sets and chunk partitions of all queries; see the module docstring.

    Attributes
    ----------
    num_queries, num_keys : int
        N and M.
    window, prefix_tokens : int
        W and P as requested.
    block_of_query : (N,) int array
        Local block of each query, -1 for prefix queries and for ``window=0``.
    exact_keys : tuple of N int arrays
        ``E^n``: prefix keys then the query's block, increasing.
    groups : tuple of ChunkGroup
        Every query is in exactly one group.
    grid : (h, w) or None
        The patch grid of a ``layout="grid"`` partition, None for 1-D blocks.
    """

    num_queries: int
    num_keys: int
    window: int
    prefix_tokens: int
    block_of_query: np.ndarray
    exact_keys: tuple[np.ndarray, ...]
    groups: tuple[ChunkGroup, ...]
    grid: tuple[int, int] | None = None

    @property
    def max_chunks(self) -> int:
        """The largest number of chunks of any group (0 when every key is exact for every query)."""
        return max((len(g.chunks) for g in self.groups), default=0)

    def blocks(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(queries, E)`` for each distinct exact set, queries increasing."""
        out = []
        for block in np.unique(self.block_of_query):
            queries = np.flatnonzero(self.block_of_query == block)
            out.append((queries, self.exact_keys[queries[0]]))
        return out


def pad_index_lists(lists: tuple[np.ndarray, ...] | list[np.ndarray], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(index, mask)`` of shape ``(len(lists), width)``: the lists left-aligned, padded with index 0.

    Padding points at a valid index (0) so that gathers stay finite; ``mask`` is False there
    and callers give padded entries a log-weight of ``-inf``.
    """
    width = max((len(a) for a in lists), default=0) if width is None else width
    index = np.zeros((len(lists), width), dtype=np.int64)
    mask = np.zeros((len(lists), width), dtype=bool)
    for row, a in enumerate(lists):
        index[row, : len(a)] = a
        mask[row, : len(a)] = True
    return index, mask


def _split(keys: np.ndarray, num_chunks: int) -> tuple[np.ndarray, ...]:
    if len(keys) == 0:
        return ()
    bounds = segment_bounds(len(keys), num_chunks)
    return tuple(keys[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:]))


def _check_grid_shapes(num_queries: int, num_keys: int, prefix_tokens: int, grid: tuple[int, int]) -> None:
    h, w = grid
    if num_queries != num_keys or num_keys != prefix_tokens + h * w:
        raise ValueError(
            f"grid={h}x{w} with prefix_tokens={prefix_tokens} needs {prefix_tokens + h * w} query and key tokens "
            f"(prefix + rows*columns), got N={num_queries} queries and M={num_keys} keys; pass the grid and prefix "
            "of these activations, or layout='sequence'"
        )


def eva_partition(
    num_queries: int,
    num_keys: int,
    *,
    window: int,
    prefix_tokens: int = 0,
    num_chunks: int = 1,
    partition: str = "paper",
    grid: tuple[int, int] | str | None = None,
) -> Partition:
    r"""The exact sets ``E^n`` and chunks ``P_c^n`` of every query (EVA sec. 4.2, app. C).

    Parameters
    ----------
    num_queries, num_keys : int
        N and M (>= 1).
    window : int
        W >= 0, the local block size in tokens; 0 = no local blocks. With a ``grid`` the
        blocks are ``s x s`` windows, ``W = s^2`` (a perfect square, 49 = 7x7).
    prefix_tokens : int
        P >= 0 keys exact for every query (CLS); the first P queries have no local block.
    num_chunks : int
        C >= 1 requested chunks (fewer when fewer keys remain).
    partition : {"paper", "reference-code"}
    grid : (h, w) or None
        The patch grid of the body tokens (``M = N = P + h w``, raster order); None = 1-D.

    Returns
    -------
    Partition
        Cached by its arguments: treat its arrays as read-only.

    Notes
    -----
    With ``partition="paper"``, for every query :math:`E^n \cap P^n_c = \emptyset` and
    :math:`E^n \cup \bigcup_c P^n_c = [M]` (EVA sec. 4.1). With ``"reference-code"`` the
    chunks cover all non-prefix keys and overlap :math:`E^n` on the query's block.

    Examples
    --------
    >>> p = eva_partition(6, 6, window=2, num_chunks=2)
    >>> p.exact_keys[3].tolist(), [c.tolist() for c in p.groups[1].chunks]
    ([2, 3], [[0, 1], [4, 5]])
    >>> g = eva_partition(16, 16, window=4, num_chunks=4, grid=(4, 4))
    >>> g.exact_keys[5].tolist(), [c.tolist() for c in g.groups[0].chunks]
    ([0, 1, 4, 5], [[2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]])
    """
    num_queries = check_positive_int("num_queries", num_queries)
    num_keys = check_positive_int("num_keys", num_keys)
    window, prefix_tokens = check_layout_params(window, prefix_tokens)
    num_chunks = check_positive_int("num_chunks", num_chunks)
    check_choice("partition", partition, PARTITIONS)
    grid = parse_grid(grid)
    if grid is not None:
        _check_grid_shapes(num_queries, num_keys, prefix_tokens, grid)
    return _eva_partition(num_queries, num_keys, window, prefix_tokens, num_chunks, partition, grid)


@lru_cache(maxsize=64)
def _eva_partition(
    num_queries: int, num_keys: int, window: int, prefix_tokens: int, num_chunks: int, partition: str, grid: tuple[int, int] | None
) -> Partition:
    """:func:`eva_partition` on validated arguments, cached (the layout depends on shapes only)."""

    pq, pk = min(prefix_tokens, num_queries), min(prefix_tokens, num_keys)
    nb, mb = num_queries - pq, num_keys - pk
    prefix_keys = np.arange(pk)
    body_keys = np.arange(pk, num_keys)

    # body key -> local block (1-D: contiguous runs of W keys; grid: s x s tiles); query -> block
    block_of_query = np.full(num_queries, -1, dtype=np.int64)
    block_of_body_key = np.full(mb, -1, dtype=np.int64)
    if window > 0 and mb > 0:
        if grid is None:
            block_of_body_key = np.arange(mb) // window
            if nb > 0:
                block_of_query[pq:] = ((np.arange(nb) * mb) // nb) // window  # proportional position
        else:
            block_of_body_key = tile_of_tokens(grid, window_side(window))
            block_of_query[pq:] = block_of_body_key  # N = M: body query i is body key i
    order = np.argsort(block_of_body_key, kind="stable")
    split = np.split(pk + order, np.cumsum(np.bincount(block_of_body_key + 1))[:-1]) if mb else []
    keys_of_block = {b - 1: keys for b, keys in enumerate(split)}  # key -1 = no block

    def block_keys(block: int) -> np.ndarray:
        return keys_of_block.get(block, np.arange(0)) if block >= 0 else np.arange(0)

    exact_cache = {b: np.concatenate([prefix_keys, block_keys(b)]) for b in np.unique(block_of_query).tolist()}
    exact_keys = tuple(exact_cache[b] for b in block_of_query.tolist())

    # body key -> the query at the same (proportional) position, for the landmarks q~_c
    if nb > 0 and mb > 0:
        key_source = np.full(num_keys, -1, dtype=np.int64)
        key_source[pk:] = pq + ((np.arange(mb) * nb) // mb)
    else:
        key_source = None

    def sources(chunk: np.ndarray) -> np.ndarray:
        return key_source[chunk] if key_source is not None else np.arange(num_queries)

    if grid is None:
        def chunks_of(keys: np.ndarray) -> tuple[np.ndarray, ...]:
            return _split(keys, num_chunks)
    else:
        # 2-D chunks: t x t tiles of the grid (at most C of them), minus the keys not given
        base = [pk + t for t in tiles(grid, tile_side_for_count(grid, num_chunks))]

        def chunks_of(keys: np.ndarray) -> tuple[np.ndarray, ...]:
            kept = [c[np.isin(c, keys, assume_unique=True)] for c in base]
            return tuple(c for c in kept if len(c))

    groups = []
    if partition == "reference-code":
        chunks = chunks_of(body_keys)
        groups.append(ChunkGroup(np.arange(num_queries), chunks, tuple(sources(c) for c in chunks)))
    else:
        for block in np.unique(block_of_query).tolist():
            queries = np.flatnonzero(block_of_query == block)
            own = block_keys(block)
            remaining = np.setdiff1d(body_keys, own, assume_unique=True)
            chunks = chunks_of(remaining)
            groups.append(ChunkGroup(queries, chunks, tuple(sources(c) for c in chunks)))
    return Partition(num_queries, num_keys, window, prefix_tokens, block_of_query, exact_keys, tuple(groups), grid)


@dataclass(frozen=True)
class PaddedPartition:
    """A :class:`Partition` as padded integer arrays, for vectorized (torch) evaluation.

    Blocks are the distinct exact sets (queries sharing ``E^n``); every block belongs to one
    chunk group. Padding points at index 0 and is False in the masks.

    Attributes
    ----------
    block_queries, block_query_mask : (B, Q)
        The queries of each block.
    block_keys, block_key_mask : (B, E)
        The exact set ``E^n`` of each block.
    group_of_block : (B,)
        The chunk group of each block (all 0 for ``reference-code``; ``arange(B)`` for ``paper``).
    chunk_keys, chunk_key_mask : (G, C, L)
        The keys of each group's chunks (groups with fewer chunks are padded with empty ones).
    chunk_sources, chunk_source_mask : (G, C, L_q)
        The queries pooled into each chunk's landmark ``q~_c``.
    query_slot : (N,)
        Position of each query in the flattened ``(B * Q)`` block layout.
    """

    block_queries: np.ndarray
    block_query_mask: np.ndarray
    block_keys: np.ndarray
    block_key_mask: np.ndarray
    group_of_block: np.ndarray
    chunk_keys: np.ndarray
    chunk_key_mask: np.ndarray
    chunk_sources: np.ndarray
    chunk_source_mask: np.ndarray
    query_slot: np.ndarray


def padded_partition(
    num_queries: int,
    num_keys: int,
    *,
    window: int,
    prefix_tokens: int = 0,
    num_chunks: int = 1,
    partition: str = "paper",
    grid: tuple[int, int] | str | None = None,
) -> PaddedPartition:
    """:func:`eva_partition` (same arguments) as padded arrays; cached, treat as read-only."""
    layout = eva_partition(
        num_queries, num_keys, window=window, prefix_tokens=prefix_tokens, num_chunks=num_chunks, partition=partition, grid=grid
    )
    return _padded(layout)


@lru_cache(maxsize=64)
def _padded(layout: Partition) -> PaddedPartition:
    num_queries = layout.num_queries
    blocks = layout.blocks()
    bq, bq_mask = pad_index_lists([q for q, _ in blocks])
    bk, bk_mask = pad_index_lists([e for _, e in blocks])
    group_of_query = np.empty(num_queries, dtype=np.int64)
    for g, group in enumerate(layout.groups):
        group_of_query[group.queries] = g
    group_of_block = group_of_query[bq[:, 0]]
    c_max = max(layout.max_chunks, 1)
    l_max = max((len(c) for g in layout.groups for c in g.chunks), default=1)
    s_max = max((len(c) for g in layout.groups for c in g.chunk_queries), default=1)
    ck = np.zeros((len(layout.groups), c_max, l_max), dtype=np.int64)
    ck_mask = np.zeros(ck.shape, dtype=bool)
    cs = np.zeros((len(layout.groups), c_max, s_max), dtype=np.int64)
    cs_mask = np.zeros(cs.shape, dtype=bool)
    for g, group in enumerate(layout.groups):
        n = len(group.chunks)
        if n:
            ck[g, :n], ck_mask[g, :n] = pad_index_lists(group.chunks, l_max)
            cs[g, :n], cs_mask[g, :n] = pad_index_lists(group.chunk_queries, s_max)
    query_slot = np.empty(num_queries, dtype=np.int64)
    rows, cols = np.nonzero(bq_mask)
    query_slot[bq[rows, cols]] = rows * bq.shape[1] + cols
    return PaddedPartition(bq, bq_mask, bk, bk_mask, group_of_block, ck, ck_mask, cs, cs_mask, query_slot)
