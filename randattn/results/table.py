"""The results table on disk: writing and reading it, with its per-position table and its metadata.

A sweep's table (:data:`~randattn.results.schema.COLUMNS`) is written as ``.parquet``, ``.csv`` or ``.json``
(:func:`write_table`, :func:`write_tables`), its metadata -- master seed, command line, randattn version,
configuration -- in the sidecar ``<table>.meta.json`` (:func:`sidecar_path`) and, in Parquet, also in the file's
schema metadata. A masked run's per-position table lies beside it (:func:`positions_path`: ``mse.parquet`` ->
``mse.positions.parquet``). :func:`read_results` reads any of these back, with the metadata, checking the measured
columns; where the metadata stored in the file and the sidecar differ, the file's own wins and
:class:`MetadataConflictWarning` says so (the metadata-conflict rule).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from randattn._callers import outside_stacklevel
from randattn._files import atomic_path, named_write_errors

__all__ = [
    "OUTPUT_FORMATS",
    "SweepTables",
    "Results",
    "ResultsError",
    "PositionsTableError",
    "MetadataConflictWarning",
    "NewerTableWarning",
    "is_positions_table",
    "positions_path",
    "sidecar_path",
    "table_records",
    "write_table",
    "write_tables",
    "read_results",
]

#: the suffixes a sweep's table can be written as
OUTPUT_FORMATS = (".parquet", ".csv", ".json")
_READERS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet", ".json": "json"}
#: where table metadata may live beside the table: ``results.csv`` -> ``results.csv.meta.json`` (what
#: :func:`write_table` writes) or ``results.meta.json``
_SIDECAR_SUFFIXES = (".meta.json", ".metadata.json")
_PARQUET_METADATA_KEYS = (b"randattn", b"randattn_metadata", b"metadata")


class MetadataConflictWarning(UserWarning):
    """A table's metadata stored in the file (Parquet, JSON) and in the ``.meta.json`` beside it differ; the
    file's own is used."""


class NewerTableWarning(UserWarning):
    """A table written by a newer randattn than the one reading it: columns or rules it added may be read
    wrongly or left out."""


class ResultsError(ValueError):
    """A results file that cannot be read, or a table without the columns a figure or report needs."""


#: the columns only a per-position table has (:data:`~randattn.results.schema.POSITION_COLUMNS`): its bucket
POSITION_BUCKET_COLUMNS = ("position_lo", "position_hi")


class PositionsTableError(ResultsError):
    """A run's per-position table given where its main table is expected (:func:`read_results` with
    ``main_table``).

    Its rows are (head, S, position bucket) rather than cells, so averaging them as cells weighs every bucket like a
    head: the reports' and figures' numbers would be wrong. The main table brings it along
    (:attr:`Results.positions`).

    Attributes
    ----------
    path : pathlib.Path
        The per-position table that was given.
    main_path : pathlib.Path or None
        The run's main table it belongs to: the name its metadata records (``positions_of``), else ``path``
        without ``.positions`` (``mse.positions.parquet`` -> ``mse.parquet``); None when neither says.
    """

    def __init__(self, path: Path, main_path: Path | None) -> None:
        self.path = Path(path)
        self.main_path = main_path
        main = f"the main table, {str(main_path)!r}" if main_path is not None else "the run's main table"
        super().__init__(f"results {str(self.path)!r} are a run's per-position table (one row per head, S and "
                         f"query-position bucket), not its main table; read {main}, which brings this one along")


@dataclass(frozen=True)
class SweepTables:
    """What a sweep returns: its table and, where it measured any, its per-position table.

    Attributes
    ----------
    table : pandas.DataFrame
        :func:`~randattn.analysis.sweep.run_sweep`'s table (:data:`~randattn.results.schema.COLUMNS`).
    positions : pandas.DataFrame or None
        One row per (cell, position bucket) (:data:`~randattn.results.schema.POSITION_COLUMNS`), sorted like the
        table and then by bucket; None when no layer of the run gets per-position metrics
        (:meth:`~randattn.analysis.plan.SweepConfig.positions_of`).
    """

    table: Any
    positions: Any = None


# ------------------------------------------------------------------------------------------------------------ write
def table_records(table) -> list[dict[str, Any]]:
    """Rows as JSON-ready dicts: numpy scalars become Python ones, NaN, inf and a nullable column's ``<NA>`` become
    None (exact floats)."""
    import pandas as pd

    records = []
    for record in table.to_dict(orient="records"):
        clean = {}
        for key, value in record.items():
            if value is pd.NA:
                value = None
            elif isinstance(value, np.generic):
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            clean[key] = value
        records.append(clean)
    return records


def sidecar_path(path: str | os.PathLike) -> Path:
    """Where :func:`write_table` puts the metadata of the table at ``path``: ``mse.parquet`` ->
    ``mse.parquet.meta.json``."""
    path = Path(path)
    return path.with_name(path.name + ".meta.json")


def positions_path(path: str | os.PathLike) -> Path:
    """Where the per-position table of the table at ``path`` lives: ``mse.parquet`` -> ``mse.positions.parquet``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.positions{path.suffix}")


def write_tables(tables: SweepTables, path: str | os.PathLike, metadata: Mapping[str, Any]) -> list[Path]:
    """Write a sweep's table to ``path`` and its per-position table beside it (:func:`positions_path`).

    Both in ``path``'s format, each with its metadata (:func:`write_table`); the per-position table's
    metadata adds ``"positions_of"``: the table it belongs to. A run without per-position metrics
    removes a per-position table left at that path by an earlier run, so that a report never pairs a
    table with another run's positions. Every file is first written under a temporary name and all
    are renamed into place only once all are written: a failed write (a full disk) leaves each output
    as it was, never a table without its metadata or its per-position table.

    Returns
    -------
    list of Path
        The files written (tables and sidecars).

    Raises
    ------
    OSError
        A write failed; its ``filename`` is the output file meant (not a temporary name).
    """
    path = Path(path)
    beside = positions_path(path)
    outputs = [(tables.table, path, metadata)]
    if tables.positions is not None:
        outputs.append((tables.positions, beside, {**dict(metadata), "positions_of": path.name}))
    written = _write_together(outputs)
    if tables.positions is None:
        for stale in (beside, beside.with_name(beside.name + ".meta.json")):
            stale.unlink(missing_ok=True)
    return written


def write_table(table, path: str | os.PathLike, metadata: Mapping[str, Any]) -> tuple[Path, Path]:
    """Write ``table`` to ``path`` (``.parquet``, ``.csv`` or ``.json`` records) and ``metadata`` beside it.

    The metadata (master seed, command line, randattn version, config, ...) goes to the sidecar
    ``<path>.meta.json`` for every format, and for parquet also into the file's schema metadata
    under the key ``randattn``. Both are written under temporary names and renamed into place
    together, once both are written.

    Returns
    -------
    (table path, sidecar path)

    Raises
    ------
    OSError
        A write failed; its ``filename`` is the output file meant (not a temporary name).
    """
    table_path, sidecar = _write_together([(table, Path(path), metadata)])
    return table_path, sidecar


def _write_together(outputs: Sequence[tuple[Any, Path, Mapping[str, Any]]]) -> list[Path]:
    """Write each ``(table, path, metadata)`` and its sidecar; rename them all into place only when all are written."""
    from contextlib import ExitStack

    for _, path, _ in outputs:
        if path.suffix.lower() not in OUTPUT_FORMATS:
            raise ValueError(f"output {str(path)!r}: unknown suffix {path.suffix!r}; use one of {list(OUTPUT_FORMATS)}")
    written: list[Path] = []
    with ExitStack() as renames:  # on leaving, each atomic_path renames its file into place (or, failing, removes it)
        for table, path, metadata in outputs:
            text = json.dumps(dict(metadata), indent=2, sort_keys=True, default=str)
            with named_write_errors(path):
                _write_format(table, renames.enter_context(atomic_path(path)), path.suffix.lower(), text)
            sidecar = sidecar_path(path)
            with named_write_errors(sidecar):
                renames.enter_context(atomic_path(sidecar)).write_text(text, encoding="utf-8")
            written += [path, sidecar]
    return written


def _write_format(table, tmp: Path, suffix: str, text: str) -> None:
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        arrow = pa.Table.from_pandas(table, preserve_index=False)
        arrow = arrow.replace_schema_metadata({**(arrow.schema.metadata or {}), b"randattn": text.encode()})
        pq.write_table(arrow, tmp)
    elif suffix == ".csv":
        table.to_csv(tmp, index=False)
    else:
        with open(tmp, "w") as fh:
            json.dump(table_records(table), fh, indent=1)


# ------------------------------------------------------------------------------------------------------------- read
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
        The per-position table stored beside it (:func:`positions_path`), when
        there is one.
    """

    table: pd.DataFrame
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    positions: pd.DataFrame | None = None


def read_results(path: str | os.PathLike, *, main_table: bool = False) -> Results:
    """Read a results table (CSV, Parquet or JSON) and the metadata stored with it.

    Parameters
    ----------
    path : str or path-like
        ``.csv``, ``.parquet`` / ``.pq`` or ``.json``. JSON may be a list of row records, a pandas
        ``orient="table"`` / ``"split"`` document, or an object ``{"metadata": {...}, "rows" | "results" |
        "data": [...]}``. Parquet metadata is read from the schema key ``randattn``; a sidecar
        ``<stem>.meta.json`` beside any format is read too.
    main_table : bool
        Accept only a run's main table: a per-position table (:func:`is_positions_table`) raises
        :class:`PositionsTableError`. What reports and figures ask, since they average the rows as cells and a
        per-position table's rows are buckets. Without it a per-position table reads as any table.

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
    PositionsTableError
        With ``main_table``: ``path`` is a run's per-position table (it has the bucket columns ``position_lo`` and
        ``position_hi``, or its metadata names the table it belongs to); read that main table instead.
    """
    table, metadata, path = _read_one(path)
    _warn_if_newer(path, metadata)
    if main_table and is_positions_table(table, metadata):
        raise PositionsTableError(path, _main_table_of(path, metadata))
    beside = positions_path(path)
    positions = _read_one(beside)[0] if beside.is_file() and beside != path else None
    return Results(table=table, metadata=metadata, path=path, positions=positions)


def _release(text: Any) -> tuple[int, ...] | None:
    """``"0.2.0"`` -> ``(0, 2, 0)``; None for what names no release ("unknown", a missing field)."""
    import re

    numbers = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return None if numbers is None else tuple(int(n) for n in numbers.groups(default="0"))


def _warn_if_newer(path: Path, metadata: Mapping[str, Any]) -> None:
    """:class:`NewerTableWarning` where the metadata's ``randattn_version`` is a later release than this one."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        here = version("randattn")
    except PackageNotFoundError:  # a source tree that is not installed: no release to compare
        return
    written, reading = _release(metadata.get("randattn_version")), _release(here)
    if written is not None and reading is not None and written > reading:
        warnings.warn(f"{str(path)!r} was written by randattn {metadata['randattn_version']}, newer than this "
                      f"{here}: what that version added may be read wrongly or left out; update randattn to read it",
                      NewerTableWarning, stacklevel=3)


def is_positions_table(table: pd.DataFrame, metadata: Mapping[str, Any]) -> bool:
    """Whether ``table`` (read with ``metadata``) is a per-position table: by its bucket columns
    (:data:`POSITION_BUCKET_COLUMNS`), which a table renamed or stripped of its metadata keeps, or by the
    ``positions_of`` entry :func:`write_tables` gives its metadata."""
    return set(POSITION_BUCKET_COLUMNS) <= set(table.columns) or "positions_of" in metadata


def _main_table_of(path: Path, metadata: Mapping[str, Any]) -> Path | None:
    """The main table the per-position table at ``path`` belongs to (:attr:`PositionsTableError.main_path`)."""
    named = metadata.get("positions_of")
    if isinstance(named, str) and named.strip():
        return path.with_name(Path(named).name)
    if path.stem.endswith(".positions"):
        return path.with_name(path.stem[: -len(".positions")] + path.suffix)
    return None


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
    # not `queries`: the results table's is the selection ("all", "last:64"), which a number would turn into NaN;
    # the per-position table's count of queries reads back as the integer it was written as
    for column in ("layer", "head", "tokens", "num_samples", "replicates", "position_lo", "position_hi"):
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
                   "ess_mean", "delta_var_ratio", "pareto_khat", "ref_max_abs_dev", "seconds", "sink_mass",
                   "ref_max_rel_err", "ref_rms_dev")
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

