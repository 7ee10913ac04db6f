"""EVA, Scatterbrain and local attention on the patch grid (``layout="grid"``): windows, chunks, identities.

Every identity of the 1-D layout (tests/estimators/test_eva.py) is checked again on grids,
including non-square ones and prefix tokens 0, 1 and 5. Expected windows come from the
rectangle description (row // s, column // s), written out here; expected outputs from softmax,
RFA or a masked softmax in plain numpy. Float64 tolerance: the issue's 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import randattn
from randattn.estimators.base import Draws
from randattn.estimators.eva import batched as eva_bat
from randattn.estimators.eva import draw as eva_draw
from randattn.estimators.eva import reference as eva_ref
from randattn.estimators.eva.partition import eva_partition
from randattn.estimators.grid import parse_grid, tile_side_for_count, tiles
from randattn.estimators.local import batched as local_bat
from randattn.estimators.local import reference as local_ref
from randattn.estimators.rfa import reference as rfa_ref
from randattn.estimators.scatterbrain import batched as sb_bat
from randattn.estimators.scatterbrain import draw as sb_draw
from randattn.estimators.scatterbrain import reference as sb_ref
from randattn.estimators.softmax import reference as softmax_ref
from randattn.testing import assert_close

ATOL64 = 1e-10
#: (grid, prefix, window, chunks): non-square, square, the DeiT 7x7 window on 14x14 and 28x28
CASES = [
    ((3, 5), 0, 4, 3), ((3, 5), 1, 4, 4), ((3, 5), 5, 4, 2), ((4, 4), 1, 4, 4), ((5, 3), 1, 9, 2),
    ((14, 14), 1, 49, 49), ((14, 14), 0, 49, 16), pytest.param(((28, 28), 1, 49, 49), marks=pytest.mark.slow, id="28x28-p1-W49-C49"),
]
#: the cases without pytest.param wrappers, for tests that build their own parameters
PLAIN_CASES = [c.values[0] if hasattr(c, "values") else c for c in CASES]


def case_id(case) -> str:
    (h, w), p, window, chunks = case
    return f"{h}x{w}-p{p}-W{window}-C{chunks}"


def qkv(tokens: int, *, d: int = 8, dv: int = 5, batch=(2,), seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(*batch, tokens, d)), rng.normal(size=(*batch, tokens, d)), rng.normal(size=(*batch, tokens, dv))


def both(ref, bat, q, k, v, draws, **params):
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    return ref.estimate(q, k, v, draws, **params), bat.estimate(t(q), t(k), t(v), draws.to_torch(), **params)


def expected_window(grid, prefix, side, token):
    """Keys of ``token``'s window written out: same tile row and tile column (row // s, col // s)."""
    h, w = grid
    r, c = divmod(token - prefix, w)
    return [prefix + rr * w + cc for rr in range(h) for cc in range(w) if rr // side == r // side and cc // side == c // side]


# ---------------------------------------------------------------------------------------
# grid helpers and the partition
# ---------------------------------------------------------------------------------------

def test_parse_grid_forms_and_errors():
    assert parse_grid("14x14") == (14, 14) and parse_grid(" 3X5 ") == (3, 5) and parse_grid((3, 5)) == (3, 5)
    assert parse_grid([2, 7]) == (2, 7) and parse_grid(None) is None
    for bad, error, match in [("14*14", ValueError, "'HxW'"), ("0x3", ValueError, "rows >= 1"), ((3,), TypeError, "pair"),
                              ((3.0, 5), TypeError, "two integers"), (14, TypeError, "pair")]:
        with pytest.raises(error, match=match):
            parse_grid(bad)


def test_tiles_of_a_non_divisible_grid_are_smaller_at_the_edges():
    # 3 x 5 grid, 2 x 2 tiles: rows {0,1},{2}; columns {0,1},{2,3},{4} (hand-written)
    assert [t.tolist() for t in tiles((3, 5), 2)] == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9], [10, 11], [12, 13], [14]]


@pytest.mark.parametrize("grid, count, side", [((14, 14), 49, 2), ((14, 14), 1, 14), ((14, 14), 196, 1), ((3, 5), 4, 3), ((3, 5), 6, 2), ((28, 28), 49, 4)])
def test_chunk_side_is_the_smallest_with_at_most_count_tiles(grid, count, side):
    h, w = grid
    n_tiles = lambda s: -(-h // s) * -(-w // s)  # noqa: E731
    assert tile_side_for_count(grid, count) == side
    assert n_tiles(side) <= count and (side == 1 or n_tiles(side - 1) > count)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_grid_partition_windows_chunks_and_cover(case):
    grid, prefix, window, chunks = case
    h, w = grid
    tokens = prefix + h * w
    side = int(round(window**0.5))
    part = eva_partition(tokens, tokens, window=window, prefix_tokens=prefix, num_chunks=chunks, grid=grid)
    official = eva_partition(tokens, tokens, window=window, prefix_tokens=prefix, num_chunks=chunks, partition="reference-code", grid=grid)
    group_of = {int(n): g for g in part.groups for n in g.queries}
    t = tile_side_for_count(grid, chunks)
    for n in range(tokens):
        exact = part.exact_keys[n].tolist()
        if n < prefix:
            assert exact == list(range(prefix)), "a prefix query's exact set is the prefix keys"
        else:
            assert exact == list(range(prefix)) + expected_window(grid, prefix, side, n)
        group = group_of[n]
        assert len(group.chunks) <= chunks
        covered = np.concatenate([part.exact_keys[n], *group.chunks])
        assert sorted(covered.tolist()) == list(range(tokens)), "E^n and the chunks partition [M]"
        for chunk in group.chunks:
            r, c = np.divmod(chunk - prefix, w)
            assert len(set((r // t).tolist())) == 1 and len(set((c // t).tolist())) == 1, "a chunk lies in one t x t tile"
    all_body = sorted(np.concatenate(official.groups[0].chunks).tolist())
    assert len(official.groups) == 1 and all_body == list(range(prefix, tokens)), "official chunks: every body key once"


def test_the_block_layouts_read_their_tokens_as_lara_does():
    """EVA, Scatterbrain and local attention state (layout, grid, prefix_tokens) as one TokenLayout, LARA's."""
    from randattn.estimators.eva.reference import EvaOptions
    from randattn.estimators.grid import TokenLayout
    from randattn.estimators.lara.reference import LaraOptions
    from randattn.estimators.local.reference import LocalOptions

    for options in (EvaOptions, LocalOptions):
        assert options(grid="3x4", prefix_tokens=1, window=4).token_layout == TokenLayout("grid", (3, 4), 1)
        assert options(grid="3x4", layout="sequence", window=4).resolved_grid is None
    assert LaraOptions(grid=[3, 4], prefix_tokens=1).token_layout == EvaOptions(grid="3 x 4", prefix_tokens=1).token_layout


def test_grid_layout_errors_name_the_problem():
    q, k, v = qkv(16)
    draws = eva_draw(q.shape, k.shape, num_samples=2, rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"grid=3x4 with prefix_tokens=1 needs 13 query and key tokens .* got N=16"):
        eva_ref.estimate(q, k, v, draws, grid="3x4", prefix_tokens=1, window=4)
    with pytest.raises(ValueError, match="window=6 is not a perfect square"):
        eva_bat.estimate(*map(torch.as_tensor, (q, k, v)), draws, grid=(4, 4), window=6)
    with pytest.raises(ValueError, match="layout='tiles' is not allowed"):
        eva_ref.estimate(q, k, v, draws, grid=(4, 4), layout="tiles")
    with pytest.raises(ValueError, match=r"grid='4-4' is not a grid; write rows x columns as 'HxW'"):
        eva_ref.estimate(q, k, v, draws, grid="4-4")  # the same rule and words as LARA's
    # sequence layout ignores the grid; grid=None is the 1-D layout
    a = eva_ref.estimate(q, k, v, draws, grid="3x5", layout="sequence", window=4)
    assert_close(a, eva_ref.estimate(q, k, v, draws, window=4), atol=0.0)


# ---------------------------------------------------------------------------------------
# identities on the grid (reference and batched, float64, same draws)
# ---------------------------------------------------------------------------------------

VARIANTS = [
    {}, {"partition": "reference-code"}, {"chunk_weight": "mean-key"}, {"chunk_weight": "rfa"},
    {"chunk_weight": "mean-key", "add_log_chunk_size": True, "partition": "reference-code", "proposal_mean": "half"},
    {"samples_per_chunk": 3, "chunk_weight": "rfa", "proposal_mean": "standard"}, {"sample": "mean"},
    {"noise": "reference-code", "samples_per_chunk": 2}, {"window": 0},
]


def _grid_cases():
    """Every variant on the small grids; on 14x14 the default (the rest, and 28x28, is ``slow``)."""
    for case in PLAIN_CASES:
        for variant in VARIANTS:
            big = case[0][0] >= 28 or (case[0][0] >= 14 and variant != {})
            yield pytest.param(case, variant, id=f"{case_id(case)}-{variant}", marks=[pytest.mark.slow] if big else [])


@pytest.mark.parametrize("case, variant", list(_grid_cases()))
def test_batched_matches_reference_on_the_grid(case, variant):
    grid, prefix, window, chunks = case
    q, k, v = qkv(prefix + grid[0] * grid[1], batch=(2,) if grid[0] < 20 else ())
    params = {"window": window, "prefix_tokens": prefix, "grid": f"{grid[0]}x{grid[1]}", **variant}
    draw_params = {p: params[p] for p in ("sample", "samples_per_chunk") if p in params}
    draws = eva_draw(q.shape, k.shape, num_samples=chunks, replicates=2, rng=np.random.default_rng(1), **draw_params)
    a, b = both(eva_ref, eva_bat, q, k, v, draws, **params)
    assert_close(b, a, atol=ATOL64, what=f"{case} {variant}")


@pytest.mark.parametrize("partition", ["paper", "reference-code"])
@pytest.mark.parametrize("case", [((3, 5), 1, 4, 4), ((4, 4), 1, 4, 4), ((5, 3), 5, 9, 2)], ids=case_id)
def test_one_block_per_slice_matches_reference(monkeypatch, case, partition):
    """With every slice one block, each slice's rows land on their own queries (padding slots skipped).

    ``WORK_ELEMENTS = 1`` makes every slice one block; the edge tiles and the prefix tokens' block
    are padded. Expected: the float64 reference, and its probabilities as the estimate of ``I_M``.
    """
    monkeypatch.setattr(eva_bat, "WORK_ELEMENTS", 1)
    grid, prefix, window, chunks = case
    tokens = prefix + grid[0] * grid[1]
    q, k, v = qkv(tokens)
    params = {"window": window, "prefix_tokens": prefix, "grid": grid, "partition": partition}
    draws = eva_draw(q.shape, k.shape, num_samples=chunks, replicates=2, rng=np.random.default_rng(3))
    eye = np.broadcast_to(np.eye(tokens), (*k.shape[:-1], tokens))
    expected_out = eva_ref.estimate(q, k, v, draws, **params)
    expected_probs = eva_ref.estimate(q, k, eye, draws, **params)
    t = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    out, probs = eva_bat.estimate_with_probabilities(t(q), t(k), t(v), draws.to_torch(), **params)
    assert_close(out, expected_out, atol=ATOL64, what="estimate")
    assert_close(probs, expected_probs, atol=ATOL64, what="probabilities with the estimate")
    assert_close(eva_bat.probabilities(t(q), t(k), draws.to_torch(), **params), expected_probs, atol=ATOL64,
                 what="probabilities alone")


@pytest.mark.parametrize("weight", ["exact", "mean-key"])
@pytest.mark.parametrize("case", PLAIN_CASES[:5] + [pytest.param(PLAIN_CASES[5], marks=pytest.mark.slow)], ids=case_id)
def test_single_patch_chunks_recover_softmax_on_the_grid(case, weight):
    """C >= h w: every 2-D chunk is one patch, beta = v_m (Prop. 1), weight exp(x.y_m) for both weights: softmax."""
    grid, prefix, window, _ = case
    tokens = prefix + grid[0] * grid[1]
    q, k, v = qkv(tokens)
    draws = eva_draw(q.shape, k.shape, num_samples=grid[0] * grid[1], replicates=2, rng=np.random.default_rng(1))
    expected = softmax_ref.estimate(q, k, v)
    a, b = both(eva_ref, eva_bat, q, k, v, draws, window=window, prefix_tokens=prefix, grid=grid, chunk_weight=weight)
    for what, out in (("reference", a), ("batched", b)):
        assert_close(out, np.broadcast_to(expected, out.shape), atol=ATOL64, what=what)


@pytest.mark.parametrize("weight", ["exact", "mean-key", "rfa"])
@pytest.mark.parametrize("grid, prefix", [((3, 5), 0), ((3, 5), 1), ((3, 5), 5), ((14, 14), 1)], ids=str)
def test_window_covering_the_grid_is_softmax(grid, prefix, weight):
    """A window of side >= max(h, w) holds every patch: nothing is left to chunk (paper partition)."""
    tokens = prefix + grid[0] * grid[1]
    q, k, v = qkv(tokens)
    draws = eva_draw(q.shape, k.shape, num_samples=3, replicates=2, rng=np.random.default_rng(1))
    side = max(grid)
    a, b = both(eva_ref, eva_bat, q, k, v, draws, window=side * side, prefix_tokens=prefix, grid=grid, chunk_weight=weight)
    expected = np.broadcast_to(softmax_ref.estimate(q, k, v), a.shape)
    assert_close(a[..., prefix:, :], expected[..., prefix:, :], atol=ATOL64, what="reference")
    assert_close(b[..., prefix:, :], expected[..., prefix:, :], atol=ATOL64, what="batched")


@pytest.mark.parametrize("grid", [(3, 5), (4, 4)], ids=str)
def test_no_window_one_chunk_standard_proposal_is_rfa_on_the_grid(grid):
    """|E| = 0, C = 1 (one 2-D chunk = the whole grid), N(0, I): RFA with the same omega (EVA app. G.1)."""
    tokens = grid[0] * grid[1]
    q, k, v = qkv(tokens)
    draws = eva_draw(q.shape, k.shape, num_samples=1, replicates=3, rng=np.random.default_rng(1), samples_per_chunk=16)
    expected = rfa_ref.estimate(q, k, v, Draws({"omega": draws["eps"][..., 0, :, :]}, 3))
    a, b = both(eva_ref, eva_bat, q, k, v, draws, window=0, grid=grid, proposal_mean="standard", samples_per_chunk=16)
    assert_close(a, expected, atol=ATOL64, what="reference")
    assert_close(b, expected, atol=ATOL64, what="batched")


@pytest.mark.parametrize("case", PLAIN_CASES[:6], ids=case_id)
def test_scatterbrain_is_eva_with_one_chunk_on_the_grid(case):
    """EVA app. G.5 on the grid: C = 1, N(0, I), S samples, rfa chunk weight == Scatterbrain (eq. 30)."""
    grid, prefix, window, _ = case
    tokens = prefix + grid[0] * grid[1]
    q, k, v = qkv(tokens)
    omega = sb_draw(q.shape, k.shape, num_samples=7, replicates=2, rng=np.random.default_rng(2))
    eps = Draws({"eps": omega["omega"][..., None, :, :]}, 2)
    layout = {"window": window, "prefix_tokens": prefix, "grid": grid}
    sb_a, sb_b = both(sb_ref, sb_bat, q, k, v, omega, **layout)
    ev_a, ev_b = both(eva_ref, eva_bat, q, k, v, eps, **layout, proposal_mean="standard", chunk_weight="rfa", samples_per_chunk=7)
    assert_close(sb_a, ev_a, atol=ATOL64, what="reference")
    assert_close(sb_b, ev_b, atol=ATOL64, what="batched")
    assert_close(sb_b, sb_a, atol=ATOL64, what="scatterbrain batched vs reference")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_local_is_softmax_under_the_grid_window_mask(case):
    grid, prefix, window, _ = case
    tokens = prefix + grid[0] * grid[1]
    q, k, v = qkv(tokens, batch=())
    side = int(round(window**0.5))
    mask = np.zeros((tokens, tokens), dtype=bool)
    mask[:, :prefix] = True
    for n in range(prefix, tokens):
        mask[n, expected_window(grid, prefix, side, n)] = True
    logits = np.where(mask, (q * 8**-0.25) @ (k * 8**-0.25).T, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    expected = (p / p.sum(-1, keepdims=True)) @ v
    ref = local_ref.estimate(q, k, v, window=window, prefix_tokens=prefix, grid=grid)
    bat = local_bat.estimate(torch.as_tensor(q), torch.as_tensor(k), torch.as_tensor(v), window=window, prefix_tokens=prefix, grid=grid)
    assert_close(ref, expected, atol=ATOL64, what="reference")
    assert_close(bat, expected, atol=ATOL64, what="batched")


def test_grid_windows_differ_from_raster_blocks():
    """Negative control: on 14x14 + CLS, 7x7 windows and 49-token raster blocks are different estimators."""
    q, k, v = qkv(197, batch=())
    grid = randattn.estimate("local", q, k, v, window=49, prefix_tokens=1, grid="14x14")
    raster = randattn.estimate("local", q, k, v, window=49, prefix_tokens=1, layout="sequence", grid="14x14")
    assert np.abs(np.asarray(grid) - np.asarray(raster)).max() > 1e-2
