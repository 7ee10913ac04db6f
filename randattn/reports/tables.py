"""Results tables for reporting: read, validate, aggregate over images, summarise.

A results table is the tidy long-format table written by ``randattn mse`` (one row per
``(image, layer, head, estimator, params, num_samples)``). This module reads it back from CSV, Parquet or
JSON, checks the columns a figure needs, and aggregates it the way LARA app. H.1 does: per
``(layer, head, image)``, then the mean over heads and layers of each image, then the mean over images with a
bootstrap confidence interval over images.

A masked run also writes a per-position table beside its table
(:func:`~randattn.analysis.sweep.positions_path`: ``mse.parquet`` -> ``mse.positions.parquet``; one row per
cell and position bucket, :data:`~randattn.analysis.positions.POSITION_COLUMNS`); :func:`read_results` reads it
into :attr:`Results.positions` and :func:`aggregate_positions` aggregates it the same way, per bucket.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd

from randattn._callers import outside_stacklevel
from randattn.analysis.positions import POSITION_COLUMNS
from randattn.analysis.sweep import COLUMNS, positions_path

__all__ = [
    "RESULT_COLUMNS",
    "PLOT_COLUMNS",
    "POSITION_COLUMNS",
    "POSITION_PLOT_COLUMNS",
    "ResultsError",
    "MetadataConflictWarning",
    "Results",
    "read_results",
    "require_columns",
    "AGGREGATED_VALUES",
    "aggregate_over_images",
    "aggregate_positions",
    "position_pivot",
    "table_masks",
    "approximate_labels",
    "summary_table",
    "mse_pivot",
    "label_order",
    "describe_data",
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
_READERS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".json": "json"}
#: where table metadata may live beside the table: ``results.csv`` -> ``results.csv.meta.json`` (what
#: :func:`randattn.analysis.sweep.write_table` writes) or ``results.meta.json``
_SIDECAR_SUFFIXES = (".meta.json", ".metadata.json")
_PARQUET_METADATA_KEYS = (b"randattn", b"randattn_metadata", b"metadata")


class MetadataConflictWarning(UserWarning):
    """A table's metadata stored in the file (Parquet, JSON) and in the ``.meta.json`` beside it differ; the
    file's own is used."""


class ResultsError(ValueError):
    """A results file that cannot be read, or a table without the columns a figure or report needs."""


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


@dataclass(frozen=True)
class Results:
    """A results table with the metadata stored beside it.

    Attributes
    ----------
    table : pandas.DataFrame
        One row per ``(image, layer, head, estimator, params, num_samples)``.
    metadata : dict
        Model, master seed, command line, randattn version, ... (empty when the file carried none).
    path : pathlib.Path or None
        Where the table was read from.
    positions : pandas.DataFrame or None
        The per-position table stored beside it (:func:`~randattn.analysis.sweep.positions_path`), when
        there is one.
    """

    table: pd.DataFrame
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    positions: pd.DataFrame | None = None


def read_results(path: str | os.PathLike) -> Results:
    """Read a results table (CSV, Parquet or JSON) and the metadata stored with it.

    Parameters
    ----------
    path : str or path-like
        ``.csv``, ``.parquet`` / ``.pq`` or ``.json``. JSON may be a list of row records, a pandas
        ``orient="table"`` / ``"split"`` document, or an object ``{"metadata": {...}, "rows" | "results" |
        "data": [...]}``. Parquet metadata is read from the schema key ``randattn``; a sidecar
        ``<stem>.meta.json`` beside any format is read too.

    Returns
    -------
    Results
        With the per-position table beside it in :attr:`Results.positions`, when the run wrote one.

    Raises
    ------
    ResultsError
        The file does not exist, has an unknown suffix, cannot be parsed, or holds no rows; a measured column
        (``mse``, ``variance``, ...) holds text that is not a number, or an error column (``mse``, ``variance``,
        ``bias_sq``) an infinite value; or its per-position table cannot be read.
    """
    table, metadata, path = _read_one(path)
    beside = positions_path(path)
    positions = _read_one(beside)[0] if beside.is_file() and beside != path else None
    return Results(table=table, metadata=metadata, path=path, positions=positions)


def _read_one(path: str | os.PathLike) -> tuple[pd.DataFrame, dict[str, Any], Path]:
    """One table file and its metadata (:func:`read_results` without what lies beside it)."""
    path = Path(path)
    kind = _READERS.get(path.suffix.lower())
    if kind is None:
        raise ResultsError(
            f"cannot read results {str(path)!r}: unknown suffix {path.suffix!r}; use one of "
            f"{', '.join(sorted(_READERS))}"
        )
    if not path.is_file():
        raise ResultsError(f"cannot read results {str(path)!r}: no such file")
    metadata: dict[str, Any] = {}
    try:
        if kind == "csv":
            table = pd.read_csv(path)
        elif kind == "parquet":
            table, metadata = _read_parquet(path)
        else:
            table, metadata = _read_json(path)
    except ResultsError:
        raise
    except (ValueError, OSError, UnicodeDecodeError, pd.errors.ParserError, ImportError) as exc:
        raise ResultsError(f"cannot read results {str(path)!r} as {kind}: {exc}") from exc
    if not isinstance(table, pd.DataFrame) or table.empty:
        raise ResultsError(f"results {str(path)!r} hold no rows")
    sidecar, sidecar_path = _read_sidecar(path)
    differing = sorted(key for key in sidecar.keys() & metadata.keys()
                       if json.dumps(sidecar[key], sort_keys=True) != json.dumps(metadata[key], sort_keys=True))
    if differing:
        shown = ", ".join(differing[:5]) + (f" and {len(differing) - 5} more" if len(differing) > 5 else "")
        warnings.warn(f"{path}: {sidecar_path.name} differs from the metadata stored in the file ({shown}); the "
                      "file's own is used (edit the metadata inside the file, or remove it to use the sidecar)",
                      MetadataConflictWarning, stacklevel=outside_stacklevel())
    metadata = {**sidecar, **metadata}
    return _checked_values(_normalise_types(table), path), metadata, path


def _read_parquet(path: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    table = pd.read_parquet(path)
    metadata: dict[str, Any] = {}
    try:
        import pyarrow.parquet as pq

        schema_metadata = pq.read_schema(path).metadata or {}
    except ImportError:  # pandas may read parquet through fastparquet
        schema_metadata = {}
    for key in _PARQUET_METADATA_KEYS:
        if key in schema_metadata:
            try:
                metadata = json.loads(schema_metadata[key])
            except (ValueError, TypeError):
                metadata = {}
            break
    if not metadata and table.attrs:
        metadata = dict(table.attrs)
    return table, metadata if isinstance(metadata, dict) else {}


def _read_json(path: Path) -> tuple[pd.DataFrame, dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        document = json.load(handle)
    metadata: dict[str, Any] = {}
    if isinstance(document, list):
        return pd.DataFrame.from_records(document), metadata
    if not isinstance(document, dict):
        raise ResultsError(f"cannot read results {str(path)!r}: JSON must be a list of rows or an object")
    if isinstance(document.get("metadata"), dict):
        metadata = document["metadata"]
    for key in ("rows", "results", "data", "table"):
        rows = document.get(key)
        if isinstance(rows, list):
            if rows and not isinstance(rows[0], dict) and isinstance(document.get("columns"), list):
                return pd.DataFrame(rows, columns=document["columns"]), metadata  # orient="split"
            return pd.DataFrame.from_records(rows), metadata
    # a column-oriented pandas document {"column": {"0": value, ...}, ...}
    return pd.DataFrame(document), metadata


def _read_sidecar(path: Path) -> tuple[dict[str, Any], Path | None]:
    """The metadata in the sidecar beside ``path`` and the sidecar's path ({} and None without one)."""
    # write_table writes ``results.csv.meta.json``; hand-made sidecars may drop the table's suffix
    candidates = [path.with_name(path.name + suffix) for suffix in _SIDECAR_SUFFIXES]
    candidates += [path.with_name(path.stem + suffix) for suffix in _SIDECAR_SUFFIXES]
    for sidecar in candidates:
        if sidecar.is_file():
            try:
                with open(sidecar, encoding="utf-8") as handle:
                    value = json.load(handle)
            except (OSError, ValueError):
                return {}, sidecar
            return (value if isinstance(value, dict) else {}), sidecar
    return {}, None


def _normalise_types(table: pd.DataFrame) -> pd.DataFrame:
    table = table.copy()
    if "random" in table:
        # CSV round trips write booleans as text
        table["random"] = table["random"].map(
            lambda value: value if isinstance(value, (bool, np.bool_)) else str(value).strip().lower() in ("true", "1")
        ).astype(bool)
    for column in ("layer", "head", "tokens", "num_samples", "replicates", "position_lo", "position_hi", "queries"):
        if column in table:
            table[column] = pd.to_numeric(table[column], errors="coerce")
    if "label" not in table and "estimator" in table:
        table["label"] = table["estimator"]
    for column in ("image", "label", "estimator", "model", "mask"):
        if column in table:
            table[column] = table[column].astype(str)
    return table


#: the measured columns: numbers, NaN where a value was not computed
_NUMBER_COLUMNS = ("mse", "mse_se", "variance", "bias_sq", "bias_sq_naive", "bias_sq_se", "rel_error", "prob_mse",
                   "ess_mean", "delta_var_ratio", "pareto_khat", "ref_max_abs_dev", "seconds", "sink_mass")
#: the columns that are aggregated and drawn: finite as well (or NaN)
_FINITE_COLUMNS = ("mse", "variance", "bias_sq")
#: text that reads as a missing number
_MISSING_TEXT = frozenset({"", "nan", "none", "null", "na", "n/a", "<na>"})


def _where(row: pd.Series) -> str:
    """Where a row of a results table was measured, for a message: ``"rfa at S = 16, layer 0, head 1"``."""
    parts = [str(row["label"]) if "label" in row else None,
             f"S = {row['num_samples']:g}" if "num_samples" in row and pd.notna(row["num_samples"]) else None]
    return " at ".join(part for part in parts if part) or f"row {row.name}"


def _checked_values(table: pd.DataFrame, path: Path) -> pd.DataFrame:
    """``table`` with its measured columns as floats; text that is not a number, or an infinite error, raises
    :class:`ResultsError` naming the file, the column and the first such row."""
    for column in _NUMBER_COLUMNS:
        if column not in table or pd.api.types.is_numeric_dtype(table[column]):
            continue
        values = table[column]
        numbers = pd.to_numeric(values, errors="coerce")
        missing = values.isna() | values.astype(str).str.strip().str.lower().isin(_MISSING_TEXT)
        bad = numbers.isna() & ~missing
        if bad.any():
            first = table[bad].iloc[0]
            raise ResultsError(
                f"results {str(path)!r}: column {column!r} holds {int(bad.sum())} value(s) that are not numbers, "
                f"e.g. {values[bad].iloc[0]!r} ({_where(first)})"
            )
        table[column] = numbers.astype(float)
    for column in _FINITE_COLUMNS:
        if column in table:
            infinite = np.isinf(table[column].to_numpy(dtype=float))
            if infinite.any():
                first = table[infinite].iloc[0]
                raise ResultsError(
                    f"results {str(path)!r}: column {column!r} holds {int(infinite.sum())} infinite value(s), e.g. "
                    f"{first[column]} ({_where(first)}); an error must be a finite number, or NaN where not computed"
                )
    return table


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

    A thin adapter over :func:`randattn.analysis.sweep.aggregate` (the one definition of the aggregation)
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
    With few images (two in the default demo) the percentile interval over images is narrow and is a
    spread rather than a calibrated interval.
    """
    from randattn.analysis.sweep import aggregate

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
    from randattn.analysis.sweep import aggregate

    require_columns(positions, [*POSITION_PLOT_COLUMNS, "bias_sq", "variance"], "the aggregation by position")
    result = aggregate(positions, level=confidence, n_boot=n_boot, seed=seed, by=("position_lo", "position_hi"))
    result = result.rename(columns={f"{v}_{end}": f"{v}_ci_{name}" for v in AGGREGATED_VALUES
                                    for end, name in (("lo", "low"), ("hi", "high"))})
    order = {label: i for i, label in enumerate(label_order(result["label"]))}
    result = result.assign(_order=result["label"].map(order)).sort_values(
        ["tokens", "_order", "num_samples", "position_lo"])
    return result.drop(columns="_order").reset_index(drop=True)


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
        Index: estimator label in display order; columns: the buckets as text (``"1"``, ``"2-3"``, ...), in order;
        with a single token count (else the columns are ``(tokens, bucket)``).
    """
    from randattn.analysis.positions import bucket_text

    require_columns(positions, POSITION_PLOT_COLUMNS, "the table of errors by position")
    s = int(positions["num_samples"].max()) if num_samples is None else int(num_samples)
    rows = positions[positions["num_samples"] == s]
    if rows.empty:
        raise ResultsError(f"the per-position table has no rows at S = {s}; it has S = "
                           f"{', '.join(str(int(x)) for x in sorted(positions['num_samples'].unique()))}")
    means = aggregate_positions(rows, n_boot=1, seed=seed)
    means = means.assign(bucket=[bucket_text(lo, hi) for lo, hi in zip(means["position_lo"], means["position_hi"])])
    several = means["tokens"].nunique() > 1
    columns = ["tokens", "position_lo", "bucket"] if several else ["position_lo", "bucket"]
    pivot = means.pivot_table(index="label", columns=columns, values="mse", aggfunc="first")
    pivot = pivot.droplevel("position_lo", axis=1)
    pivot = pivot.reindex(label_order(pivot.index))
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
        are sequences for a language-model capture (:func:`item_noun`).
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
        parts.append(f"{table['head'].nunique()} heads")
    masks = table_masks(table)
    if masks:
        parts.append(" and ".join(f"{kind} mask" for kind in masks))
    random_rows = table[table["random"].astype(bool)] if "random" in table else table
    if "replicates" in random_rows and random_rows["replicates"].notna().any():
        # deterministic estimators run one replicate; R is the random estimators' count
        replicates = sorted(set(int(x) for x in random_rows["replicates"].dropna()))
        parts.append("R = " + ", ".join(map(str, replicates)))
    return " · ".join(parts)


def _compact_ints(values: Sequence[int]) -> str:
    if len(values) > 3 and list(values) == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ", ".join(map(str, values))
