"""Reports: matplotlib figures, summary tables and the self-contained HTML report of a results table.

Figures are built as :class:`matplotlib.figure.Figure` objects without pyplot (no global figure state) and
rendered with the Agg canvas.
"""

from randattn.reports.figures import (
    FIGURE_KINDS,
    bias_variance_figure,
    features_figure,
    heatmap_figure,
    make_figure,
    mse_vs_samples_figure,
    position_figure,
    save_figure,
)
from randattn.reports.tables import Results, ResultsError, read_results, summary_table

__all__ = [
    "FIGURE_KINDS",
    "Results",
    "ResultsError",
    "bias_variance_figure",
    "features_figure",
    "heatmap_figure",
    "make_figure",
    "mse_vs_samples_figure",
    "position_figure",
    "read_results",
    "save_figure",
    "summary_table",
]
