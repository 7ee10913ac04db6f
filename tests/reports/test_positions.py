"""The error-by-position figure, its aggregation and the report's mask note, on a small real causal sweep."""

from __future__ import annotations

import numpy as np
import pytest

from randattn.activations import make_activations
from randattn.analysis.sweep import SweepConfig, parse_estimator_list, run_sweep_tables
from randattn.reports.figures import position_figure
from randattn.reports.html import build_report, mask_note
from randattn.reports.tables import ResultsError, aggregate_positions, position_pivot, table_masks


@pytest.fixture(scope="module")
def tables():
    rng = np.random.default_rng(4)
    arrays = {layer: tuple(0.8 * rng.normal(size=(2, 2, 10, 4)) for _ in range(3)) for layer in (0, 3)}
    acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["a", "b"]})
    config = SweepConfig(estimators=parse_estimator_list("ra;softmax"), num_samples=(2, 4), replicates=3, seed=1,
                         backend="reference", diagnostics=False, mask={0: "causal", 3: None})
    return run_sweep_tables(acts, config)


def test_aggregate_positions_is_the_lara_h1_mean_per_bucket(tables):
    positions = tables.positions
    aggregated = aggregate_positions(positions, n_boot=200)
    row = aggregated[(aggregated.label == "ra") & (aggregated.num_samples == 4) & (aggregated.position_lo == 4)]
    cells = positions[(positions.label == "ra") & (positions.num_samples == 4) & (positions.position_lo == 4)]
    # one layer: mean over heads per image, then over images
    assert row.mse.iloc[0] == pytest.approx(cells.groupby("image").mse.mean().mean(), rel=1e-12)
    assert row.mse_ci_low.iloc[0] <= row.mse.iloc[0] <= row.mse_ci_high.iloc[0]
    assert list(aggregated.loc[aggregated.label == "ra"].groupby("num_samples").position_lo.apply(list)) == [
        [1, 2, 4, 8], [1, 2, 4, 8]]
    pivot = position_pivot(positions)
    assert list(pivot.columns) == ["1", "2-3", "4-7", "8-10"] and list(pivot.index) == ["softmax", "ra"]


def test_the_figure_has_a_panel_per_s_and_leaves_out_what_it_cannot_show(tables):
    figure = position_figure(tables.positions)
    axes = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes] == ["S = 2", "S = 4"]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["2-3", "4-7", "8-10"]  # position 1: one key, exact
    title = figure._suptitle.get_text()
    assert "under the causal mask" in title and "position 1 (a single visible key" in title
    assert "exact, not drawn: Softmax" in title
    one = position_figure(tables.positions, num_samples=4)
    assert [ax.get_title() for ax in one.axes if ax.get_title()] == ["S = 4"]
    with pytest.raises(ResultsError, match="no rows at S = 3; available: 2, 4"):
        position_figure(tables.positions, num_samples=3)
    # softmax's error is float64 round-off, not 0: the message says which (issue #27)
    with pytest.raises(ResultsError, match=r"every estimator is exact \(its error is round-off\)"):
        position_figure(tables.positions, labels=["softmax"])


def test_the_mask_note_names_the_masked_layers(tables):
    table = tables.table
    assert table_masks(table) == {"causal": [0]}
    note = mask_note(table, has_positions=True)
    assert note.startswith("These results were measured under the causal mask on layer 0 (query n sees keys m ≤ n "
                           "+ (M − N) only); layer 3 without a mask.")
    assert note.endswith("the section on error by position separates them.")
    assert mask_note(table[table.layer == 3]) is None
    assert mask_note(table.drop(columns="mask")) is None  # a table from before masks: bidirectional


def test_the_report_shows_the_positions_section_only_with_positions(tables):
    without = build_report(tables.table, figures=[], environment={}, dpi=40)
    assert 'id="positions"' not in without and "measured under the causal mask on layer 0" in without
    page = build_report(tables.table, positions=tables.positions, figures=[], environment={}, dpi=40)
    assert '<h2 id="positions">Causal attention: error by position</h2>' in page
    assert "<h3>Mean MSE by position bucket, S = 4</h3>" in page


def test_the_bucket_table_gives_a_row_per_mask_when_layers_differ():
    """A window layer beside a causal one (a Gemma file): the report's bucket table keeps both masks' rows, each
    the aggregate of its own layer, instead of one of them."""
    rng = np.random.default_rng(5)
    arrays = {layer: tuple(0.8 * rng.normal(size=(1, 2, 10, 4)) for _ in range(3)) for layer in (0, 3)}
    acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["a"]})
    config = SweepConfig(estimators=parse_estimator_list("ra"), num_samples=(2,), replicates=3, seed=1,
                         backend="reference", diagnostics=False, mask={0: "sliding:3", 3: "causal"})
    positions = run_sweep_tables(acts, config).positions
    pivot = position_pivot(positions)
    assert list(pivot.index) == [("ra", "causal"), ("ra", "sliding:3")]
    for mask, layer in (("causal", 3), ("sliding:3", 0)):
        cells = positions[(positions.layer == layer) & (positions.position_lo == 4)]
        assert pivot.loc[("ra", mask), "4-7"] == pytest.approx(cells.mse.mean(), rel=1e-12)  # one image: over heads
    page = build_report(run_sweep_tables(acts, config).table, environment={}, figures=[], positions=positions)
    assert "<th>RA (unbiased), causal</th>" in page and "<th>RA (unbiased), sliding:3</th>" in page
    assert '<h2 id="positions">Causal and sliding-window attention: error by position</h2>' in page
    window = positions[positions.layer == 0]
    page = build_report(run_sweep_tables(acts, config).table.query("layer == 0"), environment={}, figures=[],
                        positions=window)
    assert '<h2 id="positions">Sliding-window attention: error by position</h2>' in page


def test_a_bucket_measured_in_part_says_how_many_of_its_queries_were_measured():
    """The last 6 of 16 causal queries are positions 11-16: bucket 8-15 holds 5 of them, bucket 16 its one. The
    terminal table, the pivot and the figure's ticks say "8-15 (5 measured)", not the bucket alone, whose error it
    is not; a bucket measured whole keeps its plain label."""
    from rich.console import Console

    from randattn.analysis.positions import bucket_text
    from randattn.reports.console import positions_table

    assert bucket_text(8, 15) == "8-15" and bucket_text(8, 15, 8) == "8-15" and bucket_text(16, 16, 1) == "16"
    assert bucket_text(8, 15, 7) == "8-15 (7 measured)"
    rng = np.random.default_rng(5)
    acts = make_activations({0: tuple(0.8 * rng.normal(size=(1, 2, 16, 4)) for _ in range(3))},
                            {"scale": 0.5, "model": "synthetic", "layout": "sequence"})
    config = SweepConfig(estimators=parse_estimator_list("ra"), num_samples=(2,), replicates=3, seed=1,
                         backend="reference", diagnostics=False, mask="causal", queries="last:6")
    positions = run_sweep_tables(acts, config).positions
    assert sorted(zip(positions["position_lo"], positions["position_hi"], positions["queries"]))[0] == (8, 15, 5)
    console = Console(width=300, record=True)
    console.print(positions_table(positions, seed=0))
    header = " ".join(console.export_text().split())
    assert "p 8-15 (5 measured)" in header and "p 16 " in header
    assert list(position_pivot(positions).columns) == ["8-15 (5 measured)", "16"]
    figure = position_figure(positions)
    ticks = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert ticks == ["8-15 (5 measured)", "16"]


def test_the_figure_and_the_report_name_the_buckets_the_table_holds(tables):
    """Both said "1, 2-3, 4-7, ..." whatever the buckets; a run with --position-buckets edges has others."""
    def caption(positions) -> str:
        return " ".join(position_figure(positions)._suptitle.get_text().split())

    assert "position buckets 2-3, 4-7, 8-10:" in caption(tables.positions)  # position 1 is not drawn (it says)
    custom = tables.positions.copy()
    custom.loc[custom["position_lo"] >= 4, ["position_lo", "position_hi"]] = [4, 10]  # one bucket of 4-10
    custom = custom.drop_duplicates(["label", "num_samples", "image", "layer", "head", "position_lo"])
    assert "position buckets 2-3, 4-10:" in caption(custom)
    page = build_report(tables.table, positions=custom, environment={"python": "3"}, figures=[])
    assert "in buckets 1, 2–3, 4–10 and aggregated" in " ".join(page.split())
    from randattn.reports.tables import buckets_text

    seven = np.arange(len(tables.positions)) % 7 + 1  # more than five buckets: the first three, then the last
    assert buckets_text(tables.positions.assign(position_lo=seven, position_hi=seven)) == "1, 2, 3, ..., 7"


def test_the_position_labels_of_a_short_last_bucket_do_not_overlap(tables):
    """log2 buckets of 512 tokens end 256-511, 512: the two centres stand 0.4 octaves apart and their rotated
    labels ran into each other. Labels are upright where centres crowd, and no two tick labels overlap."""
    import pandas as pd

    template = tables.positions[tables.positions["position_lo"] == 4]
    buckets = [(2 ** k, 2 ** (k + 1) - 1) for k in range(1, 9)] + [(512, 512)]  # 2-3, ..., 256-511, 512
    positions = pd.concat([template.assign(position_lo=lo, position_hi=hi) for lo, hi in buckets],
                          ignore_index=True)
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = position_figure(positions)
    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    for ax in (ax for ax in figure.axes if ax.get_title()):
        boxes = [label.get_window_extent(renderer) for label in ax.get_xticklabels() if label.get_text()]
        assert len(boxes) == len(buckets)
        assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), boxes
