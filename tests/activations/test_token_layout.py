"""Token layout in activation files: ``grid`` / ``prefix_tokens`` metadata, validation, old files, inference rule."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from randattn.activations import io
from randattn.activations.io import NoGridWarning, infer_grid, load_activations, make_activations, save_activations
from randattn.activations.torch_vit import _token_layout


def _arrays(tokens: int) -> dict:
    rng = np.random.default_rng(0)
    return {0: tuple(rng.standard_normal((1, 2, tokens, 4)).astype(np.float32) for _ in range(3))}


@pytest.mark.parametrize("suffix", [".safetensors", ".npz", ".pt"])
@pytest.mark.parametrize("grid, prefix", [([3, 5], 1), ([4, 4], 0), ([2, 2], 5)])
def test_layout_round_trips(tmp_path, suffix, grid, prefix):
    acts = make_activations(_arrays(prefix + grid[0] * grid[1]), {"scale": 0.5, "grid": grid, "prefix_tokens": prefix})
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoGridWarning)  # a file with a grid says nothing
        back = load_activations(save_activations(acts, tmp_path / f"a{suffix}"))
    assert back.grid == tuple(grid) and back.prefix_tokens == prefix
    assert back.metadata["grid"] == grid


@pytest.mark.parametrize(
    "meta, message",
    [
        ({"grid": [3, 5], "prefix_tokens": 0}, r"'grid' \[3, 5\] and 'prefix_tokens' 0 give 0 \+ 3\*5 = 15 tokens, but the arrays have 16"),
        ({"grid": [3, 5]}, r"'grid' is \[3, 5\] but 'prefix_tokens' is missing"),
        ({"grid": [3], "prefix_tokens": 1}, r"'grid' must be \[rows, columns\] of positive integers, got \[3\]"),
        ({"grid": [0, 15], "prefix_tokens": 1}, r"'grid' must be \[rows, columns\]"),
        ({"grid": "3x5", "prefix_tokens": 1}, r"'grid' must be \[rows, columns\]"),
        ({"prefix_tokens": -1}, r"'prefix_tokens' must be an integer in \[0, tokens=16\]"),
        ({"prefix_tokens": 1.5}, r"'prefix_tokens' must be an integer"),
        ({"prefix_tokens": 17}, r"'prefix_tokens' must be an integer in \[0, tokens=16\]"),
    ],
)
def test_bad_layout_is_named(meta, message):
    with pytest.raises(ValueError, match=message):
        make_activations(_arrays(16), {"scale": 1.0, **meta}, where="f.npz")


def test_prefix_without_grid_and_unknown_layout():
    acts = make_activations(_arrays(16), {"scale": 1.0, "prefix_tokens": 1})
    assert acts.grid is None and acts.prefix_tokens == 1
    plain = make_activations(_arrays(16), {"scale": 1.0})
    assert plain.grid is None and plain.prefix_tokens == 0


def test_old_file_loads_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(io, "_warned_no_grid", False)
    path = save_activations(make_activations(_arrays(197), {"scale": 1.0}), tmp_path / "old.npz")
    with pytest.warns(NoGridWarning, match="no patch 'grid' in the metadata.*1-D"):
        first = load_activations(path)
    assert first.grid is None and first.prefix_tokens == 0 and first.shape == (1, 2, 197, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoGridWarning)
        load_activations(path)  # said once


@pytest.mark.parametrize(
    "tokens, prefix, expected",
    [(197, 1, (1, (14, 14))), (577, 1, (1, (24, 24))), (785, 1, (1, (28, 28))), (196, 0, (0, (14, 14))),
     (201, 5, (5, (14, 14))), (200, 1, None), (1, 1, None), (198, 1, None)],
)
def test_infer_grid_square_rule(tokens, prefix, expected):
    assert infer_grid(tokens, prefix) == expected


class _Embed:
    def __init__(self, patch, img, grid):
        self.patch_size, self.img_size, self.grid_size = patch, img, grid


class _Model:
    def __init__(self, prefix, embed):
        self.num_prefix_tokens, self.patch_embed = prefix, embed


@pytest.mark.parametrize(
    "model, size, tokens, expected",
    [
        (_Model(1, _Embed((16, 16), (224, 224), (14, 14))), 224, 197, {"prefix_tokens": 1, "grid": [14, 14]}),
        (_Model(1, _Embed((16, 16), (224, 224), (14, 14))), 384, 577, {"prefix_tokens": 1, "grid": [24, 24]}),
        (_Model(5, _Embed((14, 14), (518, 518), (37, 37))), 224, 261, {"prefix_tokens": 5, "grid": [16, 16]}),
        (_Model(1, _Embed((16, 16), (224, 224), (14, 14))), 224, 196, {}),  # tokens pooled/dropped: no layout
        (object(), 224, 197, {}),
    ],
)
def test_timm_token_layout(model, size, tokens, expected):
    assert _token_layout(model, size, tokens) == expected
