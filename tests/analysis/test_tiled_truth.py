"""Long contexts: the engine's truth by tiles agrees with the dense truth, and no unit allocates a K x M array.

Where a head's K x M probabilities exceed ``TILED_ABOVE`` entries the engine holds the exact output and
log-normaliser only (the flash recurrence) and forms probabilities one key tile at a time. The tiles sum in another
order than the dense softmax, so the rows agree to rounding, not bit for bit: the tolerance here is 1e-10 relative
(float64; the measured differences are about 1e-15). Rows of estimators that are exact at these sizes (their error
is rounding noise of ~1e-34) are not compared relatively. The dense side is the engine's unchanged dense path.
"""

from __future__ import annotations

import dataclasses

import warnings

import numpy as np
import pytest

import randattn.analysis.exact_cache as exact_cache
from randattn.activations import make_activations
from randattn.analysis.cell_memory import extrapolate_peak
from randattn.analysis.execute import UnitRunner, run_recording
from randattn.analysis.memory import measure_peak
from randattn.analysis.plan import SweepConfig, parse_estimator_list
from randattn.analysis.sweep import plan, plan_sweep, run_sweep

RTOL = 1e-10
#: the columns compared (every float column of the table that is a measurement, not a time or the spot check,
#: whose slice differs by design)
MEASURED = ("mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error", "prob_mse",
            "sink_mass", "mean_abs")


def _acts(n: int, heads: int = 2, d: int = 8, seed: int = 0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return make_activations({0: tuple((0.5 * rng.normal(size=(1, heads, n, d))).astype(dtype) for _ in range(3))},
                            {"scale": d ** -0.5, "layout": "sequence"})


def _both(monkeypatch, acts, config):
    dense = run_sweep(acts, config)
    with monkeypatch.context() as patch:
        patch.setattr(exact_cache, "TILED_ABOVE", 0)  # every unit tiled
        tiled = run_sweep(acts, config)
    return dense, tiled


def _assert_close(dense, tiled, random_labels):
    assert list(dense.label) == list(tiled.label)
    rows = dense.label.isin(random_labels).to_numpy()
    for column in MEASURED:
        if column not in dense:
            continue
        a, b = dense[column].to_numpy()[rows], tiled[column].to_numpy()[rows]
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=column)
        finite = ~np.isnan(a)
        np.testing.assert_allclose(b[finite], a[finite], rtol=RTOL, atol=0, err_msg=column)


@pytest.mark.parametrize("mask", [None, "causal"])
def test_tiled_rows_equal_dense_rows(monkeypatch, mask):
    """RFA (factors bidirectionally, one-hot key columns under the causal mask) and RA (columns): every measured
    column within 1e-10 relative, prob_mse and the sink mass included; the per-position rows too."""
    acts = _acts(16)
    config = SweepConfig(estimators=parse_estimator_list("rfa;ra"), num_samples=(4,), replicates=3, seed=3,
                         threads=1, dtype="float64", mask=mask, diagnostics=False, check_reference=0.0)
    dense, tiled = _both(monkeypatch, acts, config)
    _assert_close(dense, tiled, {"rfa", "ra"})
    assert np.isfinite(tiled.prob_mse).all()


@pytest.mark.parametrize("queries", ["all", "last:5"])
def test_a_sliding_window_takes_its_truth_by_tiles_too(monkeypatch, queries):
    """A window of 6 keys over 16 tokens (and its last 5 queries): RA, top-k and softmax rows from the tiled truth
    within 1e-10 relative of the dense one, prob_mse and the sink mass included (key 0 leaves the window of
    queries 6 on: their share of the sink mass is an exact 0, so the mean is below the causal one); softmax runs
    as the third estimator."""
    acts = _acts(16)
    config = SweepConfig(estimators=parse_estimator_list("ra;topk;softmax"), num_samples=(4,), replicates=3, seed=3,
                         threads=1, dtype="float64", mask="sliding:6", diagnostics=False, check_reference=0.0,
                         queries=queries)
    dense, tiled = _both(monkeypatch, acts, config)
    _assert_close(dense, tiled, {"ra", "topk"})  # softmax's error is round-off (1e-33) against either truth
    assert np.isfinite(tiled.prob_mse).all()
    if queries != "all":  # the last 5 queries sit at tokens 11..15 >= W: none sees key 0
        assert (tiled.sink_mass == 0).all()
    causal = run_sweep(acts, dataclasses.replace(config, mask="causal"))
    assert (tiled.sink_mass.to_numpy() < causal.sink_mass.to_numpy()).all()


def test_a_denominator_promise_counts_the_same_violations_on_the_tiled_truth(monkeypatch):
    """vAttention's promise is checked on |Z_hat - Z| / Z: against the dense log-normaliser (a logsumexp) or the tiled
    truth's (the flash recurrence), the same violation counts for the last 6 queries under the causal mask, with the
    rate strictly between 0 and 1 (the two logs differ by ~1e-15: only a d that close to epsilon could count
    differently, and a different count fails here)."""
    acts = _acts(24, seed=4)
    label = "vattention:sinks=1,local=2,top_k=2,epsilon=0.02,delta=0.2,base_rate=0.25"
    config = SweepConfig(estimators=parse_estimator_list(label), num_samples=(4,), replicates=8, seed=2, threads=1,
                         dtype="float64", mask="causal", queries="last:6", diagnostics=False, check_reference=0.0)
    dense, tiled = _both(monkeypatch, acts, config)
    assert set(dense.violation_of) == set(tiled.violation_of) == {"denominator"}
    assert ((dense.violation_rate > 0) & (dense.violation_rate < 1)).all()
    for column in ("violation_rate", "violation_lo", "violation_hi", "promise_broken"):
        np.testing.assert_array_equal(tiled[column].to_numpy(), dense[column].to_numpy(), err_msg=column)
    _assert_close(dense, tiled, {label})


@pytest.mark.slow
def test_tiled_rows_equal_dense_rows_for_lara_and_the_last_queries(monkeypatch):
    """LARA's factors, and a decode-regime run (--queries last:5, causal): the truth of 5 rows over 24 keys."""
    acts = _acts(24)
    config = SweepConfig(estimators=parse_estimator_list("lara;rfa"), num_samples=(4,), replicates=3, threads=1,
                         dtype="float64", diagnostics=False, check_reference=0.0)
    _assert_close(*_both(monkeypatch, acts, config), {"lara", "rfa"})
    decode = SweepConfig(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=3, threads=1,
                         dtype="float64", mask="causal", queries="last:5", diagnostics=False, check_reference=0.0)
    _assert_close(*_both(monkeypatch, acts, decode), {"rfa"})


def test_extrapolate_peak_fits_both_terms():
    """Peaks made from alpha (K + M) + beta K M at two slices give the model back at 32k tokens (written out)."""
    alpha, beta = 1000.0, 8.0

    def peak(k, m):
        return alpha * (k + m) + beta * k * m

    points = [(512, 512, peak(512, 512)), (1024, 1024, peak(1024, 1024))]
    assert extrapolate_peak(points, 32768, 32768) == pytest.approx(peak(32768, 32768), rel=1e-9)
    linear = [(512, 512, 1000.0 * 1024), (1024, 1024, 1000.0 * 2048)]
    assert extrapolate_peak(linear, 32768, 32768) == pytest.approx(1000.0 * 65536, rel=1e-9)
    # a constant part (measured 10^6 bytes at both sizes) is never extrapolated below what was measured
    assert extrapolate_peak([(512, 512, 1e6), (1024, 1024, 1e6)], 32768, 32768) >= 1e6


N_LONG = 4096
DENSE_BYTES = 8 * N_LONG * N_LONG  # one N x M float64 matrix: 128 MiB


@pytest.fixture(scope="module")
def long_acts():
    return _acts(N_LONG, heads=1, d=16, dtype=np.float32)


def test_a_long_causal_unit_never_allocates_an_n_by_m_array(long_acts):
    """N = M = 4096, causal, a budget of 16 MiB (an eighth of one N x M float64 matrix): the plan forecasts from
    slices and the unit runs in the budget; the peak of planning and running it (numpy and torch, measured) stays
    below one N x M float64 matrix, and prob_mse is NaN with its reason in the warnings, since RFA under the
    causal mask has no factors and its N x M probabilities do not fit."""
    config = SweepConfig(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=2, threads=2,
                         mask="causal", max_memory=16 * 2**20, diagnostics=False, check_reference=1.0)
    runner = UnitRunner(long_acts, config)
    unit = plan(long_acts, config)[0]
    result = {}

    def work():
        runner.blocks(unit)  # the forecast (calibration on slices) and the budget check
        result["out"] = run_recording(runner, unit)

    peak = measure_peak(work, torch_tensors=True)
    assert peak < DENSE_BYTES / 2
    rows, caught, _, _ = result["out"]
    assert np.isnan(rows[0]["prob_mse"]) and np.isfinite(rows[0]["mse"]) and 0 < rows[0]["sink_mass"] < 1
    assert any(cat == "ProbabilitiesSkippedWarning" and "4096 x 4096" in msg for cat, msg in caught)


@pytest.mark.slow
def test_a_long_unit_over_its_budget_is_refused_from_slices(long_acts):
    """A budget below the unit's store is refused by the plan without the full-size work: the planning peak stays
    far below one N x M matrix."""
    config = SweepConfig(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=2, threads=2,
                         mask="causal", max_memory=2**20, diagnostics=False)
    result = {}
    peak = measure_peak(lambda: result.setdefault("plan", plan_sweep(long_acts, config)), torch_tensors=True)
    assert result["plan"].refused is not None
    assert peak < DENSE_BYTES / 8


def test_the_torch_backend_holds_a_long_unit_in_the_files_dtype():
    """The keys and values of a unit are the file's own arrays on the torch backend (consecutive heads: a read-only
    view, no copy), float64 copies on the reference backend; a float64 copy of a 131,072-token unit's k and v is
    400 MiB, which put the last:64 run over its 1 GiB goal. The rows are the same bits either way: the golden tables
    and the tiled/dense comparisons above hold them."""
    acts = _acts(64, heads=3, dtype=np.float32)
    stored_k = acts.stored_qkv(0)[1]

    def config(backend):
        return SweepConfig(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=2, mask="causal",
                           diagnostics=False, backend=backend)

    unit = plan(acts, config("torch"))[0]
    q, k, v = UnitRunner(acts, config("torch")).inputs(unit)
    assert q.dtype == k.dtype == v.dtype == np.float32
    assert np.shares_memory(k, stored_k) and not k.flags.writeable
    q64, k64, v64 = UnitRunner(acts, config("reference")).inputs(unit)
    assert q64.dtype == k64.dtype == v64.dtype == np.float64
    np.testing.assert_array_equal(k64, k)


def test_units_share_the_files_arrays_without_torch_warnings(tmp_path):
    """The torch backend shares the file's read-only arrays with torch (no copy); torch warns once per process when
    it does, a warning about nothing the user can act on (the engine never writes its inputs). A fresh process,
    since torch warns only once, under -W error::UserWarning, runs `mse` on a tiled causal unit of a float32 file
    (1,100 tokens: 1.2M probabilities per head), then on a dense unit of a float64 file (shared whole by the exact
    softmax): the first warning of either would end it."""
    import subprocess
    import sys

    from randattn.activations import save_activations

    runs = []
    for tokens, dtype in ((1100, np.float32), (64, np.float64)):
        path = save_activations(_acts(tokens, heads=2, d=8, dtype=dtype), tmp_path / f"{tokens}.safetensors")
        runs.append(["mse", str(path), "--mask", "causal", "-e", "rfa", "--samples", "4", "--replicates", "2",
                     "--threads", "1", "--out", str(tmp_path / f"{tokens}.csv")])
    script = ("import sys; from randattn.cli import main\n"
              f"for args in {runs!r}:\n"
              "    main(args, standalone_mode=False)\n")
    run = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "not writable" not in run.stderr
    assert all((tmp_path / f"{tokens}.csv").exists() for tokens in (1100, 64))


@pytest.mark.parametrize("probabilities", [True, False], ids=["probabilities", "no-probabilities"])
def test_a_tiled_unit_takes_its_probability_columns_from_the_estimates_own_call(monkeypatch, probabilities):
    """Where a form gives the estimate with its probabilities (the decode-time estimators, RA, EVA), a tiled unit
    measures prob_mse from that one call per block. Columns by one-hot key tiles ran the whole estimator again for
    every tile of 256 keys (twice more here at 300 keys; 79 times at 20,000), MagicPIG hashing every key each time:
    the tiled run hashes exactly as often as the dense run, each hashing giving the keys used too (with or without
    the probability error), and its rows are the dense rows (float64, 1e-10)."""
    import randattn.estimators.magicpig.batched as magicpig_batched

    acts = _acts(300, heads=1)
    config = SweepConfig(estimators=parse_estimator_list(
        "magicpig:sinks=1,local=2,hash_bits=2;topk;vattention:sinks=1,local=2,top_k=2,budget=fixed"),
        num_samples=(4,), replicates=3, threads=1, dtype="float64", mask="causal", diagnostics=False,
        check_reference=0.0, probabilities=probabilities)
    original, hashings = magicpig_batched._hash_and_sample, []

    def counted(*args, **kwargs):
        hashings.append(kwargs["weights"])
        return original(*args, **kwargs)

    monkeypatch.setattr(magicpig_batched, "_hash_and_sample", counted)
    dense = run_sweep(acts, config)
    dense_hashings, hashings[:] = list(hashings), []
    with monkeypatch.context() as patch:
        patch.setattr(exact_cache, "TILED_ABOVE", 0)  # every unit tiled
        tiled = run_sweep(acts, config)
    assert dense_hashings.count(True) > 0
    assert hashings == dense_hashings
    # and the keys each query read are counted from that same hashing, not from a second one (weights=False)
    assert all(hashings)
    _assert_close(dense, tiled, set(dense.label))
    if probabilities:
        assert np.isfinite(tiled.prob_mse).all() and (tiled.prob_mse > 0).all()
    else:
        assert np.isnan(tiled.prob_mse).all()
    assert (tiled.keys_used > 0).all()


def test_a_tiled_units_reference_check_leaves_the_exactness_of_its_slice_unsaid(monkeypatch):
    """A tiled unit is spot-checked on its first 256 keys. vAttention's default 128 sinks and 128 local keys cover
    that slice exactly but not the 512-key cell, whose MSE is not rounding: the tiled check records no reference
    error (NaN), so the cell keeps its ratio; the dense check of the same unit records the reference's own error."""
    from randattn.analysis.records import reference_check_summary

    config = SweepConfig(estimators=parse_estimator_list("vattention"), num_samples=(4,), replicates=3, seed=2,
                         threads=1, mask="causal", queries="last:64", check_reference=1.0, backend="torch",
                         probabilities=False, diagnostics=False)
    dense, tiled = _both(monkeypatch, _acts(512, heads=1), config)
    assert (dense["mse"] > 1e-8).all()  # the cell is not exact
    for table in (dense, tiled):
        checked = table[table["ref_max_abs_dev"].notna()]
        assert len(checked) == 1 and np.isfinite(checked["ref_rms_dev"]).all()
        assert reference_check_summary(table)["max_dev_over_rmse"] is not None
    assert dense.dropna(subset=["ref_max_abs_dev"])["ref_max_rel_err"].iloc[0] > 1e-10
    assert tiled.dropna(subset=["ref_max_abs_dev"])["ref_max_rel_err"].isna().all()


def test_a_tiled_unit_of_a_spec_with_a_probability_form_alone_takes_its_columns_from_it(monkeypatch):
    """A plugin that declares ``forms.probabilities`` and no one-pass form: a tiled unit measures prob_mse from one
    call of that form per block, where one-hot key tiles ran the whole estimate again for every tile of 256 keys
    (twice more at 300 keys, 128 times at 32,768). Top-k's own forms, declared as such a plugin would: its rows are
    the dense rows (float64, 1e-10), the estimate called once per block as densely."""
    import dataclasses

    from randattn.estimators import topk
    from randattn.estimators.base import BatchedForms
    from randattn.estimators.registry import register_estimator, unregister_estimator

    calls = []

    def estimate(*args, **kwargs):
        calls.append("estimate")
        return topk.batched.estimate(*args, **kwargs)

    def probabilities(*args, **kwargs):
        calls.append("probabilities")
        return topk.batched.probabilities(*args, **kwargs)

    name = "topk-probability-form-alone"
    spec = dataclasses.replace(topk.SPEC, name=name, keys_used=None,
                               forms=BatchedForms(estimate=estimate, probabilities=probabilities))
    register_estimator(spec)
    try:
        acts = _acts(300, heads=1)
        config = SweepConfig(estimators=parse_estimator_list(name), num_samples=(4,), replicates=1, threads=1,
                             dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
        dense = run_sweep(acts, config)
        dense_calls, calls[:] = list(calls), []
        with monkeypatch.context() as patch:
            patch.setattr(exact_cache, "TILED_ABOVE", 0)  # every unit tiled
            tiled = run_sweep(acts, config)
    finally:
        unregister_estimator(name)
    assert calls.count("estimate") == dense_calls.count("estimate") and calls.count("probabilities") > 0
    _assert_close(dense, tiled, {name})
    assert np.isfinite(tiled.prob_mse).all() and (tiled.prob_mse > 0).all()
