"""Sweeps: configurations, seeds, chunking invariance, interruption and resume, aggregation, output."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from randattn.activations import make_activations
from randattn.analysis.sweep import (
    COLUMNS,
    SweepConfig,
    aggregate,
    cell_seed,
    estimator_config,
    parse_estimator_list,
    read_parts,
    run_sweep,
    write_table,
)


@pytest.fixture
def acts(rng):
    arrays = {layer: tuple(0.8 * rng.normal(size=(2, 2, 9, 4)) for _ in range(3)) for layer in (0, 5)}
    return make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["cat", "dog"]})


def _config(**kw):
    base = dict(
        estimators=parse_estimator_list("rfa;rfa:coupling=orthogonal;ra;softmax"),
        num_samples=(4, 8), replicates=3, seed=11, diagnostics=False,
    )
    base.update(kw)
    return SweepConfig(**base)


def _without_time(table):
    return table.drop(columns=["seconds"])


def test_estimator_config_label_and_params():
    c = estimator_config("rfa:coupling=orthogonal")
    assert c.label == "rfa:coupling=orthogonal" and c.random and c.needs_samples
    assert json.loads(c.params_json) == {"coupling": "orthogonal", "feature_map": "positive"}
    assert estimator_config("rfa").label == "rfa"
    assert estimator_config("ra:sample=mean,variant=biased").random is False
    with pytest.raises(ValueError, match="unknown estimator 'nope'"):
        parse_estimator_list("rfa;nope")


def test_table_schema_and_deterministic_rows(acts):
    table = run_sweep(acts, _config())
    assert tuple(table.columns) == COLUMNS
    # 2 layers x 2 images x 2 heads x (3 S-dependent estimators x 2 S + softmax reported at both S)
    assert len(table) == 2 * 2 * 2 * 4 * 2
    soft = table[table.estimator == "softmax"]
    assert (soft.replicates == 1).all() and not soft.random.any()
    assert (soft.variance == 0).all() and (soft.mse_se == 0).all()
    assert soft.mse.max() < 1e-28 and soft.prob_mse.max() < 1e-28
    rand = table[table.random]
    assert (rand.replicates == 3).all() and (rand.variance > 0).all()
    assert set(table.image) == {"cat", "dog"} and set(table.layer) == {0, 5}


def test_seed_reproducibility_and_chunking_invariance(acts):
    big = run_sweep(acts, _config(max_memory=2**34))
    small = run_sweep(acts, _config(max_memory=1))  # one cell, one replicate at a time
    pd.testing.assert_frame_equal(_without_time(big), _without_time(small))
    other = run_sweep(acts, _config(seed=12))
    assert not np.allclose(other.mse[other.random], big.mse[big.random])
    row = big.iloc[0]
    assert row["seed"] == cell_seed(11, row["image"], row["layer"], row["head"], row["params"], row["estimator"],
                                    row["num_samples"])


def test_interrupted_sweep_resumes_to_the_same_table(acts, tmp_path):
    config = _config(max_memory=1, diagnostics=True, khat_queries=2)
    full = run_sweep(acts, config, parts_dir=tmp_path / "full")

    calls = []

    def stop_after_five(progress):
        calls.append(progress)
        if len(calls) == 5:
            raise KeyboardInterrupt("simulated interruption")

    with pytest.raises(KeyboardInterrupt):
        run_sweep(acts, config, parts_dir=tmp_path / "cut", progress=stop_after_five)
    kept = read_parts(tmp_path / "cut")
    assert 0 < len(kept) < len(full)
    with pytest.raises(FileExistsError, match="resume=True"):
        run_sweep(acts, config, parts_dir=tmp_path / "cut")
    with pytest.raises(ValueError, match="different settings \\(seed\\)"):
        run_sweep(acts, _config(max_memory=1, diagnostics=True, khat_queries=2, seed=3), parts_dir=tmp_path / "cut",
                  resume=True)
    resumed = run_sweep(acts, _config(max_memory=2**34, diagnostics=True, khat_queries=2), parts_dir=tmp_path / "cut",
                        resume=True)
    pd.testing.assert_frame_equal(_without_time(full), _without_time(resumed))


def test_torch_backend_float64_matches_reference(acts):
    ref = run_sweep(acts, _config(layers=(5,), heads=(1,)))
    tor = run_sweep(acts, _config(layers=(5,), heads=(1,), backend="torch", dtype="float64"))
    for column in ("mse", "variance", "bias_sq", "rel_error", "prob_mse"):
        np.testing.assert_allclose(tor[column], ref[column], rtol=1e-9, atol=1e-14, err_msg=column)


def test_single_replicate_random_estimator_warns(acts):
    with pytest.warns(RuntimeWarning, match="R >= 2"):
        table = run_sweep(acts, _config(replicates=1, estimators=parse_estimator_list("rfa"), num_samples=(4,)))
    assert table.variance.isna().all() and table.mse.notna().all()


def test_bad_selection_raises(acts):
    with pytest.raises(ValueError, match="layers \\[3\\] not in the activations"):
        run_sweep(acts, _config(layers=(3,)))


def test_aggregate_follows_lara_h1():
    rows = []
    # image a: layer 0 heads (1, 3), layer 1 heads (5, 7) -> layer means 2, 6 -> image mean 4; image b -> 10
    for image, values in (("a", (1, 3, 5, 7)), ("b", (7, 9, 11, 13))):
        for (layer, head), mse in zip(((0, 0), (0, 1), (1, 0), (1, 1)), values):
            rows.append(dict(estimator="rfa", label="rfa", num_samples=8, tokens=9, image=image, layer=layer,
                             head=head, mse=float(mse), bias_sq=0.0, variance=float(mse)))
    summary = aggregate(pd.DataFrame(rows), n_boot=500)
    assert len(summary) == 1
    row = summary.iloc[0]
    assert row.mse == pytest.approx(7.0) and row.ci_over == "images" and row.units == 2
    assert 4.0 <= row.mse_lo <= row.mse_hi <= 10.0
    single = aggregate(pd.DataFrame([r for r in rows if r["image"] == "a"]), n_boot=500)
    assert single.iloc[0].ci_over == "heads" and single.iloc[0].mse == pytest.approx(4.0)


def test_write_table_keeps_metadata(acts, tmp_path):
    table = run_sweep(acts, _config(layers=(0,), estimators=parse_estimator_list("rfa"), num_samples=(4,)))
    meta = {"seed": 11, "command_line": "randattn mse x.safetensors"}
    for suffix in (".parquet", ".csv", ".json"):
        path, sidecar = write_table(table, tmp_path / f"r{suffix}", meta)
        assert json.loads(sidecar.read_text())["seed"] == 11
    import pyarrow.parquet as pq

    stored = pq.read_table(tmp_path / "r.parquet")
    assert json.loads(stored.schema.metadata[b"randattn"])["command_line"] == "randattn mse x.safetensors"
    pd.testing.assert_frame_equal(stored.to_pandas(), table)
    with pytest.raises(ValueError, match="unknown suffix"):
        write_table(table, tmp_path / "r.xlsx", meta)
