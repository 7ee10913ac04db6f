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
    plan,
    read_parts,
    run_sweep,
    write_table,
)
from randattn.results import stored_unit_ids


@pytest.fixture
def acts(rng):
    arrays = {layer: tuple(0.8 * rng.normal(size=(2, 2, 9, 4)) for _ in range(3)) for layer in (0, 5)}
    return make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["cat", "dog"]})


def _config(**kw):
    base = dict(
        estimators=parse_estimator_list("rfa;rfa:coupling=orthogonal;ra;softmax"),
        num_samples=(4, 8), replicates=3, seed=11, diagnostics=False, backend="reference",
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


def test_adaptive_vattention_is_measured_once_and_reported_at_every_s(acts):
    """vAttention's adaptive budget sets its own sample size (its spec's needs_samples is a function of the
    parameters): one unit per (layer, image), drawn with S = None, its rows the same at both S; the fixed budget is
    measured at each S."""
    small = "sinks=1,local=1,top_k=1"
    adaptive, fixed = f"vattention:{small}", f"vattention:budget=fixed,{small}"
    config = _config(estimators=parse_estimator_list(f"{adaptive};{fixed}"), num_samples=(2, 3))
    units = plan(acts, config)
    assert [u.num_samples for u in units if u.label == adaptive] == [None] * 4  # 2 layers x 2 images
    assert sorted(u.num_samples for u in units if u.label == fixed) == [2, 2, 2, 2, 3, 3, 3, 3]
    table = run_sweep(acts, config)
    keys = ["layer", "image", "head"]
    rows = table[table.label == adaptive].set_index(keys)
    at_2, at_3 = rows[rows.num_samples == 2].sort_index(), rows[rows.num_samples == 3].sort_index()
    assert len(at_2) == 8 and at_2["mse"].gt(0).all()
    pd.testing.assert_series_equal(at_2["mse"], at_3["mse"])
    fixed_rows = table[table.label == fixed].set_index(keys)
    assert not np.array_equal(fixed_rows[fixed_rows.num_samples == 2].sort_index()["mse"],
                              fixed_rows[fixed_rows.num_samples == 3].sort_index()["mse"])


def _one_cell_replicate_budget(acts, config) -> int:
    """The budget that makes every block a single (cell, replicate) of the largest unit."""
    from randattn.analysis.execute import UnitRunner

    runner = UnitRunner(acts, config)
    return int(1.1 * max(runner.cell_bytes(u) for u in plan(acts, config)))  # calibration varies by a few bytes


@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow), "torch"])
def test_rows_are_bitwise_independent_of_the_memory_budget(acts, backend):
    every = parse_estimator_list("rfa;rfa:coupling=orthogonal;ra;softmax;lara;lara:weighting=balance;eva:window=4")
    common = dict(backend=backend, diagnostics=True, khat_queries=2, estimators=every, layers=(5,),
                  replicates=17)
    config = _config(**common)
    one_block = _one_cell_replicate_budget(acts, config) * 2 * 17  # the canonical block: 2 heads x 17 replicates
    big = run_sweep(acts, config)
    small = run_sweep(acts, _config(**common, max_memory=one_block))
    pd.testing.assert_frame_equal(_without_time(big), _without_time(small), check_exact=True)
    # below one canonical block the split is finer: equal to rounding (float32 for the positive-weight
    # configurations under dtype=auto: relative 1e-5 is ~100 float32 ulps accumulated over a few sums)
    tiny = run_sweep(acts, _config(**common, images=(1,), max_memory=_one_cell_replicate_budget(acts, config)))
    big = big[big.image == "dog"].reset_index(drop=True)
    numeric = [c for c in big.columns if big[c].dtype == np.float64
               and c not in ("seconds", "ref_max_abs_dev", "ref_max_rel_err", "ref_rms_dev")]  # the checked cell moves
    rtol = 1e-9 if backend == "reference" else 1e-5
    np.testing.assert_allclose(tiny[numeric].to_numpy(), big[numeric].to_numpy(), rtol=rtol, atol=1e-12)
    other = run_sweep(acts, _config(seed=12))
    base = run_sweep(acts, _config())
    assert not np.allclose(other.mse[other.random], base.mse[base.random])
    row = base.iloc[0]
    assert row["seed"] == cell_seed(11, row["image"], row["layer"], row["head"], row["params"], row["estimator"],
                                    row["num_samples"])


def test_a_unit_that_cannot_fit_is_refused_before_computing(acts):
    from randattn.analysis.sweep import MemoryBudgetError

    calls = []
    with pytest.raises(MemoryBudgetError, match="more than the memory budget of 1 B.*raise max_memory") as raised:
        run_sweep(acts, _config(max_memory=1), progress=calls.append)
    assert calls == []
    assert raised.value.budget == 1 and raised.value.needed > 1 and not raised.value.store


def test_auto_dtype_is_float64_for_signed_weights_only(acts):
    table = run_sweep(acts, _config(backend="torch", estimators=parse_estimator_list(
        "rfa;rfa:feature_map=trigonometric;lara;lara:weighting=balance;lara:alpha_clamp=1e-8;lara:weighting=coupled"),
        num_samples=(4,)))
    dtypes = table.groupby("label")["dtype"].unique().map(tuple).to_dict()
    assert dtypes == {"rfa": ("float32",), "rfa:feature_map=trigonometric": ("float64",), "lara": ("float64",),
                      "lara:weighting=balance": ("float32",), "lara:alpha_clamp=1e-08": ("float32",),
                      "lara:weighting=coupled": ("float64",)}
    ref = run_sweep(acts, _config(estimators=parse_estimator_list("rfa"), num_samples=(4,)))
    assert set(ref["dtype"]) == {"float64"}


def test_reference_check_reruns_the_first_unit_of_each_configuration(acts):
    table = run_sweep(acts, _config(backend="torch", dtype="float64", check_reference=1e-12))
    checked = table[np.isfinite(table.ref_max_abs_dev) & (table.num_samples == 4)]
    # the first unit of each configuration (layer 0, first S, image cat): its first head only
    assert sorted(checked.label) == sorted(["rfa", "rfa:coupling=orthogonal", "ra", "softmax"])
    assert (checked.layer == 0).all() and (checked.image == "cat").all() and (checked["head"] == 0).all()
    assert (checked.ref_max_abs_dev < 1e-10).all()  # float64 batched == reference with the same draws
    everything = run_sweep(acts, _config(backend="torch", check_reference=1.0))
    assert np.isfinite(everything.ref_max_abs_dev).sum() == everything.groupby(
        ["layer", "label", "num_samples", "image"]).ngroups  # one checked row per unit and reported S
    none = run_sweep(acts, _config(backend="torch", check_reference=0.0))
    assert none.ref_max_abs_dev.isna().all()


def _signed_acts():
    """2 layers x 2 images of large q, k: trigonometric RFA's normalizer turns negative in every unit."""
    rng = np.random.default_rng(3)
    arrays = {layer: (rng.normal(size=(2, 2, 30, 6)) * 3, rng.normal(size=(2, 2, 30, 6)) * 8,
                      rng.normal(size=(2, 2, 30, 6))) for layer in (0, 1)}
    return make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["cat", "dog"]})


def _signed_config(**kw):
    return SweepConfig(estimators=parse_estimator_list("rfa:feature_map=trigonometric;rfa"), num_samples=(4,),
                       replicates=8, seed=0, backend="reference", diagnostics=False, **kw)


def _raised_per_unit(acts, config):
    """unit id -> the warnings running it alone raises (one UnitRunner.run per unit, warnings caught here)."""
    import warnings

    from randattn.analysis.execute import UnitRunner

    runner, raised = UnitRunner(acts, config), {}
    for unit in plan(acts, config):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.run(unit)
        raised[unit.uid] = caught
    return raised


def test_warnings_count_the_units_that_raised_them_and_the_times_in_all():
    acts, config = _signed_acts(), _signed_config()
    raised = _raised_per_unit(acts, config)  # independent: each unit run alone, its warnings counted here
    units = sum(bool(caught) for caught in raised.values())
    times = sum(len(caught) for caught in raised.values())
    assert units == 4 and times > units  # 4 units of trigonometric RFA raise it, each more than once
    with pytest.warns(RuntimeWarning, match=f"rfa:feature_map=trigonometric: .*normalizer.*\\(raised by {units} "
                                            f"units, {times} times in all\\)"):
        table = run_sweep(acts, config)
    records = table.attrs["warnings"]
    assert len(records) == 1 and records[0]["label"] == "rfa:feature_map=trigonometric"
    assert records[0]["units"] == units and records[0]["count"] == times
    assert records[0]["category"] == "NonPositiveDenominatorWarning"


def test_a_resumed_sweep_reports_the_warnings_its_first_part_raised(tmp_path):
    """Each part keeps its unit's warnings: the resumed run's record is the uninterrupted run's."""
    acts, config = _signed_acts(), _signed_config()
    with pytest.warns(RuntimeWarning):
        full = run_sweep(acts, config, parts_dir=tmp_path / "full").attrs["warnings"]
    seen = []

    def stop_after_three(progress):
        seen.append(progress)
        if len(seen) == 3:
            raise KeyboardInterrupt("simulated interruption")

    with pytest.raises(KeyboardInterrupt):
        run_sweep(acts, config, parts_dir=tmp_path / "cut", progress=stop_after_three)
    first = stored_unit_ids(tmp_path / "cut")
    raised = _raised_per_unit(acts, config)
    assert len(first) == 3 and sum(bool(raised[uid]) for uid in first) == 2  # the first part raised it twice over
    with pytest.warns(RuntimeWarning, match="raised by 4 units"):
        resumed = run_sweep(acts, config, parts_dir=tmp_path / "cut", resume=True)
    assert resumed.attrs["timing"]["units"] == len(raised) - 3
    assert resumed.attrs["warnings"] == full
    assert full[0]["units"] == 4 and full[0]["count"] == sum(len(c) for c in raised.values())


def test_the_guide_states_the_split_rounding_as_the_cli_does():
    """docs/guide/sweeps.md says what ``randattn mse``'s plan says of a split (SPLIT_ROUNDING), and no longer
    that the split never changes a row."""
    from pathlib import Path

    from randattn.analysis.cell_memory import SPLIT_ROUNDING

    guide = " ".join((Path(__file__).resolve().parents[2] / "docs" / "guide" / "sweeps.md").read_text().split())
    assert SPLIT_ROUNDING in guide and "never changes a row" not in guide


@pytest.mark.slow  # three memory calibrations and two sweeps, ~5 s on 2 cores
def test_a_split_moves_rows_within_the_stated_rounding(monkeypatch):
    """Below the canonical block, float32 rows move by rounding: each estimate by at most twice its rounding error
    (the largest |float32 - float64 reference| of its cell, same draws), the MSE by at most
    2 d / RMSE + (d / RMSE)^2 relative with d that bound (|mean((e + x)^2) - mean(e^2)| <= 2 max|x| RMSE + max|x|^2),
    as SPLIT_ROUNDING says."""
    from randattn.analysis import execute
    from randattn.estimators.registry import get_spec

    rng = np.random.default_rng(1)
    heads, n, d = 2, 32, 16
    arrays = {0: tuple(rng.normal(size=(1, heads, n, d)) for _ in range(3))}
    acts = make_activations(arrays, {"scale": d ** -0.5, "model": "synthetic"})
    spied = []
    original = execute.output_metrics
    monkeypatch.setattr(execute, "output_metrics",
                        lambda out, *a, **k: (spied.append(out.clone()), original(out, *a, **k))[1])
    common = dict(estimators=parse_estimator_list("eva:window=4"), num_samples=(8,), replicates=16, seed=0,
                  backend="torch", dtype="float32", diagnostics=False, probabilities=False, threads=1)
    runner = execute.UnitRunner(acts, SweepConfig(**common))
    units = plan(acts, SweepConfig(**common))
    tiny = int(1.1 * max(runner.cell_bytes(u) for u in units))
    big = run_sweep(acts, SweepConfig(**common))
    small = run_sweep(acts, SweepConfig(**common, max_memory=tiny))
    assert all(len(execute.UnitRunner(acts, SweepConfig(**common, max_memory=tiny)).blocks(u)) > 2 for u in units)
    q, k, v = (arrays[0][i][0] for i in range(3))
    logits = np.einsum("cnd,cmd->cnm", q, k) * d ** -0.5
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    exact = np.einsum("cnm,cmd->cnd", weights / weights.sum(-1, keepdims=True), v)  # float64 softmax attention
    moved = {}
    for i, unit in enumerate(units):  # spied: the canonical run's units, then the split run's, in plan order
        est = SweepConfig(**common).estimators[unit.est_index]
        spec = get_spec(est.name)
        draws = execute.cell_draws(spec, est, (n, d), (n, d), unit.seeds, range(16), 8)
        reference = np.asarray(spec.reference(q, k, v, draws, scale=d ** -0.5, **est.params))  # (R, C, N, Dv)
        canonical, split = (spied[j].numpy() + exact for j in (i, len(units) + i))
        error = np.abs(canonical - reference).max(axis=(0, 2, 3))  # per head: the float32 rounding of its estimates
        delta = np.abs(split - canonical).max(axis=(0, 2, 3))
        assert (delta <= 2 * error).all(), (unit.label, delta / error)
        rows = big.label == unit.label
        mse, rmse = big.mse[rows].to_numpy(), np.sqrt(big.mse[rows].to_numpy())
        bound = 2 * (2 * error) / rmse + (2 * error / rmse) ** 2
        relative = np.abs(small.mse[rows].to_numpy() - mse) / mse
        assert (relative <= bound).all(), (unit.label, relative, bound)
        moved[unit.label] = (float((delta / error).max()), float(relative.max()))
    print("split: max delta / rounding error, max relative MSE change:", moved)
    assert moved["eva:window=4"][0] > 0  # the split did change EVA's bits (else this test measures nothing)


def test_interrupted_sweep_resumes_to_the_same_table(acts, tmp_path):
    config = _config(diagnostics=True, khat_queries=2)
    config = _config(diagnostics=True, khat_queries=2, max_memory=_one_cell_replicate_budget(acts, config))
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
    stored = len(stored_unit_ids(tmp_path / "cut"))
    with pytest.raises(FileExistsError, match="resume=True"):
        run_sweep(acts, config, parts_dir=tmp_path / "cut")
    with pytest.raises(ValueError, match="different settings \\(seed\\)"):
        run_sweep(acts, _config(diagnostics=True, khat_queries=2, seed=3), parts_dir=tmp_path / "cut",
                  resume=True)
    resumed = run_sweep(acts, _config(max_memory=2**34, diagnostics=True, khat_queries=2), parts_dir=tmp_path / "cut",
                        resume=True)
    pd.testing.assert_frame_equal(_without_time(full), _without_time(resumed))
    # timing counts the units each call ran: all of them, then only those the interruption left
    units = plan(acts, config)
    assert full.attrs["timing"]["units"] == len(units)
    assert 0 < stored < len(units) and resumed.attrs["timing"]["units"] == len(units) - stored
    assert resumed.attrs["timing"]["execute_s"] >= 0


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_timing_phases_are_disjoint_parts_of_every_unit(acts, backend):
    """``timing.phases``: one record per (configuration, S, tokens), every unit and cell counted once, and
    the phases, disjoint intervals inside a unit, add up to at most the unit's wall time (its rows' seconds)."""
    from randattn.analysis.execute import PHASES

    config = _config(backend=backend, diagnostics=True, check_reference=1.0 if backend == "torch" else 0.0)
    table = run_sweep(acts, config)
    timing = table.attrs["timing"]
    records = {(p["label"], p["num_samples"], p["tokens"]): p for p in timing["phases"]}
    assert len(records) == len(timing["phases"])  # one record per key
    units = plan(acts, config)
    assert sum(p["units"] for p in records.values()) == timing["units"] == len(units)
    for (label, s, tokens), record in records.items():
        mine = [u for u in units if u.label == label and u.num_samples == s]
        assert record["units"] == len(mine) and record["cells"] == sum(len(u.heads) for u in mine) and tokens == 9
        assert all(record[phase] >= 0.0 for phase in PHASES)
        rows = table[(table.label == label) & (table.num_samples == (s if s is not None else table.num_samples))]
        unit_wall = rows.drop_duplicates(["image", "layer", "head"]).seconds.sum()  # seconds per cell, per unit
        assert sum(record[phase] for phase in PHASES) <= unit_wall * (1 + 1e-9) + 1e-3  # rounded to 0.1 ms
    random = [p for p in records.values() if p["label"] != "softmax"]
    assert all(p["draws"] > 0 and p["estimate"] > 0 and p["metrics"] > 0 for p in random)
    assert any(p["exact"] > 0 for p in records.values())
    if backend == "torch":
        assert any(p["reference_check"] > 0 for p in random)


def test_timing_phases_add_every_blocks_interval(acts, monkeypatch):
    """Under a clock that ticks once per reading a phase's seconds count its intervals: one per block (3 blocks
    of 8, 8 and 4 replicates) for the draws, estimates, diagnostics and reference check, one per unit for the exact
    attention and the metrics; a phase that dropped, overwrote or took another's interval would count otherwise."""
    import itertools
    from types import SimpleNamespace

    from randattn.analysis import execute

    ticks = itertools.count()
    monkeypatch.setattr(execute, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    # a whole unit fits one block under the default budget; blocks of 8 replicates, as a small budget makes them
    monkeypatch.setattr(execute, "split_blocks", lambda cells, reps, *budget: [
        (slice(0, cells), slice(r, min(r + 8, reps))) for r in range(0, reps, 8)])
    config = _config(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=20, diagnostics=True)
    table = run_sweep(acts, config)
    [record] = table.attrs["timing"]["phases"]
    units = 2 * 2  # layers x images, 2 heads each
    assert (record["label"], record["num_samples"], record["tokens"]) == ("rfa", 4, 9)
    assert record["units"] == units and record["cells"] == 2 * units
    assert {phase: record[phase] for phase in execute.PHASES} == {
        "exact": units, "draws": 3 * units, "estimate": 3 * units, "diagnostics": 3 * units,
        "reference_check": 3 * units, "metrics": units}
    # a unit's wall time spans 19 readings after its start (1 + 5 per block + 3), over its 2 cells
    assert (table.seconds == 19 / 2).all()


def test_parts_on_disk_have_the_table_dtypes(acts, tmp_path):
    """A part read as it is (no coercion) already has the table's column types: ints stay int64, not float."""
    run_sweep(acts, _config(), parts_dir=tmp_path / "parts")
    part = pd.read_parquet(sorted((tmp_path / "parts").glob("part-*.parquet"))[0])
    table = read_parts(tmp_path / "parts")
    assert list(part.columns) == list(COLUMNS)
    assert part.dtypes.to_dict() == table.dtypes.to_dict()
    assert str(part["layer"].dtype) == "int64" and str(part["random"].dtype) == "bool"


def test_plan_runs_each_image_layer_consecutively(acts):
    """Units of one (layer, image) are adjacent, so the runner computes its exact attention once."""
    units = plan(acts, _config())
    keys = [(u.layer, u.image) for u in units]
    runs = [key for i, key in enumerate(keys) if i == 0 or key != keys[i - 1]]
    assert len(runs) == len(set(keys)) > 1
    # layer by layer (the progress bar and a resumed run see whole layers finish in turn)
    order = [(u.layer, u.image, u.est_index, -1 if u.num_samples is None else u.num_samples) for u in units]
    assert order == sorted(order)


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


def test_a_configuration_without_s_gets_one_interval_at_every_s():
    """Adaptive vAttention's one measurement, repeated at S = 16 and 32, beside top-k's two: its two summary rows are
    the same, intervals included (each S had a bootstrap stream of its own, so the same data read as two
    intervals); the stream is the configuration's, placed after top-k's, whichever S comes first."""
    rows = []
    for label, repeated in (("topk", False), ("vattention", True)):
        for s in (16, 32):
            for head, mse in enumerate((1.0, 2.0, 4.0, 8.0, 3.0)):
                value = mse if repeated else mse * s
                rows.append(dict(estimator=label, label=label, num_samples=s, tokens=64, image="x", layer=0,
                                 head=head, mse=value, bias_sq=0.0, variance=value))
    summary = aggregate(pd.DataFrame(rows), n_boot=200, seed=3).set_index(["label", "num_samples"])
    columns = ["mse", "mse_lo", "mse_hi", "variance_lo", "variance_hi"]
    assert summary.loc[("vattention", 16), columns].tolist() == summary.loc[("vattention", 32), columns].tolist()
    assert summary.loc[("vattention", 16), "mse_lo"] < summary.loc[("vattention", 16), "mse_hi"]
    # top-k's two S resample the same heads alike: its interval scales with the data (mse * S)
    assert summary.loc[("topk", 32), "mse_lo"] == pytest.approx(2 * summary.loc[("topk", 16), "mse_lo"])


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


def test_units_run_with_the_recorded_thread_count(acts, monkeypatch):
    """float32 rounding depends on how many threads split a product: the count is fixed, recorded and applied."""
    import torch

    from randattn.analysis import execute

    seen = []
    original = execute.UnitRunner._run

    def spy(self, unit, *args):
        seen.append(torch.get_num_threads())
        return original(self, unit, *args)

    monkeypatch.setattr(execute.UnitRunner, "_run", spy)
    before = torch.get_num_threads()
    table = run_sweep(acts, _config(backend="torch", threads=1, estimators=parse_estimator_list("rfa"),
                                    num_samples=(4,), layers=(0,)))
    assert seen and set(seen) == {1} and torch.get_num_threads() == before
    from randattn.analysis.plan import with_threads

    assert with_threads(_config(backend="torch")).threads == before
    assert with_threads(_config(backend="torch")).identity()["threads"] == before
    assert len(table) == 4


@pytest.mark.filterwarnings("ignore::randattn.estimators.rfa.reference.NonPositiveDenominatorWarning")
def test_signed_lara_probabilities_take_the_float32_product_only_within_its_bound(acts, monkeypatch):
    """Under dtype=auto, signed LARA's prob_mse comes from the float32 product: within the guaranteed
    1e-3 of the float64 run's (and not its bits), every other column the float64 run's bits. With
    the tolerance at 0 no block qualifies and every block is recomputed in float64: the same bits."""
    from randattn.analysis import estimate_block

    config = dict(backend="torch", estimators=parse_estimator_list("lara;lara:proposal=eq32,weighting=coupled"),
                  num_samples=(4, 8), diagnostics=True, khat_queries=2)
    full = _without_time(run_sweep(acts, _config(dtype="float64", **config)))
    auto = _without_time(run_sweep(acts, _config(**config)))
    assert estimate_block.PROBABILITY_ROUNDING_RTOL == 1e-3
    np.testing.assert_allclose(auto.prob_mse, full.prob_mse, rtol=1e-3, atol=0)
    assert not np.array_equal(auto.prob_mse, full.prob_mse)
    pd.testing.assert_frame_equal(auto.drop(columns="prob_mse"), full.drop(columns="prob_mse"), check_exact=True)
    monkeypatch.setattr(estimate_block, "PROBABILITY_ROUNDING_RTOL", 0.0)
    fallback = _without_time(run_sweep(acts, _config(**config)))
    pd.testing.assert_frame_equal(fallback, full, check_exact=True)


def test_probability_rounding_test_on_hand_computed_rows():
    """delta = b + 1.01 u |P|: change = sum delta (2 e + delta), floor = sum max(e - delta, 0)^2."""
    import torch

    from randattn.analysis.probability_error import probability_rounding_negligible as ok

    e = torch.tensor([[[1.0, 0.5]]], dtype=torch.float64)  # (R, C, N) = (1, 1, 2)
    no_p = torch.zeros((1, 2))
    # b = 1e-4 on both rows: change = 1e-4 * 2.0001 + 1e-4 * 1.0001 = 3.0002e-4; floor = 0.9999^2 + 0.4999^2
    assert ok(e, torch.full_like(e, 1e-4), no_p, rtol=3.0002e-4 / (0.9999**2 + 0.4999**2) * 1.000001)
    assert not ok(e, torch.full_like(e, 1e-4), no_p, rtol=3.0002e-4 / (0.9999**2 + 0.4999**2) * 0.999999)
    # the exact probabilities' rounding counts: |P_n| = 1e4 adds 1.01 * 2^-24 * 1e4 = 6.02e-4 to delta
    assert ok(e, torch.zeros_like(e), no_p, rtol=1e-3)
    assert not ok(e, torch.zeros_like(e), torch.full((1, 2), 1e4), rtol=1e-3)
    # a row error below its delta gives a floor of 0 there; a NaN or inf bound fails
    assert not ok(torch.tensor([[[1e-5]]]), torch.tensor([[[1e-4]]]), torch.zeros((1, 1)), rtol=1.0)
    assert not ok(e, torch.tensor([[[1e-4, float("nan")]]]), no_p, rtol=1.0)
    assert not ok(e, torch.tensor([[[1e-4, float("inf")]]]), no_p, rtol=1.0)


def test_parts_of_differing_schemas_are_read_back(acts, tmp_path):
    """A part written by another version (here: pandas, with ``layer`` as float) joins the others: the
    multi-threaded read falls back to reading file by file, and the table keeps its dtypes."""
    from randattn.results import read_parts, write_part

    rows = _without_time(run_sweep(acts, _config(layers=(0,)))).assign(seconds=0.0).to_dict("records")
    write_part(tmp_path, "a", rows[:4])
    old = pd.DataFrame(rows[4:8]).astype({"layer": float})
    old.to_parquet(tmp_path / "part-b.parquet", index=False)
    back = read_parts(tmp_path)
    assert len(back) == 8 and str(back["layer"].dtype) == "int64"
    assert back["layer"].tolist() == [int(r["layer"]) for r in rows[:8]]


@pytest.mark.filterwarnings("ignore::randattn.estimators.rfa.reference.NonPositiveDenominatorWarning")
def test_low_rank_probability_errors_come_from_the_factors_within_their_bound(rng, monkeypatch):
    """Where 16 S <= N, RFA's and LARA's prob_mse are measured from their factors: within the guaranteed 1e-3 of
    the dense pass's (and not its bits), every other column the dense run's bits. With the tolerance at 0 no
    block qualifies and every block goes the dense way: the same bits as a run without factors."""
    from randattn.analysis import estimate_block

    arrays = {0: tuple(0.8 * rng.normal(size=(2, 2, 70, 4)) for _ in range(3))}
    wide = make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["cat", "dog"]})
    config = _config(backend="torch", estimators=parse_estimator_list(
        "rfa:coupling=orthogonal;lara:weighting=balance;lara;rfa:feature_map=trigonometric"), num_samples=(4, 8),
        diagnostics=True, khat_queries=2)
    factored = _without_time(run_sweep(wide, config))
    monkeypatch.setattr(estimate_block, "factored_pays", lambda rank, queries: False)
    dense = _without_time(run_sweep(wide, config))
    np.testing.assert_allclose(factored.prob_mse, dense.prob_mse, rtol=1e-3, atol=0)
    low_rank = (factored.num_samples == 4) & ~factored.label.str.contains("trigonometric")
    assert (factored.prob_mse[low_rank] != dense.prob_mse[low_rank]).all()
    assert np.array_equal(factored.prob_mse[~low_rank], dense.prob_mse[~low_rank])  # 16 x 8 > 70, or no factors
    pd.testing.assert_frame_equal(factored.drop(columns="prob_mse"), dense.drop(columns="prob_mse"), check_exact=True)
    monkeypatch.setattr(estimate_block, "PROBABILITY_ROUNDING_RTOL", 0.0)
    refused = _without_time(run_sweep(wide, config))
    monkeypatch.undo()
    monkeypatch.setattr(estimate_block, "PROBABILITY_ROUNDING_RTOL", 0.0)
    monkeypatch.setattr(estimate_block, "factored_pays", lambda rank, queries: False)
    pd.testing.assert_frame_equal(refused, _without_time(run_sweep(wide, config)), check_exact=True)


@pytest.mark.filterwarnings("ignore::randattn.estimators.rfa.reference.NonPositiveDenominatorWarning")
def test_factored_errors_too_small_for_float32_are_taken_in_float64(rng, monkeypatch):
    """A block whose float32 bound is too loose (forced here) is measured from the same factors in float64: within
    1e-3 of the dense pass and not its bits (a dense pass would give them)."""
    import torch

    from randattn.analysis import estimate_block

    arrays = {0: tuple(0.8 * rng.normal(size=(1, 2, 70, 4)) for _ in range(3))}
    wide = make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["cat"]})
    config = _config(backend="torch", estimators=parse_estimator_list("rfa:coupling=orthogonal;lara"),
                     num_samples=(4,))
    original = estimate_block.factored_sq_errors
    seen = []

    def float32_too_loose(left, *args):
        sq, bound = original(left, *args)
        seen.append(left.dtype)
        return sq, (torch.full_like(bound, float("inf")) if left.dtype == torch.float32 else bound)

    monkeypatch.setattr(estimate_block, "factored_sq_errors", float32_too_loose)
    second_try = _without_time(run_sweep(wide, config))
    assert seen.count(torch.float32) == seen.count(torch.float64) > 0
    monkeypatch.undo()
    monkeypatch.setattr(estimate_block, "factored_pays", lambda rank, queries: False)
    dense = _without_time(run_sweep(wide, config))
    np.testing.assert_allclose(second_try.prob_mse, dense.prob_mse, rtol=1e-3, atol=0)
    assert (second_try.prob_mse != dense.prob_mse).all()
    pd.testing.assert_frame_equal(second_try.drop(columns="prob_mse"), dense.drop(columns="prob_mse"),
                                  check_exact=True)


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_an_estimator_that_raises_is_named_in_a_note_of_its_exception(acts, backend):
    """A plugin whose forms raise: the sweep re-raises its exception unchanged (type and message) with a note naming
    the configuration and the unit, so that the traceback says where in the sweep it came from."""
    import dataclasses

    import randattn
    from randattn.estimators.base import BatchedForms
    from randattn.estimators.registry import register_estimator, unregister_estimator

    def raising(*args, **kwargs):
        raise RuntimeError("planted")

    softmax = randattn.get_spec("softmax")
    register_estimator(dataclasses.replace(softmax, name="crashes", reference=raising,
                                           forms=BatchedForms(estimate=raising)))
    try:
        with pytest.raises(RuntimeError) as raised:
            run_sweep(acts, _config(estimators=parse_estimator_list("crashes"), backend=backend))
    finally:
        unregister_estimator("crashes")
    assert str(raised.value) == "planted"  # the message unchanged: the note stands beside it
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("randattn: raised while ") and "crashes (S = " in notes[0]
    assert ", layer " in notes[0] and ", heads [" in notes[0] and ", image " in notes[0]


def test_the_note_is_kept_where_exceptions_have_no_add_note():
    """Python 3.10 has no ``BaseException.add_note`` (PEP 678 came with 3.11): the note goes to ``__notes__`` as 3.11
    would put it, and the estimator's own exception is raised, where an AttributeError from the missing method
    replaced it. An exception class that hides ``add_note`` stands for 3.10's."""
    from randattn.analysis.execute import raised_while
    from randattn.analysis.plan import Unit

    class WithoutAddNote(RuntimeError):
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    unit = Unit(layer=3, est_index=0, num_samples=8, image=0, image_name="img", heads=(0, 1), label="ra", seeds=(1, 2))
    with pytest.raises(WithoutAddNote) as raised, raised_while("measuring ra", unit):
        raise WithoutAddNote("planted")
    assert raised.value.__notes__ == ["randattn: raised while measuring ra (S = 8, layer 3, heads [0, 1], image img)"]


class _VirtualClock:
    """A clock that moves only when a test says so: the planner's timings are then exact, where sleeping on the wall
    clock left them to the noise of the machine (a loaded CI run read 0.58 s for a planted 0.6 s)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _virtual_clock(monkeypatch) -> _VirtualClock:
    """Give the planner and the unit runner (which times the phases, the reference check among them) one
    :class:`_VirtualClock`."""
    import randattn.analysis.execute as execute
    import randattn.analysis.sweep_plan as sweep_plan

    clock = _VirtualClock()
    monkeypatch.setattr(sweep_plan, "time", clock)
    monkeypatch.setattr(execute, "time", clock)
    return clock


@pytest.mark.parametrize(("heads", "timed", "computed"), [((0,), (1,), [1, 1]), ((0, 1), (2,), [1, 2]),
                                                          ((0, 1, 2), (1, 2), [1, 1, 2])])
def test_the_dry_runs_timing_computes_a_unit_of_one_or_two_heads_whole(heads, timed, computed, monkeypatch):
    """The wall-time estimate computes one head untimed, then per configuration and S one and two heads; a unit of
    one or two heads is timed whole instead (computing it with one head first made a small selection's dry run
    cost more than its run), and its time is the unit's, not extrapolated."""
    from randattn.analysis.execute import UnitRunner
    from randattn.analysis.sweep_plan import plan_sweep

    rng = np.random.default_rng(0)
    acts = make_activations({0: tuple(rng.normal(size=(1, 3, 9, 4)) for _ in range(3))}, {"scale": 0.5})
    seen = []
    original = UnitRunner.run_timed
    clock = _virtual_clock(monkeypatch)

    def counting(self, unit, **kwargs):  # 0.2 s a head, and nothing else, on the planner's clock
        seen.append(len(unit.heads))
        clock.advance(0.2 * len(unit.heads))
        return original(self, unit, **kwargs)

    monkeypatch.setattr(UnitRunner, "run_timed", counting)
    swept = plan_sweep(acts, _config(estimators=parse_estimator_list("rfa"), num_samples=(4,), heads=heads),
                       timing=True)
    assert swept.timed_heads == timed and seen == computed
    # 1 and 2 heads: the unit's own time; 3: 0.2 + (0.4 - 0.2) x 2 from the one- and two-head timings
    assert swept.seconds == pytest.approx(0.2 * len(heads), abs=1e-12)


def test_the_dry_runs_timing_counts_the_reference_check_once_per_checked_unit(monkeypatch):
    """The float64 reference spot check runs once per checked unit, on its first head, whatever the unit's heads
    (MagicPIG's took longer than its estimates): the estimate adds its time per checked unit, and does not
    extrapolate it over the heads. Here it is made to take 0.3 s; with every unit checked (2 units: two layers),
    the estimate is 0.6 s above the unchecked one, not 0.3 s (left out) nor 1.2 s (taken per head), and the dry run
    runs the check once."""
    from randattn.analysis.execute import UnitRunner
    from randattn.analysis.sweep_plan import plan_sweep
    from randattn.reports.console import plan_lines

    rng = np.random.default_rng(0)
    acts = make_activations({layer: tuple(rng.normal(size=(1, 3, 9, 4)) for _ in range(3)) for layer in (0, 1)},
                            {"scale": 0.5})
    original = UnitRunner._reference_deviation
    calls = []

    clock = _virtual_clock(monkeypatch)

    def slow(self, *args, **kwargs):
        calls.append(1)
        clock.advance(0.3)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(UnitRunner, "_reference_deviation", slow)
    estimate = {}
    for fraction in (0.0, 1.0):
        config = _config(estimators=parse_estimator_list("rfa"), num_samples=(4,), backend="torch", threads=1,
                         check_reference=fraction)
        swept = plan_sweep(acts, config, timing=True)
        estimate[fraction] = swept.seconds
        said = ", plus the float64 reference spot checks (--check-reference), timed once; start-up"
        assert (said in plan_lines(swept, timing=True)[2]) is (fraction == 1.0)
    assert estimate[1.0] - estimate[0.0] == pytest.approx(0.6, abs=1e-12), estimate
    assert len(calls) == 1  # timed once for the one (estimator, S), not for each timed head count
