"""Sweeps under an attention mask: the config, the exact reference, refusals, per-position metrics, resume.

Expected values are computed here from the definitions: the exact causal (and sliding-window) softmax by
an explicit loop over each query's visible keys, an estimator's replicates redrawn from
``replicate_rng(cell seed, r)``, and the metrics of a bucket from their formulas over its queries.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pandas as pd
import pytest

from randattn.activations import make_activations
from randattn.analysis.execute import DiagnosticsSkippedWarning, exact_under_mask
from randattn.analysis.plan import Unit, cell_seed, estimator_config, replicate_rng
from randattn.analysis.positions import POSITION_COLUMNS, bucket_query_slices, position_buckets
from randattn.analysis.sweep import (
    COLUMNS,
    SweepConfig,
    parse_estimator_list,
    plan,
    read_position_parts,
    run_sweep,
    run_sweep_tables,
)
from randattn.estimators.registry import get_spec

SCALE = 0.5
N, D = 9, 4


@pytest.fixture
def acts(rng):
    arrays = {layer: tuple(0.8 * rng.normal(size=(2, 2, N, D)) for _ in range(3)) for layer in (0, 5)}
    return make_activations(arrays, {"scale": SCALE, "model": "synthetic", "images": ["cat", "dog"]})


def _config(**kw):
    base = dict(estimators=parse_estimator_list("ra;softmax"), num_samples=(4,), replicates=3, seed=11,
                diagnostics=False, backend="reference", mask="causal")
    base.update(kw)
    return SweepConfig(**base)


def _loop_attention(q, k, v, scale, first_key, last_key):
    """Softmax over keys first_key(n)..last_key(n) of each query, by a loop: output (N, Dv) and probabilities (N, M)."""
    n_q, n_k = len(q), len(k)
    out, probs = np.zeros((n_q, v.shape[1])), np.zeros((n_q, n_k))
    for n in range(n_q):
        keys = range(max(first_key(n, n_q, n_k), 0), last_key(n, n_q, n_k) + 1)
        logits = np.array([scale * float(q[n] @ k[j]) for j in keys])
        weights = np.exp(logits - logits.max())
        for j, w in zip(keys, weights / weights.sum()):
            probs[n, j] = w
            out[n] += w * v[j]
    return out, probs


def _causal_truth(q, k, v, scale=SCALE):
    return _loop_attention(q, k, v, scale, lambda n, nq, nk: 0, lambda n, nq, nk: n + nk - nq)


# ------------------------------------------------------------------------------------------------ config, ids
def test_a_bidirectional_run_keeps_its_unit_ids_seeds_and_identity(acts):
    """Tables of bidirectional runs stay what they were: the same unit ids and seeds (pinned from before masks
    existed), no mask or bucket key in the identity; the mask is a property of the run, not of a cell."""
    plain, causal = _config(mask=None), _config()
    assert "mask" not in plain.identity() and "position_buckets" not in plain.identity()
    assert causal.identity()["mask"] == "causal" and plain.to_json()["mask"] is None
    assert [(u.uid, u.seeds) for u in plan(acts, plain)] == [(u.uid, u.seeds) for u in plan(acts, causal)]
    assert Unit(0, 0, 4, 0, "cat", (0, 1), "rfa", (1, 2)).uid == "L0-9e730c2766572935"
    assert Unit(5, 1, None, 1, "dog", (0, 1), "softmax", (1, 2)).uid == "L5-1c9a751bf69cc45a"
    params = '{"noise":"paper","sample":"random","variant":"unbiased"}'
    assert cell_seed(11, "cat", 0, 1, params, "ra", 4) == 1986244901815327951


def test_the_mask_is_stored_canonically_and_checked():
    every = _config(mask={0: "causal", 5: "causal"})
    assert every.mask == "causal" and every.identity()["mask"] == "causal"
    mixed = _config(mask={"5": None, "0": "causal"})
    assert mixed.mask == ((0, "causal"), (5, None)) and mixed.mask_of(5) is None
    assert mixed.identity()["mask"] == {"0": "causal", "5": None}
    assert mixed.positions_of(0) == "log2" and mixed.positions_of(5) is None
    assert _config(mask=None, position_buckets="1,4").positions_of(0) == (1, 4)
    assert hash(mixed)  # a Dask worker caches its runner by the configuration
    with pytest.raises(ValueError, match="mask 'diagonal' is not a mask kind"):
        _config(mask="diagonal")
    with pytest.raises(ValueError, match="position buckets '4,2'"):
        _config(position_buckets="4,2")
    with pytest.raises(ValueError, match="names layers \\[0, 1\\] but not layer 5"):
        _config(mask={0: "causal", 1: None}).mask_of(5)


def test_log2_buckets_and_their_query_slices():
    assert position_buckets("log2", 9) == ((1, 1), (2, 3), (4, 7), (8, 9))
    assert position_buckets((1, 2, 4, 8, 64), 20) == ((1, 1), (2, 3), (4, 7), (8, 20))
    # queries are the last N of M tokens: N = 5 of M = 8 stand at positions 4..8
    assert [(lo, hi, s.start, s.stop) for lo, hi, s in bucket_query_slices("log2", 5, 8)] == [(4, 7, 0, 4),
                                                                                             (8, 8, 4, 5)]


# ------------------------------------------------------------------------------------------------ ground truth
@pytest.mark.parametrize("use_torch", [False, True], ids=["numpy", "torch"])
def test_the_exact_reference_under_a_mask_is_the_loop(rng, use_torch):
    import torch

    q, k, v = (rng.normal(size=(2, n, D)) for n in (6, 9, 9))
    for kind, first in (("causal", lambda n, nq, nk: 0), ("sliding:3", lambda n, nq, nk: n + nk - nq - 2)):
        probs, out = exact_under_mask(kind, q, k, v[..., :3], SCALE, torch=torch if use_torch else None)
        for c in range(2):
            want_out, want_probs = _loop_attention(q[c], k[c], v[c, :, :3], SCALE, first,
                                                   lambda n, nq, nk: n + nk - nq)
            np.testing.assert_allclose(out[c], want_out, rtol=1e-12, atol=1e-14, err_msg=kind)
            np.testing.assert_allclose(probs[c], want_probs, rtol=1e-12, atol=1e-14, err_msg=kind)
            assert np.array_equal(probs[c] == 0, want_probs == 0), kind  # hidden entries exactly 0


# ------------------------------------------------------------------------------------------------ refusals
def test_an_estimator_without_the_mask_is_refused_by_name_before_computing(acts):
    calls = []
    with pytest.raises(ValueError, match="estimator 'lara' does not support mask='causal'.*landmarks"):
        run_sweep(acts, _config(estimators=parse_estimator_list("ra;lara")), progress=calls.append)
    assert calls == []
    with pytest.raises(ValueError, match="rfa:feature_map=oprf.*has no causal form"):
        plan(acts, _config(estimators=parse_estimator_list("rfa:feature_map=oprf")))


def test_sliding_window_layers_are_refused_naming_the_layer(acts):
    config = _config(mask={0: "causal", 5: "sliding:3"},
                     estimators=parse_estimator_list("magicpig:local=0,sinks=2;softmax"))
    with pytest.raises(ValueError, match="layer 5 has mask 'sliding:3': estimator 'magicpig:sinks=2,local=0': "
                                         "local must be >= 1 under mask='sliding:3'"):
        plan(acts, config)
    # rfa and eva declare their masks as a function of their parameters: the same refusal, not a TypeError
    for name in ("rfa", "eva"):
        with pytest.raises(ValueError, match=f"layer 5 uses a sliding-window mask .*estimator {name!r} does not "
                                             "compute \\(it supports: none, 'causal'\\)"):
            plan(acts, _config(mask={0: "causal", 5: "sliding:3"}, estimators=parse_estimator_list(name)))
    tables = run_sweep_tables(acts, _config(mask={0: "causal", 5: "sliding:3"}, layers=(0,)))
    assert set(tables.table.layer) == {0} and set(tables.table["mask"]) == {"causal"}


# ------------------------------------------------------------------------------------------------ measurements
def _bucket_definitions(errors, exact_rows, queries):
    """MSE, variance, debiased bias^2 of replicates ``errors`` (R, N, Dv) = y_r - y restricted to ``queries``."""
    e = errors[:, queries]
    r = e.shape[0]
    mean = e.mean(0)
    variance = ((e - mean) ** 2).sum(0) / (r - 1) if r > 1 else np.zeros_like(mean)
    return {"mse": (e**2).mean(), "variance": variance.mean(), "bias_sq": (mean**2).mean() - variance.mean() / r}


def test_bucket_metrics_of_a_random_and_a_deterministic_estimator_match_the_definitions(acts):
    """Each bucket's MSE, variance and bias^2 equal the definitions over its queries, with the replicates redrawn
    from the cell's seed and the exact causal attention written as a loop; softmax's buckets are 0."""
    labels = "ra;softmax" + (";local:window=3" if get_spec("local").supports_mask("causal") else "")
    tables = run_sweep_tables(acts, _config(estimators=parse_estimator_list(labels)))
    table, positions = tables.table, tables.positions
    assert tuple(positions.columns) == POSITION_COLUMNS and set(positions["mask"]) == {"causal"}
    assert tuple(table.columns) == COLUMNS and set(table["mask"]) == {"causal"}
    assert positions[positions.label == "softmax"].mse.max() < 1e-28
    q, k, v = (a[1, 0].astype(np.float64) for a in acts.qkv(5))  # image "dog", head 0
    truth, truth_probs = _causal_truth(q, k, v)
    for label in labels.split(";"):
        cell = table[(table.label == label) & (table.layer == 5) & (table.image == "dog") & (table["head"] == 0)]
        [row] = cell.to_dict("records")
        spec = get_spec(row["estimator"])
        params = dict(estimator_config(label).params)
        reps = int(row["replicates"])
        estimates = []
        for r in range(reps):
            draws = spec.draw(q.shape, k.shape, num_samples=4, replicates=1, rng=replicate_rng(row["seed"], r),
                              mask="causal", **params)
            estimates.append(spec.reference(q, k, v, draws, scale=SCALE, mask="causal", **params)[0])
            if r == 0 and not row["random"]:
                probs = spec.reference(q, k, np.eye(N), draws, scale=SCALE, mask="causal", **params)[0]
                assert row["prob_mse"] == pytest.approx(((probs - truth_probs) ** 2).mean(), rel=1e-9, abs=1e-30)
        errors = np.array(estimates) - truth
        assert row["mse"] == pytest.approx((errors**2).mean(), rel=1e-9, abs=1e-30)
        rows = positions[(positions.label == label) & (positions.layer == 5) & (positions.image == "dog")
                         & (positions["head"] == 0)].sort_values("position_lo")
        assert list(zip(rows.position_lo, rows.position_hi, rows.queries)) == [(1, 1, 1), (2, 3, 2), (4, 7, 4),
                                                                                (8, 9, 2)]
        for bucket in rows.to_dict("records"):
            want = _bucket_definitions(errors, truth, slice(bucket["position_lo"] - 1, bucket["position_hi"]))
            for metric, value in want.items():
                assert bucket[metric] == pytest.approx(value, rel=1e-9, abs=1e-30), (label, bucket["position_lo"],
                                                                                      metric)


def test_a_sliding_window_layer_is_measured_against_its_own_window(acts):
    """topk, softmax, RA and StreamingLLM declare ``"sliding"``: on a layer with ``sliding:3`` (beside a causal one)
    each cell's MSE, keys used and per-position MSE equal the definitions, with the exact attention, top-k and
    StreamingLLM (its sink read only while the window shows it) over each query's last 3 keys written as loops here
    (RA's replicates redrawn from the cell's seed); a StreamingLLM budget with no recent window is refused naming
    the layer."""
    config = _config(mask={0: "causal", 5: "sliding:3"},
                     estimators=parse_estimator_list("topk;softmax;ra;streaming:sinks=1"), num_samples=(2,))
    tables = run_sweep_tables(acts, config)
    table, positions = tables.table, tables.positions
    assert table.groupby("layer")["mask"].unique().map(tuple).to_dict() == {0: ("causal",), 5: ("sliding:3",)}
    q, k, v = (a[0, 1].astype(np.float64) for a in acts.qkv(5))  # image "cat", head 1
    first = lambda n, nq, nk: n + nk - nq - 2  # noqa: E731 - the window's first key: W = 3 keys up to the query's own
    own = lambda n, nq, nk: n + nk - nq  # noqa: E731
    truth, _ = _loop_attention(q, k, v, SCALE, first, own)
    top2 = np.zeros_like(truth)
    for n in range(N):  # top-2 of the (up to) 3 window keys, ties to the lower index
        keys = list(range(max(n - 2, 0), n + 1))
        kept = sorted(keys, key=lambda j: (-float(q[n] @ k[j]), j))[:2]
        logits = np.array([SCALE * float(q[n] @ k[j]) for j in kept])
        weights = np.exp(logits - logits.max())
        top2[n] = (weights / weights.sum()) @ v[kept]
    sink_and_own = np.zeros_like(truth)
    for n in range(N):  # StreamingLLM, S = 2 with one sink: key 0 while the window shows it, and the query's own key
        kept = [j for j in sorted({0, n}) if j >= n - 2]
        logits = np.array([SCALE * float(q[n] @ k[j]) for j in kept])
        weights = np.exp(logits - logits.max())
        sink_and_own[n] = (weights / weights.sum()) @ v[kept]
    for label, estimate in (("softmax", truth), ("topk", top2), ("streaming:sinks=1", sink_and_own)):
        [row] = table[(table.label == label) & (table.layer == 5) & (table.image == "cat")
                      & (table["head"] == 1)].to_dict("records")
        assert row["mse"] == pytest.approx(((estimate - truth) ** 2).mean(), rel=1e-9, abs=1e-30), label
    [row] = table[(table.label == "ra") & (table.layer == 5) & (table.image == "cat")
                  & (table["head"] == 1)].to_dict("records")  # RA's replicates redrawn from the cell's seed
    estimates = [get_spec("ra").reference(q, k, v, get_spec("ra").draw(q.shape, k.shape, num_samples=2, replicates=1,
                                                                        rng=replicate_rng(row["seed"], r),
                                                                        mask="sliding:3"),
                                          scale=SCALE, mask="sliding:3")[0] for r in range(int(row["replicates"]))]
    assert row["mse"] == pytest.approx(((np.array(estimates) - truth) ** 2).mean(), rel=1e-9)
    [row] = table[(table.label == "topk") & (table.layer == 5) & (table.image == "cat")
                  & (table["head"] == 1)].to_dict("records")
    assert row["keys_used"] == pytest.approx(np.minimum(np.minimum(np.arange(1, N + 1), 3), 2).mean())
    rows = positions[(positions.label == "topk") & (positions.layer == 5) & (positions.image == "cat")
                     & (positions["head"] == 1)].sort_values("position_lo")
    for bucket in rows.to_dict("records"):
        queries = slice(bucket["position_lo"] - 1, bucket["position_hi"])
        assert bucket["mse"] == pytest.approx(((top2[queries] - truth[queries]) ** 2).mean(), rel=1e-9, abs=1e-30)
    with pytest.raises(ValueError, match="layer 5 has mask 'sliding:3': estimator 'streaming:sinks=2': "
                                         "num_samples S=2 equals sinks=2 under mask='sliding:3'"):
        plan(acts, _config(mask={0: "causal", 5: "sliding:3"},
                           estimators=parse_estimator_list("topk;streaming:sinks=2"), num_samples=(2,)))


def test_bucket_metrics_weighted_by_their_queries_give_the_cell(acts):
    """The log2 buckets partition the queries, and MSE, variance and bias^2 are averages over queries: their
    query-weighted mean over the buckets is the cell's."""
    tables = run_sweep_tables(acts, _config(estimators=parse_estimator_list("ra"), replicates=4))
    keys = ["layer", "image", "head", "label", "num_samples"]
    for metric in ("mse", "variance", "bias_sq", "bias_sq_naive"):
        weighted = tables.positions.assign(w=lambda d: d[metric] * d.queries).groupby(keys)["w"].sum() / N
        cell = tables.table.set_index(keys)[metric]
        np.testing.assert_allclose(weighted.sort_index(), cell.sort_index(), rtol=1e-12, err_msg=metric)


def test_the_torch_backend_measures_the_same_masked_errors(acts):
    ref = run_sweep_tables(acts, _config(layers=(5,)))
    tor = run_sweep_tables(acts, _config(layers=(5,), backend="torch", dtype="float64"))
    for column in ("mse", "variance", "bias_sq", "prob_mse"):
        np.testing.assert_allclose(tor.table[column], ref.table[column], rtol=1e-9, atol=1e-14, err_msg=column)
    for column in ("mse", "variance", "bias_sq"):
        np.testing.assert_allclose(tor.positions[column], ref.positions[column], rtol=1e-9, atol=1e-14,
                                   err_msg=column)


def test_positions_only_where_asked(acts):
    assert run_sweep_tables(acts, _config(mask=None)).positions is None
    mixed = run_sweep_tables(acts, _config(mask={0: "causal", 5: None}))
    assert set(mixed.positions.layer) == {0}
    assert mixed.table.groupby("layer")["mask"].unique().map(tuple).to_dict() == {0: ("causal",), 5: ("none",)}
    edges = run_sweep_tables(acts, _config(mask=None, position_buckets="1,4"))
    assert sorted(set(zip(edges.positions.position_lo, edges.positions.position_hi))) == [(1, 3), (4, 9)]
    assert set(edges.positions["mask"]) == {"none"}
    assert run_sweep_tables(acts, _config(position_buckets="none")).positions is None


def test_diagnostics_whose_weights_take_no_mask_are_nan_with_the_reason(acts):
    config = _config(estimators=parse_estimator_list("rfa"), diagnostics=True, layers=(0,))
    with pytest.warns(DiagnosticsSkippedWarning, match="rfa: IS diagnostics .* not computed under mask='causal'"):
        table = run_sweep(acts, config)
    assert table.ess_mean.isna().all() and table.delta_var_ratio.isna().all() and table.pareto_khat.isna().all()
    [record] = table.attrs["warnings"]
    assert record["category"] == "DiagnosticsSkippedWarning" and record["count"] == record["units"] == 2  # 2 images
    with warnings.catch_warnings():
        warnings.simplefilter("error", DiagnosticsSkippedWarning)
        bidirectional = run_sweep(acts, _config(estimators=parse_estimator_list("rfa"), diagnostics=True, layers=(0,),
                                                mask=None))
    assert bidirectional.ess_mean.notna().all()


def test_an_interrupted_masked_sweep_resumes_to_the_same_positions(acts, tmp_path):
    config = _config(estimators=parse_estimator_list("ra;softmax"), num_samples=(4, 8))
    full = run_sweep_tables(acts, config, parts_dir=tmp_path / "full")
    calls = []

    def stop_after_three(progress):
        calls.append(progress)
        if len(calls) == 3:
            raise KeyboardInterrupt("simulated interruption")

    with pytest.raises(KeyboardInterrupt):
        run_sweep_tables(acts, config, parts_dir=tmp_path / "cut", progress=stop_after_three)
    kept = read_position_parts(tmp_path / "cut")
    assert 0 < len(kept) < len(full.positions)
    with pytest.raises(ValueError, match="different settings \\(mask\\)"):
        run_sweep_tables(acts, _config(estimators=parse_estimator_list("ra;softmax"), num_samples=(4, 8), mask=None),
                         parts_dir=tmp_path / "cut", resume=True)
    resumed = run_sweep_tables(acts, config, parts_dir=tmp_path / "cut", resume=True)
    pd.testing.assert_frame_equal(full.positions, resumed.positions)
    pd.testing.assert_frame_equal(full.table.drop(columns="seconds"), resumed.table.drop(columns="seconds"))


def test_parts_written_before_masks_read_back_as_bidirectional(acts, tmp_path):
    from randattn.results import read_parts, write_part

    rows = run_sweep(acts, _config(mask=None, layers=(0,))).drop(columns="mask").to_dict("records")
    old = pd.DataFrame(rows[:4])
    old.to_parquet(tmp_path / "part-old.parquet", index=False)
    write_part(tmp_path, "new", [{**r, "mask": "none"} for r in rows[4:]])
    back = read_parts(tmp_path)
    assert len(back) == len(rows) and set(back["mask"]) == {"none"} and tuple(back.columns) == COLUMNS
    assert math.isfinite(back.mse.sum())
