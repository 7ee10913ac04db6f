"""Every query of a long layer in blocks of queries: the blocks, the rule, and the rows they give.

The engine's query blocks are checked against its one-call path on units small enough for both (the thresholds
lowered): deterministic estimators give the same rows to rounding (1e-10 relative, float64: a block's matrix
products see other shapes, so not bit for bit), random ones rows of the same distribution (their draws are the
blocks' own), compared within standard errors of the replicate means.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

import randattn.analysis.exact_cache as exact_cache
import randattn.analysis.query_blocks as query_blocks_module
from randattn.activations import make_activations
from randattn.analysis.estimate_block import BlockEstimator
from randattn.analysis.execute import UnitRunner
from randattn.analysis.plan import SweepConfig, parse_estimator_list, replicate_rng
from randattn.analysis.query_blocks import (
    QueryBlock,
    blocks_queries,
    largest_first,
    query_block_rows,
    query_blocks,
    timed_block_indices,
)
from randattn.analysis.sweep import plan, run_sweep
from randattn.estimators.masks import NO_MASK, Mask

RTOL = 1e-10
MEASURED = ("mse", "mse_se", "variance", "bias_sq", "rel_error", "prob_mse", "sink_mass", "keys_used", "keys_used_max",
            "keys_fraction", "rel_err_mean", "rel_err_p95")


def _acts(n: int, heads: int = 2, d: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    return make_activations({0: tuple(0.5 * rng.normal(size=(1, heads, n, d)) for _ in range(3))},
                            {"scale": d ** -0.5, "layout": "sequence"})


def _blocked(patch, rows_per_block: int, keys: int) -> None:
    """Every unit tiled and blocked, ``rows_per_block`` queries per block at ``keys`` keys."""
    patch.setattr(exact_cache, "TILED_ABOVE", 0)
    patch.setattr(query_blocks_module, "QUERY_BLOCKED_ABOVE", 0)
    patch.setattr(query_blocks_module, "QUERY_BLOCK_PAIRS", rows_per_block * keys)


def _whole_and_blocked(monkeypatch, acts, config, rows_per_block: int):
    with monkeypatch.context() as patch:
        patch.setattr(exact_cache, "TILED_ABOVE", 0)  # the same tiled truth on both sides
        whole = run_sweep(acts, config)
    with monkeypatch.context() as patch:
        _blocked(patch, rows_per_block, int(acts.shape[2]))
        blocked = run_sweep(acts, config)
    return whole, blocked


# ------------------------------------------------------------------------------------------------ the blocks
def test_rows_per_block_are_the_pairs_over_the_keys():
    assert query_block_rows(32768) == 1024
    assert query_block_rows(131072) == 256
    assert query_block_rows(2**40) == 1


def test_masked_blocks_are_given_the_keys_up_to_their_last_rows_last_visible_key():
    """K = 100 measured queries, the last of M = 2^20 tokens: row i sees keys m <= i + M - K, so rows [a, b) need the
    first b + M - K keys; 32 rows a block (2^25 / 2^20)."""
    m, k = 2**20, 100
    blocks = query_blocks(k, m, Mask.parse("causal"))
    assert blocks == [QueryBlock(0, slice(0, 32), 32 + m - k), QueryBlock(1, slice(32, 64), 64 + m - k),
                      QueryBlock(2, slice(64, 96), 96 + m - k), QueryBlock(3, slice(96, 100), m)]
    assert query_blocks(k, m, Mask.parse("sliding:7")) == blocks  # the window's start is the estimator's to apply
    assert [b.keys for b in query_blocks(k, m, NO_MASK)] == [m] * 4  # without a mask every row sees every key


def _spec(cost: str, placement: str):
    return types.SimpleNamespace(cost_of=lambda params: cost, query_placement_of=lambda params: placement)


@pytest.mark.parametrize(("cost", "placement", "mask", "expected"), [
    ("quadratic", "independent", "causal", True),
    ("quadratic", "independent", None, True),
    ("quadratic", "last-n-of-m", "sliding:512", True),
    ("quadratic", "last-n-of-m", None, False),  # a window ending at token n + M - N would move without the cut
    ("quadratic", "proportional", "causal", False),  # landmarks pool the queries present
    ("linear", "independent", "causal", False),  # no K x M array; prefix sums would be summed again per block
])
def test_which_configurations_are_blocked(cost, placement, mask, expected):
    assert blocks_queries(_spec(cost, placement), {}, Mask.parse(mask), 32768, 32768) is expected


def test_blocks_start_above_the_threshold_and_above_one_block(monkeypatch):
    spec, mask = _spec("quadratic", "independent"), Mask.parse("causal")
    assert not blocks_queries(spec, {}, mask, 8192, 8192)  # 2^26 pairs: at the threshold, one call (earlier bits)
    assert blocks_queries(spec, {}, mask, 8193, 8193)
    assert not blocks_queries(spec, {}, mask, 32, 2**21)  # the decode shape at 2M keys: 2^26 pairs, one call
    assert blocks_queries(spec, {}, mask, 64, 2**21)  # 64 rows over 2M keys, in blocks of 16
    monkeypatch.setattr(query_blocks_module, "QUERY_BLOCK_PAIRS", 2**30)
    assert not blocks_queries(spec, {}, mask, 64, 2**21)  # above the threshold, but one block holds every row


def test_a_query_blocks_stream_is_its_own():
    """Replicate r's stream without a block is the one every earlier table drew from; each block's differs from it
    and from every other block's and replicate's."""
    firsts = {(r, b): replicate_rng(11, r, b).random() for r in range(3) for b in (None, 0, 1, 2)}
    assert len(set(firsts.values())) == len(firsts)
    reference = np.random.default_rng(np.random.SeedSequence(11, spawn_key=(1,))).random()
    assert firsts[(1, None)] == reference
    # nor the query sample's stream (two words under the master seed), whatever the replicate and block numbers
    from randattn.analysis.queries import query_sample_seed

    sample = np.random.default_rng(query_sample_seed(11)).random()
    assert replicate_rng(11, 0x51, 0x5E).random() != sample


# ------------------------------------------------------------------------------------------------ the rows
@pytest.mark.parametrize("mask", [None, "causal", "sliding:5"])
def test_deterministic_rows_in_blocks_equal_one_calls(monkeypatch, mask):
    """Top-k, Quest (pages of 2), StreamingLLM (masked: its window ends at each query's token) and softmax, S = 4,
    over 21 tokens in blocks of 4 queries (the last of 1): every measured column within 1e-10 relative of the one-call run, prob_mse
    and the keys used included."""
    acts = _acts(21)
    labels = "topk;quest:page_size=2;softmax" + ("" if mask is None else ";streaming:sinks=1")
    config = SweepConfig(estimators=parse_estimator_list(labels), num_samples=(4,), replicates=1, threads=1,
                         dtype="float64", mask=mask, diagnostics=False, check_reference=0.0)
    whole, blocked = _whole_and_blocked(monkeypatch, acts, config, rows_per_block=4)
    assert list(whole.label) == list(blocked.label)
    exact = whole.label == "softmax"  # its error is round-off against either side
    for column in MEASURED:
        if column not in whole:
            continue
        a, b = whole[column].to_numpy()[~exact], blocked[column].to_numpy()[~exact]
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=column)
        finite = ~np.isnan(a)
        assert finite.any(), column
        np.testing.assert_allclose(b[finite], a[finite], rtol=RTOL, atol=0, err_msg=column)
    assert (blocked.mse[~exact] > 0).all()


def test_the_runner_blocks_and_calls_each_block_with_its_keys(monkeypatch):
    """The unit's estimator calls: rows [0, 8), [8, 16), [16, 20) of the last 20 of 24 tokens (causal), with the
    first 12, 20 and 24 keys, made widest first: 8 x 20 = 160 pairs, then 8 x 12 = 96 and 4 x 24 = 96 in their
    order (:func:`largest_first`)."""
    acts = _acts(24, heads=1)
    config = SweepConfig(estimators=parse_estimator_list("topk"), num_samples=(2,), replicates=1, threads=1,
                         dtype="float64", mask="causal", queries="last:20", diagnostics=False, check_reference=0.0,
                         probabilities=False)
    calls = []
    original = BlockEstimator.tiled_estimate

    def recording(self, spec, est, q, k, v, draws, log_normaliser, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], None, tuple(log_normaliser.shape)))
        return original(self, spec, est, q, k, v, draws, log_normaliser, **kwargs)

    with monkeypatch.context() as patch:
        _blocked(patch, 8, 24)
        patch.setattr(BlockEstimator, "tiled_estimate", recording)
        runner = UnitRunner(acts, config)
        unit = plan(acts, config)[0]
        assert runner.query_blocks(unit) == [QueryBlock(0, slice(0, 8), 12), QueryBlock(1, slice(8, 16), 20),
                                             QueryBlock(2, slice(16, 20), 24)]
        runner.blocks(unit)  # the memory calibration's calls, on the unit's own shape here
        calls.clear()
        runner.run(unit)
    assert [call[:2] for call in calls] == [(8, 20), (8, 12), (4, 24)]
    assert [call[3] for call in calls] == [(1, 8), (1, 8), (1, 4)]  # each block's rows of the log-normaliser


def test_blocks_are_computed_widest_first_ties_in_their_order():
    blocks = [QueryBlock(0, slice(0, 4), 10), QueryBlock(1, slice(4, 8), 14), QueryBlock(2, slice(8, 12), 18),
              QueryBlock(3, slice(12, 14), 20)]  # pairs 40, 56, 72, 40
    assert largest_first(blocks) == [2, 1, 0, 3]
    same = [QueryBlock(i, slice(4 * i, 4 * i + 4), 9) for i in range(3)]  # no mask: every block sees every key
    assert largest_first(same) == [0, 1, 2]


@pytest.mark.parametrize("label", ["magicpig:hash_bits=2,sinks=1,local=2",
                                   "vattention:budget=fixed,sinks=1,local=2,top_k=2"])
def test_random_rows_in_blocks_are_draws_of_the_same_distribution(monkeypatch, label):
    """MagicPIG and vAttention, causal, 40 tokens, R = 200 replicates, in blocks of 8 queries with draws of their own:
    each head's MSE within 4 standard errors of the one-call run's (the two SEs in quadrature, from the replicates:
    the table's mse_se), and not the same numbers (the draws differ)."""
    acts = _acts(40, heads=2, seed=5)
    config = SweepConfig(estimators=parse_estimator_list(label), num_samples=(4,), replicates=200, seed=1,
                         threads=1, dtype="float64", mask="causal", diagnostics=False, check_reference=0.0,
                         probabilities=False)
    whole, blocked = _whole_and_blocked(monkeypatch, acts, config, rows_per_block=8)
    se = np.hypot(whole.mse_se.to_numpy(), blocked.mse_se.to_numpy())
    gap = np.abs(whole.mse.to_numpy() - blocked.mse.to_numpy())
    assert (gap <= 4 * se).all(), (gap, se)
    assert (gap > 0).all()


@pytest.mark.slow
def test_a_blocked_unit_fits_a_budget_that_one_call_does_not(monkeypatch):
    """Top-k over 2,048 causal tokens in blocks of 128 queries: the memory model forecasts a peak far below the
    one-call unit's, so a budget between the two refuses one call and runs the blocks."""
    from randattn.analysis.cell_memory import MemoryBudgetError

    acts = _acts(2048, heads=1, d=16)
    config = SweepConfig(estimators=parse_estimator_list("topk"), num_samples=(8,), replicates=1, threads=1,
                         dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
    unit = plan(acts, config)[0]
    whole = UnitRunner(acts, config).block_bytes(unit, 1, 1)
    with monkeypatch.context() as patch:
        _blocked(patch, 128, 2048)
        blocked = UnitRunner(acts, config).block_bytes(unit, 1, 1)
    assert blocked < whole / 4, (blocked, whole)
    budget = (blocked + whole) // 2
    import dataclasses

    tight = dataclasses.replace(config, max_memory=budget)
    with pytest.raises(MemoryBudgetError):
        UnitRunner(acts, tight).blocks(unit)
    with monkeypatch.context() as patch:
        _blocked(patch, 128, 2048)
        rows = UnitRunner(acts, tight).run(unit)
    assert np.isfinite(rows[0]["mse"]) and np.isfinite(rows[0]["prob_mse"])


def test_a_unit_whose_truth_is_dense_runs_in_one_call(monkeypatch):
    """A block's truth is rows of the tiled truth: where the truth is dense (the block thresholds lowered below the
    tiled truth's), the unit runs in one call and gives the one-call rows, bit for bit."""
    acts = _acts(12, heads=1)
    config = SweepConfig(estimators=parse_estimator_list("topk"), num_samples=(3,), replicates=1, threads=1,
                         dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
    whole = run_sweep(acts, config)
    with monkeypatch.context() as patch:
        patch.setattr(query_blocks_module, "QUERY_BLOCKED_ABOVE", 0)
        patch.setattr(query_blocks_module, "QUERY_BLOCK_PAIRS", 4 * 12)
        runner = UnitRunner(acts, config)
        assert runner.query_blocks(plan(acts, config)[0]) is None
        dense = run_sweep(acts, config)
    np.testing.assert_array_equal(dense.mse.to_numpy(), whole.mse.to_numpy())


def test_a_blocked_unit_leaves_the_is_diagnostics_nan_and_says_why(monkeypatch):
    """The IS diagnostics describe one call's weights: a blocked unit of an estimator that declares them (RFA, blocked
    here by force) warns once and leaves ESS and k-hat NaN; the same unit in one call computes them."""
    import randattn.analysis.execute as execute
    from randattn.analysis.execute import run_recording

    acts = _acts(16, heads=1)
    config = SweepConfig(estimators=parse_estimator_list("rfa"), num_samples=(4,), replicates=4, threads=1,
                         dtype="float64", diagnostics=True, check_reference=0.0)
    unit = plan(acts, config)[0]
    with monkeypatch.context() as patch:
        patch.setattr(exact_cache, "TILED_ABOVE", 0)
        whole, _, _, _ = run_recording(UnitRunner(acts, config), unit)
        patch.setattr(execute, "blocks_queries", lambda *args: True)
        patch.setattr(query_blocks_module, "QUERY_BLOCK_PAIRS", 4 * 16)
        blocked, caught, _, _ = run_recording(UnitRunner(acts, config), unit)
    assert np.isfinite(whole[0]["ess_mean"])
    assert np.isnan(blocked[0]["ess_mean"]) and np.isnan(blocked[0]["pareto_khat"])
    assert [message for category, message in caught if category == "DiagnosticsSkippedWarning"] == [
        "IS diagnostics (ESS, delta-method variance, k-hat) not computed for rfa: its 16 queries are estimated in "
        "blocks of 4, each with draws of its own, and the diagnostics describe one call's"]
    # an estimator without importance weights (MagicPIG) has no diagnostics to skip: a blocked unit says nothing
    pig = SweepConfig(estimators=parse_estimator_list("magicpig:hash_bits=2"), num_samples=(4,), replicates=4,
                      threads=1, dtype="float64", diagnostics=True, check_reference=0.0, mask="causal")
    with monkeypatch.context() as patch:
        _blocked(patch, 4, 16)
        runner = UnitRunner(acts, pig)
        assert runner.query_blocks(plan(acts, pig)[0]) is not None
        _, caught, _, _ = run_recording(runner, plan(acts, pig)[0])
    assert [category for category, _ in caught if category == "DiagnosticsSkippedWarning"] == []


def test_the_plan_counts_the_blocked_units_and_says_so(monkeypatch):
    """`--dry-run`'s memory line: top-k's unit is blocked, RFA's (linear) is not: 1 of 2."""
    from randattn.analysis.sweep import plan_sweep
    from randattn.reports.console import plan_lines

    acts = _acts(16, heads=1)
    config = SweepConfig(estimators=parse_estimator_list("topk;rfa"), num_samples=(4,), replicates=2, threads=1,
                         dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
    assert plan_sweep(acts, config).query_blocked == 0
    with monkeypatch.context() as patch:
        _blocked(patch, 4, 16)
        swept = plan_sweep(acts, config)
    assert swept.query_blocked == 1
    assert plan_lines(swept, timing=False)[1].endswith("; query blocks: 1 of 2 units estimated a block of queries at "
                                                       "a time, each with the keys it sees (the sweeps guide, Long "
                                                       "contexts)")


def test_the_plans_mask_probe_draws_for_a_query_block_as_the_run_does(monkeypatch):
    """The plan draws once per configuration and mask to refuse parameters with no masked form. vAttention's draws
    hold M uniforms per query: for every query of a 32,768-token layer that probe alone took 8 GiB, while the run
    draws a block of 1,024 at a time. Here (40 tokens, blocks of 8 rows) vAttention, a blocked configuration, is
    probed with 8 queries and RFA (linear cost, one call) with all 40, each against every key."""
    from randattn.estimators import registry

    drawn = []
    real = registry.get_spec

    class Spy:
        def __init__(self, spec):
            self._spec = spec

        def __getattr__(self, name):
            return getattr(self._spec, name)

        def draw(self, q_shape, k_shape, **kwargs):
            drawn.append((self._spec.name, q_shape, k_shape))
            return self._spec.draw(q_shape, k_shape, **kwargs)

    acts = _acts(40, heads=1, d=4)
    config = SweepConfig(estimators=parse_estimator_list("vattention;rfa"), num_samples=(4,), replicates=2, threads=1,
                         dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
    with monkeypatch.context() as patch:
        _blocked(patch, 8, 40)
        patch.setattr(registry, "get_spec", lambda name: Spy(real(name)))
        plan(acts, config)
    assert drawn == [("vattention", (1, 8, 4), (1, 40, 4)), ("rfa", (1, 40, 4), (1, 40, 4))]


def test_timed_blocks_are_evenly_spaced_from_the_first_to_the_last():
    assert timed_block_indices(32, 4) == [0, 10, 21, 31]
    assert timed_block_indices(3, 4) == [0, 1, 2]
    assert timed_block_indices(5, 2) == [0, 4]
    assert timed_block_indices(5, 1) == [4]


def test_the_dry_run_times_a_unit_in_many_query_blocks_on_a_few(monkeypatch):
    """A unit of 40 causal queries in blocks of 4 rows is 10 blocks; each block's estimate is made to take 0.05 s
    more. The dry run computes 4 of them (0, 3, 6, 9) and scales their draws and estimates to the 10: about 0.5 s,
    not the 0.2 s of the 4 it ran; its untimed warm-up computes one; the run itself computes all 10."""
    import time as clock

    from randattn.analysis.sweep import plan_sweep

    calls = []
    original = BlockEstimator.tiled_estimate

    def slow(self, spec, est, q, *args, **kwargs):
        calls.append(q.shape[-2])
        clock.sleep(0.05)
        return original(self, spec, est, q, *args, **kwargs)

    acts = _acts(40, heads=1, d=4)
    config = SweepConfig(estimators=parse_estimator_list("topk"), num_samples=(4,), replicates=2, threads=1,
                         dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
    with monkeypatch.context() as patch:
        _blocked(patch, 4, 40)
        patch.setattr(BlockEstimator, "tiled_estimate", slow)
        swept = plan_sweep(acts, config, timing=True)
        timed = calls.count(4)  # calls of a block's 4 rows (the memory calibration's are of all 40)
        calls.clear()
        run_sweep(acts, config)
    assert timed == 1 + 4  # the untimed warm-up's one, then the 4 timed
    assert 0.5 <= swept.seconds < 0.5 + 0.15, swept.seconds
    assert calls.count(4) == 10


def test_the_probability_error_is_summed_over_the_blocks_in_their_order_whatever_the_order_computed(monkeypatch):
    """Blocks of 8 of 32 causal queries see 8, 16, 24 and 32 keys and are computed widest first (3, 2, 1, 0); each
    block's squared probability error is replaced by a value whose float64 sum depends on the order of addition:
    in block order ((1e16 + 3) - 1e16) + 0.5 = 4.5, where the order computed gives another number. The unit's
    prob_mse is that sum over N M = 1,024 entries: the same bits as before the blocks were reordered."""
    acts = _acts(32, heads=1)
    config = SweepConfig(estimators=parse_estimator_list("topk"), num_samples=(2,), replicates=1, threads=1,
                         dtype="float64", mask="causal", diagnostics=False, check_reference=0.0)
    crafted = {8: 1e16, 16: 3.0, 24: -1e16, 32: 0.5}  # by a block's keys
    original = BlockEstimator.tiled_estimate

    def replaced(self, spec, est, q, k, v, draws, log_normaliser, **kwargs):
        out, sq, facts = original(self, spec, est, q, k, v, draws, log_normaliser, **kwargs)
        return out, np.full(np.shape(sq), crafted[k.shape[-2]]), facts

    with monkeypatch.context() as patch:
        _blocked(patch, 8, 32)
        patch.setattr(BlockEstimator, "tiled_estimate", replaced)
        table = run_sweep(acts, config)
    assert ((1e16 + 3.0) - 1e16) + 0.5 == 4.5 and ((0.5 - 1e16) + 3.0) + 1e16 != 4.5
    assert table.prob_mse.iloc[0] == 4.5 / (32 * 32)
