"""``randattn mse --position-buckets EDGES``: edges must start at 1 (refused before anything is computed otherwise),
and a run with edges gives a row per bucket whose ``queries`` counts the bucket's measured queries."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.cli import main

TOKENS = 11
HEADS = 2


@pytest.fixture(scope="module")
def acts(tmp_path_factory):
    rng = np.random.default_rng(7)
    arrays = {0: tuple(0.8 * rng.normal(size=(1, HEADS, TOKENS, 4)) for _ in range(3))}
    return save_activations(make_activations(arrays, {"scale": 0.5, "model": "synthetic", "layout": "sequence"}),
                            tmp_path_factory.mktemp("buckets") / "acts.safetensors")


def _mse(acts, *args):
    common = ["mse", str(acts), "-e", "ra", "--samples", "4", "--replicates", "3", "--no-diagnostics"]
    return CliRunner().invoke(main, [*common, *map(str, args)], catch_exceptions=False)


@pytest.mark.parametrize(("edges", "fixed"), [("8161", "1,8161"), ("100000", "1,100000"), ("4,8", "1,4,8")])
def test_edges_whose_first_is_not_1_exit_2_before_anything_is_written(acts, tmp_path, edges, fixed):
    out = tmp_path / "b.parquet"
    result = _mse(acts, "--mask", "causal", "--position-buckets", edges, "--out", out)
    assert result.exit_code == 2, result.output
    assert " ".join(result.output.split()) == (
        f"error: --position-buckets {edges!r}: the first lower edge must be 1, so that every query falls in a bucket "
        f"(positions start at 1, and those below the first edge would be in none); use {fixed}"
    ), result.output
    assert list(tmp_path.iterdir()) == []


def test_malformed_edges_still_name_the_option(acts, tmp_path):
    result = _mse(acts, "--position-buckets", "4,2", "--out", tmp_path / "b.parquet")
    assert result.exit_code == 2, result.output
    assert "error: --position-buckets '4,2': use log2, none, auto or strictly increasing positive lower edges such " \
           "as 1,2,4,8,64" in " ".join(result.output.split())


def _independent_counts(rows, lo, hi, num_queries=TOKENS, num_keys=TOKENS):
    """How many of the measured query ``rows`` have their position p = n + M - N + 1 in [lo, hi], counted directly."""
    return sum(1 for n in rows if lo <= n + num_keys - num_queries + 1 <= hi)


@pytest.mark.parametrize(("queries", "rows", "expected"), [
    ("all", range(TOKENS), [(1, 3), (4, TOKENS)]),
    ("last:5", range(TOKENS - 5, TOKENS), [(4, TOKENS)]),  # no measured query in 1-3: that bucket is left out
])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_edges_1_4_give_a_row_per_bucket_counting_its_queries(acts, tmp_path, queries, rows, expected, mask):
    out = tmp_path / "b.parquet"
    result = _mse(acts, "--mask", mask, "--position-buckets", "1,4", "--queries", queries, "--out", out)
    assert result.exit_code == 0, result.output
    positions = pd.read_parquet(tmp_path / "b.positions.parquet")
    assert sorted(set(zip(positions.position_lo, positions.position_hi))) == expected
    for (lo, hi), bucket in positions.groupby(["position_lo", "position_hi"]):
        assert len(bucket) == HEADS  # one row per head at the one S
        assert set(bucket["queries"]) == {_independent_counts(rows, lo, hi)}, (lo, hi)
    # the buckets hold every measured query once
    assert positions.groupby("head")["queries"].sum().tolist() == [len(rows)] * HEADS
