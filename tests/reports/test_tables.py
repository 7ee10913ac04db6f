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
