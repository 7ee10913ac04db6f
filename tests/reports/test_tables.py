"""Reading results tables: the metadata stored in a Parquet file and in the ``.meta.json`` beside it."""

from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest

from randattn.analysis.sweep import write_table
from randattn.results import MetadataConflictWarning, read_results

ROWS = pd.DataFrame({"estimator": ["rfa"], "label": ["rfa"], "num_samples": [4], "mse": [0.5], "variance": [0.4],
                     "bias_sq": [0.1]})


def test_the_same_metadata_in_the_file_and_beside_it_reads_without_a_warning(tmp_path):
    """NaN included: compared as JSON text, NaN equals NaN."""
    table, sidecar = write_table(ROWS, tmp_path / "r.parquet", {"seed": 3, "reference_check": {"dev": float("nan")}})
    assert sidecar.name == "r.parquet.meta.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_results(table).metadata["seed"] == 3


def test_an_edited_sidecar_is_named_and_the_files_own_metadata_wins(tmp_path):
    table, sidecar = write_table(ROWS, tmp_path / "r.parquet", {"seed": 3, "note": "a", "model": "m"})
    edited = {**json.loads(sidecar.read_text()), "seed": 4, "note": "b", "added": 1}
    sidecar.write_text(json.dumps(edited))
    with pytest.warns(MetadataConflictWarning, match=r"r\.parquet\.meta\.json differs from the metadata stored in "
                                                     r"the file \(note, seed\); the file's own is used"):
        metadata = read_results(table).metadata
    assert (metadata["seed"], metadata["note"], metadata["model"], metadata["added"]) == (3, "a", "m", 1)


def _described(queries: list[str], heads: list[int]) -> str:
    from randattn.reports.tables import describe_data

    table = pd.DataFrame({"model": "tinylm", "image": "pydoc:for", "layer": 0, "head": heads, "mask": "causal",
                          "random": True, "replicates": 4, "queries": queries})
    return describe_data(table, {"layout": "sequence"})


def test_a_table_of_the_last_queries_says_so_in_its_description():
    """Figures and the report take their subtitle from describe_data: a decode measurement (--queries last:64)
    must not read as one of every query, and one head is one head."""
    assert _described(["last:64"], [3]) == ("tinylm · 1 sequence (pydoc:for) · layer 0 · 1 head · causal mask · "
                                            "the last 64 queries of each head · R = 4")
    assert "64 sampled queries of each head" in _described(["sample:64", "sample:64"], [0, 1])
    assert "queries" not in _described(["all", "all"], [0, 1]) and "· 2 heads ·" in _described(["all", "all"], [0, 1])


def test_a_per_position_table_takes_the_query_selection_from_the_metadata():
    """Its `queries` column counts a bucket's queries; the run's selection is the metadata's."""
    from randattn.reports.tables import describe_data

    positions = pd.DataFrame({"model": "tinylm", "head": [0], "position_lo": [4096], "position_hi": [8191],
                              "queries": [63]})
    assert describe_data(positions, {"queries": {"selection": "last:64", "of": 8192}}) == \
        "tinylm · 1 head · the last 64 queries of each head"
    assert describe_data(positions, {"queries": {"selection": "all", "of": 8192}}) == "tinylm · 1 head"
    assert describe_data(positions, {}) == "tinylm · 1 head"
    assert describe_data(positions, {"queries": {"of": 8192}}) == "tinylm · 1 head"  # recorded before a selection


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".json"])
def test_the_query_selection_reads_back_as_written(tmp_path, suffix):
    """The results table's `queries` is the selection, a string: reading it as a per-position table's count
    turned 'last:64' into NaN, and the report and figures of a decode run into ones of every query."""
    rows = pd.concat([ROWS.assign(queries="last:64"), ROWS.assign(estimator="ra", label="ra", queries="sample:8")])
    table, _ = write_table(rows, tmp_path / f"r{suffix}", {"seed": 3})
    assert list(read_results(table).table["queries"]) == ["last:64", "sample:8"]


@pytest.mark.parametrize("suffix", [".parquet", ".csv", ".json"])
def test_a_per_position_tables_query_counts_read_back_as_integers(tmp_path, suffix):
    """Its `queries` is a count of the bucket's queries, read back as the integer written (no conversion needed)."""
    rows = pd.DataFrame({"estimator": ["rfa", "rfa"], "label": ["rfa", "rfa"], "num_samples": [4, 4],
                         "position_lo": [1, 2], "position_hi": [1, 3], "queries": [1, 2], "mse": [0.5, 0.25]})
    path = tmp_path / f"r.positions{suffix}"
    {".parquet": rows.to_parquet, ".csv": lambda p: rows.to_csv(p, index=False),
     ".json": lambda p: rows.to_json(p, orient="records")}[suffix](path)
    counts = read_results(path).table["queries"]
    assert pd.api.types.is_integer_dtype(counts) and list(counts) == [1, 2]


def test_a_broken_promise_line_names_the_quantity_its_rate_counts():
    """``P(err > eps)`` for the output (and for a record from before ``violation_of``), ``P(denominator err > eps)``
    for a promise on the denominator."""
    from randattn.reports.console import broken_promise_lines

    record = {"label": "vattention", "num_samples": 64, "layer": 0, "head": 3, "image": "text", "epsilon": 0.05,
              "delta": 0.05, "violation_rate": 0.5, "violation_lo": 0.4, "violation_hi": 0.6}
    old, output, denominator = broken_promise_lines([record, {**record, "violation_of": "output"},
                                                     {**record, "violation_of": "denominator"}], noun="sequence")
    assert old == output
    assert "layer 0 head 3 sequence text: P(err > 0.05) = 0.5 [0.4, 0.6] > delta = 0.05" in output
    assert "layer 0 head 3 sequence text: P(denominator err > 0.05) = 0.5 [0.4, 0.6] > delta = 0.05" in denominator


def test_a_table_written_by_a_newer_randattn_is_said_to_be(tmp_path):
    """A table whose metadata names a later release was read without a word; what that version added (columns,
    rules) may be read wrongly. This version's own tables, older ones and a missing version read silently."""
    from importlib.metadata import version

    from randattn.results import NewerTableWarning

    newer, _ = write_table(ROWS, tmp_path / "new.parquet", {"randattn_version": "9.0.0"})
    with pytest.warns(NewerTableWarning, match=r"new\.parquet. was written by randattn 9\.0\.0, newer than this "):
        read_results(newer)
    for name, written in (("same", version("randattn")), ("old", "0.1.0"), ("none", None), ("odd", "unknown")):
        table, _ = write_table(ROWS, tmp_path / f"{name}.parquet", {"randattn_version": written})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            read_results(table)
