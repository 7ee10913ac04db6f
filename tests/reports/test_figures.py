"""Figures render to non-trivial PNG/SVG files with the expected panels and lines; bad input raises."""

from __future__ import annotations

import json

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.image import imread

from randattn.reports.figures import (
    FIGURE_KINDS,
    bias_variance_figure,
    features_figure,
    heatmap_figure,
    make_figure,
    mse_vs_samples_figure,
    save_figure,
)
from randattn.results import ResultsError, read_results
from randattn.reports.testing import make_results_table

TOKENS = (197, 577)
RANDOM_LABELS = 7  # DEFAULT_LABELS minus softmax


@pytest.fixture(scope="module")
def table():
    return make_results_table(tokens=TOKENS, samples=(16, 32, 64), heads=3, layers=(0, 5, 11))


def _data_lines(ax):
    """Lines with data (excludes legend proxies, which are not added to axes)."""
    return [line for line in ax.get_lines() if len(line.get_xdata()) > 0]


def test_mse_vs_samples_one_panel_per_token_count_one_line_per_label(table):
    fig = mse_vs_samples_figure(table)
    assert isinstance(fig, Figure)
    assert len(fig.axes) == len(TOKENS)
    for ax, n in zip(fig.axes, TOKENS):
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert ax.get_title() == f"N = {n} tokens"
        assert ax.get_xlabel() == "samples S (log scale)"
        assert len(_data_lines(ax)) == RANDOM_LABELS  # softmax (MSE 0) is not drawn
        assert len(ax.collections) == RANDOM_LABELS  # one CI band per line
    assert fig.axes[0].get_ylabel() == "MSE (squared output units)"
    title = fig.get_suptitle()
    assert "dinov2-s14" in title and "2 images" in title and "exact, not drawn: Softmax (exact) (mse 0)" in " ".join(title.split())
    legend_texts = [t.get_text() for t in fig.legends[0].get_texts()]
    # readable names (randattn.estimators.names), not registry specs
    assert legend_texts[0] == "Performer (FAVOR+, iid)" and "LARA (paper, decoupled β=1)" in legend_texts
    assert any(t.startswith("EVA (") for t in legend_texts) and not any("Softmax" in t for t in legend_texts)


def test_mse_vs_samples_line_values_are_the_mean_over_images_of_layer_head_means(table):
    fig = mse_vs_samples_figure(table, labels=["ra"])
    (line,) = _data_lines(fig.axes[0])
    rows = table[(table["label"] == "ra") & (table["tokens"] == 197)]
    expected = rows.groupby(["num_samples", "image"])["mse"].mean().groupby("num_samples").mean()
    np.testing.assert_allclose(line.get_xdata(), expected.index.to_numpy())
    np.testing.assert_allclose(line.get_ydata(), expected.to_numpy(), rtol=1e-12)


def test_a_label_with_a_single_sample_count_is_a_horizontal_line(table):
    single = table[(table["label"] != "ra") | (table["num_samples"] == 16)]
    fig = mse_vs_samples_figure(single, labels=["rfa", "ra"])
    ax = fig.axes[0]
    flat = [line for line in ax.get_lines() if np.ptp(line.get_ydata()) == 0 and line.get_linestyle() == "--"]
    assert len(flat) == 1
    assert any("RA (unbiased) (S = 16 only)" == t.get_text() for t in fig.legends[0].get_texts())


def test_bias_variance_has_variance_bias_and_mse_lines_per_label(table):
    fig = bias_variance_figure(table)
    assert len(fig.axes) == len(TOKENS)
    assert len(_data_lines(fig.axes[0])) == 3 * RANDOM_LABELS
    styles = {line.get_linestyle() for line in _data_lines(fig.axes[0])}
    assert styles == {"-", "--", ":"}
    assert "variance, bias² (squared output units)" == fig.axes[0].get_ylabel()


def test_heatmap_shows_layers_by_heads_with_a_shared_log_colour_bar(table):
    fig = heatmap_figure(table, label="lara", num_samples=32)
    heatmaps = [ax for ax in fig.axes if ax.get_images()]
    assert len(heatmaps) == len(TOKENS) and len(fig.axes) == len(TOKENS) + 1  # + colour bar
    data = heatmaps[0].get_images()[0].get_array()
    assert data.shape == (3, 3)  # layers x heads
    rows = table[(table["label"] == "lara") & (table["num_samples"] == 32) & (table["tokens"] == 197)]
    expected = rows.groupby(["layer", "head"])["mse"].mean().unstack().to_numpy()
    np.testing.assert_allclose(np.asarray(data), expected, rtol=1e-12)
    assert "LARA (paper, decoupled β=1), S = 32 [lara]" in " ".join(fig.get_suptitle().split())
    assert fig.axes[-1].get_ylabel() == "MSE, log scale\n(squared output units)"


def test_heatmap_defaults_to_the_first_random_estimator_and_the_largest_s(table):
    assert "Performer (FAVOR+, iid), S = 64" in " ".join(heatmap_figure(table).get_suptitle().split())


def test_heatmap_rejects_an_unmeasured_s(table):
    with pytest.raises(ResultsError, match=r"not measured at S = 7; available: 16, 32, 64"):
        heatmap_figure(table, label="rfa", num_samples=7)


def test_heatmap_rejects_an_unknown_label(table):
    with pytest.raises(ResultsError, match=r"label\(s\) nope not in the table"):
        heatmap_figure(table, label="nope")


def test_features_compares_couplings_and_feature_maps(table):
    fig = features_figure(table)
    assert len(fig.axes) == 2 * len(TOKENS)
    coupling_ax, feature_ax = fig.axes[0], fig.axes[1]
    assert coupling_ax.get_title().startswith("coupling (positive features)")
    assert feature_ax.get_title().startswith("feature map (orthogonal coupling)")
    assert sorted(line.get_label() for line in _data_lines(coupling_ax)) == ["iid", "orthogonal"]
    assert sorted(line.get_label() for line in _data_lines(feature_ax)) == ["positive", "trigonometric"]


def test_features_needs_two_rfa_variants(table):
    only = table[table["label"].isin(["rfa", "ra"])]
    with pytest.raises(ResultsError, match="at least two rfa variants"):
        features_figure(only)


def test_missing_columns_are_named(table):
    with pytest.raises(ResultsError, match=r"needs the column\(s\) mse"):
        mse_vs_samples_figure(table.drop(columns="mse"))


def test_unknown_kind_lists_the_known_ones(table):
    with pytest.raises(ValueError, match="unknown figure kind 'pie'; choose one of mse-vs-samples, error-vs-budget, bias-variance"):
        make_figure("pie", table)


# the files of one kind in the default run (every kind is drawn there by test_no_text_is_clipped); all in `-m slow`
@pytest.mark.parametrize("kind", [kind if kind == "mse-vs-samples" else pytest.param(kind, marks=pytest.mark.slow)
                                  for kind in FIGURE_KINDS])
def test_save_figure_writes_decodable_png_and_svg(kind, table, tmp_path):
    source = _with_keys_used(table) if kind == "error-vs-budget" else table
    paths = save_figure(make_figure(kind, source), tmp_path / "sub" / kind, dpi=80)
    assert [p.name for p in paths] == [f"{kind}.png", f"{kind}.svg"]
    png, svg = paths
    assert png.stat().st_size > 20_000 and svg.stat().st_size > 20_000
    pixels = imread(png)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    assert svg.read_text(encoding="utf-8").lstrip().startswith("<?xml")


def test_save_figure_rejects_unknown_formats(table, tmp_path):
    with pytest.raises(ValueError, match=r"formats must be a non-empty subset of \('png', 'svg', 'pdf'\)"):
        save_figure(mse_vs_samples_figure(table), tmp_path / "x", formats=("gif",))


def test_no_pyplot_figures_are_left_behind(table):
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    mse_vs_samples_figure(table)
    assert plt.get_fignums() == before


def test_read_results_round_trips_csv_parquet_json_with_metadata(table, tmp_path):
    from randattn.analysis.sweep import write_table

    for suffix in (".csv", ".parquet", ".json"):
        path, _ = write_table(table, tmp_path / f"r{suffix}", {"model": "dinov2-s14", "seed": 3})
        loaded = read_results(path)
        assert loaded.metadata["seed"] == 3
        assert len(loaded.table) == len(table)
        assert loaded.table["random"].dtype == bool
        np.testing.assert_allclose(loaded.table["mse"], table["mse"], rtol=1e-12)


def test_read_results_json_object_with_rows_and_metadata(table, tmp_path):
    path = tmp_path / "r.json"
    rows = json.loads(table.head(5).to_json(orient="records"))
    path.write_text(json.dumps({"metadata": {"model": "m"}, "rows": rows}))
    loaded = read_results(path)
    assert loaded.metadata == {"model": "m"} and len(loaded.table) == 5


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("missing.csv", None, "no such file"),
        ("r.txt", "a,b\n1,2\n", "unknown suffix '.txt'"),
        ("r.json", "{not json", "as json"),
        ("r.csv", "", "as csv"),
    ],
)
def test_read_results_errors(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsError, match=message):
        read_results(path)


def _outside_canvas(fig) -> list[str]:
    """Every drawn text (axes with their tick and axis labels, colour bars, legends, titles) not inside the canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    boxes = [(f"axes {ax.get_title() or ax.get_ylabel()!r}", ax.get_tightbbox(renderer)) for ax in fig.axes]
    boxes += [("legend", legend.get_window_extent(renderer)) for legend in fig.legends]
    boxes += [(f"text {text.get_text()[:40]!r}", text.get_window_extent(renderer)) for text in fig.texts]
    if fig._suptitle is not None:
        boxes.append(("suptitle", fig._suptitle.get_window_extent(renderer)))
    # half a pixel of slack for anti-aliasing
    return [f"{what}: {box}" for what, box in boxes
            if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > width + 0.5 or box.y1 > height + 0.5]


@pytest.mark.parametrize(
    "shape",
    [dict(tokens=TOKENS, samples=(16, 64), heads=2, layers=(0, 11)),
     dict(tokens=(197,), samples=(16,), heads=1, layers=(0,))],  # one layer: the colour-bar label was cut off
    ids=["full", "one-cell"],
)
@pytest.mark.parametrize("kind", sorted(FIGURE_KINDS))
def test_no_text_is_clipped(kind, shape):
    table = make_results_table(**shape)
    table = _with_keys_used(table) if kind == "error-vs-budget" else table
    try:
        fig = make_figure(kind, table)
    except ResultsError:
        pytest.skip(f"{kind} has nothing to draw for this table")
    assert _outside_canvas(fig) == []


# ------------------------------------------------------------------------------------------ error vs budget
def _with_keys_used(table, label="ra"):
    """``table`` with keys used reported for ``label`` only: 3 S + head, so that the mean over heads is 3 S + 1."""
    budget = table.copy()
    budget["keys_used"] = np.where(budget["label"] == label, 3 * budget["num_samples"] + budget["head"], np.nan)
    return budget


def test_error_vs_budget_places_counted_estimators_at_their_mean_keys_used_and_the_rest_at_s(table):
    from randattn.reports.figures import error_vs_budget_figure

    fig = error_vs_budget_figure(_with_keys_used(table))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "keys used per query (log scale)" and ax.get_xscale() == "log"
    lines = {line.get_label(): line for line in _data_lines(ax)}
    counted = [line for line in lines.values() if line.get_linestyle() == "-"]
    # EVA (its default partition re-chunks every key: quadratic) reports no keys_used and is left out, named
    assert len(counted) == 1 and len(lines) == RANDOM_LABELS - 1
    np.testing.assert_allclose(counted[0].get_xdata(), [3 * s + 1 for s in (16, 32, 64)])  # heads 0, 1, 2
    dashed = [line for line in lines.values() if line.get_linestyle() == "--"]
    assert all(list(line.get_xdata()) == [16, 32, 64] for line in dashed)
    assert all(name.endswith("(at S)") for name, line in lines.items() if line.get_linestyle() == "--")
    assert not any(name.startswith("EVA") for name in lines)
    said = " ".join(" ".join(text.get_text() for text in fig.texts).split())
    assert "left out: EVA" in said and "(no keys_used, and each scores every key)" in said


def test_error_vs_budget_leaves_out_an_estimator_that_scores_every_key(table):
    """RA without keys_used was drawn at x = S "(at S features)", as cheap as top-k at S keys, though its proposal
    scores every visible key; a random-feature estimator stays at S, dashed."""
    from randattn.reports.figures import error_vs_budget_figure

    budget = _with_keys_used(table, label="rfa")
    fig = error_vs_budget_figure(budget[budget["label"].isin(["rfa", "ra", "lara"])])
    names = [line.get_label() for line in _data_lines(fig.axes[0])]
    assert not any(name.startswith("RA") for name in names) and any(name.endswith("(at S)") for name in names)
    said = " ".join(" ".join(text.get_text() for text in fig.texts).split())
    assert "left out: RA" in said and "(no keys_used, and each scores every key)" in said


def test_error_vs_budget_places_each_mask_panel_at_its_own_layers_keys_used():
    """A file with a window layer and a causal layer: each panel's points are the mean keys used of its own mask's
    rows (here 2 S + head under the window, 10 S + head under the causal mask), not the mean over both."""
    from randattn.reports.figures import error_vs_budget_figure

    table = make_results_table(tokens=(64,), samples=(16, 32), heads=2, layers=(0, 1), labels=["ra"])
    table["mask"] = np.where(table["layer"] == 0, "sliding:512", "causal")
    table["keys_used"] = np.where(table["layer"] == 0, 2, 10) * table["num_samples"] + table["head"]
    fig = error_vs_budget_figure(table)
    xs = {ax.get_title(): [list(line.get_xdata()) for line in _data_lines(ax)] for ax in fig.axes if ax.get_title()}
    assert sorted(xs.values()) == [[[32.5, 64.5]], [[160.5, 320.5]]], xs  # heads 0 and 1: + 0.5


def test_error_vs_budget_explains_dashed_lines_only_when_it_draws_some(table):
    """The subtitle's "dashed: no keys_used reported" is there when an estimator is placed at S, not otherwise."""
    from randattn.reports.figures import error_vs_budget_figure

    def said(fig):
        return " ".join(text.get_text() for text in fig.texts)

    assert "dashed: no keys_used reported, placed at S" in said(error_vs_budget_figure(_with_keys_used(table)))
    only_counted = _with_keys_used(table)
    only_counted = only_counted[only_counted["label"] == "ra"]
    assert "dashed" not in said(error_vs_budget_figure(only_counted))


def test_error_vs_budget_without_keys_used_says_which_estimators_have_it(table):
    from randattn.reports.figures import error_vs_budget_figure

    with pytest.raises(ResultsError, match="needs an estimator that reports the keys its queries read"):
        error_vs_budget_figure(table)
    assert "error-vs-budget" in FIGURE_KINDS


def test_a_curve_of_one_point_shows_its_interval_as_an_error_bar():
    """With a single S the band had no width and the interval the caption promises was not drawn: it is now an
    error bar from the interval's low to its high end."""
    from matplotlib.collections import LineCollection

    from randattn.reports.tables import aggregate_over_images

    one = make_results_table(tokens=(197,), samples=(16,), heads=3, layers=(0,), labels=["rfa"])
    figure = mse_vs_samples_figure(one)
    ax = next(ax for ax in figure.axes if ax.get_title())
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert len(bars) == 1
    (segment,) = bars[0].get_segments()
    row = aggregate_over_images(one, ["mse"]).iloc[0]
    assert segment[:, 1] == pytest.approx([max(row["mse_ci_low"], row["mse"] / 1e3), row["mse_ci_high"]])


def test_a_configuration_without_s_is_one_line_across_the_samples_axis():
    """Adaptive vAttention takes no S: its one measurement, repeated at each S by the table, was drawn as a curve
    with a marker at every S as if measured there. It is now a horizontal line named "(no S)", as RA at one S is;
    in the bias/variance figure a line without markers, and a variance of 0 (top-k's) is said to be left out."""
    from randattn.reports.figures import bias_variance_figure

    # label: (estimator, params, variance scale at S = 1, squared bias), as randattn.reports.testing.DEFAULT_LABELS
    decode = {"vattention": ("vattention", {}, 0.2, 0.001), "topk": ("topk", {}, 0.5, 0.0)}
    table = make_results_table(tokens=(197,), samples=(16, 32), heads=2, layers=(0,), labels=["rfa", "vattention",
                                                                                             "topk"], profiles=decode)
    table.loc[table["label"] == "topk", ["variance"]] = 0.0
    legend = [t.get_text() for t in mse_vs_samples_figure(table).legends[0].get_texts()]
    assert any(name.endswith("(no S)") and name.startswith("vAttention") for name in legend), legend
    assert not any(name.endswith("(no S)") and not name.startswith("vAttention") for name in legend), legend
    figure = bias_variance_figure(table)
    said = " ".join(" ".join(text.get_text() for text in figure.texts).split())
    assert "a variance of 0 (a deterministic estimator's) is not drawn" in said
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert any(name.startswith("vAttention") and name.endswith("(no S)") for name in legend), legend


def test_saved_figures_keep_their_text_as_text(table, tmp_path):
    """A paper's figure is edited and searched: SVG text was drawn as outlines (no <text> element) and PDF fonts were
    Type 3. Now the SVG holds <text> and the PDF embeds TrueType (Type 42) fonts."""
    svg, pdf = save_figure(mse_vs_samples_figure(table), tmp_path / "f", formats=("svg", "pdf"), dpi=80)
    svg_text = svg.read_text(encoding="utf-8")
    assert svg_text.count("<text") > 10 and ">MSE (squared output units)<" in svg_text
    assert b"/CIDFontType2" in pdf.read_bytes() and b"/Type3" not in pdf.read_bytes()  # TrueType, as CID


def test_the_features_figure_says_which_lines_are_the_same_rows(table):
    """Orthogonal positive features are "orthogonal" among the couplings and "positive" among the feature maps: the
    same rows in two colours under one legend, which the figure did not say."""
    figure = features_figure(table)
    said = " ".join(" ".join(text.get_text() for text in figure.texts).split())
    assert said.endswith("; the same rows, in two colours: orthogonal (left) = positive (right)"), said[-200:]
