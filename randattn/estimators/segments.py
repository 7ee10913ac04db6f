r"""Segments of a token sequence and their means (landmarks), numpy and torch: 1-D or 2-D.

Two layouts (``TokenLayout.layout``; every function here takes a ``token_layout``,
:class:`~randattn.estimators.grid.TokenLayout`, default :data:`SEQUENCE`):

``"sequence"``, contiguous 1-D segments (LARA app. G.3.1 for sequences)
    Segments follow ``numpy.array_split``: a length-T sequence in C segments has the first
    ``T mod C`` segments one token longer (N = 197, C = 49: 1 segment of 5 tokens, 48 of 4).
    C larger than T degrades gracefully to T segments of one token. Every token, prefix
    tokens included, is in a segment (``prefix_tokens`` is not used).

``"grid"``, 2-D blocks of the patch grid (LARA app. G.4: "2D average pooling (the same as segments)")
    The tokens are ``prefix_tokens`` leading tokens (CLS, registers) followed by the
    ``h x w`` patches in raster (row-major) order: ``T = prefix_tokens + h w``.

    *Blocks.* C blocks, ``C_eff = min(C, h w)``, tile the grid without overlap, in raster
    order of blocks (as ``AdaptiveAvgPool2d(...).flatten`` orders them):

    1. ``C_rows = floor(sqrt(C h / w) + 1/2)`` bands of block rows (blocks about square in
       patches), clipped to ``[ceil(C / w), min(h, C)]`` so that every band fits its blocks;
    2. the C blocks are dealt to the bands as evenly as possible, the first ``C mod C_rows``
       bands getting one more block (``array_split`` of C);
    3. the rows of the grid are split over the bands, and the columns of each band over its
       blocks, by ``array_split``: sizes differ by at most one, the larger first, so the
       **smaller blocks are at the bottom and right edges** when the grid is not divisible.

    So C = 49 on 14 x 14 is 7 x 7 blocks of 2 x 2 patches; C = 64 on 14 x 14 is 8 x 8 blocks
    of 2 x 2 patches with the last two block rows and columns one patch thin; C = 32 on
    14 x 14 is 6 bands of 6, 6, 5, 5, 5, 5 blocks (C is used exactly whether or not it is a
    product ``a b`` with ``a | h``, ``b | w``); C = 6 on 3 x 5 is 2 bands (2 and 1 patch
    rows) of 3 blocks (2, 2, 1 patch columns).

    *Prefix tokens are in no block*: the C landmarks are means of patches only. They still
    are queries and keys of the estimator; only the landmarks (and so the proposals) ignore
    them. Source: the official LARA ViT (HKUNLP/efficient-attention, ``vit/models/efficient_vit.py``)
    has no CLS token (its ``cls_token`` is commented out; the head mean-pools the patches), and
    its ``lara.py`` pools the ``H x W`` patch map with ``nn.AdaptiveAvgPool2d(int(sqrt(C)))``;
    the paper states no rule for prefix tokens.

    *Differences from the official code*, which uses ``int(sqrt(C))**2`` square landmarks
    (C = 32 -> 25) and adaptive pooling windows that **overlap** when ``int(sqrt(C))`` does not
    divide the grid (e.g. 4 windows on 14 rows: rows 0-3, 3-6, 7-10, 10-13): here C is kept and
    blocks never overlap ("non-overlapping blocks, edge blocks smaller"). Both
    agree whenever ``C = a^2`` with ``a`` dividing h and w (C = 49 on 14 x 14, the paper's setting).

Segments are described once, as a segment index per token (:func:`token_segments`, -1 for
tokens in no segment); the numpy pooling matrix (the reference, literal means) and the torch
scatter-add (no ``C x T`` matrix) are both built from it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from randattn._callers import outside_stacklevel
from randattn._validation import check_positive_int
from randattn.estimators.grid import LAYOUTS, SEQUENCE, TokenLayout, parse_grid, token_layout_of

__all__ = [
    "LAYOUTS",
    "TokenLayout",
    "SEQUENCE",
    "parse_grid",
    "check_layout",
    "segment_bounds",
    "effective_segments",
    "grid_block_shape",
    "grid_blocks",
    "token_segments",
    "pooling_matrix",
    "segment_means",
    "segment_means_torch",
]

def check_layout(
    length: int | None, layout: str = "sequence", grid: Any = None, prefix_tokens: int = 0, *, what: str = "tokens"
) -> tuple[int, int] | None:
    """Deprecated: ``TokenLayout(layout, grid, prefix_tokens).check_length(length, what)`` (the same checks)."""
    warnings.warn("randattn.estimators.segments.check_layout is deprecated; use "
                  "TokenLayout(layout, grid, prefix_tokens).check_length(length, what)", DeprecationWarning,
                  stacklevel=outside_stacklevel())
    return TokenLayout(layout, grid, prefix_tokens).check_length(length, what)


def effective_segments(length: int, num_segments: int, token_layout: TokenLayout = SEQUENCE, **legacy: Any) -> int:
    """``C_eff``: ``min(C, T)`` for 1-D segments, ``min(C, h w)`` for grid blocks (more would leave some empty)."""
    token_layout = token_layout_of(token_layout, legacy, "effective_segments")
    check_positive_int("num_segments", num_segments)
    check_positive_int("length", length)
    hw = token_layout.check_length(length)
    return min(num_segments, length if hw is None else hw[0] * hw[1])


def segment_bounds(length: int, num_segments: int) -> np.ndarray:
    """Offsets ``(C_eff + 1,)`` of contiguous 1-D segments, sizes differing by at most one."""
    c = effective_segments(length, num_segments)
    return _split_offsets(length, c)


def _split_offsets(length: int, parts: int) -> np.ndarray:
    """``array_split`` offsets: ``parts`` pieces of ``length``, the first ``length mod parts`` one longer."""
    base, extra = divmod(length, parts)
    sizes = np.full(parts, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def grid_block_shape(grid: Any, num_segments: int) -> tuple[int, np.ndarray]:
    """Number of block rows and blocks per row, ``(C_rows, (C_rows,) ints)``, of C blocks on ``grid`` (module docstring)."""
    h, w = parse_grid(grid)
    c = min(check_positive_int("num_segments", num_segments), h * w)
    rows = math.floor(math.sqrt(c * h / w) + 0.5)
    rows = min(max(rows, -(-c // w)), h, c)
    per_row = np.diff(_split_offsets(c, rows))
    return rows, per_row


def grid_blocks(grid: Any, num_segments: int) -> np.ndarray:
    """Block index ``(h w,)`` of every patch (raster order of patches and of blocks); see the module docstring."""
    h, w = parse_grid(grid)
    rows, per_row = grid_block_shape((h, w), num_segments)
    row_offsets = _split_offsets(h, rows)
    block = np.empty((h, w), dtype=np.int64)
    first = 0
    for band, count in enumerate(per_row):
        col_offsets = _split_offsets(w, int(count))
        for j in range(int(count)):
            block[row_offsets[band]:row_offsets[band + 1], col_offsets[j]:col_offsets[j + 1]] = first + j
        first += int(count)
    return block.reshape(-1)


def token_segments(length: int, num_segments: int, token_layout: TokenLayout = SEQUENCE, **legacy: Any) -> np.ndarray:
    """Segment index ``(T,)`` of every token, ``-1`` for tokens in no segment (prefix tokens of a grid)."""
    token_layout = token_layout_of(token_layout, legacy, "token_segments")
    c = effective_segments(length, num_segments, token_layout)
    hw = token_layout.patch_grid
    if hw is None:
        return np.repeat(np.arange(c), np.diff(_split_offsets(length, c)))
    return np.concatenate([np.full(token_layout.prefix_tokens, -1, dtype=np.int64), grid_blocks(hw, c)])


def pooling_matrix(length: int, num_segments: int, token_layout: TokenLayout = SEQUENCE, **legacy: Any) -> np.ndarray:
    """``(C_eff, T)`` averaging matrix: row c holds ``1/|segment c|`` on its tokens (0 on prefix tokens of a grid)."""
    seg = token_segments(length, num_segments, token_layout_of(token_layout, legacy, "pooling_matrix"))
    num_c = int(seg.max()) + 1
    member = (seg[None, :] == np.arange(num_c)[:, None]).astype(np.float64)
    return member / member.sum(-1, keepdims=True)


def segment_means(x: np.ndarray, num_segments: int, token_layout: TokenLayout = SEQUENCE, **legacy: Any) -> np.ndarray:
    """Landmarks ``(..., C_eff, D)``: the mean of each segment of ``x : (..., T, D)`` (LARA G.3.1, G.4)."""
    return pooling_matrix(x.shape[-2], num_segments, token_layout_of(token_layout, legacy, "segment_means")) @ x


def segment_means_torch(x: Any, num_segments: int, token_layout: TokenLayout = SEQUENCE, **legacy: Any) -> Any:
    """torch form of :func:`segment_means` (same segments, same layout), by a scatter-add: ``O(T D)``, no ``C x T`` matrix."""
    import torch

    seg = token_segments(x.shape[-2], num_segments, token_layout_of(token_layout, legacy, "segment_means_torch"))
    start = int(np.argmax(seg >= 0))  # segment tokens are contiguous after the prefix
    counts = np.bincount(seg[start:])
    index = torch.as_tensor(seg[start:], device=x.device)
    sums = torch.zeros((*x.shape[:-2], len(counts), x.shape[-1]), dtype=x.dtype, device=x.device)
    sums.index_add_(-2, index, x[..., start:, :])
    return sums / torch.as_tensor(counts, dtype=x.dtype, device=x.device).unsqueeze(-1)

