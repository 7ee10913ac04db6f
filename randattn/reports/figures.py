"""Figures of a results table: MSE vs samples, bias²/variance, layer x head heatmaps, feature-map comparison,
and the error by query position of a masked run (from its per-position table).

Every function takes a results table (see :mod:`randattn.reports.tables`) and returns a
:class:`matplotlib.figure.Figure` built without pyplot, so nothing is registered in pyplot's global figure
manager and nothing depends on the interactive backend; :func:`save_figure` renders with the Agg canvas.

The figures follow the papers they reproduce: :func:`mse_vs_samples_figure` is LARA Fig. 1 (MSE against
the number of samples, one panel per sequence length, aggregated as in LARA app. H.1) and
:func:`features_figure` is Performer Fig. 4 (orthogonal vs iid, positive vs trigonometric).
"""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd
from matplotlib import rc_context
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import NullLocator

from randattn.analysis.positions import bucket_text
from randattn.estimators.registry import takes_no_samples
from randattn.reports.tables import (
    PLOT_COLUMNS,
    POSITION_PLOT_COLUMNS,
    ResultsError,
    aggregate_over_images,
    buckets_text,
    few_units_note,
    measured_per_bucket,
    aggregate_positions,
    approximate_labels,
    describe_data,
    display_names,
    estimator_order,
    estimator_spec,
    exact_labels,
    item_noun,
    label_order,
    require_columns,
    row_params,
    table_masks,
)

__all__ = [
    "FIGURE_KINDS",
    "POSITION_FIGURE_KINDS",
    "MSE_UNITS",
    "save_figure",
    "make_figure",
    "mse_vs_samples_figure",
    "bias_variance_figure",
    "heatmap_figure",
    "features_figure",
    "position_figure",
    "error_vs_budget_figure",
    "has_budget",
    "feature_estimators",
    "label_styles",
]

#: the y-axis unit of every MSE: squared units of the attention output
MSE_UNITS = "squared output units"
_SAMPLES_LABEL = "samples S (log scale)"
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
_SUPPORTED_FORMATS = ("png", "svg", "pdf")
_PANEL_WIDTH, _PANEL_HEIGHT = 4.6, 3.6


def label_styles(labels: Iterable[str]) -> dict[str, dict[str, Any]]:
    """A fixed colour and marker per estimator label, in display order (tab10 then tab20 colours).

    Parameters
    ----------
    labels : iterable of str

    Returns
    -------
    dict
        label -> ``{"color": ..., "marker": ...}`` for :meth:`matplotlib.axes.Axes.plot`.
    """
    from matplotlib import colormaps

    ordered = label_order(labels)
    palette = colormaps["tab10"].colors if len(ordered) <= 10 else colormaps["tab20"].colors
    return {
        label: {"color": palette[i % len(palette)], "marker": _MARKERS[i % len(_MARKERS)]}
        for i, label in enumerate(ordered)
    }


def save_figure(
    fig: Figure,
    path_without_suffix: str | os.PathLike,
    formats: Sequence[str] = ("png", "svg"),
    *,
    dpi: int = 150,
) -> list[Path]:
    """Write ``fig`` once per format (``png``, ``svg``, ``pdf``) next to ``path_without_suffix``.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    path_without_suffix : str or path-like
        E.g. ``out/mse-vs-samples``; parent folders are created.
    formats : sequence of str
        Subset of ``("png", "svg", "pdf")``.
    dpi : int
        Resolution of raster formats.

    Returns
    -------
    list of pathlib.Path
        The written files, in the order of ``formats``.

    Raises
    ------
    OSError
        A write failed (e.g. ``ENOSPC``, a full disk); its ``filename`` is the figure's path, which is left as
        it was (each file is written under a temporary name and renamed when complete).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from randattn._files import atomic_path
    from randattn._files import named_write_errors

    if not isinstance(fig, Figure):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    formats = [formats] if isinstance(formats, str) else list(formats)
    bad = [f for f in formats if f not in _SUPPORTED_FORMATS]
    if bad or not formats:
        raise ValueError(f"formats must be a non-empty subset of {_SUPPORTED_FORMATS}, got {formats!r}")
    base = Path(path_without_suffix)
    base.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)  # attach a non-interactive canvas; svg/pdf pick their own backend from the suffix
    written = []
    for fmt in formats:
        path = base.with_name(base.name + "." + fmt)
        # metadata without dates keeps repeated runs byte-stable
        metadata = {"Date": None} if fmt in ("svg", "pdf") else {}
        # written under a temporary name and renamed when complete: a full disk leaves no half figure behind
        # text stays text, editable and searchable in a paper's figure: SVG <text> rather than outlines, PDF
        # TrueType (Type 42) rather than Type 3, which journals' checks reject
        with named_write_errors(path), atomic_path(path) as tmp, rc_context({"svg.fonttype": "none",
                                                                            "pdf.fonttype": 42}):
            # the layouts keep every text inside the canvas (tested); "tight" is the backstop for unusual tables
            fig.savefig(tmp, format=fmt, dpi=dpi, metadata=metadata, bbox_inches="tight", pad_inches=0.05)
        written.append(path)
    return written


def _new_figure(n_panels: int, *, ncols: int | None = None, sharey: bool = False) -> tuple[Figure, list[Axes]]:
    ncols = n_panels if ncols is None else ncols
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(max(6.4, _PANEL_WIDTH * ncols + 0.4), _PANEL_HEIGHT * nrows + 1.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=sharey).ravel().tolist()
    for ax in axes[n_panels:]:
        fig.delaxes(ax)
    return fig, axes[:n_panels]


def _wrap(line: str, width: int) -> list[str]:
    """Wrap at the " · " and "; " separators first, so a phrase ("layers 0, 5, 11") stays on one line."""
    pieces = [p for chunk in line.split(" · ") for p in (chunk,)]
    out: list[str] = []
    for piece in pieces:
        candidate = f"{out[-1]} · {piece}" if out else piece
        if out and len(candidate) <= width:
            out[-1] = candidate
        else:
            out.extend(textwrap.wrap(piece, width) or [""])
    return out


def _titles(fig: Figure, title: str, subtitle: str) -> None:
    # about 11 characters per inch at 10 pt: wrap so nothing is clipped
    width = max(40, int(fig.get_figwidth() * 11))
    lines = [wrapped for line in subtitle.split("\n") for wrapped in _wrap(line, width)]
    fig.suptitle("\n".join([*textwrap.wrap(title, width), *lines]), fontsize=10)


def _legend(fig: Figure, handles: list, n: int) -> None:
    if not handles:
        return
    longest = max(len(str(h.get_label())) for h in handles)
    column_inches = 0.075 * longest + 0.6  # text at 9 pt plus the line sample
    ncols = max(1, min(n, int(fig.get_figwidth() // column_inches)))
    # the axes keep their height: the figure grows by the legend's rows
    fig.set_figheight(fig.get_figheight() + 0.2 * math.ceil(len(handles) / ncols))
    fig.legend(handles=handles, loc="outside lower center", ncols=ncols, frameon=False, fontsize=9)


def _token_values(table: pd.DataFrame) -> list[int]:
    return sorted(int(t) for t in table["tokens"].dropna().unique())


def _token_panels(aggregated: pd.DataFrame) -> list[tuple[int, str | None, pd.DataFrame, str]]:
    """``(tokens, mask, rows, title)`` of each panel: one per token count, and per mask when rows of several masks
    share a table (a concatenation of runs, or a file whose layers differ), so that no line mixes them."""
    masks = sorted(aggregated["mask"].astype(str).unique()) if "mask" in aggregated else []
    several = len(masks) > 1
    panels = []
    for n in _token_values(aggregated):
        for mask in (masks if several else [None]):
            rows = aggregated[(aggregated["tokens"] == n)
                              & ((aggregated["mask"].astype(str) == mask) if mask is not None else True)]
            if not rows.empty:
                shown = _mask_words(mask)
                panels.append((n, mask, rows, f"N = {n} tokens" + (f", {shown}" if mask is not None else "")))
    return panels


def _band_text(aggregated: pd.DataFrame, confidence: float, noun: str = "image") -> str:
    """What the shaded bands are: a bootstrap over images (sequences, ``noun``), or over heads when there is a
    single one."""
    over = str(aggregated["ci_over"].iloc[0]) if "ci_over" in aggregated and len(aggregated) else "images"
    over = f"{noun}s" if over == "images" else over
    units = int(aggregated["units"].max()) if "units" in aggregated and len(aggregated) else 0
    if units < 2:  # one unit has no interval
        return f"no bands: a single {over[:-1]}"
    few = few_units_note(aggregated, confidence=confidence, noun=noun)
    bands = f"bands: {round(confidence * 100)}% percentile bootstrap CI over {units} {over}"
    return f"{bands}; {few}" if few else bands


def _drop_exact(aggregated: pd.DataFrame, value: str, names: dict[str, str] | None = None,
                exact: Iterable[str] = ()) -> tuple[pd.DataFrame, list[str]]:
    """Drop exact estimators: the labels in ``exact`` (exact by their spec: their error is float round-off,
    ~1e-13) and labels with ``value`` 0 everywhere.

    Returns the remaining rows and notes such as ``"Softmax (exact) (mse 1.7e-13, round-off)"``.
    """
    exact = set(exact)
    notes, dropped = [], []
    for label, group in aggregated.groupby("label", sort=False):
        values = group[value].to_numpy(dtype=float)
        if label in exact or not (values > 0).any():
            dropped.append(label)
            shown = (names or {}).get(label, label)
            if not np.isfinite(values).any():  # NaN everywhere: not measured, which is not an error of 0
                notes.append(f"{shown} (no finite {value})")
                continue
            largest = np.nanmax(values)
            notes.append(f"{shown} ({value} {largest:.2g}, round-off)" if largest > 0 else f"{shown} ({value} 0)")
    return aggregated[~aggregated["label"].isin(dropped)], notes


def _nothing_to_draw(what: str, aggregated: pd.DataFrame, value: str, exact: Iterable[str],
                     notes: Sequence[str]) -> ResultsError:
    """The error of a figure with no line left, said as it is: the estimators have a ``value`` of 0, or NaN
    (not measured, which is not an error of 0), or are exact (round-off), or some of each (``notes`` name which)."""
    name = "MSE" if value == "mse" else value
    is_exact = aggregated["label"].isin(set(exact)).to_numpy()
    values = aggregated[value].to_numpy(dtype=float)
    approximate, finite = values[~is_exact], values[~is_exact & np.isfinite(values)]
    if (np.isfinite(values) & (values == 0)).all():
        why = f"every estimator has {name} = 0"
    elif not len(approximate):
        why = "every estimator is exact (its error is round-off)"
    elif not len(finite):
        why = (f"no estimator has a finite {name} (every value is NaN)" if is_exact.sum() == 0 else
               f"no estimator but the exact ones has a finite {name} (every value is NaN)")
    elif len(finite) == len(approximate) and (finite == 0).all():
        why = f"every estimator but the exact ones has {name} = 0"
    else:
        why = f"no estimator has a finite {name} above 0: {'; '.join(notes)}"
    return ResultsError(f"{what} has nothing to draw: {why}")


def _select_labels(table: pd.DataFrame, labels: Sequence[str] | None) -> pd.DataFrame:
    if labels is None:
        return table
    labels = [labels] if isinstance(labels, str) else list(labels)
    unknown = sorted(set(labels) - set(table["label"]))
    if unknown:
        raise ResultsError(
            f"label(s) {', '.join(unknown)} not in the table; it has {', '.join(label_order(table['label']))}"
        )
    return table[table["label"].isin(labels)]


def _exact_note(exact: list[str]) -> str:
    if not exact:
        return ""
    return f" · exact, not drawn: {', '.join(exact)}"


def _drawable(table: pd.DataFrame, value: str, confidence: float, seed: int, what: str):
    """``(aggregated, exact, names, panels, styles)`` of a per-label line figure: the mean over images with its
    bootstrap band, the exact labels left out (ResultsError naming ``what`` when nothing is left), one panel per
    token count and one style per label."""
    aggregated = aggregate_over_images(table, [value], confidence=confidence, seed=seed)
    names = display_names(table)
    every = aggregated
    aggregated, exact = _drop_exact(aggregated, value, names, exact_labels(table))
    if aggregated.empty:
        raise _nothing_to_draw(what, every, value, exact_labels(table), exact)
    return aggregated, exact, names, _token_panels(aggregated), label_styles(aggregated["label"])


def _interval(ax, x: np.ndarray, y: np.ndarray, low: np.ndarray, high: np.ndarray, color: str,
              alpha: float) -> None:
    """A curve's confidence interval: a band, or, for a curve of one point, an error bar (a band of no width is
    not seen, and the caption promises an interval)."""
    if len(x) > 1:
        ax.fill_between(x, low, high, color=color, alpha=alpha, linewidth=0)
    else:
        # a percentile interval need not hold the mean: no negative arm
        ax.errorbar(x, y, yerr=[np.maximum(y - low, 0), np.maximum(high - y, 0)], fmt="none", ecolor=color,
                    elinewidth=1.2, capsize=3)


def mse_vs_samples_figure(
    table: pd.DataFrame,
    *,
    metadata: dict | None = None,
    labels: Sequence[str] | None = None,
    value: str = "mse",
    confidence: float = 0.95,
    seed: int = 0,
) -> Figure:
    """MSE against the number of samples on log-log axes, one panel per token count (LARA Fig. 1).

    Each line is an estimator label: the mean over images of the per-image mean over layers and heads,
    with a shaded bootstrap confidence band over images. A label measured at a single S in a panel with
    several S values is drawn as a dashed horizontal line (as RA with one sample in LARA Fig. 1).

    Parameters
    ----------
    table : pandas.DataFrame
        Results table with at least :data:`~randattn.reports.tables.PLOT_COLUMNS`.
    metadata : dict, optional
        Table metadata, for the subtitle.
    labels : sequence of str, optional
        Labels to draw (default: all with a non-zero MSE).
    value : str
        Column on the y axis (``"mse"`` by default; ``"variance"`` also makes sense).
    confidence : float
        Level of the band.
    seed : int
        Seed of the bootstrap.

    Returns
    -------
    matplotlib.figure.Figure
        One axes per token count; one line (plus a band) per label in each.
    """
    require_columns(table, [*PLOT_COLUMNS, value], "the MSE-vs-samples figure")
    table = _select_labels(table, labels)
    aggregated, exact, names, panels, styles = _drawable(table, value, confidence, seed, "the MSE-vs-samples figure")
    fig, axes = _new_figure(len(panels), sharey=True)
    handles: dict[str, Line2D] = {}
    for ax, (n, _, panel, title) in zip(axes, panels):
        per_label = panel.groupby("label")["num_samples"].nunique()
        free = panel["label"].map(takes_no_samples).astype(bool)  # one measurement the table repeats at each S
        swept = panel[(panel["label"].map(per_label) > 1) & ~free]
        # the x axis spans the swept S; single-S labels (RA at S = 1) and labels without S (adaptive vAttention)
        # are horizontal lines across it
        all_s = sorted((swept if not swept.empty else panel)["num_samples"].unique())
        for label in label_order(panel["label"]):
            rows = panel[panel["label"] == label].sort_values("num_samples")
            style = styles[label]
            y = rows[value].to_numpy(dtype=float)
            low = np.maximum(rows[f"{value}_ci_low"].to_numpy(dtype=float), y / 1e3)
            high = rows[f"{value}_ci_high"].to_numpy(dtype=float)
            if (len(rows) == 1 or takes_no_samples(label)) and len(all_s) > 1:
                s = int(rows["num_samples"].iloc[0])
                ax.axhline(y[0], color=style["color"], linestyle="--", linewidth=1.5)
                ax.axhspan(low[0], high[0], color=style["color"], alpha=0.12, linewidth=0)
                which = "no S" if takes_no_samples(label) else f"S = {s} only"
                handles.setdefault(label, Line2D([], [], color=style["color"], linestyle="--",
                                                 label=f"{names[label]} ({which})"))
                continue
            s = rows["num_samples"].to_numpy(dtype=float)
            (line,) = ax.plot(s, y, color=style["color"], marker=style["marker"], markersize=4, linewidth=1.6,
                              label=names[label])
            if np.isfinite(low).all() and np.isfinite(high).all():
                _interval(ax, s, y, low, high, style["color"], 0.18)
            handles.setdefault(label, line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(all_s, [str(int(s)) for s in all_s])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(_SAMPLES_LABEL)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"{value.replace('_', ' ')} ({MSE_UNITS})" if value != "mse" else f"MSE ({MSE_UNITS})")
    noun = item_noun(metadata)
    band = _band_text(aggregated, confidence, noun)
    _titles(
        fig,
        f"{'MSE' if value == 'mse' else value} of randomized attention vs exact softmax, by number of samples",
        f"{describe_data(table, metadata)}\nmean over layers and heads per {noun}, then over {noun}s; {band}"
        f"{_exact_note(exact)}",
    )
    ordered = [handles[label] for label in label_order(handles)]
    _legend(fig, ordered, len(ordered))
    return fig


def has_budget(table: pd.DataFrame) -> bool:
    """Whether some estimator of ``table`` reports the keys its queries read (a ``keys_used`` value)."""
    return "keys_used" in table.columns and bool(np.isfinite(table["keys_used"].to_numpy(dtype=float)).any())


def _budget_of(panel: pd.DataFrame) -> pd.DataFrame:
    """Per ``(label, num_samples)``: the mean keys used (over images, layers and heads), or S where the
    estimator reports none (random features: S features per query, each an inner product like one key)."""
    keys = panel["keys_used"].to_numpy(dtype=float) if "keys_used" in panel else np.full(len(panel), np.nan)
    frame = panel.assign(_keys=keys)
    budget = frame.groupby(["label", "num_samples"], sort=False)["_keys"].mean().reset_index()
    budget["counted"] = np.isfinite(budget["_keys"])
    budget["budget"] = np.where(budget["counted"], budget["_keys"], budget["num_samples"].astype(float))
    return budget.drop(columns="_keys")


def _scores_every_key(table: pd.DataFrame, label: str) -> bool:
    """Whether ``label``'s estimator, as configured, costs O(N M): it reads every key (RA's proposal scores them
    all), so S, its sample size, is no budget of keys."""
    row = table[table["label"] == label].iloc[0]
    spec = estimator_spec(row["estimator"])
    return spec is not None and spec.cost_of(row_params(spec, row.get("params"))) == "quadratic"


def error_vs_budget_figure(
    table: pd.DataFrame,
    *,
    metadata: dict | None = None,
    labels: Sequence[str] | None = None,
    value: str = "mse",
    confidence: float = 0.95,
    seed: int = 0,
) -> Figure:
    """Error against the keys each query reads, log-log, one panel per token count: the quality-efficiency
    curve of the decode-time sparse and sampling estimators (Quest Fig. 7, MagicPIG Fig. 1, vAttention Fig. 3).

    The x value of a point is the mean ``keys_used`` of its rows (exact and sampled keys together, averaged over
    queries, replicates, heads, layers and items); an estimator that does not report keys used is placed at S,
    its features, samples or proposals per query, and drawn dashed -- the common budget axis that ``--samples``
    sets for every estimator -- where its cost is linear, and left out, named in the caption, where it scores every
    key (RA; EVA with its default partition): at S it would look as cheap as S keys. The y value and its band are
    those of :func:`mse_vs_samples_figure`.
    """
    require_columns(table, [*PLOT_COLUMNS, value], "the error-vs-budget figure")
    table = _select_labels(table, labels)
    if not has_budget(table):
        raise ResultsError("the error-vs-budget figure needs an estimator that reports the keys its queries read "
                           "(a keys_used value: topk, streaming, quest, magicpig, vattention); this table has none "
                           "(mse-vs-samples draws its estimators against S)")
    aggregated, exact, names, panels, styles = _drawable(table, value, confidence, seed, "the error-vs-budget figure")
    fig, axes = _new_figure(len(panels), sharey=True)
    handles: dict[str, Line2D] = {}
    dashed, left_out = False, set()
    for ax, (n, mask, panel, title) in zip(axes, panels):
        rows_of_panel = (table["tokens"] == n) & ((table["mask"].astype(str) == mask) if mask is not None else True)
        budget = _budget_of(table[rows_of_panel])  # a panel per mask: its own layers' keys, not the run's mean
        panel = panel.merge(budget, on=["label", "num_samples"], how="left")
        for label in label_order(panel["label"]):
            rows = panel[panel["label"] == label].sort_values("budget")
            style = styles[label]
            x = rows["budget"].to_numpy(dtype=float)
            y = rows[value].to_numpy(dtype=float)
            counted = bool(rows["counted"].all())
            if not counted and _scores_every_key(table, label):
                left_out.add(names[label])  # at S it would look as cheap as S keys: it reads every one
                continue
            dashed |= not counted
            (line,) = ax.plot(x, y, color=style["color"], marker=style["marker"], markersize=4, linewidth=1.6,
                              linestyle="-" if counted else "--",
                              label=names[label] if counted else f"{names[label]} (at S)")
            low = np.maximum(rows[f"{value}_ci_low"].to_numpy(dtype=float), y / 1e3)
            high = rows[f"{value}_ci_high"].to_numpy(dtype=float)
            if np.isfinite(low).all() and np.isfinite(high).all():
                _interval(ax, x, y, low, high, style["color"], 0.15)
            handles.setdefault(label, line)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("keys used per query (log scale)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"MSE ({MSE_UNITS})" if value == "mse" else value.replace("_", " "))
    noun = item_noun(metadata)
    _titles(
        fig,
        f"{'MSE' if value == 'mse' else value} vs keys used per query: quality against budget",
        f"{describe_data(table, metadata)}\nmean over layers and heads per {noun}, then over {noun}s; "
        f"{_band_text(aggregated, confidence, noun)}"
        + ("; dashed: no keys_used reported, placed at S (its features, samples or proposals per query)" if dashed
           else "")
        + (f"; left out: {', '.join(sorted(left_out))} (no keys_used, and each scores every key)" if left_out else "")
        + _exact_note(exact),
    )
    ordered = [handles[label] for label in label_order(handles)]
    _legend(fig, ordered, len(ordered))
    return fig


def bias_variance_figure(
    table: pd.DataFrame,
    *,
    metadata: dict | None = None,
    labels: Sequence[str] | None = None,
    seed: int = 0,
) -> Figure:
    """Bias²/variance decomposition of the MSE: paired lines per estimator, one panel per token count.

    Solid lines are the variance, dashed lines the debiased squared bias (``bias_sq``), both against S on
    log-log axes with the label's colour; thin dotted lines are the MSE. A debiased bias² at or below zero
    (the bias is smaller than the replicate noise can resolve) leaves a gap in the dashed line.

    Parameters
    ----------
    table : pandas.DataFrame
        Results table with ``variance`` and ``bias_sq`` besides the plot columns.
    metadata : dict, optional
    labels : sequence of str, optional
    seed : int

    Returns
    -------
    matplotlib.figure.Figure
        One axes per token count; three lines (variance, bias², MSE) per random label in each.
    """
    require_columns(table, [*PLOT_COLUMNS, "variance", "bias_sq"], "the bias/variance figure")
    table = _select_labels(table, labels)
    aggregated = aggregate_over_images(table, ["mse", "variance", "bias_sq"], n_boot=1, seed=seed)
    names = display_names(table)
    every = aggregated
    aggregated, exact = _drop_exact(aggregated, "mse", names, exact_labels(table))
    if aggregated.empty:
        raise _nothing_to_draw("the bias/variance figure", every, "mse", exact_labels(table), exact)
    panels = _token_panels(aggregated)
    styles = label_styles(aggregated["label"])
    fig, axes = _new_figure(len(panels), sharey=True)
    no_variance = False
    for ax, (n, _, panel, title) in zip(axes, panels):
        all_s = sorted(panel["num_samples"].unique())
        for label in label_order(panel["label"]):
            rows = panel[panel["label"] == label].sort_values("num_samples")
            style = styles[label]
            # a configuration without S: one measurement, a line without markers at the S it was not measured at
            marker = None if takes_no_samples(label) else style["marker"]
            s = rows["num_samples"].to_numpy(dtype=float)
            variance = rows["variance"].to_numpy(dtype=float)
            bias_sq = rows["bias_sq"].to_numpy(dtype=float)
            mse = rows["mse"].to_numpy(dtype=float)
            no_variance |= bool((variance <= 0).any())
            ax.plot(s, np.where(variance > 0, variance, np.nan), color=style["color"], marker=marker,
                    markersize=4, linewidth=1.6)
            ax.plot(s, np.where(bias_sq > 0, bias_sq, np.nan), color=style["color"], marker=marker,
                    markersize=4, linewidth=1.6, linestyle="--", markerfacecolor="white")
            ax.plot(s, np.where(mse > 0, mse, np.nan), color=style["color"], linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(all_s, [str(int(s)) for s in all_s])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(_SAMPLES_LABEL)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"variance, bias² ({MSE_UNITS})")
    _titles(
        fig,
        "Bias² / variance decomposition of the MSE",
        f"{describe_data(table, metadata)}\nsolid: variance · dashed: debiased bias² (gaps: ≤ 0, below the "
        f"replicate noise) · dotted: MSE"
        + (" · a variance of 0 (a deterministic estimator's) is not drawn" if no_variance else "")
        + _exact_note(exact),
    )
    handles = [Line2D([], [], color=styles[label]["color"],
                      marker=None if takes_no_samples(label) else styles[label]["marker"],
                      label=names[label] + (" (no S)" if takes_no_samples(label) else ""))
               for label in label_order(aggregated["label"])]
    handles += [
        Line2D([], [], color="0.3", linewidth=1.6, label="variance"),
        Line2D([], [], color="0.3", linewidth=1.6, linestyle="--", label="bias² (debiased)"),
        Line2D([], [], color="0.3", linewidth=0.8, linestyle=":", label="MSE"),
    ]
    _legend(fig, handles, len(handles))
    return fig


def _default_heatmap_label(table: pd.DataFrame) -> str:
    candidates = approximate_labels(table)
    if not candidates:
        approximate = table[~table["label"].astype(str).isin(exact_labels(table))]
        values = approximate["mse"].to_numpy(dtype=float)
        if approximate.empty:
            why = "every estimator is exact"
        elif not np.isfinite(values).any():
            why = "no estimator has a finite MSE (every value is NaN)"
        elif (values[np.isfinite(values)] == 0).all() and np.isfinite(values).all():
            why = "every estimator has MSE = 0"
        else:
            why = "no estimator has a finite MSE above 0"
        raise ResultsError(f"the heatmap has nothing to draw: {why}")
    return candidates[0]


def heatmap_figure(
    table: pd.DataFrame,
    *,
    label: str | None = None,
    num_samples: int | None = None,
    metadata: dict | None = None,
    annotate: bool | None = None,
) -> Figure:
    """Layer x head heatmap of the MSE (mean over images) for one estimator and S, one panel per token count.

    Parameters
    ----------
    table : pandas.DataFrame
    label : str, optional
        Estimator label (default: the first random estimator in display order, e.g. ``rfa``).
    num_samples : int, optional
        S (default: the largest S measured for ``label``).
    metadata : dict, optional
    annotate : bool, optional
        Write the value in each cell (default: when there are at most 96 cells per panel).

    Returns
    -------
    matplotlib.figure.Figure
        One heatmap axes per token count plus one shared colour bar (log scale).
    """
    require_columns(table, PLOT_COLUMNS, "the heatmap")
    label = _default_heatmap_label(table) if label is None else label
    rows = _select_labels(table, [label])
    available = sorted(int(s) for s in rows["num_samples"].dropna().unique())
    if num_samples is None:
        if not available:
            raise ResultsError(f"the heatmap's estimator {label!r} has no num_samples values")
        num_samples = available[-1]
    elif num_samples not in available:
        raise ResultsError(
            f"the heatmap's estimator {label!r} was not measured at S = {num_samples}; "
            f"available: {', '.join(map(str, available))}"
        )
    rows = rows[rows["num_samples"] == num_samples]
    grid = rows.groupby(["tokens", "layer", "head"])["mse"].mean()
    positive = grid[grid > 0]
    if positive.empty:
        finite = grid[np.isfinite(grid)]
        what = "no finite MSE" if finite.empty else "MSE = 0" if (finite == 0).all() else "no MSE above 0"
        raise ResultsError(f"the heatmap has nothing to draw: {label} has {what} at S = {num_samples}")
    norm = LogNorm(vmin=float(positive.min()), vmax=float(positive.max()))
    tokens = sorted(int(t) for t in grid.index.get_level_values("tokens").unique())
    layers = sorted(int(x) for x in rows["layer"].unique())
    heads = sorted(int(x) for x in rows["head"].unique())
    annotate = len(layers) * len(heads) <= 96 if annotate is None else annotate
    fig = Figure(
        # at least 3.6 in tall: the colour bar (and its two-line label) needs that height beside one layer
        figsize=(max(3.4, 0.55 * len(heads) + 1.6) * len(tokens) + 1.4, max(3.6, 0.42 * len(layers) + 2.6)),
        layout="constrained",
    )
    axes = fig.subplots(1, len(tokens), squeeze=False).ravel().tolist()
    image = None
    for ax, n in zip(axes, tokens):
        values = np.full((len(layers), len(heads)), np.nan)
        for (t, layer, head), mse in grid.items():
            if int(t) == n:
                values[layers.index(int(layer)), heads.index(int(head))] = mse
        shown = np.where(values > 0, values, np.nan)
        image = ax.imshow(shown, norm=norm, cmap="viridis", aspect="auto", origin="upper")
        ax.set_xticks(range(len(heads)), [str(h) for h in heads])
        ax.set_yticks(range(len(layers)), [str(x) for x in layers])
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"N = {n} tokens", fontsize=10)
        if annotate:
            log_mid = math.sqrt(norm.vmin * norm.vmax)
            for i in range(len(layers)):
                for j in range(len(heads)):
                    if np.isfinite(shown[i, j]):
                        ax.text(j, i, f"{shown[i, j]:.2g}", ha="center", va="center", fontsize=7,
                                color="white" if shown[i, j] < log_mid else "black")
    fig.colorbar(image, ax=axes, label=f"MSE, log scale\n({MSE_UNITS})", shrink=0.9)
    shown = display_names(table).get(label, label)
    _titles(
        fig,
        f"MSE per layer and head: {shown}{samples_text(label, num_samples)}"
        + (f" [{label}]" if shown != label else ""),
        f"{describe_data(table, metadata)}\nmean over {item_noun(metadata)}s; darker is more accurate",
    )
    return fig


def samples_text(label: str, num_samples: int) -> str:
    """``", S = 64"`` in a title; nothing for a configuration that takes no S (softmax, adaptive vAttention), whose
    one measurement a table repeats at each S (:func:`randattn.estimators.registry.takes_no_samples`)."""
    return "" if takes_no_samples(label) else f", S = {num_samples}"


#: the parameters the features figure compares (Performer Fig. 4): an estimator whose spec has both is drawn
_FEATURE_PARAMS: tuple[str, str] = ("feature_map", "coupling")
#: the coupling the feature-map panel prefers when it was measured (Performer Fig. 4 compares maps on it)
_PREFERRED_COUPLING = "orthogonal"


def _compares_features(spec: Any) -> bool:
    """Whether an estimator's spec has the parameters the features figure compares."""
    return spec is not None and set(_FEATURE_PARAMS) <= set(spec.params)


def feature_estimators(table: pd.DataFrame) -> list[str]:
    """Estimators of ``table`` that the features figure compares: those whose spec has ``feature_map`` and
    ``coupling`` parameters, in catalogue order.

    Parameters
    ----------
    table : pandas.DataFrame
        With an ``estimator`` column.

    Returns
    -------
    list of str
        Registry names; empty when the table has none (or no ``estimator`` column).
    """
    if "estimator" not in table:
        return []
    present = {str(name) for name in table["estimator"].unique()}
    return [name for name in estimator_order() if name in present and _compares_features(estimator_spec(name))]


def _feature_variants(table: pd.DataFrame) -> pd.DataFrame:
    """Rows of :func:`feature_estimators` with their compared parameters as columns.

    Adds ``feature_map`` and ``coupling`` (from ``params``, the spec's defaults filled in), ``_default_map`` and
    ``_default_coupling`` (the spec's defaults), and ``_family``: ``""``, or ``"<family>: "`` when the table
    holds several such estimators, so that their variants keep apart in one panel.
    """
    names = feature_estimators(table)
    rows = table[table["estimator"].astype(str).isin(names)].copy()
    if rows.empty:
        known = [name for name in estimator_order() if _compares_features(estimator_spec(name))]
        raise ResultsError(
            "the feature-map comparison needs rows of an estimator with feature_map and coupling parameters "
            f"({', '.join(known) or 'none is registered'}); the table has none"
        )
    given = rows["params"].astype(str) if "params" in rows else pd.Series("", index=rows.index)
    configs = {key: (estimator_spec(key[0]), row_params(estimator_spec(key[0]), key[1]))  # once per configuration
               for key in set(zip(rows["estimator"].astype(str), given))}
    specs, params = zip(*(configs[key] for key in zip(rows["estimator"].astype(str), given)))
    rows["feature_map"] = [str(p.get("feature_map")) for p in params]
    rows["coupling"] = [str(p.get("coupling")) for p in params]
    rows["_default_map"] = [str(spec.params["feature_map"].default) for spec in specs]
    rows["_default_coupling"] = [str(spec.params["coupling"].default) for spec in specs]
    rows["_family"] = [f"{spec.family_name}: " if len(names) > 1 else "" for spec in specs]
    return rows


def _map_coupling(rows: pd.DataFrame) -> str | None:
    """The coupling at which the feature-map panel compares maps: orthogonal when two or more maps were measured
    with it (Performer Fig. 4), else the coupling with the most maps (an estimator's default first on a tie);
    None when no coupling was measured with two maps."""
    maps = rows.groupby("coupling")["feature_map"].nunique()
    if maps.get(_PREFERRED_COUPLING, 0) >= 2:
        return _PREFERRED_COUPLING
    defaults = set(rows["_default_coupling"])
    candidates = sorted((c for c in maps.index if maps[c] >= 2), key=lambda c: (-maps[c], c not in defaults, c))
    return candidates[0] if candidates else None


def _feature_panels(rows: pd.DataFrame) -> list[tuple[str, pd.DataFrame, str]]:
    """(title, rows, compared column) of each panel with at least two variants to compare.

    Couplings are compared on each estimator's default feature map (positive features for rfa); feature maps at
    the orthogonal coupling when two maps were measured with it, else at the coupling measured with the most
    maps (:func:`_map_coupling`).
    """
    panels: list[tuple[str, pd.DataFrame, str]] = []
    by_coupling = rows[rows["feature_map"] == rows["_default_map"]]
    if by_coupling["coupling"].nunique() >= 2:
        panels.append((f"coupling ({', '.join(sorted(by_coupling['feature_map'].unique()))} features)",
                       by_coupling, "coupling"))
    coupling = _map_coupling(rows)
    if coupling is not None:
        panels.append((f"feature map ({coupling} coupling)", rows[rows["coupling"] == coupling], "feature_map"))
    return panels


def _left_out(rows: pd.DataFrame, panels: list[tuple[str, pd.DataFrame, str]], table: pd.DataFrame
              ) -> tuple[list[str], str]:
    """The readable names of the measured variants that no panel shows, and why."""
    shown = set().union(*(set(subset["label"]) for _, subset, _ in panels)) if panels else set()
    missing = [label for label in label_order(rows["label"]) if label not in shown]
    if not missing:
        return [], ""
    names = display_names(table)
    compared = [f"couplings on {', '.join(sorted(set(subset['feature_map'])))} features" if column == "coupling"
                else f"feature maps at {', '.join(sorted(set(subset['coupling'])))} coupling"
                for _, subset, column in panels]
    why = f"the figure compares {' and '.join(compared)} only" if compared else "no two variants compare"
    return [names.get(label, label) for label in missing], why


def feature_variants_left_out(table: pd.DataFrame) -> tuple[list[str], str]:
    """The variants :func:`features_figure` measured but does not draw, and why (empty when it draws them all).

    Parameters
    ----------
    table : pandas.DataFrame
        A results table with ``estimator`` and ``params`` columns.

    Returns
    -------
    (list of str, str)
        Readable names of the variants left out, and the reason, e.g.
        ``(["Performer (trigonometric RFA, iid)"], "the figure compares couplings on positive features and
        feature maps at orthogonal coupling only")``.
    """
    try:
        rows = _feature_variants(table)
    except ResultsError:
        return [], ""
    return _left_out(rows, _feature_panels(rows), table)


def _not_shown_note(rows: pd.DataFrame, panels: list[tuple[str, pd.DataFrame, str]], table: pd.DataFrame) -> str:
    """Which measured variants no panel shows and why, so that the figure does not drop them silently."""
    missing, why = _left_out(rows, panels, table)
    return f"\nnot shown: {'; '.join(missing)} ({why})" if missing else ""


def features_figure(table: pd.DataFrame, *, metadata: dict | None = None, seed: int = 0) -> Figure:
    """Random-feature coupling and feature-map comparison (Performer Fig. 4): orthogonal vs iid, positive vs
    trigonometric.

    The rows compared are those of every estimator whose spec has ``feature_map`` and ``coupling`` parameters
    (:func:`feature_estimators`: rfa among the built-ins). Left column: couplings with the default feature map
    (positive). Right column: feature maps with the orthogonal coupling, or, when fewer than two maps were
    measured with it, with the coupling measured with the most maps (e.g. iid). One row per token count; MSE
    against S on log-log axes with a bootstrap band over images. Variants that neither column holds (e.g.
    trigonometric features with iid directions beside orthogonal ones) are named in the subtitle with the
    reason (:func:`feature_variants_left_out`).

    Parameters
    ----------
    table : pandas.DataFrame
        Results with ``estimator`` and ``params`` columns and at least two variants of such an estimator.
    metadata : dict, optional
    seed : int

    Returns
    -------
    matplotlib.figure.Figure
        ``2 x tokens`` axes (a column is left out when it would hold a single variant).
    """
    require_columns(table, [*PLOT_COLUMNS, "params"], "the feature-map comparison")
    rows = _feature_variants(table)
    panels = _feature_panels(rows)
    families = "/".join(feature_estimators(rows))
    if not panels:
        raise ResultsError(
            f"the feature-map comparison needs at least two {families} variants that differ in coupling or feature "
            f"map; the table has {families} with feature maps {', '.join(sorted(rows['feature_map'].unique()))} "
            f"and couplings {', '.join(sorted(rows['coupling'].unique()))}"
        )
    tokens = _token_values(rows)
    variants = sorted({v for _, subset, column in panels for v in (subset["_family"] + subset[column]).unique()})
    styles = label_styles(variants)
    fig, axes = _new_figure(len(tokens) * len(panels), ncols=len(panels))
    handles: dict[str, Line2D] = {}
    for row_index, n in enumerate(tokens):
        for col_index, (title, subset, column) in enumerate(panels):
            ax = axes[row_index * len(panels) + col_index]
            panel = subset[subset["tokens"] == n].assign(label=lambda d: d["_family"] + d[column])
            if panel.empty:
                continue
            aggregated = aggregate_over_images(panel, ["mse"], seed=seed)
            all_s = sorted(aggregated["num_samples"].unique())
            for variant in sorted(aggregated["label"].unique()):
                line_rows = aggregated[aggregated["label"] == variant].sort_values("num_samples")
                s = line_rows["num_samples"].to_numpy(dtype=float)
                y = line_rows["mse"].to_numpy(dtype=float)
                style = styles[variant]
                (line,) = ax.plot(s, np.where(y > 0, y, np.nan), color=style["color"], marker=style["marker"],
                                  markersize=4, linewidth=1.6, label=variant)
                low = np.maximum(line_rows["mse_ci_low"].to_numpy(dtype=float), y / 1e3)
                high = line_rows["mse_ci_high"].to_numpy(dtype=float)
                if np.isfinite(low).all() and np.isfinite(high).all() and (y > 0).all():
                    _interval(ax, s, y, low, high, style["color"], 0.18)
                handles.setdefault(variant, line)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(all_s, [str(int(v)) for v in all_s])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_title(f"{title}, N = {n} tokens", fontsize=10)
            ax.set_xlabel(_SAMPLES_LABEL)
            ax.set_ylabel(f"MSE ({MSE_UNITS})")
            ax.grid(True, which="both", alpha=0.3)
    noun = item_noun(metadata)
    _titles(
        fig,
        f"Random-feature attention ({families}): coupling and feature map",
        f"{describe_data(rows, metadata)}\nmean over layers and heads per {noun}, then over {noun}s; "
        f"{_band_text(aggregate_over_images(rows, ['mse'], n_boot=2, seed=seed), 0.95, noun)}"
        f"{_not_shown_note(rows, panels, table)}{_shared_variant_note(panels)}",
    )
    _legend(fig, [handles[v] for v in sorted(handles)], len(handles))
    return fig


def _shared_variant_note(panels) -> str:
    """``"; the same rows: iid (couplings) = positive (feature maps)"``: a configuration that both columns hold, which
    each names by what it varies (plain rfa is "iid" among couplings and "positive" among feature maps), drawn in
    two colours."""
    if len(panels) < 2:
        return ""
    (_, left, left_column), (_, right, right_column) = panels[:2]
    shared = sorted(set(left["label"]) & set(right["label"]))
    pairs = []
    for label in shared:
        a = left.loc[left["label"] == label].iloc[0]
        b = right.loc[right["label"] == label].iloc[0]
        pairs.append(f"{a['_family']}{a[left_column]} (left) = {b['_family']}{b[right_column]} (right)")
    return f"; the same rows, in two colours: {', '.join(pairs)}" if pairs else ""


_POSITION_LABEL = "query position p = n + M − N + 1 (log scale)"


def _mask_words(kind: str) -> str:
    """A panel's mask, as its title says it: ``"no mask"``, ``"causal mask"``, ``"sliding:8 mask"``."""
    return "no mask" if kind == "none" else f"{kind} mask"


def _drop_single_visible_key(positions: pd.DataFrame) -> tuple[pd.DataFrame, bool]:
    """``positions`` without the buckets in which each query sees a single key under a mask, for normalized estimators.

    Under a causal or sliding mask the query at position 1 sees key 0 only, and an estimator whose spec says it
    is normalized (its weights sum to one) returns that key's value: its error there is round-off, which would
    set the log axis. Returns the remaining rows and whether any were dropped.
    """
    if "mask" not in positions:
        return positions, False
    masked = positions["mask"].astype(str) != "none"
    configs = positions[["estimator"]].astype(str).drop_duplicates()["estimator"]
    normalized = {name: bool(getattr(estimator_spec(name), "normalized", False)) for name in configs}
    single = masked & (positions["position_hi"] == 1) & positions["estimator"].astype(str).map(normalized)
    return positions[~single], bool(single.any())


def position_figure(
    positions: pd.DataFrame,
    *,
    metadata: dict | None = None,
    labels: Sequence[str] | None = None,
    num_samples: int | None = None,
    confidence: float = 0.95,
    seed: int = 0,
) -> Figure:
    """MSE against the query's position on log-log axes, one line per estimator, one panel per S (and token count).

    Under a causal mask query n sees the :math:`p = n + M - N + 1` keys up to itself, so its error depends on
    where it stands: this figure draws the per-position table of a masked run
    (:mod:`randattn.analysis.positions`). Each point is a position bucket (``1``, ``2-3``, ``4-7``, ...) at its
    geometric centre, aggregated like :func:`mse_vs_samples_figure` (mean over heads and layers per image, then
    over images) with a shaded bootstrap band.

    Parameters
    ----------
    positions : pandas.DataFrame
        A per-position table with at least :data:`~randattn.reports.tables.POSITION_PLOT_COLUMNS`, ``bias_sq``
        and ``variance``.
    metadata : dict, optional
        Table metadata, for the subtitle.
    labels : sequence of str, optional
        Labels to draw (default: all with a non-zero MSE).
    num_samples : int, optional
        Draw this S only (default: one panel per S).
    confidence : float
        Level of the band.
    seed : int
        Seed of the bootstrap.

    Returns
    -------
    matplotlib.figure.Figure
        One axes per (token count, S), and per mask where the rows hold several (as
        :func:`mse_vs_samples_figure`); one line (plus a band) per label in each.
    """
    require_columns(positions, [*POSITION_PLOT_COLUMNS, "bias_sq", "variance"], "the error-by-position figure")
    positions = _select_labels(positions, labels)
    if num_samples is not None:
        available = sorted(int(s) for s in positions["num_samples"].unique())
        if int(num_samples) not in available:
            raise ResultsError(f"the error-by-position figure has no rows at S = {num_samples}; available: "
                               f"{', '.join(map(str, available))}")
        positions = positions[positions["num_samples"] == int(num_samples)]
    positions, single_key = _drop_single_visible_key(positions)
    if positions.empty:
        raise ResultsError("the error-by-position figure has nothing to draw: every row is a query that sees a single "
                           "key, where a normalized estimator is exact")
    aggregated = aggregate_positions(positions, confidence=confidence, seed=seed)
    measured = measured_per_bucket(positions)
    names = display_names(positions)
    every = aggregated
    aggregated, exact = _drop_exact(aggregated, "mse", names, exact_labels(positions))
    if aggregated.empty:
        raise _nothing_to_draw("the error-by-position figure", every, "mse", exact_labels(positions), exact)
    # layers under different masks (causal and sliding-window layers of one model): a panel per mask, named
    kinds = sorted(set(aggregated["mask"].astype(str))) if "mask" in aggregated else []
    several_masks = len(kinds) > 1
    panels = [(int(n), int(s), kind) for n in _token_values(aggregated)
              for s in sorted(aggregated.loc[aggregated["tokens"] == n, "num_samples"].unique())
              for kind in (kinds if several_masks else [None])]
    several_tokens = len({n for n, _, _ in panels}) > 1
    styles = label_styles(aggregated["label"])
    fig, axes = _new_figure(len(panels), ncols=min(len(panels), 3), sharey=True)
    handles: dict[str, Line2D] = {}
    zeros = False
    for ax, (n, s, kind) in zip(axes, panels):
        panel = aggregated[(aggregated["tokens"] == n) & (aggregated["num_samples"] == s)]
        if kind is not None:
            panel = panel[panel["mask"].astype(str) == kind]
        ticks: dict[float, str] = {}
        for label in label_order(panel["label"]):
            rows = panel[panel["label"] == label].sort_values("position_lo")
            lo, hi = rows["position_lo"].to_numpy(dtype=float), rows["position_hi"].to_numpy(dtype=float)
            x = np.sqrt(lo * hi)  # the bucket's geometric centre: evenly spaced log2 buckets stay evenly spaced
            y = rows["mse"].to_numpy(dtype=float)
            zeros |= bool((y <= 0).any())
            shown = np.where(y > 0, y, np.nan)  # a query that sees one key is exact for a normalized estimator
            low = np.maximum(rows["mse_ci_low"].to_numpy(dtype=float), shown / 1e3)
            high = rows["mse_ci_high"].to_numpy(dtype=float)
            style = styles[label]
            (line,) = ax.plot(x, shown, color=style["color"], marker=style["marker"], markersize=4, linewidth=1.6,
                              label=names[label])
            band = np.isfinite(low) & np.isfinite(high) & np.isfinite(shown)
            if band.any():
                ax.fill_between(x, np.where(band, low, np.nan), np.where(band, high, np.nan), color=style["color"],
                                alpha=0.18, linewidth=0)
            handles.setdefault(label, line)
            ticks.update({float(c): bucket_text(a, b, measured.get((int(a), int(b)))) for c, a, b in zip(x, lo, hi)})
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        centres = sorted(ticks)
        # a short last bucket (512 after 256-511) stands near its neighbour on the log axis: labels upright then
        crowded = len(centres) > 1 and bool((np.diff(np.log2(centres)) < 0.6).any())
        ax.set_xticks(centres, [ticks[c] for c in centres], rotation=90 if crowded else 45 if len(centres) > 6 else 0)
        ax.xaxis.set_minor_locator(NullLocator())
        title = f"S = {s}" + (f", N = {n} tokens" if several_tokens else "")
        ax.set_title(title + (f", {_mask_words(kind)}" if kind else ""), fontsize=10)
        ax.set_xlabel(_POSITION_LABEL)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel(f"MSE ({MSE_UNITS})")
    masks = table_masks(positions)
    under = " and ".join(f"the {kind} mask" for kind in masks) if masks else "no mask"
    notes = "; MSE 0 is not drawn on the log axis" if zeros else ""
    if single_key:
        notes += "; position 1 (a single visible key, which a normalized estimator returns exactly) is not drawn"
    noun = item_noun(metadata)
    _titles(
        fig,
        f"MSE by query position, under {under}",
        f"{describe_data(positions, metadata)}\nposition buckets {buckets_text(positions)}: mean over layers and "
        f"heads per {noun}, then over {noun}s; {_band_text(aggregated, confidence, noun)}{notes}{_exact_note(exact)}",
    )
    ordered = [handles[label] for label in label_order(handles)]
    _legend(fig, ordered, len(ordered))
    return fig


#: ``--kind`` name -> figure function of a results table
FIGURE_KINDS: dict[str, Callable[..., Figure]] = {
    "mse-vs-samples": mse_vs_samples_figure,
    "error-vs-budget": error_vs_budget_figure,
    "bias-variance": bias_variance_figure,
    "heatmap": heatmap_figure,
    "features": features_figure,
}
#: ``--kind`` name -> figure function of a per-position table (:attr:`~randattn.results.Results.positions`)
POSITION_FIGURE_KINDS: dict[str, Callable[..., Figure]] = {
    "position": position_figure,
}


def make_figure(kind: str, table: pd.DataFrame, **options: Any) -> Figure:
    """Build the figure ``kind`` (a key of :data:`FIGURE_KINDS` or :data:`POSITION_FIGURE_KINDS`) from ``table``.

    Parameters
    ----------
    kind : str
        ``"mse-vs-samples"``, ``"bias-variance"``, ``"heatmap"``, ``"features"`` or ``"position"``.
    table : pandas.DataFrame
        A results table; for ``"position"``, a per-position table (:attr:`~randattn.results.Results.positions`).
    **options
        Passed to the figure function (``metadata``, ``labels``, ``label``, ``num_samples``, ...).

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    ValueError
        ``kind`` is not a known figure (the message lists the known ones).
    """
    kinds = {**FIGURE_KINDS, **POSITION_FIGURE_KINDS}
    if kind not in kinds:
        raise ValueError(f"unknown figure kind {kind!r}; choose one of {', '.join(kinds)}")
    return kinds[kind](table, **options)
