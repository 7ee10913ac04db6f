"""Measuring a selection of query rows (all, last:K, sample:K), the keys each query reads and the relative error with
its violation rate: the sweep's new columns against a literal numpy computation of the same cells.

The expected values are computed here from the inputs, the cell seeds and the estimator's definition, query by
query (a loop over the true query positions n with their visible keys 0..n + M - N), never from the engine: its
draws are re-made with ``replicate_rng(cell seed, r)`` (the per-(cell, replicate) stream the sweep stacks), the
estimate and the exact softmax written out per query. The sweep runs in float64, so agreement is to rounding
(1e-10 relative); the Clopper-Pearson bounds are compared with ``scipy.stats.binomtest`` (a root finder, ~1e-11).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy.special import softmax
from scipy.stats import binomtest

from _sampled_keys import NAME, SPEC
from randattn.activations import make_activations
from randattn.analysis.plan import SweepConfig, parse_estimator_list, replicate_rng
from randattn.analysis.positions import bucket_query_slices, query_positions
from randattn.analysis.queries import parse_query_selection, query_rows
from randattn.analysis.relative_error import clopper_pearson
from randattn.analysis.sweep import plan, run_sweep_tables
from randattn.estimators.masks import Mask
from randattn.estimators.registry import register_estimator, unregister_estimator

N, D, HEADS, SCALE, S, R = 9, 4, 2, 0.5, 3, 5


@pytest.fixture(scope="module")
def spec():
    register_estimator(SPEC)
    yield SPEC
    unregister_estimator(NAME)


@pytest.fixture(scope="module")
def acts():
    rng = np.random.default_rng(11)
    arrays = {0: tuple(1.5 * rng.normal(size=(1, HEADS, N, D)) for _ in range(3))}
    return make_activations(arrays, {"scale": SCALE, "model": "synthetic", "layout": "sequence"})


def _config(queries, mask, label=NAME, **kw):
    return SweepConfig(estimators=parse_estimator_list(label), num_samples=(S,), replicates=R, seed=4, dtype="float64",
                       mask=mask, queries=queries, threads=1, diagnostics=False, check_reference=0.0, **kw)


def _expected_cell(q, k, v, rows, seed, causal, eps):
    """The cell's metrics, written out query by query from the estimator's definition (module docstring)."""
    m = k.shape[0]
    errors, sq, counts = np.empty((R, len(rows))), np.empty((R, len(rows))), np.empty((R, len(rows)))
    for r in range(R):
        u = SPEC.draw((1, len(rows), D), (1, m, D), num_samples=S, replicates=1, rng=replicate_rng(seed, r),
                      **({"mask": "causal"} if causal else {}))["u"][0, 0]
        for j, n in enumerate(rows):
            last = n + m - N if causal else m - 1  # the query's last visible key (queries are the last N tokens)
            seen = np.arange(last + 1) if causal else np.arange(m)
            read = [key for key in seen if u[j, key] < S / len(seen) or key == last]
            logits = SCALE * k @ q[n]
            estimate = softmax(logits[read]) @ v[read]
            exact = softmax(logits[seen]) @ v[seen]
            errors[r, j] = np.linalg.norm(estimate - exact) / np.linalg.norm(exact)
            sq[r, j] = ((estimate - exact) ** 2).mean()
            counts[r, j] = len(read)
    visible = np.mean([(n + m - N + 1) if causal else m for n in rows])
    violations = int((errors > eps).sum())
    ci = binomtest(violations, errors.size).proportion_ci(0.95, method="exact")
    per_rep = counts.mean(1)
    return {"mse": sq.mean(), "rel_err_mean": errors.mean(), "rel_err_median": np.median(errors),
            "rel_err_p95": np.percentile(errors, 95), "violation_rate": violations / errors.size,
            "violation_lo": ci.low, "violation_hi": ci.high, "keys_used": counts.mean(),
            "keys_used_se": per_rep.std(ddof=1) / np.sqrt(R), "keys_used_max": counts.max(),
            "keys_fraction": counts.mean() / visible}


def _check_against_loop(acts, table, rows, causal, eps):
    q, k, v = acts.layer_qkv(0, image=0)
    for head in range(HEADS):
        row = table[table["head"] == head].iloc[0]
        expected = _expected_cell(q[head], k[head], v[head], rows, int(row.seed), causal, eps)
        for column, value in expected.items():
            assert row[column] == pytest.approx(value, rel=1e-10, abs=1e-300), (head, column)


@pytest.mark.parametrize(("queries", "mask", "backend"), [
    ("last:4", "causal", "torch"), ("sample:4", None, "torch"), ("all", "causal", "torch"),
    ("last:4", "causal", "reference"),
])
def test_selected_queries_measured_against_a_loop_over_their_positions(spec, acts, queries, mask, backend):
    """last:4 under the causal mask is the estimator called with q[..., -4:, :] and every key; a sample of 4
    bidirectional rows; every row; on both backends. The rows are the true ones: the per-query loop places query n
    at its token."""
    tables = run_sweep_tables(acts, _config(queries, mask, epsilon=0.3, backend=backend, position_buckets="log2"))
    table = tables.table
    rows = np.arange(N) if queries == "all" else query_rows(queries, N, 4)
    assert set(table["queries"]) == {queries} and set(table["tokens"]) == {N}
    _check_against_loop(acts, table, rows, mask == "causal", 0.3)
    assert (table["epsilon"] == 0.3).all() and table["delta"].isna().all() and not table["promise_broken"].any()
    # per-position buckets of the measured rows, at their true positions p = n + M - N + 1 (a sample's too)
    positions = tables.positions[tables.positions["head"] == 0]
    true = rows + 1
    buckets = [(lo, hi, int(((true >= lo) & (true <= hi)).sum())) for lo, hi in ((1, 1), (2, 3), (4, 7), (8, 9))]
    assert list(zip(positions.position_lo, positions.position_hi, positions.queries)) == \
        [b for b in buckets if b[2] > 0]


def test_the_sample_is_seeded_sorted_and_distinct():
    rows = query_rows("sample:5", 40, 7)
    assert np.array_equal(rows, query_rows("sample:5", 40, 7))
    assert not np.array_equal(rows, query_rows("sample:5", 40, 8))
    assert np.all(np.diff(rows) > 0) and rows.min() >= 0 and rows.max() < 40
    assert np.array_equal(query_rows("last:3", 10), [7, 8, 9]) and query_rows("all", 10) is None
    assert np.array_equal(query_rows("sample:10", 10, 3), np.arange(10))


@pytest.mark.parametrize("text", ["last:0", "sample:0", "last:x", "foo", "last", "sample:-2", "last:3:4", ""])
def test_malformed_selections_are_refused(text):
    with pytest.raises(ValueError, match="query selection"):
        parse_query_selection(text)


def test_refusals_before_any_work(spec, acts):
    with pytest.raises(ValueError, match="asks for 10 queries but the activations hold 9"):
        plan(acts, _config("last:10", None))
    with pytest.raises(ValueError, match=r"\(key m visible to query n iff m <= n \+ M - N\), which a non-contiguous "
                                         "sample of rows cannot express; use last:K"):
        plan(acts, _config("sample:3", "causal"))
    with pytest.raises(ValueError, match=r"m <= n \+ M - N, and the last W of those\), which a non-contiguous"):
        plan(acts, _config("sample:3", "sliding:4"))
    with pytest.raises(ValueError, match="estimator 'local' cannot be measured on 3 of 9 queries without a mask"):
        plan(acts, _config("last:3", None, label="local"))
    plan(acts, _config("last:3", "causal", label="local"))  # the decode regime keeps each query at its own token
    plan(acts, _config("sample:9", "causal"))  # every row: nothing to refuse
    for bad in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="epsilon must be in"):
            _config("all", None, epsilon=bad)


def test_memory_counts_the_measured_rows(spec, acts):
    """The exact cache, the store of estimates and the forecast hold K rows, never N (8 bytes x R x C x K x Dv)."""
    from randattn.analysis.execute import UnitRunner

    units = plan(acts, _config("last:2", "causal"))
    runner = UnitRunner(acts, _config("last:2", "causal"))
    q, k, v, exact_probs, exact = runner.exact_cache.get(units[0], "float64")
    assert q.shape == (HEADS, 2, D) and k.shape == (HEADS, N, D)
    assert tuple(exact_probs.shape) == (HEADS, 2, N) and exact.shape == (HEADS, 2, D)
    assert runner.stored_bytes(units[0]) == 8 * R * HEADS * 2 * D


def test_a_promise_is_checked_per_head(spec, acts):
    """eps = 0.01 with delta = 0.001: the sampled keys miss the truth by more on nearly every query, so the whole
    interval is above delta and the promise is broken; a promise of eps = 0.999 on the exact estimator's truth
    (delta = 0.5) is kept. Without --epsilon the promise's epsilon is used."""
    table = run_sweep_tables(acts, _config("last:4", "causal", label=f"{NAME}:eps=0.01,delta=0.001")).table
    assert (table["epsilon"] == 0.01).all() and (table["delta"] == 0.001).all()
    assert (table["promise_broken"] == (table["violation_lo"] > 0.001)).all() and table["promise_broken"].all()
    _check_against_loop(acts, table, query_rows("last:4", N), True, 0.01)
    kept = run_sweep_tables(acts, _config("last:4", "causal", label=f"{NAME}:eps=0.999,delta=0.5",
                                          epsilon=0.2)).table
    assert (kept["epsilon"] == 0.999).all() and not kept["promise_broken"].any()


def _expected_denominator_errors(q, k, rows, seed, causal):
    """``(R, K)``: |Z_hat / Z - 1| per replicate and measured query, Z_hat the test estimator's Horvitz-Thompson sum
    written out here (each key read with probability min(1, S / V_n), the last visible key always)."""
    m = k.shape[0]
    errors = np.empty((R, len(rows)))
    for r in range(R):
        u = SPEC.draw((1, len(rows), D), (1, m, D), num_samples=S, replicates=1, rng=replicate_rng(seed, r),
                      **({"mask": "causal"} if causal else {}))["u"][0, 0]
        for j, n in enumerate(rows):
            last = n + m - N if causal else m - 1
            seen = np.arange(last + 1) if causal else np.arange(m)
            inclusion = min(1.0, S / len(seen))
            terms = np.exp(SCALE * k @ q[n])
            estimate = sum(terms[key] / (1.0 if key == last else inclusion)
                           for key in seen if u[j, key] < S / len(seen) or key == last)
            errors[r, j] = abs(estimate / terms[seen].sum() - 1.0)
    return errors


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_a_promise_on_the_denominator_counts_the_denominators_error(spec, acts, backend):
    """A promise declared on the denominator: the violation columns count |Z_hat - Z| / Z > eps (written out per
    query above, the interval from scipy's binomtest), ``violation_of`` says so, and the rel_err columns stay the
    output's. eps = 0.7 puts the rate strictly between 0 and 1 on these inputs, so the count is not trivially
    right; the output's own rate at 0.7 differs from it (asserted), so counting the output would fail. On both
    backends (the reference's log-denominators are the spec's torch form on the CPU, as its keys used)."""
    label = f"{NAME}:eps=0.7,delta=0.2,on=denominator"
    table = run_sweep_tables(acts, _config("last:4", "causal", label=label, backend=backend)).table
    q, k, v = acts.layer_qkv(0, image=0)
    rows = query_rows("last:4", N)
    assert set(table["violation_of"]) == {"denominator"}
    for head in range(HEADS):
        row = table[table["head"] == head].iloc[0]
        errors = _expected_denominator_errors(q[head], k[head], rows, int(row.seed), True)
        violations = int((errors > 0.7).sum())
        assert 0 < violations < errors.size
        ci = binomtest(violations, errors.size).proportion_ci(0.95, method="exact")
        assert row["violation_rate"] == pytest.approx(violations / errors.size, rel=1e-12)
        assert (row["violations"], row["trials"]) == (violations, errors.size)
        assert (row["violation_lo"], row["violation_hi"]) == pytest.approx((ci.low, ci.high), rel=1e-10)
        assert row["promise_broken"] == (ci.low > 0.2)
        output = _expected_cell(q[head], k[head], v[head], rows, int(row.seed), True, 0.7)
        assert row["rel_err_mean"] == pytest.approx(output["rel_err_mean"], rel=1e-10)
        assert output["violation_rate"] != row["violation_rate"]
    on_output = run_sweep_tables(acts, _config("last:4", "causal", label=f"{NAME}:eps=0.7,delta=0.2")).table
    assert set(on_output["violation_of"]) == {"output"}


def test_estimators_without_keys_used_or_epsilon_get_nan(acts):
    table = run_sweep_tables(acts, _config("all", None, label="softmax")).table
    assert table[["keys_used", "keys_used_se", "keys_used_max", "keys_fraction", "epsilon", "violation_rate",
                  "violation_lo", "violation_hi", "delta", "violations", "trials"]].isna().all().all()
    assert not table["promise_broken"].any() and (table["rel_err_p95"] < 1e-12).all()


def test_keys_used_columns_by_hand():
    """Two replicates x two cells of per-query means and maxima: the mean, its SE over the replicates, the max and
    the fraction, written out; a deterministic estimator's SE is 0, a random one's with one replicate NaN."""
    from randattn.analysis.unit_rows import keys_used_columns

    means, largest = np.array([[2.0, 5.0], [4.0, 5.0]]), np.array([[3.0, 6.0], [7.0, 5.0]])
    got = keys_used_columns(means, largest, random=True, replicates=2, visible=8.0)
    assert np.allclose(got["keys_used"], [3.0, 5.0]) and np.allclose(got["keys_used_se"], [1.0, 0.0])
    assert np.array_equal(got["keys_used_max"], [7.0, 6.0]) and np.allclose(got["keys_fraction"], [3 / 8, 5 / 8])
    assert np.array_equal(keys_used_columns(means, largest, random=False, replicates=1, visible=8.0)["keys_used_se"],
                          [0.0, 0.0])
    assert np.isnan(keys_used_columns(means, largest, random=True, replicates=1, visible=8.0)["keys_used_se"]).all()
    assert all(np.isnan(v) for v in keys_used_columns(None, None, random=True, replicates=2, visible=8.0).values())


def test_clopper_pearson_against_scipy_binomtest():
    cases = [(0, 10), (3, 10), (10, 10), (1, 1), (0, 1), (5, 200), (199, 200)]
    lo, hi = clopper_pearson([x for x, _ in cases], [n for _, n in cases])
    for (x, n), a, b in zip(cases, lo, hi):
        ci = binomtest(x, n).proportion_ci(0.95, method="exact")
        assert a == pytest.approx(ci.low, rel=1e-8, abs=1e-14) and b == pytest.approx(ci.high, rel=1e-8), (x, n)
    assert np.isnan(clopper_pearson(0, 0)[0])


@pytest.mark.parametrize("kind", [None, "causal", "sliding:3"])
def test_visible_key_counts_are_the_mask_row_sums(kind):
    mask = Mask.parse(kind)
    for n, m in ((5, 5), (3, 7), (1, 4)):
        expected = np.full(n, m) if kind is None else mask.visible(n, m).sum(-1)
        assert np.array_equal(mask.visible_counts(n, m), expected)


def test_buckets_of_selected_rows_are_their_true_positions():
    """Each bucket's measured rows, by a loop over the rows and their positions p = n + M - N + 1."""
    rows = np.array([0, 2, 3, 7, 8, 12])
    positions = query_positions(13, 13)
    for lo, hi, part in bucket_query_slices("log2", 13, 13, rows):
        assert [n for n in rows if lo <= positions[n] <= hi] == list(rows[part])
    assert bucket_query_slices("log2", 13, 13) == bucket_query_slices("log2", 13, 13, np.arange(13))


def test_a_resumed_run_gives_the_same_new_columns(spec, acts, tmp_path):
    """Stopped after its first unit and resumed from its parts, the table's new columns round-trip the store."""
    config = _config("last:4", "causal", label=f"softmax;{NAME}:eps=0.05,delta=0.01;{NAME}:eps=0.05,on=denominator",
                     epsilon=0.2)
    whole = run_sweep_tables(acts, config).table
    assert set(whole["violation_of"]) == {"output", "denominator"}

    def stop(progress):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep_tables(acts, config, parts_dir=tmp_path / "parts", progress=stop)
    resumed = run_sweep_tables(acts, config, parts_dir=tmp_path / "parts", resume=True).table
    assert resumed.attrs["timing"]["units"] == 2  # three units, the first stored before the stop
    pd.testing.assert_frame_equal(resumed.drop(columns="seconds"), whole.drop(columns="seconds"), check_exact=True)
    assert resumed["queries"].dtype == resumed["label"].dtype and resumed["promise_broken"].dtype == bool
    assert resumed["violation_of"].dtype == resumed["label"].dtype


def test_a_table_from_before_the_new_columns_reads_as_all_queries_no_promise():
    """The golden table was written before the columns existed: every query measured, no promise checked, the
    violation columns (empty) of the output."""
    from pathlib import Path

    from randattn.results import coerce

    old = pd.read_parquet(Path(__file__).resolve().parents[1] / "data" / "golden-sweep.table.parquet")
    assert "queries" not in old.columns
    table = coerce(old)
    assert set(table["queries"]) == {"all"} and not table["promise_broken"].any()
    assert set(table["violation_of"]) == {"output"}
    assert table["keys_used"].isna().all() and table["violation_rate"].isna().all()
    pd.testing.assert_frame_equal(table[list(old.columns)], old, check_exact=True, check_dtype=False)


def test_the_forecast_counts_the_measured_rows(spec, acts, monkeypatch):
    """With the calibration fixed, a plan's peak at many replicates is STORE_FACTOR x the store of the K measured
    rows, 8 bytes x R x C x K x Dv (written out), not of the N rows."""
    from dataclasses import replace

    from randattn.analysis.cell_memory import STORE_FACTOR
    from randattn.analysis.execute import UnitRunner
    from randattn.analysis.sweep import plan_sweep

    monkeypatch.setattr(UnitRunner, "_calibration", lambda self, unit: (1_000, 10))
    reps = 10**6
    for queries, k in (("last:2", 2), ("all", N)):
        config = replace(_config(queries, "causal"), replicates=reps)
        assert plan_sweep(acts, config).peak_bytes == STORE_FACTOR * 8 * reps * HEADS * k * D


@pytest.mark.slow  # a Dask cluster of one worker process, ~20 s on 2 cores
def test_dask_workers_give_the_same_new_columns(spec, acts, tmp_path):
    """The rows a worker computes and writes as parts carry the new columns as the local run's, bit for bit."""
    distributed = pytest.importorskip("distributed")
    import cloudpickle

    import _sampled_keys
    from randattn.activations import save_activations

    path = save_activations(acts, tmp_path / "acts.safetensors")
    config = _config("last:4", "causal", label=f"softmax;{NAME}:eps=0.05,delta=0.01", epsilon=0.2)
    local = run_sweep_tables(path, config).table
    cloudpickle.register_pickle_by_value(_sampled_keys)  # the workers cannot import the tests' helper module
    try:
        with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None,
                                      silence_logs=40) as cluster, distributed.Client(cluster) as client:
            remote = run_sweep_tables(path, config, scheduler=client, parts_dir=tmp_path / "parts").table
    finally:
        cloudpickle.unregister_pickle_by_value(_sampled_keys)
    pd.testing.assert_frame_equal(remote.drop(columns="seconds"), local.drop(columns="seconds"), check_exact=True)


def test_a_window_at_the_query_token_is_measured_on_its_last_rows_and_never_on_a_sample(acts):
    """StreamingLLM's window ends at query n's token n + M - N even without a mask: last:K gives exactly the last
    K rows of the full run (same deterministic selection), while a sample, which would move rows, is refused."""
    table = run_sweep_tables(acts, _config("all", None, label="streaming:sinks=1")).table
    last = run_sweep_tables(acts, _config("last:3", None, label="streaming:sinks=1")).table
    assert (table["mse"] > 0).all() and (last["mse"] > 0).all()
    q, k, v = acts.layer_qkv(0, image=0)
    for head in range(HEADS):  # the loop: keys 0 (sink) and the S - 1 keys ending at token n, for n = 6, 7, 8
        errors = []
        for n in range(N - 3, N):
            read = [0, *range(max(1, n - (S - 2)), n + 1)]
            logits = SCALE * k[head] @ q[head, n]
            estimate = softmax(logits[read]) @ v[head, read]
            errors.append(((estimate - softmax(logits) @ v[head]) ** 2).mean())
        row = last[last["head"] == head].iloc[0]
        np.testing.assert_allclose(row["mse"], np.mean(errors), rtol=1e-10)
    with pytest.raises(ValueError, match="its windows end at each query's own token"):
        plan(acts, _config("sample:3", None, label="streaming"))


def test_a_broken_promise_of_a_configuration_without_s_is_one_record():
    """Adaptive vAttention takes no S: the table repeats its one measurement at each S, and the broken promise is
    one record with S None; the fixed budget's rows at two S are two measurements, two records."""
    import pandas as pd

    from randattn.analysis.relative_error import broken_promises
    from randattn.reports.console import broken_promise_lines

    rows = [{"label": label, "num_samples": s, "tokens": 64, "mask": "causal", "queries": "last:4", "image": "x",
             "layer": 0, "head": 1, "epsilon": 0.05, "delta": 0.05, "violation_rate": 0.2, "violation_lo": 0.1,
             "violation_hi": 0.3, "violation_of": "denominator", "promise_broken": True}
            for label in ("vattention", "vattention:budget=fixed") for s in (8, 16)]
    records = broken_promises(pd.DataFrame(rows))
    assert [(r["label"], r["num_samples"]) for r in records] == [("vattention", None),
                                                                 ("vattention:budget=fixed", 8),
                                                                 ("vattention:budget=fixed", 16)]
    lines = broken_promise_lines(records)
    assert "vattention layer 0 head 1" in lines[0] and "S=" not in lines[0]
    assert "vattention:budget=fixed S=8 layer 0 head 1" in lines[1]
