r"""Token layouts on an image's patch grid: parsing a grid, 2-D windows and 2-D blocks.

Shape-only helpers (numpy integers, no data) shared by the estimators that partition the keys
of a ViT on its patch grid: EVA's local windows and chunks, Scatterbrain's and local attention's
windows (:mod:`randattn.estimators.eva.partition`); written so that 2-D segments of other
estimators can use the same construction.

Convention (also that of the activation files, :mod:`randattn.activations.io`): a sequence of
``tokens = prefix_tokens + h * w`` tokens holds ``prefix_tokens`` leading tokens (CLS,
registers) followed by the ``h x w`` patch tokens in row-major (raster) order, the order of a
ViT's ``flatten(2)`` of its patch embedding. Body token ``t`` (``0 <= t < h w``) sits at row
``t // w`` and column ``t % w``.

Tiles: a grid is cut into non-overlapping ``side x side`` tiles starting at the top-left
corner; when ``side`` does not divide ``h`` (``w``) the last tile row (column) is shorter, so
edge tiles are ``(h mod side) x side`` etc. (the official EVA code asserts divisibility instead,
``efficient_attention/eva.py`` of HKUNLP/efficient-attention, ``_process_input``). Tiles are
numbered row-major over the tile grid; the tokens of a tile are listed in raster order.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from randattn._callers import outside_stacklevel
from randattn._validation import check_choice, check_positive_int

__all__ = [
    "LAYOUTS", "SEQUENCE", "TokenLayout", "token_layout_of", "parse_grid", "resolve_grid", "tile_of_tokens", "tiles",
    "tile_side_for_count", "window_side",
]

#: ``grid``: 2-D windows/chunks on the patch grid; ``sequence``: 1-D contiguous blocks of the token axis
LAYOUTS = ("grid", "sequence")


def parse_grid(grid: Any, name: str = "grid") -> tuple[int, int] | None:
    """``(h, w)`` from a ``(h, w)`` tuple/list, an ``"HxW"`` string (``"14x14"``) or None.

    Raises
    ------
    ValueError / TypeError
        Naming ``name``, the value and what is allowed.

    Examples
    --------
    >>> parse_grid("14x16"), parse_grid([3, 5]), parse_grid(None)
    ((14, 16), (3, 5), None)
    """
    if grid is None:
        return None
    if isinstance(grid, str):
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", grid)
        if not match:
            raise ValueError(f"{name}={grid!r} is not a grid; write rows x columns as 'HxW', e.g. '14x14', or pass (h, w)")
        h, w = int(match.group(1)), int(match.group(2))
    elif isinstance(grid, (tuple, list, np.ndarray)) and len(grid) == 2:
        vals = list(grid)
        if not all(isinstance(a, (int, np.integer)) and not isinstance(a, bool) for a in vals):
            raise TypeError(f"{name}={grid!r} must hold two integers (rows, columns)")
        h, w = int(vals[0]), int(vals[1])
    else:
        raise TypeError(f"{name} must be None, an 'HxW' string or a (rows, columns) pair, got {type(grid).__name__} {grid!r}")
    if h < 1 or w < 1:
        raise ValueError(f"{name}={grid!r} must have rows >= 1 and columns >= 1")
    return h, w


@dataclass(frozen=True)
class TokenLayout:
    """How a sequence's tokens are laid out: one 1-D sequence, or a prefix then a patch grid (module docstring).

    ``layout`` is one of :data:`LAYOUTS`; ``grid`` the ``(h, w)`` patch grid (any form :func:`parse_grid`
    takes, kept parsed), None when unknown; ``prefix_tokens >= 0`` the leading tokens (CLS, registers) before
    the patches. Construction validates all three (ValueError/TypeError naming the argument), so a
    ``TokenLayout`` in hand is a valid one; ``layout="grid"`` without a grid is the 1-D layout
    (:attr:`patch_grid` is None).

    Examples
    --------
    >>> TokenLayout("grid", "14x14", 1).patch_grid, TokenLayout("grid").patch_grid
    ((14, 14), None)
    >>> TokenLayout("grid", (3, 4), 1).check_length(13, what="keys")
    (3, 4)
    """

    layout: str = "sequence"
    grid: Any = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        check_choice("layout", self.layout, LAYOUTS)
        object.__setattr__(self, "grid", parse_grid(self.grid))
        object.__setattr__(self, "prefix_tokens", check_positive_int("prefix_tokens", self.prefix_tokens, minimum=0))

    @property
    def patch_grid(self) -> tuple[int, int] | None:
        """The grid in force: ``(h, w)`` for ``layout="grid"`` with a grid given, else None (1-D)."""
        return self.grid if self.layout == "grid" else None

    def check_length(self, length: int | None, what: str = "tokens") -> tuple[int, int] | None:
        """:attr:`patch_grid`, after checking that ``length`` tokens (the ``what``) are ``prefix_tokens + h w``.

        ValueError naming the grid, the prefix and ``what``'s length when they disagree; nothing is checked
        for the 1-D layout or when ``length`` is None.
        """
        hw = self.patch_grid
        if hw is not None and length is not None and length != self.prefix_tokens + hw[0] * hw[1]:
            raise ValueError(
                f"grid={hw[0]}x{hw[1]} with prefix_tokens={self.prefix_tokens} describes "
                f"{self.prefix_tokens + hw[0] * hw[1]} tokens, but the {what} have {length}; pass the patch grid of "
                "these tokens, or layout='sequence'"
            )
        return hw


#: one 1-D sequence: every token in a segment (the default layout of every function here)
SEQUENCE = TokenLayout()

_LAYOUT_KEYWORDS = ("layout", "grid", "prefix_tokens")


def token_layout_of(token_layout: TokenLayout, legacy: dict[str, Any], function: str) -> TokenLayout:
    """``token_layout``, or the :class:`TokenLayout` of the former ``layout=, grid=, prefix_tokens=`` keywords of
    ``function`` (with a DeprecationWarning naming the replacement, pointing at the caller outside randattn).

    Raises TypeError for another keyword, or for both forms at once.
    """
    unknown = sorted(set(legacy) - set(_LAYOUT_KEYWORDS))
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    if not legacy:
        return token_layout
    if token_layout is not SEQUENCE:
        raise TypeError(f"{function}() takes token_layout or the deprecated {', '.join(sorted(legacy))}, not both")
    warnings.warn(f"{function}(..., layout=, grid=, prefix_tokens=) is deprecated; pass "
                  f"token_layout=TokenLayout(layout, grid, prefix_tokens)", DeprecationWarning,
                  stacklevel=outside_stacklevel())
    return TokenLayout(**legacy)


def resolve_grid(layout: str, grid: Any) -> tuple[int, int] | None:
    """The grid in force (:attr:`TokenLayout.patch_grid`): ``(h, w)`` for ``layout="grid"`` with a grid given,
    else None (sequence). Validates both (ValueError/TypeError naming ``layout`` or ``grid``).
    """
    return TokenLayout(layout, grid).patch_grid


def window_side(window: int) -> int:
    """The side ``s`` of a ``window = s * s`` token window (``window=49`` -> 7); ValueError otherwise."""
    side = math.isqrt(window)
    if side * side != window:
        raise ValueError(
            f"window={window} is not a perfect square: with layout='grid' the local windows are s x s patches "
            f"and window = s*s tokens (e.g. 49 = 7x7, EVA's DeiT setting); use layout='sequence' for 1-D blocks"
        )
    return side


def tile_of_tokens(grid: tuple[int, int], side: int) -> np.ndarray:
    """``(h w,)`` tile number of each body token for ``side x side`` tiles (see the module docstring)."""
    h, w = grid
    rows, cols = np.divmod(np.arange(h * w), w)
    tiles_per_row = -(-w // side)
    return (rows // side) * tiles_per_row + cols // side


def tiles(grid: tuple[int, int], side: int) -> list[np.ndarray]:
    """Body-token indices of each ``side x side`` tile, tiles row-major, tokens increasing.

    Examples
    --------
    >>> [t.tolist() for t in tiles((3, 5), 2)]
    [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9], [10, 11], [12, 13], [14]]
    """
    tile = tile_of_tokens(grid, side)
    order = np.argsort(tile, kind="stable")
    counts = np.bincount(tile)
    return np.split(order, np.cumsum(counts)[:-1])


def tile_side_for_count(grid: tuple[int, int], count: int) -> int:
    """The smallest side ``t`` whose ``t x t`` tiles number at most ``count`` on the grid.

    EVA's 2-D chunks (app. C, "2D windows for images"): the official code uses chunks of side
    ``int(sqrt(N / num_landmarks))`` (``efficient_attention/eva.py``, ``rf_win_size``), which
    gives exactly ``count`` chunks when the grid is divisible (14x14 and 49 chunks -> 2x2);
    the smallest side with at most ``count`` tiles agrees there and never makes more chunks
    than there are draws. ``count = 1`` gives one chunk (the whole grid), ``count >= h w`` gives
    single-patch chunks.
    """
    h, w = grid
    side = max(1, math.isqrt(max(h * w // max(count, 1), 1)))
    while (-(-h // side)) * (-(-w // side)) > count:
        side += 1
    return side
