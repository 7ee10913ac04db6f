"""Cells of a sweep never share draws, and their replicate errors are independent (issue #13).

Every head of the activations below holds the *same* q, k, v, so two cells that shared their
random draws would report bitwise-identical replicate errors. Only the public sweep API is used
(``run_sweep``, ``SweepConfig``, ``estimator_config``, ``cell_seed``, ``replicate_rng``); the
replicate errors are recomputed here from ``replicate_rng(cell seed, r)`` with the estimator's own
``draw`` and reference ``estimate``, and an exact softmax written with scipy.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from scipy import stats
from scipy.special import softmax

from randattn.activations import make_activations
from randattn.analysis.sweep import SweepConfig, cell_seed, estimator_config, replicate_rng, run_sweep
from randattn.estimators.registry import get_spec

SCALE = 0.5
LABELS = ("rfa", "ra", "rfa:coupling=orthogonal")


@pytest.fixture(scope="module")
def same_head_everywhere():
    rng = np.random.default_rng(5)
    q, k, v = (0.7 * rng.standard_normal((6, 4)) for _ in range(3))
    tile = lambda a: np.broadcast_to(a, (2, 3, 6, 4)).copy()  # noqa: E731 - 2 images x 3 heads
    arrays = {layer: (tile(q), tile(k), tile(v)) for layer in (0, 3)}
    acts = make_activations(arrays, {"scale": SCALE, "model": "synthetic", "images": ["a", "b"]})
    return acts, (q, k, v)


def _table(acts, replicates):
    config = SweepConfig(estimators=tuple(estimator_config(label) for label in LABELS), num_samples=(3, 5),
                         replicates=replicates, seed=4, diagnostics=False, probabilities=False,
                         backend="reference")
    return run_sweep(acts, config)


def _replicate_errors(row, qkv, replicates):
    """Per-replicate MSE of one cell, recomputed from replicate_rng(cell_seed(...), r)."""
    q, k, v = qkv
    spec = get_spec(row["estimator"])
    params = json.loads(row["params"])
    seed = cell_seed(4, row["image"], int(row["layer"]), int(row["head"]), row["params"], row["estimator"],
                     int(row["num_samples"]))
    assert seed == int(row["seed"])
    exact = softmax(SCALE * q @ k.T, axis=-1) @ v
    errors = []
    for r in range(replicates):
        draws = spec.draw(q.shape, k.shape, num_samples=int(row["num_samples"]), replicates=1,
                          rng=replicate_rng(seed, r), **params)
        est = spec.reference(q, k, v, draws, scale=SCALE, **params)[0]
        errors.append(((est - exact) ** 2).mean())
    return np.array(errors)


def test_no_two_cells_share_draws(same_head_everywhere):
    acts, _ = same_head_everywhere
    table = _table(acts, replicates=3)
    rand = table[table.random]
    assert len(rand) == 2 * 2 * 3 * len(LABELS) * 2
    assert rand.seed.is_unique, "two cells got the same seed"
    for (label, s), group in rand.groupby(["label", "num_samples"]):
        assert len(group) == 12
        # identical inputs: equal statistics would mean shared draws
        for column in ("mse", "variance", "bias_sq_naive"):
            assert group[column].is_unique, f"{label} S={s}: two cells share draws ({column} repeats)"


def test_replicate_errors_of_different_cells_are_independent(same_head_everywhere):
    """Spearman rank correlation of the R = 150 replicate errors of every pair of the 12 cells of
    one (estimator, S): under independence sqrt(R - 1) rho ~ N(0, 1); 66 pairs at 4.5 keep the
    false alarm below 1e-3. The table's MSE must equal the mean of the recomputed errors (so the
    recomputation is what the sweep ran), and within a cell all replicate errors are distinct."""
    acts, qkv = same_head_everywhere
    reps = 150
    table = _table(acts, replicates=reps)
    cells = table[(table.label == "rfa") & (table.num_samples == 3)]
    errors = np.stack([_replicate_errors(row, qkv, reps) for _, row in cells.iterrows()])  # (12, R)
    np.testing.assert_allclose(errors.mean(1), cells.mse.to_numpy(), rtol=1e-9)
    assert len(np.unique(errors)) == errors.size, "a replicate's draws repeat inside or across cells"
    worst = 0.0
    for i, j in itertools.combinations(range(len(errors)), 2):
        rho = stats.spearmanr(errors[i], errors[j]).statistic
        worst = max(worst, abs(rho) * np.sqrt(reps - 1))
    assert worst < 4.5, f"replicate errors of two cells are correlated (max |z| = {worst:.2f})"


def _every_variant():
    from randattn.estimators.registry import list_estimators

    for name in list_estimators():
        spec = get_spec(name)
        for variant, params in {"default": {}, **spec.variants}.items():
            yield pytest.param(name, params, id=f"{name}-{variant}")


@pytest.mark.parametrize("name, params", _every_variant())
def test_block_draws_are_the_per_cell_per_replicate_draws_stacked(name, params):
    """``cell_draws`` makes one ``draw`` call over a (replicates, cells) grid of generators; every
    variant of every estimator gets, bit for bit, what one call per (cell, replicate) with
    ``replicate_rng(seed, r)`` gives (written out here), so rows do not depend on the blocking."""
    from randattn.analysis.execute import cell_draws
    from randattn.analysis.plan import estimator_config

    spec = get_spec(name)
    config = estimator_config(name, params)
    q_shape, k_shape = (13, 6), (13, 6)
    seeds, reps = [11, 12, 13], range(2, 5)
    samples = 80 if spec.needs_samples else None  # > D = 6: several orthogonal blocks, the last truncated; whole Quest pages of 16
    block = cell_draws(spec, config, q_shape, k_shape, seeds, reps, samples)
    assert block.replicates == len(reps)
    for c, seed in enumerate(seeds):
        for i, r in enumerate(reps):
            one = spec.draw(q_shape, k_shape, num_samples=samples, replicates=1, rng=replicate_rng(seed, r),
                            **config.params)
            assert set(one.arrays) == set(block.arrays)
            for key, array in one.arrays.items():
                assert np.array_equal(block.arrays[key][i, c], array[0]), (key, c, r)


def test_stacked_generators_check_the_requested_shape():
    from randattn.analysis.plan import StackedGenerators

    grid = StackedGenerators([[np.random.default_rng(i) for i in range(3)]])
    assert grid.shape == (1, 3)
    assert grid.standard_normal((1, 3, 2)).shape == (1, 3, 2)
    with pytest.raises(ValueError, match=r"a draw of shape \(3, 2\) does not start with the generators' grid shape"):
        grid.standard_normal((3, 2))
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        StackedGenerators([np.random.RandomState(0)])


@pytest.mark.parametrize("seed, replicate", [(0, 0), (17, 3), (2**62 + 5, 31)])
def test_replicate_rng_is_the_seed_sequence_of_the_cell_and_replicate(seed, replicate):
    """The documented stream: ``default_rng(SeedSequence(seed, spawn_key=(r,)))``, written out here (tables of earlier
    versions depend on it bit for bit)."""
    expected = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(replicate,)))
    got = replicate_rng(seed, replicate)
    assert np.array_equal(got.standard_normal(64), expected.standard_normal(64))
    assert np.array_equal(got.integers(0, 2**63, 8), expected.integers(0, 2**63, 8))


# ------------------------------------------------------------------------------------------------ plugin draws
@pytest.fixture
def uniform_keys():
    """A registered plugin whose ``draw`` calls ``rng.integers`` (tests/analysis/_uniform_keys.py)."""
    from _uniform_keys import NAME, SPEC

    from randattn.estimators.registry import register_estimator, unregister_estimator

    register_estimator(SPEC)
    yield SPEC
    unregister_estimator(NAME)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_a_plugin_draw_gets_a_numpy_generator_in_the_sweep(same_head_everywhere, uniform_keys, backend):
    """The plugin guide promises ``draw`` a numpy ``Generator``: a plugin that does not declare ``stacked_draw`` is
    drawn one cell and replicate a call, so ``rng.integers`` works, and the table's MSE is the mean of the replicate
    errors recomputed from ``replicate_rng(cell seed, r)`` (float64: to rounding, 1e-9 relative)."""
    acts, qkv = same_head_everywhere
    config = SweepConfig(estimators=(estimator_config(uniform_keys.name),), num_samples=(3,), replicates=4, seed=4,
                         diagnostics=False, probabilities=False, backend=backend, dtype="float64")
    table = run_sweep(acts, config)
    assert len(table) == 2 * 2 * 3
    for _, row in table.iterrows():
        np.testing.assert_allclose(_replicate_errors(row, qkv, 4).mean(), row["mse"], rtol=1e-9)
    assert table.mse.nunique() > 1  # the cells drew their own keys


def test_per_cell_draws_are_the_one_cell_draws_stacked_and_named_when_they_do_not_stack(uniform_keys):
    from randattn.analysis.execute import cell_draws
    from randattn.estimators.base import Draws, EstimatorSpec

    config = estimator_config(uniform_keys.name)
    seeds, reps = [7, 8], range(1, 4)
    block = cell_draws(uniform_keys, config, (5, 3), (9, 3), seeds, reps, 6)
    assert block.replicates == 3 and block["idx"].shape == (3, 2, 6)
    for c, seed in enumerate(seeds):
        for i, r in enumerate(reps):
            want = replicate_rng(seed, r).integers(0, 9, size=(1, 6))[0]  # the plugin's draw, written out
            assert np.array_equal(block["idx"][i, c], want)

    def without_replicate_dim(q_shape, k_shape, *, num_samples, replicates=1, rng):
        return Draws({"idx": rng.integers(0, k_shape[-2], size=num_samples).astype(float)}, replicates)

    bad = EstimatorSpec(**{**vars(uniform_keys), "draw": without_replicate_dim})
    with pytest.raises(ValueError, match=r"estimator 'uniform-keys': draw\(replicates=1\) gave 'idx' of shape \(6,\), "
                                         r"which does not start with the replicate dim 1"):
        cell_draws(bad, config, (5, 3), (9, 3), seeds, reps, 6)

    def shape_by_seed(q_shape, k_shape, *, num_samples, replicates=1, rng):
        return Draws({"idx": np.zeros((replicates, int(rng.integers(1, 3))))}, replicates)

    moving = EstimatorSpec(**{**vars(uniform_keys), "draw": shape_by_seed})
    with pytest.raises(ValueError, match="must not change shape from one seed to the next"):
        cell_draws(moving, config, (5, 3), (9, 3), list(range(10)), reps, 6)


def test_a_plugin_declaring_stacked_draw_wrongly_is_refused_by_name_in_the_sweep(same_head_everywhere, uniform_keys):
    """A draw calling ``rng.integers`` that declares ``stacked_draw`` anyway: the sweep refuses it with a ValueError
    naming the estimator, the method and the declaration (the CLI's exit 2), not an AttributeError traceback."""
    import dataclasses

    from randattn.analysis.plan import StackedDrawError
    from randattn.estimators.registry import register_estimator, unregister_estimator

    acts, _ = same_head_everywhere
    register_estimator(dataclasses.replace(uniform_keys, name="stacks-integers", stacked_draw=True))
    try:
        config = SweepConfig(estimators=(estimator_config("stacks-integers"),), num_samples=(3,), replicates=2,
                             seed=4, diagnostics=False, probabilities=False, backend="torch")
        with pytest.raises(StackedDrawError, match="estimator 'stacks-integers': draw\\(\\) asked its rng for "
                                                   "Generator.integers.*must not declare stacked_draw"):
            run_sweep(acts, config)
    finally:
        unregister_estimator("stacks-integers")
    from randattn.analysis.plan import StackedGenerators

    grid = StackedGenerators([[np.random.default_rng(0)]])
    with pytest.raises(AttributeError, match="no attribute 'not_a_method'"):
        grid.not_a_method
