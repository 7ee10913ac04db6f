"""Reports: matplotlib figures, summary tables and the self-contained HTML report of a results table.

Figures are built as :class:`matplotlib.figure.Figure` objects without pyplot (no global figure state) and
rendered with the Agg canvas.

The names below are imported on first use (PEP 562): importing :mod:`randattn.reports.console` for the command
line's text must not cost matplotlib's import (about half a second).
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "FIGURE_KINDS": "figures",
    "bias_variance_figure": "figures",
    "features_figure": "figures",
    "heatmap_figure": "figures",
    "make_figure": "figures",
    "mse_vs_samples_figure": "figures",
    "position_figure": "figures",
    "save_figure": "figures",
    "Results": "randattn.results.table",
    "ResultsError": "tables",
    "read_results": "randattn.results.table",
    "summary_table": "tables",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = home if "." in home else f"{__name__}.{home}"  # the table itself is read by randattn.results
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
