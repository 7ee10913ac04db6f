"""Results tables for reporting: validate, aggregate over images, summarise.

A results table is the tidy long-format table written by ``randattn mse`` (one row per
``(image, layer, head, estimator, params, num_samples)``), read back by :func:`randattn.results.read_results`.
This module checks the columns a figure needs, and aggregates it the way LARA app. H.1 does: per
``(layer, head, image)``, then the mean over heads and layers of each image, then the mean over images with a
bootstrap confidence interval over images.

A masked run also writes a per-position table beside its table
(:func:`~randattn.results.positions_path`: ``mse.parquet`` -> ``mse.positions.parquet``; one row per
cell and position bucket, :data:`~randattn.results.POSITION_COLUMNS`); :func:`~randattn.results.read_results`
reads it into :attr:`~randattn.results.Results.positions` and :func:`aggregate_positions` aggregates it the same
way, per bucket.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from randattn.results.schema import COLUMNS, POSITION_COLUMNS
from randattn.results.table import ResultsError

__all__ = [
    "RESULT_COLUMNS",
    "PLOT_COLUMNS",
    "POSITION_COLUMNS",
    "POSITION_PLOT_COLUMNS",
    "ResultsError",
    "require_columns",
    "AGGREGATED_VALUES",
    "aggregate_over_images",
    "few_units_note",
    "measured_per_bucket",
    "buckets_text",
    "aggregate_positions",
    "once_without_s",
    "MAX_BROKEN_HEADS_SHOWN",
    "position_pivot",
    "table_masks",
    "approximate_labels",
    "summary_table",
    "mse_pivot",
    "label_order",
    "describe_data",
    "queries_noun",
    "item_noun",
    "display_names",
    "estimator_order",
    "estimator_spec",
    "exact_labels",
    "is_exact",
    "parse_params",
    "row_params",
]

#: every column of a full results table, in order: the sweep's schema, defined once
RESULT_COLUMNS: tuple[str, ...] = COLUMNS
#: the columns every figure needs
PLOT_COLUMNS: tuple[str, ...] = ("image", "layer", "head", "tokens", "estimator", "label", "num_samples", "mse")
#: the columns the error-by-position figure needs of a per-position table
POSITION_PLOT_COLUMNS: tuple[str, ...] = (*PLOT_COLUMNS, "position_lo", "position_hi")


# -------------------------------------------------------------------------------- what the registry says of a row
# A table names its estimators; what they are (exact or not, signed weights, their parameters) is asked of
# their specs, so that a plugin's rows are reported like a built-in's (ARCHITECTURE sec. 13).
def estimator_order() -> tuple[str, ...]:
    """Registered estimator names in catalogue order: the built-ins as the papers introduce them, then plugins.

    Colours and legends follow it (:func:`label_order`).
    """
    from randattn.estimators.registry import list_estimators

    return tuple(list_estimators())


def estimator_spec(name: Any) -> Any:
    """The registered spec of estimator ``name``, or None.

    Parameters
    ----------
    name : str
        A table's ``estimator`` value.

    Returns
    -------
    EstimatorSpec or None
        None for a name not registered here: a table written with a plugin that is not installed, whose
        rows are still reported, but without what only its spec could say.
    """
    from randattn.estimators.registry import get_spec

    try:
        return get_spec(str(name))
    except ValueError:
        return None


def parse_params(params: Any) -> dict[str, Any]:
    """A table's ``params`` value (canonical JSON, a mapping, or missing) as a dict; ``{}`` when unreadable."""
    if isinstance(params, dict):
        return dict(params)
    if not isinstance(params, str) or not params.strip():
        return {}
    try:
        value = json.loads(params)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def row_params(spec: Any, params: Any = None) -> dict[str, Any]:
    """A row's parameters as its spec's facts read them: the row's ``params`` with the spec's defaults filled in.

    Parameters
    ----------
    spec : EstimatorSpec or None
        From :func:`estimator_spec`.
    params : str or mapping, optional
        The row's ``params`` (JSON of the resolved parameters).

    Returns
    -------
    dict
        ``spec.resolve_params(params)``; when the spec refuses them (a table written by another version may
        hold a parameter or value it no longer knows), the row's values over the defaults, unchecked: a
        report still names and explains the row. Without a spec, the row's values as they are.
    """
    given = parse_params(params)
    if spec is None:
        return given
    try:
        return spec.resolve_params(given)
    except (TypeError, ValueError):
        return {**{key: param.default for key, param in spec.params.items()}, **given}


def is_exact(name: Any, params: Any = None) -> bool:
    """Whether estimator ``name`` with ``params`` is exact softmax attention (its spec's convergence ``"exact"``).

    False for an estimator not registered here: nothing says it is exact, so its error is shown.
    """
    spec = estimator_spec(name)
    return spec is not None and spec.convergence_of(row_params(spec, params)) == "exact"


def exact_labels(table: pd.DataFrame) -> set[str]:
    """Labels of ``table`` whose estimator is exact by its spec (:func:`is_exact`); empty without ``estimator``.

    Parameters
    ----------
    table : pandas.DataFrame
        With ``label`` and ``estimator`` (``params`` optional) columns.

    Returns
    -------
    set of str
    """
    if "estimator" not in table or "label" not in table:
        return set()
    columns = ["label", "estimator", *(["params"] if "params" in table else [])]
    # one spec lookup per configuration, not per row
    configs = table[columns].astype(str).drop_duplicates()
    exact: dict[str, bool] = {}
    for row in configs.itertuples(index=False):
        params = row[2] if len(row) > 2 else None
        exact[row[0]] = exact.get(row[0], True) and is_exact(row[1], params)
    return {label for label, value in exact.items() if value}


def require_columns(table: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    """Raise :class:`ResultsError` naming the columns of ``columns`` that ``table`` lacks.

    Parameters
    ----------
    table : pandas.DataFrame
    columns : iterable of str
    what : str
        What needs them, for the message (e.g. ``"the heatmap"``).
    """
    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"table must be a pandas DataFrame, got {type(table).__name__}")
    # each missing column named once, though a caller's list may repeat one (PLOT_COLUMNS plus value="mse")
    missing = [column for column in dict.fromkeys(columns) if column not in table.columns]
    if missing:
        raise ResultsError(
            f"{what} needs the column(s) {', '.join(missing)}; the table has {', '.join(map(str, table.columns))}"
        )
    if table.empty:
        raise ResultsError(f"{what} needs at least one row; the table is empty")


def display_names(table: pd.DataFrame) -> dict[str, str]:
    """Readable name of every label of ``table`` (:func:`randattn.estimators.names.display_name`).

    The name is built from the row's ``params`` JSON (all parameters, resolved) when the table has that column,
    else from the label text. Two labels that would share a name keep it with their spec in brackets, so a
    legend never merges two configurations.

    Parameters
    ----------
    table : pandas.DataFrame
        With a ``label`` column (``params`` optional).

    Returns
    -------
    dict
        label -> readable name, e.g. ``"rfa:coupling=orthogonal"`` -> ``"Performer (FAVOR+, orthogonal)"``.
    """
    from randattn.estimators.names import display_name_of_label

    if "params" in table:
        firsts = table.drop_duplicates("label").set_index("label")["params"]
        names = {str(label): display_name_of_label(str(label), firsts[label]) for label in firsts.index}
    else:
        names = {str(label): display_name_of_label(str(label)) for label in table["label"].unique()}
    counts: dict[str, int] = {}
    for name in names.values():
        counts[name] = counts.get(name, 0) + 1
    return {label: name if counts[name] == 1 else f"{name} [{label}]" for label, name in names.items()}


def label_order(labels: Iterable[str]) -> list[str]:
    """Labels sorted by estimator family in catalogue order (:func:`estimator_order`), then by text.

    Parameters
    ----------
    labels : iterable of str
        Labels such as ``"rfa:coupling=orthogonal"`` (the family is the text before ``":"``).

    Returns
    -------
    list of str
        Unique labels in display order; labels of estimators not registered here come last, by text.
    """
    rank = {name: i for i, name in enumerate(estimator_order())}

    def key(label: str) -> tuple[int, str]:
        return rank.get(label.split(":", 1)[0], len(rank)), label

    return sorted(set(map(str, labels)), key=key)


#: the values :func:`randattn.analysis.sweep.aggregate` summarises
AGGREGATED_VALUES: tuple[str, ...] = ("mse", "bias_sq", "variance")


def approximate_labels(table: pd.DataFrame) -> list[str]:
    """Labels of the estimators that approximate softmax: not exact by their spec, and with some MSE > 0.

    Parameters
    ----------
    table : pandas.DataFrame
        Results with ``label``, ``estimator`` and ``mse``.

    Returns
    -------
    list of str
        In display order (:func:`label_order`).
    """
    rows = table[~table["label"].astype(str).isin(exact_labels(table))]
    largest = rows.groupby("label")["mse"].max()
    return label_order(label for label in largest.index if largest[label] > 0)


def aggregate_over_images(
    table: pd.DataFrame,
    values: Sequence[str] = ("mse",),
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """Mean over heads and layers of each image, then over images with a bootstrap CI (LARA app. H.1).

    A thin adapter over :func:`randattn.results.summary.aggregate` (the one definition of the aggregation)
    that renames its interval columns, adds ``n_images`` and ``random``, and sorts labels for display.

    Parameters
    ----------
    table : pandas.DataFrame
        A results table with columns ``estimator, label, tokens, num_samples, image, layer, head`` and
        ``mse, bias_sq, variance``.
    values : sequence of str
        Which of ``mse``, ``bias_sq``, ``variance`` the caller needs (all three are computed).
    confidence : float
        Level of the percentile bootstrap interval, in (0, 1).
    n_boot : int
        Bootstrap resamples.
    seed : int
        Seed of the bootstrap.

    Returns
    -------
    pandas.DataFrame
        One row per ``(tokens, label, num_samples)`` with ``estimator``, ``random`` (when the table has it),
        ``n_images``, ``ci_over`` (``"images"``, or ``"heads"`` for a single image) and, for each value
        ``x``, ``x`` (the mean over images), ``x_ci_low`` and ``x_ci_high`` (NaN with a single unit).

    Notes
    -----
    With few images (two in the default demo) the percentile interval over images is a spread rather than a
    calibrated interval: it lies within their range (:func:`few_units_note` says when that falls short of
    ``confidence``).
    """
    from randattn.results.summary import aggregate

    unknown = [value for value in values if value not in AGGREGATED_VALUES]
    if unknown:
        raise ValueError(f"values {unknown} cannot be aggregated; choose from {', '.join(AGGREGATED_VALUES)}")
    require_columns(
        table, ["estimator", "label", "tokens", "num_samples", "image", "layer", "head", *AGGREGATED_VALUES],
        "the aggregation over images",
    )
    keys = ["tokens", "label", "num_samples", *(["mask"] if "mask" in table else [])]
    result = aggregate(table, level=confidence, n_boot=n_boot, seed=seed)
    result = result.rename(columns={f"{v}_{end}": f"{v}_ci_{name}" for v in AGGREGATED_VALUES
                                    for end, name in (("lo", "low"), ("hi", "high"))})
    images = table.groupby(keys, dropna=False)["image"].nunique().rename("n_images").reset_index()
    result = result.merge(images, on=keys, how="left")
    if "random" in table:
        random = table.groupby(keys, dropna=False)["random"].first().reset_index()
        result = result.merge(random, on=keys, how="left")
    order = {label: i for i, label in enumerate(label_order(result["label"]))}
    result = result.assign(_order=result["label"].map(order)).sort_values(["tokens", "_order", "num_samples"])
    return result.drop(columns="_order").reset_index(drop=True)


def few_units_note(summary: pd.DataFrame, *, confidence: float = 0.95, noun: str = "image") -> str:
    """What an interval over too few units is: ``""`` unless some row's percentile interval cannot reach
    ``confidence`` (:func:`randattn.results.summary.range_coverage`), else a sentence for the fewest units.

    Parameters
    ----------
    summary : pandas.DataFrame
        An aggregate (:func:`aggregate_over_images`, :func:`randattn.results.summary.aggregate`) with ``units``
        and ``ci_over``.
    confidence : float
        The level the intervals were computed at.
    noun : str
        What the table's entries are (:func:`item_noun`).
    """
    from randattn.results.summary import range_coverage

    if "units" not in summary:
        return ""
    rows = summary[summary["units"] > 1]  # one unit has no interval at all
    if rows.empty:
        return ""
    fewest = rows.loc[rows["units"].idxmin()]
    units = int(fewest["units"])
    coverage = range_coverage(units)
    if coverage >= confidence:
        return ""
    over = f"{noun}s" if fewest.get("ci_over", "images") == "images" else "heads"
    return (f"with {units} {over}, a percentile interval lies within their range, which holds the median of "
            f"their distribution with probability {coverage * 100:g}% (1 - 2^(1 - n)), below the "
            f"{confidence * 100:g}% stated: read such an interval as the {over}' spread")


def aggregate_positions(
    positions: pd.DataFrame,
    *,
    confidence: float = 0.95,
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """A per-position table aggregated like :func:`aggregate_over_images`, per position bucket.

    Parameters
    ----------
    positions : pandas.DataFrame
        A per-position table (:data:`POSITION_PLOT_COLUMNS` at least, plus ``bias_sq`` and ``variance``).
    confidence, n_boot, seed
        As :func:`aggregate_over_images`.

    Returns
    -------
    pandas.DataFrame
        One row per ``(tokens, label, num_samples, position_lo, position_hi)`` (and ``mask`` when the table has
        it) with ``estimator``, ``mse``, ``mse_ci_low``, ``mse_ci_high`` and the same for ``bias_sq`` and
        ``variance``, ``units``, ``ci_over``; labels in display order, then buckets in order.
    """
    from randattn.results.summary import aggregate

    require_columns(positions, [*POSITION_PLOT_COLUMNS, "bias_sq", "variance"], "the aggregation by position")
    result = aggregate(positions, level=confidence, n_boot=n_boot, seed=seed, by=("position_lo", "position_hi"))
    result = result.rename(columns={f"{v}_{end}": f"{v}_ci_{name}" for v in AGGREGATED_VALUES
                                    for end, name in (("lo", "low"), ("hi", "high"))})
    order = {label: i for i, label in enumerate(label_order(result["label"]))}
    result = result.assign(_order=result["label"].map(order)).sort_values(
        ["tokens", "_order", "num_samples", "position_lo"])
    return result.drop(columns="_order").reset_index(drop=True)


#: heads with a broken promise listed at most, in the terminal and in the report (the rest are counted; ``--json``
#: lists every one)
MAX_BROKEN_HEADS_SHOWN = 40


def once_without_s(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` (rows per label and S) with a configuration that takes no S (softmax, local, adaptive vAttention:
    one measurement a table repeats at each S) kept once per token count and mask, marked in a column ``s_free``
    (:func:`randattn.analysis.relative_error.s_free_repeats`): what a reader is shown, "–" for its S."""
    from randattn.analysis.relative_error import s_free_repeats

    s_free, repeated = s_free_repeats(frame, ("label", "tokens", "mask"))
    return frame.assign(s_free=s_free)[~repeated]


def buckets_text(positions: pd.DataFrame, dash: str = "-") -> str:
    """The position buckets of a per-position table as a caption names them: ``"1, 2-3, 4-7, ..., 512-1023"`` for
    log2 buckets, the table's own for ``--position-buckets`` edges (every one where there are at most five, else
    the first three, then the last)."""
    from randattn.analysis.positions import bucket_text

    pairs = sorted({(int(lo), int(hi)) for lo, hi in zip(positions["position_lo"], positions["position_hi"])})
    texts = [bucket_text(lo, hi).replace("-", dash) for lo, hi in pairs]
    return ", ".join(texts if len(texts) <= 5 else [*texts[:3], "...", texts[-1]])


def measured_per_bucket(positions: pd.DataFrame) -> dict[tuple[int, int], int]:
    """``(position_lo, position_hi) -> queries`` of a per-position table: how many of a bucket's queries each of its
    cells measured (the most, where cells differ), for :func:`~randattn.analysis.positions.bucket_text`."""
    if "queries" not in positions or positions.empty:
        return {}
    counts = positions.groupby(["position_lo", "position_hi"])["queries"].max()
    return {(int(lo), int(hi)): int(count) for (lo, hi), count in counts.items()}


def position_pivot(positions: pd.DataFrame, *, num_samples: int | None = None, seed: int = 0) -> pd.DataFrame:
    """Mean MSE over images (after heads and layers) as an estimator x position-bucket grid, at one S.

    Parameters
    ----------
    positions : pandas.DataFrame
        A per-position table.
    num_samples : int, optional
        S (default: the largest S of the table).
    seed : int

    Returns
    -------
    pandas.DataFrame
        Index: estimator label in display order (``(estimator, mask)`` where the rows were measured under several
        masks: a window layer beside a causal one); columns: the buckets as text (``"1"``, ``"2-3"``, ...), in
        order; with a single token count (else the columns are ``(tokens, bucket)``).
    """
    from randattn.analysis.positions import bucket_text

    require_columns(positions, POSITION_PLOT_COLUMNS, "the table of errors by position")
    s = int(positions["num_samples"].max()) if num_samples is None else int(num_samples)
    rows = positions[positions["num_samples"] == s]
    if rows.empty:
        raise ResultsError(f"the per-position table has no rows at S = {s}; it has S = "
                           f"{', '.join(str(int(x)) for x in sorted(positions['num_samples'].unique()))}")
    means = aggregate_positions(rows, n_boot=1, seed=seed)
    measured = measured_per_bucket(rows)
    means = means.assign(bucket=[bucket_text(lo, hi, measured.get((int(lo), int(hi))))
                                 for lo, hi in zip(means["position_lo"], means["position_hi"])])
    several = means["tokens"].nunique() > 1
    columns = ["tokens", "position_lo", "bucket"] if several else ["position_lo", "bucket"]
    masks = "mask" in means and means["mask"].astype(str).nunique() > 1  # a window layer beside a causal one
    pivot = means.pivot_table(index=["label", "mask"] if masks else "label", columns=columns, values="mse",
                              aggfunc="first")
    pivot = pivot.droplevel("position_lo", axis=1)
    labels = label_order(pivot.index.get_level_values("label").unique())
    pivot = pivot.reindex(labels, level="label") if masks else pivot.reindex(labels)
    if masks:
        pivot.index = pivot.index.set_names(["estimator", "mask"])
    else:
        pivot.index.name = "estimator"
    return pivot


def table_masks(table: pd.DataFrame) -> dict[str, list[int]]:
    """The masks a table's rows were measured under, each with its layers: ``{"causal": [0, 1]}``.

    Empty for a bidirectional table (every ``mask`` is ``"none"``) and for a table written before the
    ``mask`` column existed.
    """
    if "mask" not in table or "layer" not in table:
        return {}
    masks: dict[str, list[int]] = {}
    for (kind, layer), _ in table.groupby([table["mask"].astype(str), "layer"], sort=True):
        if kind not in ("none", "nan"):
            masks.setdefault(kind, []).append(int(layer))
    return masks


def summary_table(table: pd.DataFrame, *, confidence: float = 0.95, seed: int = 0, noun: str = "image") -> pd.DataFrame:
    """The headline table: MSE with its CI, variance and bias² per token count, estimator and S.

    Parameters
    ----------
    table : pandas.DataFrame
        A results table.
    confidence : float
        Level of the bootstrap interval over images.
    seed : int
        Seed of the bootstrap.
    noun : str
        What the table's entries are (:func:`item_noun`): names the column that counts them.

    Returns
    -------
    pandas.DataFrame
        Columns ``tokens, estimator`` (readable name, :func:`display_names`), ``spec`` (the exact label),
        ``S, images`` (``sequences`` with ``noun="sequence"``), ``MSE, MSE CI low, MSE CI high`` and, when the
        table has them,
        ``variance, bias² (debiased)``, ``bias share`` (bias² / MSE); ``mask`` after ``tokens`` when the
        table's rows were measured under several masks.
    """
    values = [name for name in ("mse", "variance", "bias_sq") if name in table]
    aggregated = aggregate_over_images(table, values, confidence=confidence, seed=seed)
    columns = {
        "tokens": "tokens", "label": "estimator", "num_samples": "S", "n_images": f"{noun}s",
        "mse": "MSE", "mse_ci_low": "MSE CI low", "mse_ci_high": "MSE CI high",
        "variance": "variance", "bias_sq": "bias² (debiased)",
    }
    if "mask" in aggregated and aggregated["mask"].nunique() > 1:
        columns = {**dict(list(columns.items())[:1]), "mask": "mask", **dict(list(columns.items())[1:])}
    summary = aggregated[[c for c in columns if c in aggregated]].rename(columns=columns)
    summary.insert(list(summary.columns).index("estimator") + 1, "spec", summary["estimator"])
    summary["estimator"] = summary["spec"].map(display_names(table))
    if "bias² (debiased)" in summary:
        with np.errstate(divide="ignore", invalid="ignore"):
            summary["bias share"] = summary["bias² (debiased)"] / summary["MSE"]
    return summary


def mse_pivot(table: pd.DataFrame, *, seed: int = 0) -> pd.DataFrame:
    """Mean MSE over images (after heads and layers) as an estimator x (tokens, S) grid.

    Parameters
    ----------
    table : pandas.DataFrame
    seed : int
        Seed of the bootstrap (unused in the means; kept for a stable call).

    Returns
    -------
    pandas.DataFrame
        Index: estimator label in display order; columns: ``(tokens, S)``, or ``(tokens, mask, S)`` when the
        table's rows were measured under several masks.
    """
    aggregated = aggregate_over_images(table, ["mse"], n_boot=2, seed=seed)
    several = "mask" in aggregated and aggregated["mask"].nunique() > 1  # keep differently masked rows apart
    columns = ["tokens", *(["mask"] if several else []), "num_samples"]
    pivot = aggregated.pivot_table(index="label", columns=columns, values="mse", aggfunc="first")
    pivot = pivot.reindex(label_order(pivot.index))
    pivot.index.name = "estimator"
    pivot.columns.names = ["tokens", *(["mask"] if several else []), "S"]
    return pivot


def item_noun(metadata: dict[str, Any] | None = None) -> str:
    """What one entry of the activations' leading axis is: ``"sequence"`` for a language-model capture, else
    ``"image"``.

    Parameters
    ----------
    metadata : dict, optional
        A table's metadata (the activation file's under ``"activations"``, as ``randattn mse`` writes it) or an
        activation file's own. Its ``layout`` ``"sequence"``, a model ``architecture`` or ``token_strings`` mark
        a language-model capture.
    """
    metadata = metadata or {}
    acts = metadata.get("activations") if isinstance(metadata.get("activations"), dict) else metadata
    lm = acts.get("layout") == "sequence" or bool(acts.get("architecture")) or bool(acts.get("token_strings"))
    return "sequence" if lm else "image"


def describe_data(table: pd.DataFrame, metadata: dict[str, Any] | None = None) -> str:
    """One line naming the model and the data behind a table, for figure subtitles and the report.

    Parameters
    ----------
    table : pandas.DataFrame
    metadata : dict, optional
        Table metadata (``model`` is taken from it when the table has no ``model`` column).

    Returns
    -------
    str
        E.g. ``"dinov2-s14 · 2 images (astronaut, coffee) · layers 0, 5, 11 · 6 heads · R = 8"``; the entries
        are sequences for a language-model capture (:func:`item_noun`), and a table measured on some queries says
        which (``"... · causal mask · the last 64 queries of each head · R = 4"``).
    """
    metadata = metadata or {}
    parts = []
    models = sorted(set(table["model"].astype(str))) if "model" in table else []
    model = ", ".join(models) if models else str(metadata.get("model", "model unknown"))
    parts.append(model)
    if "image" in table:
        images = sorted(set(table["image"].astype(str)))
        shown = ", ".join(images[:4]) + (", ..." if len(images) > 4 else "")
        parts.append(f"{len(images)} {item_noun(metadata)}{'s' if len(images) != 1 else ''} ({shown})")
    if "layer" in table:
        layers = sorted(set(int(x) for x in table["layer"].dropna()))
        parts.append(("layer " if len(layers) == 1 else "layers ") + _compact_ints(layers))
    if "head" in table:
        heads = table["head"].nunique()
        parts.append(f"{heads} head{'s' if heads != 1 else ''}")
    masks = table_masks(table)
    if masks:
        parts.append(" and ".join(f"{kind} mask" for kind in masks))
    # a figure of the last 64 queries must not read as one of every query; a per-position table's `queries` is
    # the count of its bucket's queries instead, and the run's selection is in the metadata
    if "queries" in table and "position_lo" not in table:
        selections = set(table["queries"].dropna().astype(str))
    else:
        recorded = metadata.get("queries")
        selections = {str(recorded.get("selection", "all"))} if isinstance(recorded, dict) else set()
    parts.extend(f"{queries_noun(selection)} of each head" for selection in sorted(selections - {"all"}))
    random_rows = table[table["random"].astype(bool)] if "random" in table else table
    if "replicates" in random_rows and random_rows["replicates"].notna().any():
        # deterministic estimators run one replicate; R is the random estimators' count
        replicates = sorted(set(int(x) for x in random_rows["replicates"].dropna()))
        parts.append("R = " + ", ".join(map(str, replicates)))
    return " · ".join(parts)


def queries_noun(queries: str) -> str:
    """``"the last 64 queries"``, ``"64 sampled queries"``: a query selection other than ``all``
    (:mod:`randattn.analysis.queries`) in words."""
    kind, count = str(queries).split(":")
    return f"the last {count} queries" if kind == "last" else f"{count} sampled queries"


def _compact_ints(values: Sequence[int]) -> str:
    if len(values) > 3 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))


#: the names that moved to :mod:`randattn.results` (reading the table and its metadata is the table's owner's)
_MOVED = ("MetadataConflictWarning", "Results", "read_results")


def __getattr__(name: str) -> Any:
    """The reading of a results table, moved to :mod:`randattn.results`, answered with a ``DeprecationWarning``."""
    if name in _MOVED:
        import randattn.results

        warnings.warn(f"randattn.reports.tables.{name} is deprecated: use randattn.results.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(randattn.results, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
