"""The terminal's tables (randattn.reports.console): a configuration that takes no S is one row, its S "–"."""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.console import Console


def _text(table) -> str:
    console = Console(width=200, record=True)
    console.print(table)
    return console.export_text()


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("│ ").split("│")]
            for line in text.splitlines() if line.startswith("│")]


def test_a_configuration_without_s_is_one_row_in_the_mse_and_budget_tables():
    """softmax and adaptive vAttention take no S: the sweep repeats their one measurement at S = 8 and 16, the
    terminal shows it once with S "–"; top-k and vAttention's fixed budget take S: a row per S."""
    from randattn.reports.console import budget_table, summary_table

    labels = ["softmax", "vattention", "vattention:budget=fixed", "topk"]
    frame = pd.DataFrame([{"label": label, "num_samples": s, "tokens": 64, "mse": 0.5, "mse_lo": 0.4, "mse_hi": 0.6,
                           "bias_sq": 0.1, "variance": 0.4, "ci_over": "heads", "units": 2, "keys_used": 3.0,
                           "keys_fraction": 0.1, "rel_err_median": 0.2, "rel_err_p95": 0.3, "epsilon": np.nan,
                           "violation_rate": np.nan, "delta": np.nan, "heads": 2, "promises_broken": 0}
                          for label in labels for s in (8, 16)])
    for table in (summary_table(frame), budget_table(frame)):
        shown = [(row[0], row[1]) for row in _rows(_text(table))]
        assert shown == [("softmax", "–"), ("vattention", "–"), ("vattention:budget=fixed", "8"),
                         ("vattention:budget=fixed", "16"), ("topk", "8"), ("topk", "16")]


def test_the_budget_table_and_the_red_lines_give_the_family_wise_decision():
    """``family-wise: N`` beside the heads broken where the summary has the count, nothing where it is NaN (a table
    without the counts); each red line says whether its head is flagged family-wise too (nothing for None)."""
    from randattn.reports.console import broken_promise_lines, budget_table

    row = {"label": "vattention", "num_samples": 8, "tokens": 64, "keys_used": 3.0, "keys_fraction": 0.1,
           "rel_err_median": 0.2, "rel_err_p95": 0.3, "epsilon": 0.05, "violation_rate": 0.2, "delta": 0.05,
           "heads": 54, "promises_broken": 2}
    counted = _text(budget_table(pd.DataFrame([{**row, "promises_broken_familywise": 1}])))
    assert "broken on 2 of 54 heads (<= 1.4 expected by chance; family-wise: 1)" in " ".join(counted.split())
    uncounted = _text(budget_table(pd.DataFrame([{**row, "promises_broken_familywise": np.nan}])))
    assert "(<= 1.4 expected by chance)" in " ".join(uncounted.split()) and "family-wise" not in uncounted
    record = {"label": "vattention", "num_samples": 8, "layer": 0, "head": 3, "image": "text", "epsilon": 0.05,
              "delta": 0.05, "violation_rate": 0.5, "violation_lo": 0.4, "violation_hi": 0.6}
    yes, no, unknown = broken_promise_lines([{**record, "familywise": True}, {**record, "familywise": False},
                                             {**record, "familywise": None}])
    assert yes.endswith("> delta = 0.05; flagged family-wise too")
    assert no.endswith("> delta = 0.05; not flagged family-wise") and unknown.endswith("> delta = 0.05")


def test_a_promise_not_shown_broken_is_not_called_kept():
    """A rate of 0.078 above delta = 0.05 whose interval reaches below it: the test does not reject, which says the
    head is not shown to break the promise, not that it keeps it; one head is "1 head"."""
    from randattn.reports.console import budget_table

    row = {"label": "vattention", "num_samples": 8, "tokens": 64, "keys_used": 3.0, "keys_fraction": 0.1,
           "rel_err_median": 0.2, "rel_err_p95": 0.3, "epsilon": 0.05, "violation_rate": 0.078, "delta": 0.05,
           "heads": 1, "promises_broken": 0, "promises_broken_familywise": 0}
    text = " ".join(_text(budget_table(pd.DataFrame([row]))).split())
    assert "delta = 0.05: no head shown to break it (1 head)" in text and "kept" not in text
    broken = " ".join(_text(budget_table(pd.DataFrame([{**row, "promises_broken": 1}]))).split())
    assert "broken on 1 of 1 head (<= 0.025 expected by chance; family-wise: 0)" in broken


def test_the_red_lines_stop_at_the_most_shown_and_count_the_rest():
    """45 broken heads: the 40 with the highest lower bounds (heads 5 to 44 here), in the table's order, then one
    line counting the 5 others."""
    from randattn.reports.console import broken_promise_lines

    record = {"label": "vattention", "num_samples": 8, "layer": 0, "image": "text", "epsilon": 0.05, "delta": 0.05,
              "violation_rate": 0.5, "violation_hi": 0.6}
    broken = [{**record, "head": h, "violation_lo": 0.1 + 0.001 * h} for h in range(45)]
    lines = broken_promise_lines(broken, noun="sequence")
    assert len(lines) == 41 and lines[-1] == ("[bold red]5 more heads with a broken promise[/] not listed "
                                              "(--json lists every one)")
    assert [int(line.split(" head ")[1].split()[0]) for line in lines[:-1]] == list(range(5, 45))
    assert len(broken_promise_lines(broken[:3])) == 3 and len(broken_promise_lines(broken, most=2)) == 3
