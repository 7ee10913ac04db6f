"""A plugin estimator is reported like a built-in: tables, figures and the HTML report ask its spec, not its name.

The plugins here are built-in specs under new names (``dataclasses.replace``), registered for this module with
:func:`~randattn.estimators.registry.register_estimator` and removed afterwards: a deterministic local-attention
copy, a random-feature copy (it has ``feature_map`` and ``coupling``, so the features figure compares it) and an
exact copy of softmax. Nothing in randattn knows their names.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from randattn.estimators.registry import get_spec, register_estimator, unregister_estimator
from randattn.reports.figures import (
    feature_estimators,
    features_figure,
    heatmap_figure,
    mse_vs_samples_figure,
)
from randattn.reports.html import build_report, default_figures, diagnostics_overview
from randattn.reports.tables import (
    approximate_labels,
    display_names,
    estimator_order,
    exact_labels,
    is_exact,
    label_order,
    summary_table,
)
from randattn.reports.testing import make_results_table

ENV = {"python": "3.x", "numpy": "n", "torch": "t", "platform": "p"}
#: label -> (estimator, params, variance scale, squared bias), as randattn.reports.testing.DEFAULT_LABELS
PROFILES = {
    "mylocal": ("mylocal", {}, 0.0, 0.01),
    "myrfa": ("myrfa", {}, 3.0, 0.02),
    "myrfa:coupling=orthogonal": ("myrfa", {"coupling": "orthogonal"}, 2.0, 0.015),
    "myrfa:feature_map=trigonometric": ("myrfa", {"feature_map": "trigonometric"}, 20.0, 0.2),
    "myexact": ("myexact", {}, 0.0, 0.0),
    "gone": ("gone", {}, 1.0, 0.01),  # a plugin that wrote the table but is not installed here
}


@pytest.fixture(scope="module")
def plugins():
    specs = [
        replace(get_spec("local"), name="mylocal", display_name="My local"),
        replace(get_spec("rfa"), name="myrfa", display_name="My RFA"),
        replace(get_spec("softmax"), name="myexact", display_name="My exact"),
    ]
    for spec in specs:
        register_estimator(spec)
    yield specs
    for spec in specs:
        unregister_estimator(spec.name)


@pytest.fixture(scope="module")
def table(plugins):
    return make_results_table(tokens=(197,), samples=(16, 64), heads=2, layers=(0, 11), profiles=PROFILES,
                              labels=["softmax", "rfa", "rfa:coupling=orthogonal", "mylocal", "myrfa",
                                      "myrfa:coupling=orthogonal", "myrfa:feature_map=trigonometric", "myexact"])


def test_the_synthetic_table_asks_the_spec_what_each_plugin_is(table):
    random = table.groupby("label")["random"].first()
    assert not random["mylocal"] and not random["myexact"] and random["myrfa"]  # is_random of the spec
    assert (table.loc[table["label"] == "myexact", "mse"] == 0).all()  # exact by convergence, not by name
    assert (table.loc[table["label"] == "mylocal", "mse"] > 0).all()


def test_plugins_are_ordered_after_the_builtins_and_unknown_names_last(plugins):
    order = estimator_order()
    assert order.index("local") < order.index("mylocal") < order.index("myrfa")
    labels = ["zz-unknown", "mylocal", "myrfa:coupling=orthogonal", "softmax", "aa-unknown", "rfa", "myrfa"]
    assert label_order(labels) == ["softmax", "rfa", "mylocal", "myrfa", "myrfa:coupling=orthogonal",
                                   "aa-unknown", "zz-unknown"]


def test_exactness_comes_from_the_spec(table):
    assert exact_labels(table) == {"softmax", "myexact"}
    assert is_exact("myexact") and not is_exact("mylocal") and not is_exact("not-installed")
    assert "myexact" not in approximate_labels(table) and "mylocal" in approximate_labels(table)


def test_tables_show_the_plugins_display_names(table):
    names = display_names(table)
    assert names["mylocal"] == "My local (exact 49-token window)"
    assert names["myrfa:coupling=orthogonal"] == "My RFA (FAVOR+, orthogonal)"
    summary = summary_table(table)
    assert {"My local (exact 49-token window)", "My exact (exact)"} <= set(summary["estimator"])


def test_figures_draw_the_plugins(table):
    fig = mse_vs_samples_figure(table)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    # a local window takes no S: one measurement, a horizontal line named so
    assert "My local (exact 49-token window) (no S)" in legend and "My RFA (FAVOR+, iid)" in legend
    assert not any(text.startswith("My exact") for text in legend)  # exact: noted, not drawn
    assert "My exact (exact) (mse 0)" in " ".join(fig.get_suptitle().split())
    heatmap = heatmap_figure(table, label="mylocal", num_samples=16)
    # a local window takes no S: its one measurement, repeated at each S, is titled without one
    assert "My local (exact 49-token window) [mylocal]" in " ".join(heatmap.get_suptitle().split())


def test_the_features_figure_compares_every_estimator_with_feature_map_and_coupling(table):
    assert feature_estimators(table) == ["rfa", "myrfa"]
    fig = features_figure(table)
    labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    # two families in one panel: each variant is named with its family; no coupling was measured with two maps but
    # iid, so the feature maps are compared there (myrfa:feature_map=trigonometric is measured with iid only)
    assert labels == {"Performer: iid", "Performer: orthogonal", "My RFA: iid", "My RFA: orthogonal",
                      "Performer: positive", "My RFA: positive", "My RFA: trigonometric"}
    assert "Random-feature attention (rfa/myrfa)" in fig.get_suptitle() and "not shown" not in fig.get_suptitle()
    alone = features_figure(table[table["estimator"] == "myrfa"])
    assert {line.get_label() for line in alone.axes[0].get_lines()} == {"iid", "orthogonal"}
    assert alone.axes[1].get_title().startswith("feature map (iid coupling)")
    assert {line.get_label() for line in alone.axes[1].get_lines()} == {"positive", "trigonometric"}
    # beside an orthogonal trigonometric variant the maps are compared at orthogonal: the iid one is named, and why
    trig_orthogonal = "myrfa:coupling=orthogonal,feature_map=trigonometric"
    both = make_results_table(tokens=(197,), samples=(16, 64), heads=1, layers=(0,),
                              profiles={**PROFILES, trig_orthogonal: ("myrfa", {"coupling": "orthogonal",
                                                                                "feature_map": "trigonometric"},
                                                                      15.0, 0.1)},
                              labels=["myrfa", "myrfa:coupling=orthogonal", "myrfa:feature_map=trigonometric",
                                      trig_orthogonal])
    subtitle = " ".join(features_figure(both).get_suptitle().split())
    assert ("not shown: My RFA (trigonometric RFA, iid) (the figure compares couplings on positive features and "
            "feature maps at orthogonal coupling only)") in subtitle


def test_the_report_shows_and_explains_the_plugins(table):
    nan = table.copy()
    nan.loc[nan["label"] == "myrfa:feature_map=trigonometric", ["pareto_khat", "delta_var_ratio", "ess_mean"]] = np.nan
    overview = diagnostics_overview(nan).set_index(["label", "S"])
    assert overview.loc[("mylocal", 16), "k-hat"] == (
        "k-hat not computed: deterministic estimator (no draws, no importance weights)")
    assert overview.loc[("myrfa:feature_map=trigonometric", 64), "ESS"] == (
        "ESS not computed: signed weights (My RFA (trigonometric RFA, iid) has no importance weights)")
    assert overview.loc[("mylocal", 16), "estimator"] == "My local (exact 49-token window)"
    figures = {figure.name: figure for figure in default_figures(table)}
    assert "features" in figures and figures["features"].caption.endswith("for rfa, myrfa.")
    assert "heatmap-mylocal" in figures and "heatmap-myexact" not in figures
    page = build_report(nan, environment=ENV, figures=[])
    assert '<th title="mylocal">My local (exact 49-token window)</th>' in page
    assert "My RFA (trigonometric RFA, iid) has no importance weights" in page


def test_a_table_of_a_plugin_not_installed_here_is_still_reported(plugins):
    table = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,), profiles=PROFILES,
                               labels=["softmax", "rfa", "gone"])
    table.loc[table["label"] == "gone", ["pareto_khat", "delta_var_ratio", "ess_mean"]] = np.nan
    assert label_order(table["label"]) == ["softmax", "rfa", "gone"]
    overview = diagnostics_overview(table).set_index(["label", "S"])
    assert overview.loc[("gone", 16), "k-hat"] == (
        "k-hat not computed: estimator gone is not installed here; its diagnostics cannot be explained")
    page = build_report(table, environment=ENV, dpi=40)
    assert '<th title="gone">gone</th>' in page

