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
from randattn.analysis.diagnostics import KHAT_MIN_WEIGHTS, KHAT_THRESHOLD
from randattn.reports.figures import (
    MSE_UNITS,
    bias_variance_figure,
    error_vs_budget_figure,
    feature_estimators,
    features_figure,
    has_budget,
    heatmap_figure,
    mse_vs_samples_figure,
    position_figure,
    samples_text,
)
from randattn.estimators.registry import takes_no_samples
from randattn.reports.tables import (
    MAX_BROKEN_HEADS_SHOWN,
    PLOT_COLUMNS,
    ResultsError,
    approximate_labels,
    describe_data,
    buckets_text,
    aggregate_over_images,
    display_names,
    estimator_spec,
    few_units_note,
    item_noun,
    label_order,
    mse_pivot,
    once_without_s,
    position_pivot,
    require_columns,
    row_params,
    summary_table,
    table_masks,
)

__all__ = [
    "KHAT_THRESHOLD",
    "DELTA_RATIO_BAND",
    "ReportFigure",
    "environment_info",
    "figure_data_uri",
    "diagnostics_summary",
    "diagnostics_overview",
    "warnings_summary",
    "reference_check_html",
    "mask_note",
    "positions_section",
    "lm_section",
    "is_lm_metadata",
    "sink_by_layer",
    "WARNING_EXPLANATIONS",
    "default_figures",
    "build_report",
    "write_report",
]

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
th[title], td[title], table.diagnostics td { text-align: left; }
.spec { font-family: ui-monospace, monospace; color: #555; font-size: 0.9em; }
td.flag { background: #fff4e5 !important; } td.na { color: #666; font-style: italic; }
"""

#: warning category -> what it means for the results (shown in the report's warnings section)
WARNING_EXPLANATIONS: dict[str, str] = {
    "NonPositiveDenominatorWarning": (
        "The estimate's self-normalizer was zero or negative for some queries, so their outputs are not "
        "meaningful (sign kept exactly, no epsilon added). LARA's decoupled weights (eq. 38, the paper's default) "
        "can be negative, and trigonometric random features are signed; on ViT keys this makes the error "
        "heavy-tailed and can make it rise with S. That is why LARA as written (lara: eq. 38, beta = 1, signs "
        "kept) and LARA as run (lara:preset=official-code: the authors' code clips alpha at 1e-8, so every weight "
        "is positive, and draws its noise unscaled) differ: the clipped estimator is a different, biased but "
        "stable one. weighting=balance (eq. 36) also converges; docs/guide/reading-results.md shows both on DINOv2."
    ),
    "RuntimeWarning": (
        "A numerical or statistical caveat raised while computing the results (e.g. too few replicates for a "
        "variance or a jackknife standard error); the affected values are NaN, not guessed."
    ),
    "UserWarning": "A caveat raised while computing the results; read the message.",
    "DiagnosticsSkippedWarning": (
        "The importance-sampling diagnostics (ESS, delta-method variance, Pareto k-hat) of this estimator were not "
        "computed under the run's attention mask: its importance-weight provider takes no mask, and weights that "
        "pool later keys would describe the bidirectional estimator, not the one measured. Those columns are NaN; "
        "the errors themselves are measured under the mask."
    ),
}

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
            # a count only where the diagnostic exists: 0 would read "none flagged" where none was computed
            f"k-hat > {khat_threshold:g}": bad_khat if group["_khat"].notna().any() else np.nan,
            "max k-hat": float(group["_khat"].max()),
            f"ratio outside [{low:g}, {high:g}]": bad_ratio if group["_ratio"].notna().any() else np.nan,
            "median ratio": float(group["_ratio"].median()),
        })
    result = pd.DataFrame(rows)
    if result.empty:
        return result
    order = {label: i for i, label in enumerate(label_order(result["estimator"]))}
    return (result.assign(_o=result["estimator"].map(order)).sort_values(["tokens", "_o", "S"])
            .drop(columns="_o").reset_index(drop=True))


def warnings_summary(metadata: Mapping[str, Any] | None) -> pd.DataFrame:
    """The warnings recorded in the table's metadata, one row per distinct (category, estimator, message).

    Parameters
    ----------
    metadata : dict or None
        Table metadata; its ``"warnings"`` entry is a list of
        ``{"category": str, "message": str, "count": int, "units": int, "label": str}`` (label optional;
        ``units``, the number of units that raised it, absent from tables written before it was recorded).

    Returns
    -------
    pandas.DataFrame
        Columns ``category, label, message, count, units, meaning`` (``meaning`` from
        :data:`WARNING_EXPLANATIONS`); counts of repeated entries are summed, and their units where every
        entry has them (else ``units`` is None). Empty when none were recorded.
    """
    records = (metadata or {}).get("warnings") or []
    if isinstance(records, Mapping):
        records = [records]
    rows: dict[tuple[str, str, str], list] = {}
    for record in records if isinstance(records, (list, tuple)) else []:
        if not isinstance(record, Mapping):
            continue
        key = (str(record.get("category") or "Warning"), str(record.get("label") or ""),
               str(record.get("message") or ""))
        try:
            count = int(record.get("count", 1))
        except (TypeError, ValueError):
            count = 1
        try:
            units = int(record["units"])
        except (KeyError, TypeError, ValueError):
            units = None
        total = rows.setdefault(key, [0, 0])
        total[0] += count
        total[1] = None if units is None or total[1] is None else total[1] + units
    frame = pd.DataFrame(
        [{"category": c, "label": lab, "message": m, "count": n, "units": units,
          "meaning": WARNING_EXPLANATIONS.get(c, "No explanation recorded for this category; read the message.")}
         for (c, lab, m), (n, units) in rows.items()],
        columns=["category", "label", "message", "count", "units", "meaning"],
    )
    return frame.sort_values(["category", "label", "message"], kind="stable").reset_index(drop=True)


def _not_computed_reason(rows: pd.DataFrame, column: str, metadata: Mapping[str, Any]) -> str:
    """Why ``column`` (``pareto_khat``, ``delta_var_ratio`` or ``ess_mean``) is NaN in every one of ``rows``.

    ``rows`` are the cells of one label; what the estimator is (its importance weights, signed or not, how many
    per sample) is asked of its spec, so a plugin's rows are explained like a built-in's.
    """
    from randattn.estimators.names import display_name

    # the sweep (and demo) configurations record whether diagnostics were asked for
    places = [metadata, metadata.get("config"), metadata.get("demo"), *(metadata.get("sweeps") or [])]
    if any(isinstance(place, Mapping) and place.get("diagnostics") is False for place in places):
        return "diagnostics were turned off for this run"
    if column not in rows:
        return "the table has no such column"
    if "random" in rows and not rows["random"].astype(bool).any():
        return "deterministic estimator (no draws, no importance weights)"
    name = str(rows["estimator"].iloc[0]) if "estimator" in rows else str(rows["label"].iloc[0]).split(":")[0]
    spec = estimator_spec(name)
    if spec is None:
        return f"estimator {name} is not installed here; its diagnostics cannot be explained"
    params = row_params(spec, rows["params"].iloc[0] if "params" in rows else None)
    shown = display_name(name, params)
    if not spec.diagnostics_apply(params) and spec.has_signed_weights(params):
        return f"signed weights ({shown} has no importance weights)"
    if spec.importance_weights is None:
        return f"not defined for {name} (no self-normalized importance weights to diagnose)"
    if not spec.diagnostics_apply(params):
        return f"not defined for {shown} (no self-normalized importance weights to diagnose)"
    masks = sorted(set(rows["mask"].astype(str)) - {"none", "nan"}) if "mask" in rows else []
    if masks:
        from randattn.analysis.masking import diagnostics_skip_reason, parse_mask_kind

        config = metadata.get("config") if isinstance(metadata.get("config"), Mapping) else {}
        backend = str(config.get("backend") or "torch")
        for kind in masks:
            try:
                skipped = diagnostics_skip_reason(spec, params, parse_mask_kind(kind), backend)
            except ValueError:
                skipped = None
            if skipped is not None:
                return (f"mask={kind!r}, and the importance-weight provider of {name} takes no mask (bidirectional "
                        "weights would describe another estimator)")
    if spec.has_signed_weights(params):
        # the diagnostics exist where a draw's weights happen to be all positive; in these cells none was
        return f"signed weights (the weights of {shown} can be negative)"
    if column == "pareto_khat":
        s = int(rows["num_samples"].max())
        if s * spec.weights_per_sample(params) < KHAT_MIN_WEIGHTS:
            return (f"S = {s} is below the minimum tail size (k-hat needs at least {KHAT_MIN_WEIGHTS} weights per "
                    "query for a Pareto tail of 5)")
    return "not available for these cells (e.g. some weights not positive)"


def diagnostics_overview(table: pd.DataFrame, metadata: Mapping[str, Any] | None = None, *,
                         khat_threshold: float = KHAT_THRESHOLD,
                         ratio_band: tuple[float, float] = DELTA_RATIO_BAND) -> pd.DataFrame:
    """Every estimator and S with its diagnostics, or why they were not computed.

    Parameters
    ----------
    table : pandas.DataFrame
    metadata : dict, optional
    khat_threshold : float
    ratio_band : (float, float)

    Returns
    -------
    pandas.DataFrame
        One row per ``(label, S)`` (over all token counts) in display order: ``label``, ``estimator``
        (readable name), ``S``, ``cells``, ``k-hat``, ``variance ratio``, ``ESS`` (text: a count of flagged
        cells out of the diagnosed ones, or ``"not computed: <why>"``), and ``flagged`` (bool).
    """
    metadata = dict(metadata or {})
    low, high = ratio_band
    names = display_names(table)
    rows = []
    for label in label_order(table["label"]):
        for s, group in table[table["label"] == label].groupby("num_samples", sort=True):
            texts, flagged = {}, False
            for column, title in (("pareto_khat", "k-hat"), ("delta_var_ratio", "variance ratio"),
                                  ("ess_mean", "ESS")):
                values = group[column].astype(float) if column in group else pd.Series(dtype=float)
                finite = values[np.isfinite(values)]
                if finite.empty:
                    texts[title] = f"{title} not computed: {_not_computed_reason(group, column, metadata)}"
                    continue
                missing = len(group) - len(finite)
                tail = f"; {missing} cells not computed" if missing else ""
                if column == "pareto_khat":
                    bad = int((finite > khat_threshold).sum())
                    flagged |= bad > 0
                    texts[title] = (f"{bad} of {len(finite)} cells > {khat_threshold:g} "
                                    f"(max {finite.max():.2f}){tail}")
                elif column == "delta_var_ratio":
                    bad = int(((finite < low) | (finite > high)).sum())
                    flagged |= bad > 0
                    texts[title] = (f"{bad} of {len(finite)} cells outside [{low:g}, {high:g}] "
                                    f"(median {finite.median():.2f}){tail}")
                else:
                    texts[title] = f"median {finite.median():.3g} of S = {int(s)}{tail}"
            rows.append({"label": label, "estimator": names.get(label, label), "S": int(s), "cells": len(group),
                         **texts, "flagged": flagged})
    return pd.DataFrame(rows, columns=["label", "estimator", "S", "cells", "k-hat", "variance ratio", "ESS",
                                       "flagged"])


def mask_note(table: pd.DataFrame, has_positions: bool = False) -> str | None:
    """One sentence on the mask the table's rows were measured under; None for a bidirectional table.

    Parameters
    ----------
    table : pandas.DataFrame
        With ``mask`` and ``layer`` columns (a table without ``mask`` predates masks: bidirectional).
    has_positions : bool
        Whether the report shows the error by position (the note then points to it).

    Returns
    -------
    str or None
    """
    masks = table_masks(table)
    if not masks:
        return None
    layers = sorted({int(x) for x in table["layer"].dropna()})
    described = []
    for kind, mask_layers in masks.items():
        plural = "s" if len(mask_layers) > 1 else ""
        where = "every layer" if mask_layers == layers else f"layer{plural} {', '.join(map(str, mask_layers))}"
        rule = ("query n sees keys m ≤ n + (M − N) only" if kind == "causal"
                else f"query n sees its last {kind.split(':', 1)[1]} keys only")
        described.append(f"the {kind} mask on {where} ({rule})")
    others = [layer for layer in layers if not any(layer in v for v in masks.values())]
    tail = f"; layer{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} without a mask" if others else ""
    return (f"These results were measured under {' and '.join(described)}{tail}. The exact softmax they are "
            "compared with applies the same mask (hidden probabilities are 0 in both), and every MSE averages over "
            "all queries, of which the early ones see few keys"
            + ("; the section on error by position separates them." if has_positions else "."))


def positions_section(positions: pd.DataFrame, metadata: Mapping[str, Any] | None = None, *,
                      dpi: int = 110) -> list[str]:
    """HTML of the report's error-by-position section: an explanation, the figure at the largest S, a short table.

    Parameters
    ----------
    positions : pandas.DataFrame
        A per-position table (:attr:`~randattn.results.Results.positions`).
    metadata : dict, optional
    dpi : int

    Returns
    -------
    list of str
        HTML fragments, starting with the ``<h2 id="positions">`` heading.
    """
    esc = html.escape
    metadata = dict(metadata or {})
    masks = table_masks(positions)
    kinds = " and ".join(sorted({"sliding-window" if kind.startswith("sliding") else kind for kind in masks}))
    title = f"{kinds.capitalize()} attention: error by position" if kinds else "Error by query position"
    s = int(positions["num_samples"].max())
    names = display_names(positions)
    noun = item_noun(metadata)
    out = [f'<h2 id="positions">{esc(title)}</h2>',
           "<p>Under a causal mask query n sees the p = n + M − N + 1 keys up to itself (under a sliding window "
           "of W keys, the last min(p, W) of them), so its estimate averages "
           "fewer values the earlier it stands, and one MSE over all queries hides where the error lies. Here "
           f"each query's errors are grouped by its position p in buckets {esc(buckets_text(positions, '–'))} "
           "and aggregated like the "
           f"rest of the report (per layer, head and {noun}; mean over heads and layers per {noun}, then over "
           f"{noun}s), at S = {s}.</p>"]
    try:
        figure = position_figure(positions, metadata=metadata, num_samples=s)
    except ResultsError as exc:
        out.append(f'<p class="ok">No figure: {esc(str(exc))}</p>')
    else:
        out += [f'<figure id="fig-position"><h3>MSE by query position, S = {s}</h3>',
                f'<img alt="MSE by query position" src="{figure_data_uri(figure, dpi=dpi)}">',
                "<figcaption>Mean squared error per output element against the exact masked softmax, by the query's "
                f"position (log-log axes; bands: bootstrap over {noun}s, or heads for a single {noun}).</figcaption>"
                "</figure>"]
    pivot = position_pivot(positions, num_samples=s).rename(columns=str).map(_format_number)
    pivot.index = [names.get(key, key) if isinstance(key, str) else f"{names.get(key[0], key[0])}, {key[1]}"
                   for key in pivot.index]  # (label, mask) where the layers were measured under several masks
    pivot.index.name = "estimator"
    out += [f"<h3>Mean MSE by position bucket, S = {s}</h3>", _label_tooltips(_table_html(pivot, index=True), names)]
    return out


def is_lm_metadata(metadata: Mapping[str, Any] | None) -> bool:
    """Whether a table's metadata says its activations are a decoder language-model capture.

    ``randattn mse`` copies the activation file's ``architecture`` and ``layout`` into ``metadata["activations"]``;
    either (an architecture, or the ``"sequence"`` layout) marks an LM capture.
    """
    acts = (metadata or {}).get("activations") or {}
    return isinstance(acts, Mapping) and (bool(acts.get("architecture")) or acts.get("layout") == "sequence"
                                          or bool(acts.get("token_strings")))


def sink_by_layer(table: pd.DataFrame) -> pd.DataFrame | None:
    """Mean, min and max over heads (and sequences) of the ``sink_mass`` column, one row per layer; None without it.

    Every estimator row of a cell repeats the cell's exact sink mass, so one row per (image, layer, head) is kept.
    """
    if "sink_mass" not in table.columns or not np.isfinite(table["sink_mass"].astype(float)).any():
        return None
    cells = table.drop_duplicates(["image", "layer", "head"])
    grouped = cells.groupby("layer")["sink_mass"]
    return pd.DataFrame({"layer": grouped.mean().index.astype(int), "mean over heads": grouped.mean().to_numpy(),
                         "min": grouped.min().to_numpy(), "max": grouped.max().to_numpy()})


#: the relative-error and promise columns :func:`promise_section` reads (``randattn mse`` writes them)
_RELATIVE_COLUMNS = ("rel_err_mean", "rel_err_median", "rel_err_p95")


def _counts_other_than_output(table: pd.DataFrame) -> bool:
    """Whether some row's violation columns count another quantity than the output (a promise on the denominator)."""
    if "violation_of" not in table.columns:
        return False
    quantity = table["violation_of"]
    return bool((quantity.notna() & quantity.ne("output")).any())  # NaN: a table from before the column


def _heads_broken(flags: pd.DataFrame) -> str:
    """``"2 of 54 (<= 1.4 expected by chance; family-wise: 0)"``: the heads flagged (``promise_broken``), the most
    flagged on average where all keep it, and those flagged family-wise (``familywise``; left out where a table lacks
    the counts); empty for a configuration without a promise (its ``delta`` NaN: the table writes its
    ``promise_broken`` False)."""
    from randattn.analysis.relative_error import flags_by_chance

    if flags["promise_broken"].isna().all() or flags["delta"].isna().all():  # no promise: nothing to count
        return ""
    broken = int(flags["promise_broken"].eq(True).sum())  # NaN (no promise checked) is not a flag
    if not broken:
        return f"0 of {len(flags)}"
    familywise = flags["familywise"]
    familywise = f"; family-wise: {int(familywise.eq(True).sum())}" if familywise.notna().all() else ""
    return f"{broken} of {len(flags)} (<= {flags_by_chance(len(flags)):.2g} expected by chance{familywise})"


def promise_summary(table: pd.DataFrame) -> pd.DataFrame | None:
    """Per ``(label, num_samples)`` (and ``mask`` where the layers were measured under several; a configuration
    without S once, its S "–"): the keys each query reads where estimators report them (``keys used``, the mean the
    error-vs-budget figure draws, and ``keys fraction``), the relative output error ``||y_hat_n - y_n|| / ||y_n||``
    over heads (mean of the heads' means and medians, the largest 95th percentile) and, where measured, the
    violation rate ``P(error >
    epsilon)`` (mean over heads; with ``violation of`` where some promise bounds another quantity than the output)
    and how many heads break a promise; None when the table has no such columns."""
    if not set(_RELATIVE_COLUMNS) <= set(table.columns) or table["rel_err_mean"].isna().all():
        return None
    masks = "mask" in table and table["mask"].astype(str).nunique() > 1  # a window layer beside a causal one
    if "promise_broken" in table.columns:
        from randattn.analysis.relative_error import familywise_broken

        table = table.assign(familywise=familywise_broken(table))
    groups = table.groupby(["label", "num_samples", *(["mask"] if masks else [])], sort=False)
    summary = pd.DataFrame({
        "mean rel. error": groups["rel_err_mean"].mean(),
        "median rel. error": groups["rel_err_median"].mean(),
        "largest 95th pct": groups["rel_err_p95"].max(),
    })
    if "keys_used" in table.columns and table["keys_used"].notna().any():
        # the error-vs-budget figure's x: the keys each query reads, mean over heads, layers and items
        summary.insert(0, "keys used", groups["keys_used"].mean())
        if "keys_fraction" in table.columns:
            summary.insert(1, "keys fraction", groups["keys_fraction"].mean())
    if "violation_rate" in table.columns:
        summary["epsilon"] = groups["epsilon"].first()
        summary["violation rate"] = groups["violation_rate"].mean()
        if _counts_other_than_output(table):
            summary["violation of"] = groups["violation_of"].first()
    if "promise_broken" in table.columns:
        summary["delta"] = groups["delta"].first()
        summary["heads broken"] = groups[["promise_broken", "familywise", "delta"]].apply(_heads_broken)
    shown = once_without_s(summary.reset_index())  # a configuration without S once, its S "–"
    shown["num_samples"] = ["–" if free else s for free, s in zip(shown["s_free"], shown["num_samples"])]
    return shown.drop(columns="s_free")


def promise_section(table: pd.DataFrame) -> list[str]:
    """HTML of the relative-error section: the summary of :func:`promise_summary` and, first, every head where an
    estimator's promise ``P(error > epsilon) <= delta`` is broken (the Clopper-Pearson interval of its violation
    rate lies wholly above delta); empty when the table has no relative-error columns."""
    summary = promise_summary(table)
    if summary is None:
        return []
    esc = html.escape
    names = display_names(table)
    out = ['<h2 id="promise">Relative error and promises</h2>',
           "<p>Per query and replicate, the relative output error ||y&#770;<sub>n</sub> &minus; y<sub>n</sub>|| / "
           "||y<sub>n</sub>||; per head its mean, median and 95th percentile over the measured queries and "
           "replicates. With an error bound epsilon (<code>--epsilon</code>, or an estimator's own promise, as "
           "vAttention's (epsilon, delta)) the violation rate is the fraction of (query, replicate) pairs above it, "
           "with a 95% Clopper-Pearson interval. A promise is checked on the quantity it bounds: the output, or "
           "the softmax denominator Z<sub>n</sub>, as |Z&#770;<sub>n</sub> &minus; Z<sub>n</sub>| / Z<sub>n</sub> "
           "(vAttention's, whose budget rule sizes its sample for the denominator; the column <em>violation of</em> "
           "names it); the relative errors are always the output's.</p>"]
    if "promise_broken" in table.columns:
        from randattn.analysis.relative_error import broken_promises

        broken = pd.DataFrame.from_records(broken_promises(table))  # one record a measurement, at every S once
        if not broken.empty:
            shown = broken.sort_values("violation_lo", ascending=False).head(MAX_BROKEN_HEADS_SHOWN)
            rows = pd.DataFrame({
                "estimator": [names.get(label, label) for label in shown["label"]],
                "S": ["–" if s is None or s != s else str(int(s)) for s in shown["num_samples"]],
                "layer": shown["layer"].astype(int),
                "head": shown["head"].astype(int), "item": shown["image"],
                "epsilon": shown["epsilon"].map(_format_number), "delta": shown["delta"].map(_format_number),
                "violation rate": shown["violation_rate"].map(_format_number),
                **({"violation of": [q if isinstance(q, str) else "output" for q in shown["violation_of"]]}
                   if _counts_other_than_output(table) else {}),
                "95% interval": [f"[{_format_number(lo)}, {_format_number(hi)}]"
                                 for lo, hi in zip(shown["violation_lo"], shown["violation_hi"])],
                **({"family-wise": ["yes" if flag else "no" for flag in shown["familywise"]]}
                   if shown["familywise"].notna().all() else {}),
            })
            more = len(broken) - len(shown)
            out += [f'<p class="warning"><strong>Broken promise</strong> in {len(broken)} head(s): the violation '
                    "rate's whole interval lies above the promised delta"
                    + (f" ({more} more not listed)" if more else "") + "."
                    + (" Each head is checked alone, so some heads are flagged by chance; <em>family-wise</em> says "
                       "whether Holm's procedure over all the configuration's heads flags it too (a false flag "
                       "among them at most 2.5 % of the time)." if "family-wise" in rows else "") + "</p>",
                    _table_html(rows)]
        elif "delta" in table.columns and table["delta"].notna().any():
            out.append("<p>No head breaks a promise: every promised estimator's violation interval reaches down to "
                       "its delta or below.</p>")
        else:
            out.append("<p>No estimator of this table makes a promise (an (epsilon, delta) of its own, as "
                       "vAttention's): the rates above are against <code>--epsilon</code> alone.</p>")
    shown = summary.assign(label=[names.get(label, label) for label in summary["label"]])
    shown = shown.rename(columns={"label": "estimator", "num_samples": "S"})
    for column in shown.columns:
        if column not in ("estimator", "S", "heads broken", "violation of"):
            shown[column] = shown[column].map(_format_number)
    out.append(_table_html(shown))
    return out


def lm_section(table: pd.DataFrame, metadata: Mapping[str, Any] | None = None) -> list[str]:
    """HTML of the report's language-model section (empty unless :func:`is_lm_metadata`).

    Names the model, its layers, query and key/value heads and the mask the table was measured under, and
    tabulates the attention sink: the mean exact attention probability on the first token, by layer.
    """
    if not is_lm_metadata(metadata):
        return []
    esc = html.escape
    acts = dict((metadata or {}).get("activations") or {})
    heads = acts.get("heads")
    kv = acts.get("kv_heads") or heads
    masks = sorted(set(table["mask"].astype(str))) if "mask" in table.columns else []
    layers = sorted(int(x) for x in table["layer"].unique())
    facts = {
        "model": acts.get("model"), "architecture": acts.get("architecture"), "weights": acts.get("weights"),
        "text": acts.get("text") or acts.get("source"),
        "sequences x tokens": f"{table['image'].nunique()} x {', '.join(map(str, sorted(table['tokens'].unique())))}",
        "layers measured": ", ".join(map(str, layers)) + (f" (of {len(acts['layers'])} captured)"
                                                          if isinstance(acts.get("layers"), list) else ""),
        "query heads / key-value heads": f"{heads} / {kv}" + (" (grouped-query attention)"
                                                               if heads and kv and kv != heads else ""),
        "mask": ", ".join(masks) or "none",
    }
    out = ['<h2 id="language-model">Language model</h2>',
           "<p>The activations are a decoder language model's q, k, v, measured under the mask it ran with. "
           "Grouped-query heads share their key/value head's keys and values.</p>",
           _table_html(pd.DataFrame({"item": list(facts), "value": [str(v) for v in facts.values()]}))]
    sink = sink_by_layer(table)
    if sink is not None:
        out += ["<h3>Attention sink: exact probability on the first token, by layer</h3>",
                "<p>The mean over queries of each head's exact attention probability on key 0; the first token "
                "draws much of a language model's attention, so the estimators' error there weighs heavily.</p>",
                _table_html(sink.assign(**{c: sink[c].map(_format_number)
                                           for c in ("mean over heads", "min", "max")}))]
    return out


def default_figures(table: pd.DataFrame, metadata: Mapping[str, Any] | None = None) -> list[ReportFigure]:
    """Every figure the table supports: MSE vs S, bias²/variance, random features, one heatmap per estimator.

    Figures a table cannot support (no random-feature variants to compare, see
    :func:`~randattn.reports.figures.feature_estimators`; an estimator with MSE 0) are left out.

    Parameters
    ----------
    table : pandas.DataFrame
    metadata : dict, optional

    Returns
    -------
    list of ReportFigure
    """
    metadata = dict(metadata or {})
    noun = item_noun(metadata)
    figures = [ReportFigure(
        "mse-vs-samples", "MSE vs number of samples (LARA Fig. 1)",
        "Mean squared error between each estimator and exact softmax attention, per element of the output, "
        f"averaged over queries and value dimensions, then over layers and heads per {noun}, then over {noun}s. "
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
    if has_budget(table):
        figures.append(ReportFigure(
            "error-vs-budget", "MSE vs keys used per query (quality against budget)",
            "The same MSE against the keys each query reads, exact and sampled together (the sparse and sampling "
            "estimators' budget); estimators that report no keys used (random features) are placed at S, their "
            "features per query, and drawn dashed.",
            error_vs_budget_figure(table, metadata=metadata),
        ))
    compared = feature_estimators(table) if "params" in table else []
    if compared:
        try:
            figures.append(ReportFigure(
                "features", "Random-feature attention: coupling and feature map (Performer Fig. 4)",
                f"Orthogonal vs iid random features, and positive vs other feature maps, for {', '.join(compared)}.",
                features_figure(table, metadata=metadata),
            ))
        except ResultsError:
            pass  # a single variant: nothing to compare
    names = display_names(table)
    for label in approximate_labels(table):
        s = int(table.loc[table["label"] == label, "num_samples"].max())
        figures.append(ReportFigure(
            f"heatmap-{_safe_name(label)}",
            f"MSE per layer and head: {names.get(label, label)}{samples_text(label, s)}",
            f"Which layers and heads are hard for this estimator (mean over {noun}s; log colour scale).",
            heatmap_figure(table, label=label, num_samples=s, metadata=metadata),
        ))
    return figures


def _safe_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in label).strip("-")


def _summary_once_without_s(summary: pd.DataFrame) -> pd.DataFrame:
    """:func:`~randattn.reports.tables.summary_table` with a configuration that takes no S kept once per token count
    (and mask), its S "–": the same rule as the terminal's tables."""
    shown = once_without_s(summary.assign(label=summary["spec"]))  # its rows are keyed by the exact label, "spec"
    shown["S"] = shown["S"].astype(object).where(~shown["s_free"], "–")
    return shown.drop(columns=["label", "s_free"])


def _format_number(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        if not np.isfinite(value):
            return "–"
        return f"{value:.3g}"
    return str(value)


def _few_units_paragraph(table: pd.DataFrame, noun: str) -> list[str]:
    """A warning under the summary where its intervals rest on too few units (:func:`few_units_note`)."""
    note = few_units_note(aggregate_over_images(table, ["mse"], n_boot=2), noun=noun)
    return [f'<p class="warning">Intervals: {html.escape(note)}.</p>'] if note else []


def _table_html(frame: pd.DataFrame, *, index: bool = False) -> str:
    body = frame.to_html(index=index, border=0, na_rep="–", float_format=lambda v: _format_number(v),
                         classes="results", escape=True)
    return f'<div class="scroll">{body}</div>'


def build_report(
    table: pd.DataFrame,
    *,
    metadata: Mapping[str, Any] | None = None,
    positions: pd.DataFrame | None = None,
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
    positions : pandas.DataFrame, optional
        The run's per-position table (:attr:`~randattn.results.Results.positions`): adds the section
        on error by position (:func:`positions_section`).
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
    names = display_names(table)
    noun = item_noun(metadata)
    has_positions = positions is not None and not positions.empty
    esc = html.escape
    pivot = mse_pivot(table).rename(columns=str).map(_format_number)
    # a configuration without S (adaptive vAttention, local) is one measurement the table repeats at each S
    pivot.index = [names.get(label, label) + (" (no S: one measurement, at every S)" if takes_no_samples(label)
                                              else "") for label in pivot.index]
    pivot.index.name = "estimator"
    # the summary's rule (randattn.results.summary.aggregate): over items, or over heads where there is one item
    interval = (f"interval over {noun}s" if table["image"].nunique() > 1 else
                f"interval over heads, each the mean over layers: with a single {noun} it is the heads' spread, not "
                f"a spread between {noun}s")
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title>", f"<style>{_CSS}</style>", "</head>", "<body>",
        f"<h1>{esc(title)}</h1>", f'<p class="subtitle">{esc(describe_data(table, metadata))}</p>',
        f"<p>All errors are per output element, in {esc(MSE_UNITS)}, measured against exact float64 softmax "
        f"attention on the same q, k, v, and aggregated as in LARA app. H.1: per (layer, head, {noun}), then the "
        f"mean over heads and layers of each {noun}, then the mean over {noun}s with a percentile bootstrap "
        f"{interval}.</p>",
        '<nav><a href="#summary">summary</a> · <a href="#figures">figures</a> · '
        + ('<a href="#language-model">language model</a> · ' if is_lm_metadata(metadata) else "")
        + ('<a href="#positions">error by position</a> · ' if has_positions else "")
        + ('<a href="#promise">relative error</a> · ' if promise_summary(table) is not None else "")
        + '<a href="#warnings">warnings</a> · <a href="#diagnostics">diagnostics</a> · '
        '<a href="#provenance">provenance</a></nav>',
        '<h2 id="summary">Summary</h2>',
        "<p>Estimators are named as in their papers; hover a name for the exact spec (the <code>spec</code> "
        "column holds it too).</p>",
        "<h3>Mean MSE by estimator, token count and samples S</h3>",
        _label_tooltips(_table_html(pivot, index=True), names),
        "<h3>MSE with bootstrap interval, variance and debiased bias²</h3>",
        _label_tooltips(_table_html(_summary_once_without_s(summary_table(table, noun=noun))), names),
        *_few_units_paragraph(table, noun),
        '<h2 id="figures">Figures</h2>',
    ]
    for item in figures:
        parts += [
            f'<figure id="fig-{esc(item.name)}"><h3>{esc(item.title)}</h3>',
            f'<img alt="{esc(item.title)}" src="{figure_data_uri(item.figure, dpi=dpi)}">',
            f"<figcaption>{esc(item.caption)}</figcaption></figure>",
        ]
    lm = lm_section(table, metadata)
    if lm:
        parts += lm
    parts += promise_section(table)
    if has_positions:
        parts += positions_section(positions, metadata, dpi=dpi)
    note = mask_note(table, has_positions)
    parts += ['<h2 id="warnings">Warnings</h2>', *([f'<p class="warning">{esc(note)}</p>'] if note else []),
              *_warnings_html(metadata, names)]
    parts += ['<h2 id="diagnostics">Diagnostics</h2>', *_diagnostics_html(table, metadata, names)]
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


def _diagnostics_html(table: pd.DataFrame, metadata: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    esc = html.escape
    low, high = DELTA_RATIO_BAND
    out = [f"<p>Importance-sampling diagnostics of every estimator and S. Pareto k-hat &gt; {KHAT_THRESHOLD:g} "
           "means the importance weights are so heavy-tailed that the replicate variance (and so the MSE) is not a "
           "reliable estimate; a delta-method / replicate variance ratio outside "
           f"[{low:g}, {high:g}] means the two variance estimates disagree; ESS is Kish's effective sample size "
           "per query. Where a diagnostic is not defined the table says why.</p>"]
    flagged = diagnostics_summary(table)
    if flagged.empty:
        has_any = any(c in table and table[c].notna().any() for c in ("pareto_khat", "delta_var_ratio"))
        out.append(f'<p class="ok">No diagnosed cell has Pareto k-hat &gt; {KHAT_THRESHOLD:g} or a variance ratio '
                   f"outside [{low:g}, {high:g}].</p>" if has_any else
                   '<p class="ok">No importance-sampling diagnostics in this table (columns absent or all NaN); '
                   "the table below says why for each estimator.</p>")
    else:
        khat_col = f"k-hat > {KHAT_THRESHOLD:g}"
        ratio_col = f"ratio outside [{low:g}, {high:g}]"
        # counted over the cells where each diagnostic exists (a NaN k-hat is neither good nor bad)
        khat_cells = table[table["pareto_khat"].notna()].groupby("label").size() if "pareto_khat" in table else {}
        ratio_cells = (table[table["delta_var_ratio"].notna()].groupby("label").size()
                       if "delta_var_ratio" in table else {})
        for label in label_order(flagged["estimator"]):
            rows = flagged[flagged["estimator"] == label]
            reasons = []
            if rows[khat_col].sum():
                reasons.append(f"{int(rows[khat_col].sum())} of {khat_cells[label]} cells with a k-hat have k-hat "
                               f"&gt; {KHAT_THRESHOLD:g} (max {rows['max k-hat'].max():.2f})")
            if rows[ratio_col].sum():
                reasons.append(f"{int(rows[ratio_col].sum())} of {ratio_cells[label]} cells with a variance ratio "
                               "have it outside the band")
            settings = "; ".join(f"N = {t}, S = {s}" for t, s in zip(rows["tokens"], rows["S"]))
            out.append(f'<p class="warning"><b title="{esc(label)}">{esc(names.get(label, label))}</b>: '
                       f'{"; ".join(reasons)} (settings: {esc(settings)}).</p>')
    # a configuration without S (softmax, adaptive vAttention) once, its S "-", as the other tables show it
    overview = once_without_s(diagnostics_overview(table, metadata).rename(columns={"S": "num_samples"}))
    overview.insert(2, "S", ["–" if free else s for free, s in zip(overview["s_free"], overview["num_samples"])])
    overview = overview.drop(columns=["num_samples", "s_free"])
    out.append('<h3>Per estimator and S</h3><div class="scroll"><table class="dataframe results diagnostics">'
               "<thead><tr><th>estimator</th><th>S</th><th>cells</th><th>Pareto k-hat</th>"
               "<th>delta-method / replicate variance</th><th>ESS</th></tr></thead><tbody>")
    for row in overview.itertuples(index=False):
        cells_html = []
        for text in (row[4], row[5], row[6]):
            count = str(text).split(" of ", 1)[0]
            klass = ("na" if " not computed: " in str(text)
                     else "flag" if count.isdigit() and int(count) > 0 and " of " in str(text) else "")
            cells_html.append(f'<td class="{klass}">{esc(str(text))}</td>' if klass else f"<td>{esc(str(text))}</td>")
        out.append(f'<tr><th title="{esc(row.label)}">{esc(row.estimator)}</th><td>{row.S}</td>'
                   f"<td>{row.cells}</td>{''.join(cells_html)}</tr>")
    out.append("</tbody></table></div>")
    if not flagged.empty:
        shown = flagged.assign(estimator=flagged["estimator"].map(lambda lab: names.get(lab, lab)))
        out.append("<details><summary>flagged settings, per token count</summary>" + _table_html(shown)
                   + "</details>")
    return out


def reference_check_html(metadata: Mapping[str, Any] | None, names: Mapping[str, str] | None = None) -> list[str]:
    """The float32-reference check that ``randattn mse`` records (``metadata["reference_check"]``), as HTML.

    A sample of units is re-run on the float64 reference; when the batched result deviates from it by more than
    the tolerance (a fraction of the cell's RMSE), float32 rounding can move the measured MSE, and the advice is
    to rerun with ``--dtype float64``.

    Parameters
    ----------
    metadata : dict or None
        Table metadata; its ``"reference_check"`` entry holds ``units_checked``, ``max_abs_dev``,
        ``max_abs_dev_label``, ``max_dev_over_rmse``, ``max_dev_over_rmse_label``, ``max_dev_over_rmse_dtype`` and
        ``tolerance_dev_over_rmse``.
    names : dict, optional
        Label -> readable name.

    Returns
    -------
    list of str
        A warning paragraph above the tolerance, a short note within it; empty when nothing was recorded.
    """
    check = (metadata or {}).get("reference_check")
    if not isinstance(check, Mapping):
        return []
    esc = html.escape
    if check.get("non_finite"):  # one form gave NaN or inf where the other did not: no deviation to state
        label = str(check.get("max_abs_dev_label", ""))
        who = esc((names or {}).get(label, label))
        return [f'<div class="warning"><b>Reference check</b>: for <span title="{esc(label)}">{who}</span> one form '
                "(batched or reference) gave a non-finite value where the other did not, so its rows say nothing; "
                f"<code>randattn check {esc(label.split(':')[0])}</code> compares the two.</div>"]
    if check.get("max_dev_over_rmse", 0.0) is None:  # only exact cells checked: their RMSE is rounding
        try:
            units, deviation = int(check.get("units_checked", 0)), float(check["max_abs_dev"])
        except (KeyError, TypeError, ValueError):
            return []
        return [f'<p class="ok">Reference check: {units} unit(s) were re-run on the float64 reference; the batched '
                f"result deviates from it by at most {deviation:.2g} (exact estimators or cells only: their RMSE is "
                "rounding, so no ratio to it is given).</p>"]
    try:
        ratio, tolerance = float(check["max_dev_over_rmse"]), float(check["tolerance_dev_over_rmse"])
        units = int(check.get("units_checked", 0))
    except (KeyError, TypeError, ValueError):
        return []
    label = str(check.get("max_dev_over_rmse_label", ""))
    who = esc((names or {}).get(label, label))
    dtype = esc(str(check.get("max_dev_over_rmse_dtype", "")))
    of = "in root mean square " if check.get("dev_over_rmse_of") == "rms" else ""  # older metadata: the largest
    measured = (f"{units} unit(s) were re-run on the float64 reference; the batched result deviates from it {of}by "
                f"at most {ratio:.2g} of a cell's RMSE (<span title=\"{esc(label)}\">{who}</span>, {dtype})")
    if not ratio > tolerance:
        return [f'<p class="ok">Reference check: {measured}, within the tolerance {tolerance:g}.</p>']
    dtypes = check.get("above_tolerance_dtypes") or [check.get("max_dev_over_rmse_dtype", "")]
    if all(d == "float64" for d in dtypes):  # --dtype float64 cannot help a run that is float64 already
        return [f'<div class="warning"><b>Reference check</b>: {measured}, above the tolerance {tolerance:g} although '
                "computed in float64, so not float32 rounding: the batched form departs from its reference "
                "(<code>randattn check NAME</code> compares the two).</div>"]
    return [f'<div class="warning"><b>Reference check</b>: {measured}, above the tolerance {tolerance:g}: '
            f"{dtype} rounding can move the measured MSE by up to about {100 * ratio * (2 + ratio):.2g}% "
            "(2r + r<sup>2</sup> of that fraction r). "
            "Rerun with <code>--dtype float64</code>.</div>"]


def _warnings_html(metadata: Mapping[str, Any], names: Mapping[str, str]) -> list[str]:
    esc = html.escape
    reference = reference_check_html(metadata, names)
    if "warnings" not in metadata:
        return [*reference,
                '<p class="ok">The results carry no record of warnings (the metadata has no "warnings" entry; '
                "tables written before randattn recorded them show none here, so check the run's terminal "
                "output).</p>"]
    frame = warnings_summary(metadata)
    if frame.empty:
        return [*reference, '<p class="ok">No warnings were raised while computing these results.</p>']
    out = [*reference,
           f"<p>{int(frame['count'].sum())} warning(s) of {len(frame)} distinct kind(s) were raised while computing "
           "these results. Each is listed once with how often it occurred and what it means.</p>"]
    for category, group in frame.groupby("category", sort=False):
        out.append(f'<div class="warning"><b>{esc(category)}</b> ({int(group["count"].sum())} times): '
                   f"{esc(group['meaning'].iloc[0])}<ul>")
        for row in group.itertuples(index=False):
            who = (f'<span title="{esc(row.label)}">{esc(names.get(row.label, row.label))}</span>: '
                   if row.label else "")
            by = "" if row.units is None or pd.isna(row.units) else \
                f" (raised by {int(row.units)} unit{'s' * (int(row.units) != 1)})"
            out.append(f"<li>{who}{row.count} × <q>{esc(row.message)}</q>{by}</li>")
        out.append("</ul></div>")
    return out


def _label_tooltips(page_part: str, names: Mapping[str, str]) -> str:
    """Put each label's exact spec in a ``title`` tooltip on the table cells that show its readable name."""
    esc = html.escape
    for label, name in names.items():
        for tag in ("th", "td"):
            # pandas escapes <, > and & in cells but not quotes
            page_part = page_part.replace(f"<{tag}>{esc(name, quote=False)}</{tag}>",
                                          f'<{tag} title="{esc(label)}">{esc(name)}</{tag}>')
    return page_part


def write_report(
    table: pd.DataFrame,
    out_dir: str | os.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    command: str | None = None,
    name: str = "report.html",
    figures: Sequence[ReportFigure] | None = None,
    dpi: int = 110,
    positions: pd.DataFrame | None = None,
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
    positions : pandas.DataFrame, optional
        The run's per-position table (see :func:`build_report`).

    Returns
    -------
    pathlib.Path
        The written file.

    Raises
    ------
    OSError
        The write failed (e.g. ``ENOSPC``, a full disk); its ``filename`` is the page's path, which is left as
        it was.
    """
    from randattn._files import named_write_errors

    text = build_report(table, metadata=metadata, command=command, figures=figures, dpi=dpi, positions=positions)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with named_write_errors(out / name):
        atomic_write_text(out / name, text)
    return out / name
