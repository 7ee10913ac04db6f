"""The HTML report is one self-contained page: tables, embedded figures, diagnostics, provenance."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from matplotlib.image import imread

from randattn.reports.html import (
    build_report,
    diagnostics_overview,
    diagnostics_summary,
    environment_info,
    warnings_summary,
    write_report,
)
from randattn.reports.tables import ResultsError, summary_table
from randattn.reports.testing import make_results_table

ENV = {"python": "3.x", "numpy": "n", "torch": "t", "platform": "p"}


@pytest.fixture(scope="module")
def table():
    labels = ["softmax", "rfa", "rfa:coupling=orthogonal", "ra", "lara"]
    return make_results_table(tokens=(197,), samples=(16, 64), heads=2, layers=(0, 11), labels=labels)


@pytest.fixture(scope="module")
def page(table):
    return build_report(table, metadata={"seed": 7, "command_line": "randattn mse a.safetensors --out r.csv"},
                        environment=ENV, dpi=60)


@pytest.mark.slow  # over 5 s on the 2-core AVX2 machine: in the slow target
def test_page_is_complete_html_with_every_section(page):
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    for anchor in ("summary", "figures", "diagnostics", "provenance"):
        assert f'id="{anchor}"' in page


def test_page_loads_nothing_from_outside(page):
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:|//|file:)""", page, re.I)
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert not re.search(r"url\(\s*['\"]?(https?:|//)", page, re.I)
    assert "@import" not in page


def test_figures_are_embedded_png_that_decode(page):
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    # mse-vs-samples, bias-variance, features (iid vs orthogonal), one heatmap per random label (4)
    assert len(images) == 3 + 4
    pixels = imread(io.BytesIO(base64.b64decode(images[0])), format="png")
    assert pixels.ndim == 3 and pixels[..., :3].std() > 0.05


def test_summary_tables_hold_the_aggregated_numbers(table, page):
    summary = summary_table(table)
    assert page.count('<table class="dataframe results"') >= 3
    rfa = summary[(summary["spec"] == "rfa") & (summary["S"] == 16)]["MSE"].iloc[0]
    assert set(summary.loc[summary["spec"] == "rfa", "estimator"]) == {"Performer (FAVOR+, iid)"}
    assert f"{rfa:.3g}" in page
    assert "bias² (debiased)" in page and "MSE CI low" in page


def test_provenance_shows_command_environment_and_metadata(page):
    assert "randattn mse a.safetensors --out r.csv" in page
    assert "<td>torch</td>" in page and "<td>t</td>" in page
    assert "&quot;seed&quot;: 7" in page


def test_diagnostics_flag_high_khat(table, page):
    flagged = diagnostics_summary(table)
    assert not flagged.empty and (flagged["k-hat > 0.7"] > 0).any()
    assert 'class="warning"' in page and "Pareto k-hat &gt; 0.7" in page


def test_diagnostics_absent_or_clean():
    clean = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,), labels=["rfa"])
    clean["pareto_khat"] = 0.2
    clean["delta_var_ratio"] = 1.0
    assert diagnostics_summary(clean).empty
    assert diagnostics_summary(clean.drop(columns=["pareto_khat", "delta_var_ratio"])).empty
    nan = clean.assign(pareto_khat=np.nan, delta_var_ratio=np.nan)
    assert "No importance-sampling diagnostics" in build_report(nan, environment=ENV, figures=[])


def test_delta_ratio_outside_the_band_is_flagged():
    rows = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,), labels=["rfa"])
    rows["pareto_khat"] = 0.1
    rows["delta_var_ratio"] = 3.0
    flagged = diagnostics_summary(rows)
    assert flagged["ratio outside [0.5, 2]"].tolist() == [len(rows)]


def test_text_is_escaped(table):
    page = build_report(table, metadata={"command_line": "<b>x</b>"}, environment=ENV, figures=[])
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page


def test_write_report_writes_a_readable_file(table, tmp_path):
    path = write_report(table, tmp_path / "out", figures=[])
    assert path == tmp_path / "out" / "report.html"
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert path.stat().st_mode & 0o044  # readable by others, unlike a bare mkstemp file


def test_report_needs_the_plot_columns(table):
    with pytest.raises(ResultsError, match=r"the report needs the column\(s\) head, label; the table has"):
        build_report(table.drop(columns=["label", "head"]), figures=[])


def test_environment_lists_versions_without_importing():
    info = environment_info()
    assert {"python", "platform", "numpy", "torch", "randattn"} <= set(info)


# ------------------------------------------------------------------------------------ warnings and diagnostics
WARNINGS = [
    {"category": "NonPositiveDenominatorWarning", "label": "lara", "count": 38, "units": 5,
     "message": "the estimator's normalizer is zero or negative for 3 of 197 queries"},
    {"category": "NonPositiveDenominatorWarning", "label": "lara", "count": 2, "units": 1,
     "message": "the estimator's normalizer is zero or negative for 3 of 197 queries"},
    {"category": "SomethingNewWarning", "message": "<odd>", "count": 1},
]


@pytest.fixture(scope="module")
def nan_table():
    """k-hat where randattn leaves it NaN: signed LARA weights, rfa at S = 16 (tail too short), EVA, softmax."""
    table = make_results_table(tokens=(197,), samples=(16, 64), heads=1, layers=(0,),
                               labels=["softmax", "rfa", "lara", "eva"])
    table.loc[table["label"].isin(["lara", "eva"]), ["pareto_khat", "delta_var_ratio", "ess_mean"]] = np.nan
    table.loc[(table["label"] == "rfa") & (table["num_samples"] == 16), "pareto_khat"] = np.nan
    return table


def test_warnings_are_listed_once_with_counts_and_meaning(nan_table):
    summary = warnings_summary({"warnings": WARNINGS})
    assert summary["count"].tolist() == [40, 1]  # the two identical LARA entries are merged
    page = build_report(nan_table, metadata={"warnings": WARNINGS}, environment=ENV, figures=[])
    section = page[page.index('id="warnings"'):page.index('id="diagnostics"')]
    assert "NonPositiveDenominatorWarning</b> (40 times)" in section
    assert "LARA&#x27;s decoupled weights (eq. 38" in section  # the meaning, not just the name
    assert 'title="lara">LARA (paper, decoupled β=1)</span>: 40 ×' in section
    assert "197 queries</q> (raised by 6 units)</li>" in section  # the units of the merged entries, summed
    assert summary["units"].isna().tolist() == [False, True]  # a record without units (an older table): unknown
    assert "&lt;odd&gt;" in section and "No explanation recorded for this category" in section


@pytest.mark.parametrize(("metadata", "text"), [({}, "carry no record of warnings"),
                                                 ({"warnings": []}, "No warnings were raised")])
def test_no_warnings_says_which_case(nan_table, metadata, text):
    page = build_report(nan_table, metadata=metadata, environment=ENV, figures=[])
    assert text in page[page.index('id="warnings"'):page.index('id="diagnostics"')]


def test_diagnostics_reasons_come_from_the_spec():
    """Signed features have no importance weights; k-hat's tail counts the spec's weights per sample (2 for
    hyperbolic features, so S = 16 gives 32 >= 25 weights and the short-tail reason does not apply)."""
    profiles = {"rfa:feature_map=hyperbolic": ("rfa", {"feature_map": "hyperbolic"}, 4.0, 0.02)}
    table = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,), profiles=profiles,
                               labels=["rfa", "rfa:feature_map=trigonometric", "rfa:feature_map=hyperbolic"])
    table[["pareto_khat", "delta_var_ratio", "ess_mean"]] = np.nan
    overview = diagnostics_overview(table).set_index(["label", "S"])
    assert overview.loc[("rfa:feature_map=trigonometric", 16), "k-hat"] == (
        "k-hat not computed: signed weights (Performer (trigonometric RFA, iid) has no importance weights)")
    assert overview.loc[("rfa", 16), "k-hat"].startswith("k-hat not computed: S = 16 is below the minimum tail")
    assert overview.loc[("rfa:feature_map=hyperbolic", 16), "k-hat"] == (
        "k-hat not computed: not available for these cells (e.g. some weights not positive)")


def test_the_report_module_shares_the_diagnostics_thresholds():
    from randattn.analysis import diagnostics
    from randattn.reports import html as report_html

    assert report_html.KHAT_THRESHOLD is diagnostics.KHAT_THRESHOLD


def test_diagnostics_say_why_they_were_not_computed(nan_table):
    overview = diagnostics_overview(nan_table).set_index(["label", "S"])
    assert overview.loc[("softmax", 16), "k-hat"] == (
        "k-hat not computed: deterministic estimator (no draws, no importance weights)")
    assert overview.loc[("lara", 64), "k-hat"] == (
        "k-hat not computed: signed weights (the weights of LARA (paper, decoupled β=1) can be negative)")
    assert overview.loc[("eva", 64), "variance ratio"].startswith("variance ratio not computed: not defined for eva")
    assert overview.loc[("rfa", 16), "k-hat"].startswith("k-hat not computed: S = 16 is below the minimum tail size")
    ratios = nan_table.loc[(nan_table["label"] == "rfa") & (nan_table["num_samples"] == 16), "delta_var_ratio"]
    outside = int(((ratios < 0.5) | (ratios > 2)).sum())
    assert overview.loc[("rfa", 16), "variance ratio"] == (
        f"{outside} of {len(ratios)} cells outside [0.5, 2] (median {ratios.median():.2f})")
    page = build_report(nan_table, environment=ENV, figures=[])
    section = page[page.index('id="diagnostics"'):page.index('id="provenance"')]
    # every estimator and S has a row, spec in a tooltip; softmax takes no S: one row, its S "-"
    softmax_rows = int((overview.reset_index()["label"] == "softmax").sum())
    assert softmax_rows > 1 and section.count('<th title="') == len(overview) - softmax_rows + 1
    assert '<th title="softmax">Softmax (exact)</th><td>–</td>' in section
    # a NaN k-hat is never reported as a clean count
    khat_cells = re.findall(r"<td[^>]*>(\d+) of (\d+) cells &gt; 0.7", section)
    assert len(khat_cells) == 1  # rfa at S = 64 only


def test_the_report_lists_a_broken_promise_and_summarises_the_relative_error():
    """A head whose violation interval lies wholly above delta is listed as broken; the others are counted."""
    from randattn.reports.html import build_report, promise_summary
    from randattn.reports.testing import make_results_table

    table = make_results_table(tokens=(64,), samples=(8, 16), heads=2, layers=(0,))
    table["rel_err_mean"], table["rel_err_median"], table["rel_err_p95"] = 0.1, 0.08, 0.3 + table["head"]
    table["epsilon"], table["delta"] = 0.05, 0.1
    table["violation_rate"] = 0.02 + 0.5 * table["head"]
    table["violation_lo"], table["violation_hi"] = table["violation_rate"] - 0.01, table["violation_rate"] + 0.01
    table["promise_broken"] = table["violation_lo"] > table["delta"]
    summary = promise_summary(table)
    assert list(summary.columns) == ["label", "num_samples", "mean rel. error", "median rel. error",
                                     "largest 95th pct", "epsilon", "violation rate", "delta", "heads broken"]
    # the table's order; softmax takes no S: its one measurement once, its S "–"
    expected = dict.fromkeys((label, "–" if label == "softmax" else s)
                             for label, s in zip(table["label"], table["num_samples"]))
    assert list(zip(summary["label"], summary["num_samples"])) == list(expected)
    assert set(summary["largest 95th pct"]) == {1.3}
    assert set(summary["mean rel. error"]) == {0.1} and set(summary["median rel. error"]) == {0.08}
    assert set(summary["epsilon"]) == {0.05} and set(summary["delta"]) == {0.1}
    assert np.allclose(summary["violation rate"], 0.02 + 0.5 * 0.5)  # heads 0 and 1 in equal numbers
    assert promise_summary(table.assign(rel_err_mean=np.nan)) is None  # a table from before the relative error
    items = table["image"].nunique()
    # head 1 of each item, beside the most a 95% interval flags by chance: 2.5 % of the heads checked
    assert set(summary["heads broken"]) == {f"{items} of {2 * items} (<= {0.025 * 2 * items:.2g} expected by chance)"}
    unbroken = promise_summary(table.assign(promise_broken=False))
    assert set(unbroken["heads broken"]) == {f"0 of {2 * items}"}
    # a configuration without a promise has no heads to count: blank, as its delta (it said "0 of 2"); a sweep writes
    # its promise_broken False (the table's schema), an older table NaN
    unpromised = promise_summary(table.assign(promise_broken=False,
                                              delta=np.where(table["label"] == "softmax", np.nan, 0.1)))
    assert set(unpromised.loc[unpromised["label"] == "softmax", "heads broken"]) == {""}
    unpromised = promise_summary(table.assign(promise_broken=np.where(table["label"] == "softmax", np.nan, False),
                                              delta=np.where(table["label"] == "softmax", np.nan, 0.1)))
    assert (set(unpromised.loc[unpromised["label"] == "softmax", "heads broken"]) == {""}
            and set(unpromised.loc[unpromised["label"] != "softmax", "heads broken"]) == {f"0 of {2 * items}"})
    # a head left unchecked (NaN) beside checked ones is no flag, and the others are still counted
    partly = promise_summary(table.assign(promise_broken=np.where(table["head"] == 0, np.nan, 1.0)))
    assert set(partly["heads broken"]) == {f"{items} of {2 * items} (<= {0.025 * 2 * items:.2g} expected by chance)"}
    page = build_report(table, environment={}, figures=[])  # the figures are tested elsewhere
    assert '<h2 id="promise">Relative error and promises</h2>' in page and 'href="#promise"' in page
    # softmax takes no S: its one measurement per head, repeated at both S, is listed once
    flagged = table["promise_broken"]
    heads = int(flagged.sum()) - int((flagged & (table["label"] == "softmax")).sum()) // 2
    assert f"Broken promise</strong> in {heads} head(s)" in page
    assert "[0.51, 0.53]" in page
    assert "No head breaks a promise" in build_report(table.assign(promise_broken=False), environment={}, figures=[])
    # no estimator with a promise of its own (an --epsilon run of estimators without one): not "no head breaks one"
    unpromised_page = build_report(table.assign(promise_broken=False, delta=np.nan), environment={}, figures=[])
    assert "No head breaks a promise" not in unpromised_page
    assert "No estimator of this table makes a promise" in unpromised_page
    assert "violation of" not in summary.columns and "<th>violation of</th>" not in page  # every rate the output's
    # the same when the column says so (a table of this version) and when it is absent (read without coerce)
    for labelled in (table.assign(violation_of="output"), table.drop(columns="violation_of", errors="ignore")):
        assert "violation of" not in promise_summary(labelled).columns
        assert "<th>violation of</th>" not in build_report(labelled, environment={}, figures=[])


def test_the_report_gives_the_family_wise_decision_where_the_table_has_the_counts():
    """With ``violations`` and ``trials`` in the table, the *heads broken* column adds how many heads Holm's procedure
    flags over each configuration's heads, and the broken heads' list says which. Head 1 of each item: 52 of 100
    trials above epsilon against delta = 0.1, a binomial tail below 1e-20 (far under 2.5 % over the 2 x items
    heads); head 0: 2 of 100, a tail near 1, flagged neither way."""
    from randattn.reports.html import build_report, promise_summary
    from randattn.reports.testing import make_results_table

    table = make_results_table(tokens=(64,), samples=(8,), heads=2, layers=(0,), labels=["ra"])
    table["rel_err_mean"], table["rel_err_median"], table["rel_err_p95"] = 0.1, 0.08, 0.3
    table["epsilon"], table["delta"], table["trials"] = 0.05, 0.1, 100.0
    table["violations"] = np.where(table["head"] == 1, 52.0, 2.0)
    table["violation_rate"] = table["violations"] / table["trials"]
    table["violation_lo"], table["violation_hi"] = table["violation_rate"] - 0.01, table["violation_rate"] + 0.01
    table["promise_broken"] = table["head"] == 1
    items = table["image"].nunique()
    summary = promise_summary(table)
    assert list(summary["heads broken"]) == [f"{items} of {2 * items} (<= {0.025 * 2 * items:.2g} expected by chance; "
                                             f"family-wise: {items})"]
    page = build_report(table, environment={}, figures=[])
    assert "<th>family-wise</th>" in page and page.count("<td>yes</td>") == items and "<td>no</td>" not in page
    assert "Holm's procedure" in page
    before = build_report(table.drop(columns=["violations", "trials"]), environment={}, figures=[])
    assert "<th>family-wise</th>" not in before and "Holm's procedure" not in before


def test_the_report_names_a_promise_on_the_denominator():
    """Where a promise bounds the denominator, the summary and the broken heads say what the violation rate counts."""
    from randattn.reports.html import build_report, promise_summary
    from randattn.reports.testing import make_results_table

    table = make_results_table(tokens=(64,), samples=(8,), heads=2, layers=(0,))
    table["rel_err_mean"], table["rel_err_median"], table["rel_err_p95"] = 0.1, 0.08, 0.3
    table["epsilon"], table["delta"], table["violation_rate"] = 0.05, 0.1, 0.5
    table["violation_lo"], table["violation_hi"] = 0.4, 0.6
    table["promise_broken"] = table["head"] == 1
    table["violation_of"] = np.where(table["label"] == table["label"].iloc[0], "denominator", "output")
    summary = promise_summary(table)
    assert dict(zip(summary["label"], summary["violation of"])) == dict(zip(table["label"], table["violation_of"]))
    page = build_report(table, environment={}, figures=[])
    assert page.count("<td>denominator</td>") == 1 + int(((table["violation_of"] == "denominator")
                                                          & table["promise_broken"]).sum())


def test_the_promise_summary_gives_a_row_per_mask_when_layers_differ():
    """A window layer beside a causal one: the relative-error summary keeps the masks apart, each row the mean of
    its own layer's heads, not the mean over both."""
    from randattn.reports.html import promise_summary
    from randattn.reports.testing import make_results_table

    table = make_results_table(tokens=(64,), samples=(8,), heads=2, layers=(0, 5), labels=["ra"])
    table["mask"] = np.where(table["layer"] == 0, "sliding:4", "causal")
    table["rel_err_mean"] = np.where(table["layer"] == 0, 0.3, 0.1)
    table["rel_err_median"], table["rel_err_p95"] = 0.05, 0.5
    summary = promise_summary(table)
    assert list(zip(summary["label"], summary["mask"], summary["mean rel. error"])) == [("ra", "sliding:4", 0.3),
                                                                                         ("ra", "causal", 0.1)]


def test_a_configuration_without_s_has_no_s_in_its_heatmap_title():
    """softmax and adaptive vAttention take no S: their heatmaps say none; rfa's says its S."""
    from randattn.reports.figures import samples_text

    assert samples_text("vattention", 256) == "" and samples_text("softmax", 16) == ""
    assert samples_text("rfa", 64) == ", S = 64" and samples_text("vattention:budget=fixed", 64) == ", S = 64"


def test_a_real_table_leaves_heads_broken_blank_without_a_promise():
    """On a sweep's own table (not a hand-made one: the sweep writes promise_broken False where nothing is promised)
    top-k's cell is blank and vAttention's counts its heads."""
    from randattn.activations import make_activations
    from randattn.analysis.plan import SweepConfig, parse_estimator_list
    from randattn.analysis.sweep import run_sweep
    from randattn.reports.html import promise_summary

    rng = np.random.default_rng(2)
    acts = make_activations({0: tuple(rng.normal(size=(1, 2, 24, 4)) for _ in range(3))},
                            {"scale": 0.5, "layout": "sequence"})
    config = SweepConfig(estimators=parse_estimator_list("topk;vattention:sinks=1,local=2,top_k=2"), num_samples=(4,),
                         replicates=2, threads=1, mask="causal", diagnostics=False, check_reference=0.0)
    summary = promise_summary(run_sweep(acts, config)).set_index("label")
    assert summary.loc["topk", "heads broken"] == ""
    assert " of 2" in summary.loc["vattention:sinks=1,local=2,top_k=2", "heads broken"]


def test_the_report_says_over_what_its_interval_is():
    """With one image the summary's interval is over heads (``aggregate``'s rule); the report said "over images",
    so a spread between heads read as one between images."""
    one = make_results_table(images=("astronaut",), tokens=(197,), samples=(16,), heads=3, layers=(0, 11),
                             labels=["rfa"])
    page = " ".join(build_report(one, environment=ENV, figures=[]).split())
    assert "bootstrap interval over heads, each the mean over layers: with a single image it is the heads' spread" \
        in page
    two = " ".join(build_report(make_results_table(tokens=(197,), samples=(16,), heads=2, layers=(0,),
                                                   labels=["rfa"]), environment=ENV, figures=[]).split())
    assert "with a percentile bootstrap interval over images." in two and "heads' spread" not in two


def test_a_flagged_setting_counts_only_the_diagnostics_it_has():
    """k-hat not computed (S too small) beside a flagged variance ratio: its count was 0, read as "none flagged";
    it is now missing, as its maximum is."""
    table = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,), labels=["rfa"])
    table = table.assign(pareto_khat=np.nan, delta_var_ratio=5.0)
    flagged = diagnostics_summary(table)
    assert len(flagged) == 1 and np.isnan(flagged["k-hat > 0.7"].iloc[0]) and np.isnan(flagged["max k-hat"].iloc[0])
    assert flagged["ratio outside [0.5, 2]"].iloc[0] == 2  # the two images' cells


def test_a_configuration_without_s_is_shown_once_in_the_reports_tables():
    """Adaptive vAttention's one measurement, repeated at each S by the table, gave three identical rows in the
    report's interval table and three columns in its pivot, as if measured at each S; the terminal shows it once."""
    from randattn.reports.html import _summary_once_without_s

    decode = {"vattention": ("vattention", {}, 0.2, 0.001)}
    table = make_results_table(tokens=(197,), samples=(16, 32, 64), heads=2, layers=(0,),
                               labels=["rfa", "vattention"], profiles=decode)
    shown = _summary_once_without_s(summary_table(table))
    assert list(shown.loc[shown["spec"] == "vattention", "S"]) == ["–"]
    assert list(shown.loc[shown["spec"] == "rfa", "S"]) == [16, 32, 64]
    page = build_report(table, environment=ENV, figures=[])
    assert "(no S: one measurement, at every S)" in page
    interval_table = page.split("MSE with bootstrap interval")[1].split("</table>")[0]
    assert interval_table.count("<td>vattention</td>") == 1 and interval_table.count("<td>rfa</td>") == 3


def test_the_reports_relative_error_table_holds_the_keys_read():
    """The report drew the error-vs-budget figure but no table held its x values (the terminal's did): the keys
    each query reads are now a column of the relative-error summary, the mean over heads, layers and items."""
    from randattn.reports.html import promise_summary

    table = make_results_table(tokens=(64,), samples=(8, 16), heads=2, layers=(0,), labels=["rfa", "ra"])
    table["rel_err_mean"], table["rel_err_median"], table["rel_err_p95"] = 0.1, 0.08, 0.3
    table["keys_used"] = np.where(table["label"] == "ra", 3 * table["num_samples"] + table["head"], np.nan)
    table["keys_fraction"] = table["keys_used"] / 64
    summary = promise_summary(table).set_index(["label", "num_samples"])
    assert list(summary.columns[:2]) == ["keys used", "keys fraction"]
    assert summary.loc[("ra", 8), "keys used"] == 24.5 and summary.loc[("ra", 16), "keys fraction"] == 48.5 / 64
    assert np.isnan(summary.loc[("rfa", 8), "keys used"])
    assert "keys used" not in promise_summary(table.drop(columns=["keys_used", "keys_fraction"]))
