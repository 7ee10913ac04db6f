"""Intervals over few units: a percentile bootstrap interval lies within the units' range, and that range holds the
median of their distribution with probability 1 - 2^(1-n), below 95 % up to 5 units; the reports say so there."""

from __future__ import annotations

import re

import numpy as np
import pandas as pd
import pytest
from rich.console import Console

from randattn.reports.testing import make_results_table
from randattn.reports.tables import few_units_note
from randattn.results.summary import aggregate, range_coverage


def test_the_range_holds_the_median_as_often_as_stated():
    """Independent of the formula: the frequency with which the range of n exponential draws (asymmetric, median
    ln 2) holds ln 2, over 40,000 seeded trials, within 4 binomial standard errors of range_coverage(n); and the
    known small cases: one draw never does, two do when they straddle it (2 of 4 equally likely sign patterns)."""
    rng = np.random.default_rng(20261129)
    trials = 40_000
    for n in (2, 3, 4, 5, 6):
        draws = rng.exponential(size=(trials, n))
        held = float(((draws.min(axis=1) <= np.log(2)) & (np.log(2) <= draws.max(axis=1))).mean())
        standard_error = np.sqrt(held * (1 - held) / trials)
        assert abs(range_coverage(n) - held) < 4 * standard_error, n
    assert range_coverage(1) == 0.0 and range_coverage(2) == 0.5
    with pytest.raises(ValueError, match="units"):
        range_coverage(0)


def _two_images(values=(4.0, 10.0)) -> pd.DataFrame:
    return pd.DataFrame([dict(estimator="rfa", label="rfa", num_samples=8, tokens=9, image=image, layer=0, head=0,
                              mse=value, bias_sq=0.0, variance=value) for image, value in zip("ab", values)])


def test_a_95_percent_interval_over_two_images_is_their_range():
    """Each resampled mean is 4, 7 or 10, with probabilities 1/4, 1/2, 1/4 > 2.5 %: the 2.5 % and 97.5 % quantiles
    are the two images' values themselves."""
    row = aggregate(_two_images(), n_boot=2000, seed=5).iloc[0]
    assert (row.mse_lo, row.mse_hi, row.units) == (4.0, 10.0, 2)


@pytest.mark.parametrize(("units", "confidence", "shown"), [
    (2, 0.95, "50%"), (3, 0.95, "75%"), (5, 0.95, "93.75%"), (6, 0.95, None), (5, 0.90, None), (4, 0.90, "87.5%"),
    (1, 0.95, None),
])
def test_the_note_is_given_below_the_stated_level_only(units, confidence, shown):
    summary = pd.DataFrame({"units": [units, 9], "ci_over": ["images", "images"]})
    note = few_units_note(summary, confidence=confidence, noun="sequence")
    if shown is None:
        assert note == ""
    else:
        assert note.startswith(f"with {units} sequences, a percentile interval lies within their range")
        assert f"probability {shown} (1 - 2^(1 - n)), below the {confidence * 100:g}% stated" in note


def test_over_heads_the_note_names_heads():
    note = few_units_note(pd.DataFrame({"units": [3], "ci_over": ["heads"]}))
    assert note.startswith("with 3 heads,") and note.endswith("read such an interval as the heads' spread")


def _text(renderable) -> str:
    console = Console(width=400, record=True)
    console.print(renderable)
    return " ".join(console.export_text().split())


def test_the_terminal_tables_carry_the_note_with_two_images_and_not_with_six(monkeypatch):
    import randattn.cli._demo_session as demo_session
    from randattn.reports.console import summary_table

    for images, expected in ((("a", "b"), True), (tuple("abcdef"), False)):
        summary = aggregate(make_results_table(images=images, tokens=(197,), samples=(16,), heads=2, layers=(0,)),
                            n_boot=200)
        assert ("with 2 images, a percentile interval" in _text(summary_table(summary))) is expected
        console = Console(width=400, record=True)
        monkeypatch.setattr(demo_session, "out_console", console)
        demo_session.print_summary(summary)
        assert ("read such an interval as the images' spread" in " ".join(console.export_text().split())) is expected


def test_the_figure_and_the_page_carry_the_note_with_two_images():
    from randattn.reports.figures import mse_vs_samples_figure
    from randattn.reports.html import build_report

    table = make_results_table(images=("a", "b"), tokens=(197,), samples=(16, 32), heads=2, layers=(0,))
    figure = mse_vs_samples_figure(table)
    subtitle = " ".join(" ".join(t.get_text() for t in figure.texts).split())
    assert "bands: 95% percentile bootstrap CI over 2 images; with 2 images, a percentile interval lies within " \
           "their range, which holds the median of their distribution with probability 50%" in " ".join(
               (subtitle + " " + figure.get_suptitle()).split())
    page = build_report(table, figures=[], environment={"python": "3"})
    assert re.search(r'<p class="warning">Intervals: with 2 images, a percentile interval lies within their range',
                     page)


def test_the_figure_weighs_the_units_against_its_own_level():
    """Five images: their range holds the median with probability 93.75 %, short of 95 % but not of 90 %."""
    from randattn.reports.figures import mse_vs_samples_figure

    table = make_results_table(images=tuple("abcde"), tokens=(197,), samples=(16, 32), heads=2, layers=(0,))
    for confidence, expected in ((0.95, True), (0.90, False)):
        figure = mse_vs_samples_figure(table, confidence=confidence)
        text = " ".join(" ".join([figure.get_suptitle(), *(t.get_text() for t in figure.texts)]).split())
        assert ("with 5 images, a percentile interval lies within their range" in text) is expected


def test_a_figure_over_a_single_unit_says_it_has_no_band():
    """One image and one head: no interval exists, and "bands: ... over 1 heads" said one did."""
    from randattn.reports.figures import mse_vs_samples_figure

    table = make_results_table(images=("a",), tokens=(197,), samples=(16, 32), heads=1, layers=(0,))
    figure = mse_vs_samples_figure(table)
    text = " ".join(" ".join([figure.get_suptitle(), *(t.get_text() for t in figure.texts)]).split())
    assert "no bands: a single head" in text and "bands: 95%" not in text
