"""Readable estimator names: the papers' names for the common configurations, a distinct name for every variant."""

from __future__ import annotations

import pytest

from randattn.estimators.names import display_name, display_name_of_label, parse_label
from randattn.estimators.registry import get_spec, list_estimators


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("rfa", {"coupling": "orthogonal"}, "Performer (FAVOR+, orthogonal)"),
        ("rfa", {"feature_map": "oprf"}, "Performer (FAVOR++, iid)"),
        ("rfa", {"feature_map": "sderf", "coupling": "orthogonal"}, "Performer (FAVOR#, orthogonal)"),
        ("lara", {}, "LARA (paper, decoupled β=1)"),
        ("lara", {"weighting": "balance"}, "LARA (balance heuristic)"),
        ("ra", {}, "RA (unbiased)"),
        ("softmax", {}, "Softmax (exact)"),
        ("eva", {"window": 49, "layout": "grid", "grid": [14, 14]}, "EVA (exact local 7×7 + control variates"),
        ("eva", {"window": 49}, "EVA (exact local 49-token window + control variates"),
    ],
)
def test_names_the_papers_use(name, params, expected):
    assert display_name(name, params).startswith(expected)


def test_every_registered_variant_has_a_distinct_name():
    for name in list_estimators():
        variants = get_spec(name).variants
        names = {key: display_name(name, params) for key, params in variants.items()}
        assert all(n.strip() for n in names.values())
        # distinct within the estimator: two variants with one name would be merged in a legend
        assert len(set(names.values())) == len(names), f"{name}: {names}"


def test_demo_configurations_have_distinct_names():
    from randattn.analysis.sweep import estimator_config
    from randattn.workflows.demo import DEFAULT_ESTIMATORS

    configs = [estimator_config(spec) for spec in DEFAULT_ESTIMATORS]
    names = [display_name(c.name, c.params) for c in configs]
    assert len(set(names)) == len(names), names
    assert "Performer (FAVOR+, orthogonal)" in names and "LARA (balance heuristic)" in names


def test_unknown_parameters_and_presets_fall_back_gracefully():
    assert display_name("lara", {"preset": "official-code"}).startswith("LARA (official code")
    assert display_name("rfa", {"future_option": 3}) == "Performer (FAVOR+, iid, future_option=3)"
    assert display_name("newcomer", {"a": 1}) == "newcomer (a=1)"
    assert display_name("local", {"window": "wide"})  # an unexpected type does not raise


def test_names_from_table_rows():
    assert parse_label("lara:beta=2.0,alpha_clamp=none") == ("lara", {"beta": 2.0, "alpha_clamp": None})
    assert display_name_of_label("rfa:coupling=orthogonal") == "Performer (FAVOR+, orthogonal)"
    assert display_name_of_label("lara", '{"weighting": "balance", "beta": 1.0}') == "LARA (balance heuristic)"
