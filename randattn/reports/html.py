"""A self-contained HTML report of a results table: summary tables, every figure, diagnostics, provenance.

The page embeds its figures as base64 PNG ``data:`` URIs and carries its own CSS, so it opens offline and
can be mailed as one file; it loads nothing from the network (no external CSS, JS, fonts or images).
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from randattn._files import atomic_write_text

from randattn.reports.figures import (
    MSE_UNITS,
    bias_variance_figure,
    features_figure,
    heatmap_figure,
    mse_vs_samples_figure,
)
from randattn.reports.tables import (
    PLOT_COLUMNS,
    ResultsError,
    approximate_labels,
    describe_data,
    label_order,
    mse_pivot,
    require_columns,
    summary_table,
)

__all__ = [
    "KHAT_THRESHOLD",
    "DELTA_RATIO_BAND",
    "ReportFigure",
    "environment_info",
    "figure_data_uri",
    "diagnostics_summary",
    "default_figures",
    "build_report",
    "write_report",
]

#: Pareto k-hat above which importance-sampling variance estimates are unreliable (Vehtari et al. 2024)
KHAT_THRESHOLD = 0.7
#: delta-method variance / replicate variance outside this band flags a variance estimate to distrust
DELTA_RATIO_BAND = (0.5, 2.0)
_PACKAGES = ("randattn", "numpy", "scipy", "torch", "pandas", "matplotlib", "onnxruntime")

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #1a1a1a; line-height: 1.45; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
.subtitle { color: #555; margin-top: 0; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.6em 0 1.2em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: right; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1em 0 2em; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #444; font-size: 0.9em; }
pre { background: #f6f6f6; padding: 0.7em; overflow-x: auto; font-size: 0.85em; white-space: pre-wrap; }
.warning { background: #fff4e5; border-left: 4px solid #f0a030; padding: 0.5em 0.8em; margin: 0.5em 0; }
.ok { background: #eef8ee; border-left: 4px solid #4a4; padding: 0.5em 0.8em; margin: 0.5em 0; }
.scroll { overflow-x: auto; }
"""


@dataclass(frozen=True)
class ReportFigure:
    """A figure of the report with its heading and a one-paragraph explanation.

    Attributes
    ----------
    name : str
        File-name-safe key (``"mse-vs-samples"``).
    title : str
    caption : str
    figure : matplotlib.figure.Figure
    """

    name: str
    title: str
    caption: str
    figure: Figure


def environment_info() -> dict[str, str]:
    """Python, platform and package versions, without importing the packages (importlib.metadata).

    Returns
    -------
    dict
        ``{"python": ..., "platform": ..., "numpy": ..., "torch": ..., ...}``; ``"not installed"`` for a
        missing package.
    """
    from importlib.metadata import PackageNotFoundError, version

    info = {"python": sys.version.split()[0], "implementation": platform.python_implementation(),
            "platform": platform.platform(), "machine": platform.machine(), "cpus": str(os.cpu_count())}
    for package in _PACKAGES:
        try:
            info[package] = version(package)
        except PackageNotFoundError:
            info[package] = "not installed"
    return info


def figure_data_uri(fig: Figure, *, dpi: int = 110) -> str:
    """``data:image/png;base64,...`` of ``fig``, rendered with the Agg canvas.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    dpi : int

    Returns
    -------
    str
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def diagnostics_summary(
    table: pd.DataFrame,
    *,
    khat_threshold: float = KHAT_THRESHOLD,
    ratio_band: tuple[float, float] = DELTA_RATIO_BAND,
) -> pd.DataFrame:
    """Cells whose importance-sampling diagnostics say the Monte Carlo variance should not be trusted.

    A cell is flagged when ``pareto_khat > khat_threshold`` (heavy-tailed weights, Vehtari et al. 2024) or
    when ``delta_var_ratio`` (delta-method variance over replicate variance) lies outside ``ratio_band``.
    NaN diagnostics (estimators without importance weights) are ignored.

    Parameters
    ----------
    table : pandas.DataFrame
        Results table; columns ``pareto_khat`` / ``delta_var_ratio`` are used when present.
    khat_threshold : float
    ratio_band : (float, float)
        Acceptable ``(low, high)`` range of the ratio.

    Returns
    -------
    pandas.DataFrame
        One row per ``(tokens, estimator label, S)`` with at least one flagged cell: ``cells`` (with
        diagnostics), ``k-hat > t`` (count), ``max k-hat``, ``ratio outside [lo, hi]`` (count),
        ``median ratio``. Empty when nothing is flagged or the columns are absent or all NaN.
    """
    low, high = ratio_band
    if not 0 < low < 1 < high:
        raise ValueError(f"ratio_band must satisfy 0 < low < 1 < high, got {ratio_band!r}")
    has_khat = "pareto_khat" in table and table["pareto_khat"].notna().any()
    has_ratio = "delta_var_ratio" in table and table["delta_var_ratio"].notna().any()
    if not (has_khat or has_ratio):
        return pd.DataFrame()
    khat = table["pareto_khat"].astype(float) if has_khat else pd.Series(np.nan, index=table.index)
    ratio = table["delta_var_ratio"].astype(float) if has_ratio else pd.Series(np.nan, index=table.index)
    frame = table.assign(
        _khat=khat, _ratio=ratio, _has=khat.notna() | ratio.notna(),
        _khat_bad=khat > khat_threshold, _ratio_bad=ratio.notna() & ((ratio < low) | (ratio > high)),
    )
    frame = frame[frame["_has"]]
    rows = []
    for (tokens, label, s), group in frame.groupby(["tokens", "label", "num_samples"], sort=True):
        bad_khat, bad_ratio = int(group["_khat_bad"].sum()), int(group["_ratio_bad"].sum())
        if bad_khat == 0 and bad_ratio == 0:
            continue
        rows.append({
            "tokens": int(tokens), "estimator": label, "S": int(s), "cells": int(len(group)),
            f"k-hat > {khat_threshold:g}": bad_khat, "max k-hat": float(group["_khat"].max()),
            f"ratio outside [{low:g}, {high:g}]": bad_ratio, "median ratio": float(group["_ratio"].median()),
        })
    result = pd.DataFrame(rows)
    if result.empty:
        return result
    order = {label: i for i, label in enumerate(label_order(result["estimator"]))}
    return (result.assign(_o=result["estimator"].map(order)).sort_values(["tokens", "_o", "S"])
            .drop(columns="_o").reset_index(drop=True))


def default_figures(table: pd.DataFrame, metadata: Mapping[str, Any] | None = None) -> list[ReportFigure]:
    """Every figure the table supports: MSE vs S, bias²/variance, rfa features, one heatmap per estimator.

    Figures a table cannot support (no rfa variants to compare; an estimator with MSE 0) are left out.

    Parameters
    ----------
    table : pandas.DataFrame
    metadata : dict, optional

    Returns
    -------
    list of ReportFigure
    """
    metadata = dict(metadata or {})
    figures = [ReportFigure(
        "mse-vs-samples", "MSE vs number of samples (LARA Fig. 1)",
        "Mean squared error between each estimator and exact softmax attention, per element of the output, "
        "averaged over queries and value dimensions, then over layers and heads per image, then over images. "
        "Lower is better; a slope of -1 on these log-log axes is the Monte Carlo rate 1/S.",
        mse_vs_samples_figure(table, metadata=metadata),
    )]
    if {"variance", "bias_sq"} <= set(table.columns):
        figures.append(ReportFigure(
            "bias-variance", "Bias² and variance",
            "MSE = bias² + variance. Variance should fall like 1/S; bias² of self-normalized (biased) "
            "estimators falls too but more slowly, and an unbiased estimator's debiased bias² scatters around 0 "
            "(gaps on the log axis).",
            bias_variance_figure(table, metadata=metadata),
        ))
    if "params" in table and (table["estimator"] == "rfa").any():
        try:
            figures.append(ReportFigure(
                "features", "Random-feature attention: coupling and feature map (Performer Fig. 4)",
                "Orthogonal vs iid random features, and positive vs other feature maps, for rfa.",
                features_figure(table, metadata=metadata),
            ))
        except ResultsError:
            pass  # a single rfa variant: nothing to compare
    for label in approximate_labels(table):
        s = int(table.loc[table["label"] == label, "num_samples"].max())
        figures.append(ReportFigure(
            f"heatmap-{_safe_name(label)}", f"MSE per layer and head: {label}, S = {s}",
            "Which layers and heads are hard for this estimator (mean over images; log colour scale).",
            heatmap_figure(table, label=label, num_samples=s, metadata=metadata),
        ))
    return figures


def _safe_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in label).strip("-")


def _format_number(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value):
            return "–"
        return f"{value:.3g}"
    return str(value)


def _table_html(frame: pd.DataFrame, *, index: bool = False) -> str:
    body = frame.to_html(index=index, border=0, na_rep="–", float_format=lambda v: _format_number(v),
                         classes="results", escape=True)
    return f'<div class="scroll">{body}</div>'


def build_report(
    table: pd.DataFrame,
    *,
    metadata: Mapping[str, Any] | None = None,
    command: str | None = None,
    figures: Sequence[ReportFigure] | None = None,
    title: str = "randattn report: randomized attention vs exact softmax",
    environment: Mapping[str, str] | None = None,
    dpi: int = 110,
) -> str:
    """The report as one HTML string (figures embedded as base64 PNG; no external resources).

    Parameters
    ----------
    table : pandas.DataFrame
        Results table.
    metadata : dict, optional
        Table metadata (shown in full; ``command`` is taken from it when not given).
    command : str, optional
        The exact command line that produced the results.
    figures : sequence of ReportFigure, optional
        Default: :func:`default_figures`.
    title : str
    environment : dict, optional
        Default: :func:`environment_info`.
    dpi : int
        Resolution of the embedded PNGs.

    Returns
    -------
    str
        A complete ``<!DOCTYPE html>`` document.
    """
    require_columns(table, PLOT_COLUMNS, "the report")
    metadata = dict(metadata or {})
    command = command if command is not None else _metadata_command(metadata)
    figures = default_figures(table, metadata) if figures is None else list(figures)
    environment = environment_info() if environment is None else dict(environment)
    esc = html.escape
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        f"<h1>{esc(title)}</h1>", f'<p class="subtitle">{esc(describe_data(table, metadata))}</p>',
        f"<p>All errors are per output element, in {esc(MSE_UNITS)}, measured against exact float64 softmax attention on the same q, k, v, and "
        "aggregated as in LARA app. H.1: per (layer, head, image), then the mean over heads and layers of each "
        "image, then the mean over images with a percentile bootstrap interval over images.</p>",
        '<nav><a href="#summary">summary</a> · <a href="#figures">figures</a> · '
        '<a href="#diagnostics">diagnostics</a> · <a href="#provenance">provenance</a></nav>',
        '<h2 id="summary">Summary</h2>',
        "<h3>Mean MSE by estimator, token count and samples S</h3>",
        _table_html(mse_pivot(table).rename(columns=str).map(_format_number), index=True),
        "<h3>MSE with bootstrap interval, variance and debiased bias²</h3>",
        _table_html(summary_table(table)),
        '<h2 id="figures">Figures</h2>',
    ]
    for item in figures:
        parts += [
            f'<figure id="fig-{esc(item.name)}"><h3>{esc(item.title)}</h3>',
            f'<img alt="{esc(item.title)}" src="{figure_data_uri(item.figure, dpi=dpi)}">',
            f"<figcaption>{esc(item.caption)}</figcaption></figure>",
        ]
    parts += ['<h2 id="diagnostics">Diagnostics</h2>', *_diagnostics_html(table)]
    parts += [
        '<h2 id="provenance">Provenance</h2>',
        "<h3>Command</h3>", f"<pre>{esc(command or 'not recorded')}</pre>",
        "<h3>Environment</h3>",
        _table_html(pd.DataFrame({"item": list(environment), "value": list(environment.values())})),
        "<h3>Metadata stored with the results</h3>",
        f"<pre>{esc(json.dumps(metadata, indent=2, sort_keys=True, default=str)) if metadata else 'none'}</pre>",
        "</body>", "</html>",
    ]
    return "\n".join(parts) + "\n"


def _metadata_command(metadata: Mapping[str, Any]) -> str | None:
    for key in ("command", "command_line", "argv"):
        value = metadata.get(key)
        if isinstance(value, (list, tuple)):
            return " ".join(map(str, value))
        if value:
            return str(value)
    return None


def _diagnostics_html(table: pd.DataFrame) -> list[str]:
    esc = html.escape
    flagged = diagnostics_summary(table)
    has_any = any(c in table and table[c].notna().any() for c in ("pareto_khat", "delta_var_ratio"))
    if not has_any:
        return ['<p class="ok">No importance-sampling diagnostics in this table (columns absent or all NaN).</p>']
    if flagged.empty:
        return [f'<p class="ok">No cell has Pareto k-hat &gt; {KHAT_THRESHOLD:g} or a delta-method/replicate '
                f"variance ratio outside [{DELTA_RATIO_BAND[0]:g}, {DELTA_RATIO_BAND[1]:g}].</p>"]
    khat_col = f"k-hat > {KHAT_THRESHOLD:g}"
    ratio_col = f"ratio outside [{DELTA_RATIO_BAND[0]:g}, {DELTA_RATIO_BAND[1]:g}]"
    out = [f"<p>Pareto k-hat &gt; {KHAT_THRESHOLD:g} means the importance weights are so heavy-tailed that the "
           "replicate variance (and so the MSE) is not a reliable estimate; a delta-method / replicate variance "
           f"ratio outside [{DELTA_RATIO_BAND[0]:g}, {DELTA_RATIO_BAND[1]:g}] means the two variance estimates "
           "disagree.</p>"]
    diagnosed = table[[c for c in ("pareto_khat", "delta_var_ratio") if c in table]].notna().any(axis=1)
    cells = table.loc[diagnosed].groupby("label").size()
    for label in label_order(flagged["estimator"]):
        rows = flagged[flagged["estimator"] == label]
        reasons = []
        if rows[khat_col].sum():
            reasons.append(f"{int(rows[khat_col].sum())} of {cells[label]} cells with k-hat &gt; "
                           f"{KHAT_THRESHOLD:g} (max {rows['max k-hat'].max():.2f})")
        if rows[ratio_col].sum():
            reasons.append(f"{int(rows[ratio_col].sum())} of {cells[label]} cells with the variance ratio outside "
                           "the band")
        settings = "; ".join(f"N = {t}, S = {s}" for t, s in zip(rows["tokens"], rows["S"]))
        out.append(f'<p class="warning"><b>{esc(label)}</b>: {"; ".join(reasons)} '
                   f"(settings: {esc(settings)}).</p>")
    out.append("<details><summary>per setting</summary>" + _table_html(flagged) + "</details>")
    return out


def write_report(
    table: pd.DataFrame,
    out_dir: str | os.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    command: str | None = None,
    name: str = "report.html",
    figures: Sequence[ReportFigure] | None = None,
    dpi: int = 110,
) -> Path:
    """Write :func:`build_report` to ``out_dir / name`` (folder created; the write is atomic).

    Parameters
    ----------
    table : pandas.DataFrame
    out_dir : str or path-like
    metadata : dict, optional
    command : str, optional
    name : str
    figures : sequence of ReportFigure, optional
    dpi : int
        Resolution of the embedded PNGs.

    Returns
    -------
    pathlib.Path
        The written file.
    """
    text = build_report(table, metadata=metadata, command=command, figures=figures, dpi=dpi)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / name, text)
    return out / name
