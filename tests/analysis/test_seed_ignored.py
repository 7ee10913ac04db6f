"""A plugin declared random whose draw ignores its generator: `mse` measures one draw R times, and says so."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from randattn.activations import make_activations
from randattn.analysis.execute import UnitRunner, run_recording, seed_ignored
from randattn.analysis.plan import SweepConfig, parse_estimator_list
from randattn.analysis.sweep import plan
from randattn.estimators.base import Draws
from randattn.estimators.registry import get_spec, register_estimator, unregister_estimator


def test_seed_ignored_compares_replicates_zero_and_one():
    same = np.ones((3, 2, 4))
    assert seed_ignored(Draws({"omega": same}, 3))
    differs = same.copy()
    differs[1, 1, 3] = 0.5
    assert not seed_ignored(Draws({"omega": differs, "other": same}, 3))  # one array differing is enough
    assert not seed_ignored(Draws({"omega": same[:1]}, 1))  # one replicate: nothing to compare
    assert not seed_ignored(Draws({}, 3))  # no random variables
    assert not seed_ignored(Draws({"omega": np.ones((3, 0))}, 3))


@pytest.fixture
def fixed_seed_rfa():
    rfa = get_spec("rfa")

    def draw(q_shape, k_shape, *, rng, **kwargs):
        return rfa.draw(q_shape, k_shape, rng=np.random.default_rng(0), **kwargs)  # the fault: rng unread

    spec = register_estimator(replace(rfa, name="fixedrfa", display_name="Fixed-seed RFA", draw=draw,
                                      stacked_draw=False))
    yield spec
    unregister_estimator(spec.name)


def _warnings(label: str) -> tuple[list[dict], list[str]]:
    rng = np.random.default_rng(0)
    acts = make_activations({0: tuple(rng.normal(size=(1, 1, 12, 8)) for _ in range(3))},
                            {"scale": 8 ** -0.5, "layout": "sequence"})
    config = SweepConfig(estimators=parse_estimator_list(label), num_samples=(4,), replicates=3, threads=1,
                         dtype="float64", diagnostics=False, check_reference=0.0)
    rows, caught, _, _ = run_recording(UnitRunner(acts, config), plan(acts, config)[0])
    return rows, [message for category, message in caught if category == "SeedIgnoredWarning"]


def test_a_draw_that_ignores_its_rng_is_named(fixed_seed_rfa):
    rows, messages = _warnings("fixedrfa")
    assert rows[0]["variance"] < 1e-30  # what the warning is about: one draw, R times (0 but for rounding)
    assert messages == ["fixedrfa is declared random, but its draw gave replicates 0 and 1 the same random "
                        "variables from different generators: it ignores its rng, and its rows measure one draw "
                        "(variance 0); run `randattn check` on it"]
    rows, messages = _warnings("rfa")
    assert rows[0]["variance"] > 0 and messages == []
