"""Segments and grid blocks (randattn.estimators.segments): the convention, written out independently.

Expected values are built here by hand (explicit block lists, reshapes of the patch map),
not by the module's own helpers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from randattn._callers import PACKAGE_DIR
from randattn.estimators import grid as grid_module, segments
from randattn.estimators.grid import TokenLayout
from randattn.testing import assert_close

EXACT = 1e-12  # means of O(1) numbers in float64


def _blocks_of(seg, prefix, h, w):
    """{block: set of (row, col)} from a token -> segment index array."""
    out = {}
    for t, b in enumerate(seg[prefix:]):
        out.setdefault(int(b), set()).add(divmod(t, w))
    return out


def test_49_blocks_on_14x14_are_2x2_patches_in_raster_order(rng):
    """LARA app. G.4 with C = 49 on a 14 x 14 grid (the official code's AdaptiveAvgPool2d(7)): 7 x 7 blocks of 2 x 2."""
    x = rng.standard_normal((3, 1 + 196, 4))
    expected = x[:, 1:].reshape(3, 7, 2, 7, 2, 4).mean(axis=(2, 4)).reshape(3, 49, 4)
    got = segments.segment_means(x, 49, TokenLayout("grid", (14, 14), 1))
    assert_close(got, expected, atol=EXACT, what="2x2 block means")
    got_t = segments.segment_means_torch(torch.as_tensor(x), 49, TokenLayout("grid", "14x14", 1))
    assert_close(got_t, expected, atol=EXACT, what="torch 2x2 block means")


def test_non_divisible_grid_has_smaller_edge_blocks():
    """C = 6 on 3 x 5: 2 block rows (2 and 1 patch rows) of 3 blocks (2, 2, 1 patch columns)."""
    seg = segments.token_segments(2 + 15, 6, TokenLayout("grid", (3, 5), 2))
    assert list(seg[:2]) == [-1, -1]
    expected = np.array([[0, 0, 1, 1, 2], [0, 0, 1, 1, 2], [3, 3, 4, 4, 5]])
    assert np.array_equal(seg[2:].reshape(3, 5), expected)


def test_c_that_is_no_product_of_divisors_is_kept_exactly():
    """C = 32 on 14 x 14: 6 bands (rows 3,3,2,2,2,2) of 6,6,5,5,5,5 blocks, columns split evenly per band."""
    seg = segments.token_segments(196, 32, TokenLayout("grid", (14, 14))).reshape(14, 14)
    assert seg.max() + 1 == 32
    assert [len(np.unique(seg[r])) for r in (0, 3, 6, 8, 10, 12)] == [6, 6, 5, 5, 5, 5]
    assert np.array_equal(seg[0], [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
    assert np.array_equal(seg[13], [27, 27, 27, 28, 28, 28, 29, 29, 29, 30, 30, 30, 31, 31])


@pytest.mark.parametrize("grid", [(3, 5), (5, 3), (14, 14), (1, 13), (16, 9)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("num_segments", [1, 2, 7, 32, 64, 128, 10_000])
def test_blocks_tile_the_grid_as_even_rectangles(grid, num_segments):
    """min(C, h w) non-overlapping rectangles covering every patch once, in raster order; within
    a block row heights are equal, and widths (heights) of blocks differ by at most one."""
    h, w = grid
    seg = segments.grid_blocks(grid, num_segments)
    blocks = _blocks_of(seg, 0, h, w)
    assert sorted(blocks) == list(range(min(num_segments, h * w)))
    heights, first_rows = [], []
    for cells in blocks.values():
        rows = sorted({r for r, _ in cells})
        cols = sorted({c for _, c in cells})
        assert rows == list(range(rows[0], rows[-1] + 1)) and cols == list(range(cols[0], cols[-1] + 1))
        assert len(cells) == len(rows) * len(cols), "a block is not a rectangle"
        heights.append(len(rows))
        first_rows.append((rows[0], cols[0]))
    assert first_rows == sorted(first_rows), "blocks are not in raster order"
    assert max(heights) - min(heights) <= 1
    for band_start in {r for r, _ in first_rows}:
        widths = [len({c for _, c in cells}) for cells in blocks.values() if min(r for r, _ in cells) == band_start]
        assert max(widths) - min(widths) <= 1


def test_blocks_are_about_square_in_patches():
    """C = 16 on 28 x 28 gives 4 x 4 blocks of 7 x 7; on a 7 x 28 strip, 2 rows of 8 blocks (4 x 3-4 patches)."""
    assert np.array_equal(segments.grid_blocks((28, 28), 16).reshape(28, 28)[::7, ::7], np.arange(16).reshape(4, 4))
    rows, per_row = segments.grid_block_shape((7, 28), 16)
    assert rows == 2 and list(per_row) == [8, 8]


def test_sequence_layout_and_unknown_grid_are_1d(rng):
    """layout='sequence' ignores the grid; layout='grid' with grid=None has no grid: both are array_split segments."""
    x = rng.standard_normal((197, 3))
    one_d = np.stack([part.mean(0) for part in np.array_split(x, 49)])
    for layout in (segments.SEQUENCE, TokenLayout("sequence", (14, 14), 1), TokenLayout("grid", None)):
        assert_close(segments.segment_means(x, 49, layout), one_d, atol=EXACT, what=str(layout))
        assert_close(segments.segment_means_torch(torch.as_tensor(x), 49, layout), one_d, atol=EXACT,
                     what=f"torch {layout}")


@pytest.mark.parametrize("grid", [(3, 5), (14, 14), (28, 28)], ids=lambda g: f"{g[0]}x{g[1]}")
@pytest.mark.parametrize("prefix", [0, 1, 5])
@pytest.mark.parametrize("num_segments", [4, 49, 10_000])
def test_pooling_matrix_rows_average_their_patches_only(grid, prefix, num_segments, rng):
    """Row c is 1/|block c| on block c's patches, 0 on prefix tokens; numpy matrix == torch scatter-add."""
    h, w = grid
    n = prefix + h * w
    pool = segments.pooling_matrix(n, num_segments, TokenLayout("grid", grid, prefix))
    assert pool.shape == (min(num_segments, h * w), n)
    assert np.all(pool[:, :prefix] == 0)
    assert_close(pool.sum(-1), np.ones(len(pool)), atol=EXACT, what="rows average")
    assert np.all((pool > 0).sum(0)[prefix:] == 1), "a patch in no block or in two"
    x = rng.standard_normal((2, n, 3))
    assert_close(segments.segment_means_torch(torch.as_tensor(x), num_segments, TokenLayout("grid", grid, prefix)), pool @ x, atol=EXACT, what="torch")


@pytest.mark.parametrize("grid, expected", [("14x14", (14, 14)), (" 3 X 5 ", (3, 5)), ([2, 7], (2, 7)), ((4, 4), (4, 4)), (None, None)])
def test_parse_grid(grid, expected):
    assert segments.parse_grid(grid) == expected


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(grid="14by14"), ValueError, r"grid='14by14' is not a grid; write rows x columns as 'HxW'"),
        (dict(grid=(14,)), TypeError, r"grid must be None, an 'HxW' string or a \(rows, columns\) pair"),
        (dict(grid=(0, 14)), ValueError, r"grid=\(0, 14\) must have rows >= 1 and columns >= 1"),
        (dict(grid=(14, 14), prefix_tokens=-1), ValueError, "prefix_tokens must be >= 0"),
        (dict(grid=(14, 14), prefix_tokens=1.0), TypeError, "prefix_tokens must be an integer"),
        (dict(grid=(14, 14), layout="2d"), ValueError, r"layout='2d' is not allowed; choose one of 'grid', 'sequence'"),
    ],
)
def test_bad_layout_is_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        TokenLayout(**{"layout": "grid", **kwargs})


def test_a_grid_of_other_tokens_is_named():
    layout = TokenLayout("grid", (14, 14))
    for call in (lambda: segments.token_segments(197, 49, layout), lambda: layout.check_length(197)):
        with pytest.raises(ValueError, match=r"grid=14x14 with prefix_tokens=0 describes 196 tokens, but the tokens "
                                             r"have 197"):
            call()
    assert TokenLayout("sequence", (14, 14)).check_length(197) is None  # a 1-D layout holds any length


def test_one_grid_parser_and_one_list_of_layouts():
    """The segment helpers and the block layouts (EVA, Scatterbrain, local attention) read a grid by one rule."""
    assert segments.parse_grid is grid_module.parse_grid and segments.LAYOUTS is grid_module.LAYOUTS
    assert TokenLayout("grid", " 3 X 5 ", 2) == TokenLayout("grid", [3, 5], 2)  # kept parsed


@pytest.mark.parametrize("function, args", [
    ("token_segments", (17, 6)), ("pooling_matrix", (17, 6)), ("effective_segments", (17, 6)),
    ("segment_means", (np.ones((17, 2)), 6)),
])
def test_the_former_layout_keywords_warn_and_give_the_same_segments(function, args):
    """``layout=, grid=, prefix_tokens=`` still work, with a DeprecationWarning at the caller's line."""
    new = getattr(segments, function)(*args, TokenLayout("grid", (3, 5), 2))
    with pytest.warns(DeprecationWarning, match=rf"{function}\(\.\.\., layout=, grid=, prefix_tokens=\) is "
                                                r"deprecated; pass token_layout=TokenLayout") as record:
        old = getattr(segments, function)(*args, layout="grid", grid=(3, 5), prefix_tokens=2)
    assert not record[0].filename.startswith(PACKAGE_DIR), record[0].filename  # the caller's line, not randattn's
    assert np.array_equal(old, new)
    with pytest.raises(TypeError, match="not both"):
        getattr(segments, function)(*args, TokenLayout("grid", (3, 5), 2), grid=(3, 5))
    with pytest.raises(TypeError, match="unexpected keyword argument 'grd'"):
        getattr(segments, function)(*args, grd=(3, 5))


def test_the_former_check_layout_warns_and_checks_as_before():
    with pytest.warns(DeprecationWarning, match=r"^randattn\.estimators\.segments\.check_layout is deprecated; use "
                                                r"TokenLayout\(layout, grid, prefix_tokens\)\.check_length\(length, "
                                                r"what\)$") as record:
        assert segments.check_layout(17, "grid", (3, 5), 2) == (3, 5)
    assert not record[0].filename.startswith(PACKAGE_DIR), record[0].filename
    with pytest.warns(DeprecationWarning):
        assert segments.check_layout(17) is None  # 1-D by default: any length
    with pytest.warns(DeprecationWarning):
        assert segments.check_layout(15, "grid", (3, 5)) == (3, 5)  # no prefix by default
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="but the tokens have 18"):
        segments.check_layout(18, "grid", (3, 5), 2)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="but the keys have 18"):
        segments.check_layout(18, "grid", (3, 5), 2, what="keys")
