"""``randattn report`` and ``plot`` given a run's per-position table instead of its main table: exit 2 naming the
file and the main table, before anything is written.

The per-position table has one row per (head, S, query-position bucket); read as a results table, its buckets were
averaged as if they were heads, and the report's "Mean MSE" was wrong without a word."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.cli import main
from randattn.results import PositionsTableError, ResultsError, read_results

TOKENS = 11


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny causal run: ``g1.parquet`` and its per-position table ``g1.positions.parquet`` beside it."""
    folder = tmp_path_factory.mktemp("positions_table")
    rng = np.random.default_rng(5)
    arrays = {0: tuple(0.8 * rng.normal(size=(1, 2, TOKENS, 4)) for _ in range(3))}
    acts = save_activations(make_activations(arrays, {"scale": 0.5, "model": "synthetic", "layout": "sequence"}),
                            folder / "acts.safetensors")
    out = folder / "g1.parquet"
    result = _invoke("mse", acts, "--mask", "causal", "-e", "ra", "--samples", "4", "--replicates", "3",
                     "--no-diagnostics", "--out", out)
    assert result.exit_code == 0, result.output
    positions = folder / "g1.positions.parquet"
    assert positions.is_file(), result.output
    return out, positions


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _said(result) -> str:
    return " ".join(result.output.split())


@pytest.mark.parametrize("command", ["report", "plot"])
def test_the_per_position_table_is_refused_naming_it_and_the_main_table(run, tmp_path, command):
    out, positions = run
    target = tmp_path / "r2"
    result = _invoke(command, positions, "--out", target)
    assert result.exit_code == 2, result.output
    assert _said(result) == (
        f"error: {str(positions)!r} is the per-position table of a run (one row per head, S and query-position "
        f"bucket), not a results table; randattn {command} takes the run's main table, {str(out)!r}, and reads the "
        "per-position table beside it"
    ), result.output
    assert not target.exists()  # refused before the output folder was kept or anything was written into it


def test_a_renamed_per_position_table_without_metadata_is_known_by_its_columns(run, tmp_path):
    """No ``.positions`` in the name, no sidecar: the bucket columns alone identify it; no main table is named."""
    _, positions = run
    bare = tmp_path / "mystery.csv"
    pd.read_parquet(positions).to_csv(bare, index=False)
    result = _invoke("report", bare, "--out", tmp_path / "r3")
    assert result.exit_code == 2, result.output
    assert _said(result) == (
        f"error: {str(bare)!r} is the per-position table of a run (one row per head, S and query-position bucket), "
        "not a results table; randattn report takes the run's main table, and reads the per-position table beside it"
    ), result.output
    assert not (tmp_path / "r3").exists()


def test_a_missing_main_table_is_said_to_be_missing(run, tmp_path):
    _, positions = run
    moved = tmp_path / "g1.positions.parquet"
    moved.write_bytes(positions.read_bytes())  # without its sidecar: the main table's name comes from its own
    result = _invoke("plot", moved, "--out", tmp_path / "figs")
    assert result.exit_code == 2, result.output
    assert f"takes the run's main table, {str(tmp_path / 'g1.parquet')!r} (not found there), and reads" in _said(result)


def test_read_results_for_a_main_table_raises_a_typed_error_with_the_paths(run):
    out, positions = run
    with pytest.raises(PositionsTableError) as caught:
        read_results(positions, main_table=True)
    assert isinstance(caught.value, ResultsError) and isinstance(caught.value, ValueError)
    assert caught.value.path == positions and caught.value.main_path == out
    assert "per-position table" in str(caught.value) and repr(str(out)) in str(caught.value)
    assert "position_lo" in read_results(positions).table  # without main_table it reads as any table


def test_the_main_table_still_reads_with_its_positions(run):
    out, _ = run
    loaded = read_results(out, main_table=True)
    assert loaded.positions is not None and {"position_lo", "position_hi"} <= set(loaded.positions.columns)
    assert "position_lo" not in loaded.table.columns
