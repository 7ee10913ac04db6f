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

**Causal mask** (``mask="causal"``; EVA sec. 4 "Extension to autoregressive modeling", app. D,
Algorithm 2; ARCHITECTURE sec. 12). Key ``m`` is visible to query ``n`` iff
``m <= t_n = n + (M - N)`` (:mod:`randattn.estimators.masks`): query ``n`` *is* token ``t_n``,
so under the mask the query -> block map is the token alignment, not the proportional position
above (the two agree for N = M). The partition stays disjoint (eq. 11-13 need
:math:`E^n \cap P^n_c = \emptyset`) and covers exactly the visible keys:

- ``E^n`` = the visible prefix keys plus the visible keys of the block holding key ``t_n``:
  Algorithm 2's ``K x K`` lower-triangular mask :math:`M^E` inside the block. A query whose token
  is a prefix token (``t_n < P``) has no block and sees prefix keys ``0..t_n`` only.
- The chunks ``P^n_c`` split the visible keys *outside* ``E^n``, i.e. the body keys strictly
  before the block's first key :math:`b^n` (Algorithm 2's shift), ``[P, b^n)``, into
  ``min(C, b^n - P)`` contiguous chunks with sizes differing by at most one (the same split as
  the bidirectional complement, sec. 4.2 "evenly split [M] \ E^n into C contiguous chunks").
  Every chunk therefore lies *wholly before* ``E^n``: Algorithm 2's ``C x C`` mask
  :math:`M^P_{c,t} = 1_{c \le t}` keeps all of them (``t = C``). ``window=0`` (no block):
  the chunks split the visible body keys ``[P, t_n]``, so every query is its own group.
- *Choice*, against a single fixed chunk grid for all queries (Algorithm 2 computes the chunks
  once): with blocks of W keys and C chunks of the sequence, a fixed grid does not align with the
  block starts, and masking whole chunks would drop the visible keys of a chunk that straddles
  ``b^n`` (neither exact nor estimated). Re-chunking each block's past keeps every visible key
  exactly once and, for N = M, gives the last block exactly its bidirectional partition (its
  complement is its past). The cost is that of the bidirectional paper partition (one chunk
  group per block); with ``window=0`` one group per query.
- Query landmarks ``q~_c`` (eq. 28) pool the queries the bidirectional map assigns to the chunk's
  keys, each index capped at the group's first query, so that no query's proposal pools a later
  query (the official causal code drops the query's own chunk for the same reason,
  ``efficient_attention/causal_eva.py``: ``rf_q_bar`` "requires the future information"). For
  N = M the map is the identity and the cap never binds.
- ``partition="reference-code"`` is refused under the mask: App. D's chunk mask rests on the
  chunks being disjoint from ``E^n`` ("since any P_c^n and E^n are disjoint, we only need to
  mask all subsets P_c^n that appear after E^n"), which the code's chunks of all keys are not,
  and the paper states no causal rule for them. (The official ``causal_eva.py`` cuts fixed
  chunks aligned to its windows and lets query n see the chunks strictly before the one holding
  n, ``triu(0)``, so the window's earlier chunks count twice; that rule is the code's, not the
  paper's, and is not offered.) Grid layouts are refused too: a 2-D window has no causal meaning.
- Queries sharing their block and their chunks form one *cell* (:attr:`Partition.cell_of_query`);
  :meth:`Partition.blocks` lists cells with the union of their exact sets, and each consumer
  masks the keys after ``t_n`` (:attr:`Partition.last_visible`, :attr:`PaddedPartition.exact_visible`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

import numpy as np

from randattn._callers import outside_stacklevel
from randattn._validation import check_choice, check_positive_int
from randattn.estimators.base import MASKS, EstimatorOptions, ExactLimit, option
from randattn.estimators.grid import (LAYOUTS, TokenLayout, parse_grid, resolve_grid, tile_of_tokens, tile_side_for_count,
                                      tiles, window_side)
from randattn.estimators.masks import last_visible_key
from randattn.estimators.segments import segment_bounds

__all__ = [
    "PARTITIONS", "ChunkGroup", "Partition", "PaddedPartition", "eva_partition",
    "padded_partition",
    "check_layout_params", "check_mask_layout", "pad_index_lists", "LayoutOptions", "BLOCK_LAYOUT_VARIANTS",
]

#: ``paper``: chunks of [M] \ E^n (disjoint from the exact set); ``reference-code``: chunks of all body keys
PARTITIONS = ("paper", "reference-code")


def check_layout_params(window: int, prefix_tokens: int) -> tuple[int, int]:
    """``window >= 0`` and ``prefix_tokens >= 0`` as ints; ValueError/TypeError naming the argument."""
    return check_positive_int("window", window, minimum=0), check_positive_int("prefix_tokens", prefix_tokens, minimum=0)


@dataclass(frozen=True, kw_only=True)
class LayoutOptions(EstimatorOptions):
    """The layout options of the windowed estimators (EVA, Scatterbrain, local attention), declared once.

    Each family's options extend these (their own parameters, then ``mask``). Construction checks
    ``window`` and ``prefix_tokens`` (:func:`check_layout_params`), ``layout`` and ``grid``
    (:func:`~randattn.estimators.grid.resolve_grid`) and, on a grid, that ``window`` is a square
    (:func:`~randattn.estimators.grid.window_side`).
    """

    window: int = option(
        49,
        "local block size W >= 0 in tokens (clipped; 0 = no local block); with layout=grid and a grid, s x s windows, "
        "W = s^2 (49 = 7x7, EVA's DeiT window)",
        kind=int,
    )
    prefix_tokens: int = option(
        0, "leading keys exact for every query (1 = a ViT's CLS token); prefix queries attend exactly to them only",
        kind=int,
    )
    layout: str = option(
        "grid", "grid: 2-D windows (and EVA's 2-D chunks) on the patch grid when one is given; sequence: 1-D blocks",
        choices=LAYOUTS,
    )
    grid: Any = option(None, "patch grid 'HxW' (rows x columns) of the tokens after the prefix; None = unknown (1-D blocks)")

    def check(self) -> None:
        window, _ = check_layout_params(self.window, self.prefix_tokens)
        if self.resolved_grid is not None and window > 0:
            window_side(window)

    @property
    def token_layout(self) -> TokenLayout:
        """``layout``, ``grid``, ``prefix_tokens`` as one :class:`~randattn.estimators.grid.TokenLayout` (as LARA's)."""
        return TokenLayout(self.layout, self.grid, self.prefix_tokens)

    @property
    def resolved_grid(self) -> tuple[int, int] | None:
        """The grid in force (:attr:`~randattn.estimators.grid.TokenLayout.patch_grid`): ``(h, w)``, or None for
        1-D blocks."""
        return self.token_layout.patch_grid


def layout_masks(params: Mapping[str, Any]) -> tuple[str | None, ...]:
    """The masks a windowed estimator's configuration supports (an ``EstimatorSpec.masks`` function).

    Causal on a 1-D layout, and for EVA with the paper's disjoint partition (``params`` without a
    ``partition`` -- local attention, Scatterbrain -- have no other); :func:`check_mask_layout` says why not.
    """
    return (None, "causal") if layout_mask_note(params) is None else (None,)


def layout_mask_note(params: Mapping[str, Any]) -> str | None:
    """Why this configuration has no causal form (:func:`check_mask_layout`'s own words), or None when it has one."""
    try:
        check_mask_layout("causal", grid=resolve_grid(params.get("layout", "grid"), params.get("grid")),
                          partition=params.get("partition", "paper"))
    except ValueError as exc:
        return str(exc)
    return None


#: The layouts every family on EVA's block layout is checked on (its ``variants`` start from these): the default
#: window, several blocks, a prefix (CLS) token, a patch grid with a prefix, the default 7x7 window on an 8x8 grid.
BLOCK_LAYOUT_VARIANTS: Mapping[str, Mapping[str, Any]] = {
    "default": {},
    "window-4": {"window": 4},
    "cls": {"window": 4, "prefix_tokens": 1},
    "grid-3x4-cls": {"window": 4, "prefix_tokens": 1, "grid": "3x4"},
    "grid-8x8-7x7-window": {"grid": "8x8"},
}


def block_layout_facts(limit: str, **limit_params: Any) -> dict[str, Any]:
    """The spec facts of an estimator on EVA's block layout (EVA, Scatterbrain, local attention), said once.

    The masks its layout supports (:func:`layout_masks`, with :func:`layout_mask_note` saying why not), its queries
    placed in proportion over the keys, and its exact limit: a window holding every key (on 1-D blocks, no prefix
    tokens; ``limit_params`` add the family's own conditions), described by ``limit``.
    """
    def params(n: int, m: int) -> dict[str, Any]:
        return {"window": max(n, m), "layout": "sequence", "prefix_tokens": 0, **limit_params}

    return {"masks": layout_masks, "mask_notes": {"causal": layout_mask_note}, "query_placement": "proportional",
            "exact_limits": (ExactLimit(limit, params=params),)}


def check_mask_layout(mask: str | None, *, grid: tuple[int, int] | None, partition: str = "paper") -> str | None:
    """``mask`` if the layout has a form under it; ValueError naming the argument that rules it out.

    Parameters
    ----------
    mask : {None, "causal"}
    grid : (h, w) or None
        The resolved patch grid (``resolve_grid(layout, grid)``): a 2-D window has no causal meaning.
    partition : {"paper", "reference-code"}
        The code's chunks of all keys have no causal rule in the paper (module docstring).
    """
    check_choice("mask", mask, MASKS)
    if mask is None:
        return None
    if grid is not None:
        raise ValueError(
            f"mask='causal' is not supported with layout='grid' and grid={grid[0]}x{grid[1]}: a 2-D window has no "
            "causal meaning (its keys are not ordered before and after the query); use layout='sequence'"
        )
    if partition == "reference-code":
        raise ValueError(
            "mask='causal' is not supported with partition='reference-code': the paper's causal EVA (app. D, "
            "Algorithm 2) masks whole chunks because they are disjoint from the exact set E^n, but the code's "
            "chunks hold every key, the local window's included, and the paper states no causal rule for them; "
            "use partition='paper'"
        )
    return mask


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
    mask : {None, "causal"}
        Under ``"causal"``, ``exact_keys[n]`` holds the visible keys of ``E^n`` only and every
        chunk lies wholly before ``E^n`` (module docstring).
    cell_of_query : (N,) int array or None
        Causal only: the cell of each query (queries sharing their block and their chunk group,
        numbered in query order); None: the cells are the blocks.
    """

    num_queries: int
    num_keys: int
    window: int
    prefix_tokens: int
    block_of_query: np.ndarray
    exact_keys: tuple[np.ndarray, ...]
    groups: tuple[ChunkGroup, ...]
    grid: tuple[int, int] | None = None
    mask: str | None = None
    cell_of_query: np.ndarray | None = None

    @property
    def max_chunks(self) -> int:
        """The largest number of chunks of any group (0 when every key is exact for every query)."""
        return max((len(g.chunks) for g in self.groups), default=0)

    @property
    def last_visible(self) -> np.ndarray | None:
        """``(N,)`` the last key each query may see, ``t_n = n + M - N``, under the causal mask; None without one."""
        return None if self.mask is None else last_visible_key(self.num_queries, self.num_keys)

    def blocks(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(queries, E)`` for each distinct exact set, queries increasing.

        Causal: for each cell, ``E`` is the union of its queries' exact sets (that of its last
        query: the sets of one block are nested); query ``n`` may use only ``E``'s keys ``<= t_n``.
        """
        if self.cell_of_query is None:
            out = []
            for block in np.unique(self.block_of_query):
                queries = np.flatnonzero(self.block_of_query == block)
                out.append((queries, self.exact_keys[queries[0]]))
            return out
        return [(queries, self.exact_keys[queries[-1]])
                for queries in np.split(np.arange(self.num_queries), np.flatnonzero(np.diff(self.cell_of_query)) + 1)]


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
    mask: str | None = None,
    chunks: bool = True,
) -> Partition:
    r"""The exact sets ``E^n`` and chunks ``P_c^n`` of every query (EVA sec. 4.2, app. C; causal: app. D).

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
    mask : {None, "causal"}
        ``"causal"``: key m visible to query n iff ``m <= n + M - N`` (needs M >= N); ``E^n``
        holds the visible keys of the block of key ``n + M - N`` and the chunks split the body
        keys before that block (app. D, Algorithm 2; module docstring). ValueError with a grid
        or ``partition="reference-code"``.
    chunks : bool
        False: the exact sets only, every group without chunks (local attention); the
        ``partition`` check under the mask is then moot.

    Returns
    -------
    Partition
        Cached by its arguments: treat its arrays as read-only.

    Notes
    -----
    With ``partition="paper"``, for every query :math:`E^n \cap P^n_c = \emptyset` and
    :math:`E^n \cup \bigcup_c P^n_c = [M]` (EVA sec. 4.1); under the causal mask the union is
    the visible keys :math:`\{m \le n + M - N\}` and every chunk lies wholly before
    :math:`E^n`. With ``"reference-code"`` the chunks cover all non-prefix keys and overlap
    :math:`E^n` on the query's block.

    Examples
    --------
    >>> p = eva_partition(6, 6, window=2, num_chunks=2)
    >>> p.exact_keys[3].tolist(), [c.tolist() for c in p.groups[1].chunks]
    ([2, 3], [[0, 1], [4, 5]])
    >>> g = eva_partition(16, 16, window=4, num_chunks=4, grid=(4, 4))
    >>> g.exact_keys[5].tolist(), [c.tolist() for c in g.groups[0].chunks]
    ([0, 1, 4, 5], [[2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]])
    >>> c = eva_partition(10, 10, window=4, num_chunks=2, mask="causal")
    >>> c.exact_keys[9].tolist(), c.exact_keys[5].tolist(), [ch.tolist() for ch in c.groups[1].chunks]
    ([8, 9], [4, 5], [[0, 1], [2, 3]])
    """
    num_queries = check_positive_int("num_queries", num_queries)
    num_keys = check_positive_int("num_keys", num_keys)
    window, prefix_tokens = check_layout_params(window, prefix_tokens)
    num_chunks = check_positive_int("num_chunks", num_chunks)
    check_choice("partition", partition, PARTITIONS)
    grid = parse_grid(grid)
    check_mask_layout(mask, grid=grid, partition=partition if chunks else "paper")
    if grid is not None:
        _check_grid_shapes(num_queries, num_keys, prefix_tokens, grid)
    if mask is not None:
        last_visible_key(num_queries, num_keys)  # ValueError for M < N
        return _causal_partition(num_queries, num_keys, window, prefix_tokens, num_chunks, bool(chunks))
    return _eva_partition(num_queries, num_keys, window, prefix_tokens, num_chunks, partition, grid, bool(chunks))


@lru_cache(maxsize=64)
def _eva_partition(
    num_queries: int, num_keys: int, window: int, prefix_tokens: int, num_chunks: int, partition: str,
    grid: tuple[int, int] | None, chunks: bool = True,
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
    if not chunks:  # the exact sets alone (local attention): one group without chunks
        groups.append(ChunkGroup(np.arange(num_queries), (), ()))
    elif partition == "reference-code":
        parts = chunks_of(body_keys)
        groups.append(ChunkGroup(np.arange(num_queries), parts, tuple(sources(c) for c in parts)))
    else:
        for block in np.unique(block_of_query).tolist():
            queries = np.flatnonzero(block_of_query == block)
            own = block_keys(block)
            remaining = np.setdiff1d(body_keys, own, assume_unique=True)
            parts = chunks_of(remaining)
            groups.append(ChunkGroup(queries, parts, tuple(sources(c) for c in parts)))
    return Partition(num_queries, num_keys, window, prefix_tokens, block_of_query, exact_keys, tuple(groups), grid)


def _proportional_sources(num_queries: int, num_keys: int, prefix_tokens: int) -> np.ndarray | None:
    """``(M,)`` the query the bidirectional map assigns to each key (module docstring, "Query landmarks");
    -1 for prefix keys; None when there are no body queries or keys (a chunk then pools all queries)."""
    pq, pk = min(prefix_tokens, num_queries), min(prefix_tokens, num_keys)
    nb, mb = num_queries - pq, num_keys - pk
    if nb == 0 or mb == 0:
        return None
    key_source = np.full(num_keys, -1, dtype=np.int64)
    key_source[pk:] = pq + ((np.arange(mb) * nb) // mb)
    return key_source


@lru_cache(maxsize=64)
def _causal_partition(
    num_queries: int, num_keys: int, window: int, prefix_tokens: int, num_chunks: int, chunks: bool
) -> Partition:
    """The causal partition of the module docstring (EVA app. D, Algorithm 2), 1-D, on validated arguments."""
    pk = min(prefix_tokens, num_keys)
    last = last_visible_key(num_queries, num_keys)  # t_n: query n is token t_n
    body = last >= pk  # queries whose token is past the prefix; the others see prefix keys 0..t_n only
    block_of_query = np.full(num_queries, -1, dtype=np.int64)
    if window > 0:
        block_of_query[body] = (last[body] - pk) // window
    block_start = np.where(block_of_query >= 0, pk + block_of_query * window, last + 1)
    # E^n = visible prefix keys + the block's keys b^n..t_n (Algorithm 2's K x K triangle M^E)
    exact_keys = tuple(
        np.concatenate([np.arange(min(pk, t + 1)), np.arange(b, t + 1)]) if blk >= 0 else np.arange(min(pk, t + 1))
        for t, b, blk in zip(last.tolist(), block_start.tolist(), block_of_query.tolist())
    )
    # the visible keys outside E^n: body keys [P, r_n), r_n = b^n (window > 0) or t_n + 1 (window = 0); none for
    # prefix queries. They are re-chunked per query group, so every chunk lies wholly before E^n
    rest_end = np.where(body, np.where(block_of_query >= 0, block_start, last + 1), pk)
    change = np.ones(num_queries, dtype=bool)
    change[1:] = (np.diff(block_of_query) != 0) | (np.diff(rest_end) != 0)
    cell_of_query = np.cumsum(change) - 1  # block and chunks both change monotonically with the token
    key_source = _proportional_sources(num_queries, num_keys, prefix_tokens)

    groups = []
    for queries in np.split(np.arange(num_queries), np.flatnonzero(change[1:]) + 1):
        first = int(queries[0])
        parts = _split(np.arange(pk, rest_end[first]), num_chunks) if chunks else ()
        # landmarks: the bidirectional map, capped at the group's first query (no query pools a later one)
        sources = tuple(np.minimum(key_source[c], first) if key_source is not None else np.arange(first + 1)
                        for c in parts)
        groups.append(ChunkGroup(queries, parts, sources))
    return Partition(num_queries, num_keys, window, prefix_tokens, block_of_query, exact_keys, tuple(groups), None,
                     mask="causal", cell_of_query=cell_of_query)


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
    exact_visible : (B, Q, E) bool or None
        Causal only: exact key ``e`` of block ``b`` is visible to its query in slot ``q``
        (``key <= t_n``, False on padding); None without a mask (``block_key_mask`` holds).
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
    exact_visible: np.ndarray | None = None

    @classmethod
    def of(cls, partition: Partition) -> PaddedPartition:
        """``partition`` as padded arrays; cached per partition (so per shape), treat as read-only."""
        return _padded(partition)


def padded_partition(*args: Any, **kwargs: Any) -> PaddedPartition:
    """Deprecated: ``PaddedPartition.of(eva_partition(...))`` (the same arguments, the same cached arrays)."""
    warnings.warn("randattn.estimators.eva.partition.padded_partition is deprecated; use "
                  "PaddedPartition.of(eva_partition(...))", DeprecationWarning, stacklevel=outside_stacklevel())
    return PaddedPartition.of(eva_partition(*args, **kwargs))


@lru_cache(maxsize=64)
def _padded(layout: Partition) -> PaddedPartition:
    """The arrays of :meth:`PaddedPartition.of`, cached per partition (each :func:`eva_partition` is cached)."""
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
    exact_visible = None
    last = layout.last_visible
    if last is not None:  # Algorithm 2's triangle M^E: key <= t_n within each block
        exact_visible = bk_mask[:, None, :] & (bk[:, None, :] <= last[bq][:, :, None])
    return PaddedPartition(bq, bq_mask, bk, bk_mask, group_of_block, ck, ck_mask, cs, cs_mask, query_slot, exact_visible)
