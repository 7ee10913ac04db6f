r"""A sweep's parts: one Parquet file per finished unit, beside the table they become.

ARCHITECTURE sec. 11, "store". The parts folder of a table (:func:`parts_path`: ``mse.parquet`` ->
``mse.parquet.parts``) holds ``part-<unit id>.parquet`` files, each written under a temporary name and renamed
when complete, so a process killed mid-write leaves no partial part. A unit with per-position metrics
(:mod:`randattn.analysis.positions`) also writes ``positions-<unit id>.parquet``, atomically and *before* its part:
a unit counts as stored only when its part exists, and then its per-position rows exist too (a unit killed between
the two writes runs again and replaces them). A part also carries, in its Parquet schema metadata, the warnings its
unit raised (:func:`read_part_warnings`), so they survive a resume as its rows do.

A part that cannot be read back -- cut short by a crash of the machine, or overwritten -- is set aside into
``corrupt/`` (:func:`set_aside_unreadable`), and its unit runs again. The rules of a run around its parts (the
manifest, the lock, resume and force) are the store's (:mod:`randattn.analysis.store`).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from randattn._files import atomic_path, named_write_errors
from randattn.results.schema import (
    COLUMNS,
    POSITION_COLUMNS,
    coerce,
    coerce_positions,
    empty_positions,
    empty_table,
    typed_column,
)

__all__ = [
    "CORRUPT_DIR",
    "PART_WARNINGS_KEY",
    "PART_PHASES_KEY",
    "CorruptPartWarning",
    "parts_path",
    "stored_unit_ids",
    "unit_id_of",
    "write_part",
    "read_part_warnings",
    "read_part_phases",
    "read_parts",
    "read_position_parts",
    "unreadable_parts",
    "set_aside_unreadable",
]

#: subfolder of a parts folder where unreadable parts are set aside
CORRUPT_DIR = "corrupt"
_PART_PREFIX, _PART_SUFFIX = "part-", ".parquet"
_POSITIONS_PREFIX = "positions-"
#: the key of a part's Parquet schema metadata under which the warnings its unit raised are stored (JSON: a list of
#: ``[category, message]``, one per time raised)
PART_WARNINGS_KEY = b"randattn_warnings"
#: the key under which a part keeps the wall seconds of each phase of its unit (JSON: phase -> seconds), so that a
#: resumed run's ``timing`` counts the units an earlier process computed
PART_PHASES_KEY = b"randattn_phases"


class CorruptPartWarning(UserWarning):
    """A stored part could not be read: it was set aside and its unit runs again."""


def parts_path(out: str | os.PathLike) -> Path:
    """The parts folder of the table ``out``: ``mse.parquet`` -> ``mse.parquet.parts``."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def unit_id_of(path: str | os.PathLike) -> str:
    """The unit id of a part or per-position part: ``part-<id>.parquet`` or ``positions-<id>.parquet`` -> ``<id>``."""
    name = Path(path).name
    prefix = _POSITIONS_PREFIX if name.startswith(_POSITIONS_PREFIX) else _PART_PREFIX
    return name[len(prefix) : -len(_PART_SUFFIX)]


def stored_unit_ids(parts_dir: str | os.PathLike) -> set[str]:
    """Ids of the units whose part is complete in ``parts_dir`` (temporary files are not parts)."""
    parts_dir = Path(parts_dir)
    if not parts_dir.is_dir():
        return set()
    return {p.name[len(_PART_PREFIX) : -len(_PART_SUFFIX)] for p in parts_dir.glob(f"{_PART_PREFIX}*{_PART_SUFFIX}")}


def write_part(parts_dir: str | os.PathLike, uid: str, rows: Sequence[Mapping[str, Any]],
               positions: Sequence[Mapping[str, Any]] | None = None,
               unit_warnings: Sequence[tuple[str, str]] = (), seconds: Mapping[str, float] | None = None) -> Path:
    """Write one unit's rows as ``part-<uid>.parquet``, atomically; its per-position rows first, if any.

    By pyarrow directly: pandas' ``to_parquet`` took 4.6 ms a part against 1.5 ms (W1 writes
    about 2,400 parts); ``read_parts`` reads back the same dtypes and values. The warnings the
    unit raised go into the part's schema metadata (:data:`PART_WARNINGS_KEY`), so that they
    live and die with its rows: a resumed run reports those of the units an earlier process
    computed (:func:`read_part_warnings`).

    Parameters
    ----------
    parts_dir : path
    uid : str
        The unit's id.
    rows : sequence of dict
        The unit's rows (:data:`~randattn.results.schema.COLUMNS`).
    positions : sequence of dict, optional
        Its per-position rows (:data:`~randattn.results.schema.POSITION_COLUMNS`), written as
        ``positions-<uid>.parquet`` before the part (module docstring).
    unit_warnings : sequence of (category, message)
        Every warning the unit raised, one pair per time it was raised
        (:func:`~randattn.analysis.execute.run_recording`).
    seconds : mapping of str to float, optional
        The wall seconds of each phase of the unit (:data:`PART_PHASES_KEY`, :func:`read_part_phases`).
    """
    if positions is not None:
        _write_rows(Path(parts_dir) / f"{_POSITIONS_PREFIX}{uid}{_PART_SUFFIX}", positions, POSITION_COLUMNS)
    metadata = {PART_WARNINGS_KEY: json.dumps([list(w) for w in unit_warnings]).encode()}
    if seconds is not None:
        metadata[PART_PHASES_KEY] = json.dumps({str(k): float(v) for k, v in seconds.items()}).encode()
    return _write_rows(Path(parts_dir) / f"{_PART_PREFIX}{uid}{_PART_SUFFIX}", rows, COLUMNS, metadata)


def read_part_warnings(parts_dir: str | os.PathLike, uids: Iterable[str]) -> dict[str, list[tuple[str, str]] | None]:
    """The warnings stored with each of the units ``uids`` of ``parts_dir`` (:func:`write_part`).

    Reads each part's footer only (about 0.3 ms a part).

    Returns
    -------
    dict
        unit id -> its ``(category, message)`` pairs, one per time raised; None for a part written
        before parts recorded their warnings (what it raised is not known).
    """
    return {uid: None if text is None else [(str(c), str(m)) for c, m in json.loads(text)]
            for uid, text in _part_metadata(parts_dir, uids, PART_WARNINGS_KEY).items()}


def read_part_phases(parts_dir: str | os.PathLike, uids: Iterable[str]) -> dict[str, dict[str, float] | None]:
    """The phase seconds stored with each of the units ``uids`` of ``parts_dir`` (:func:`write_part`): unit id ->
    phase -> seconds; None for a part written without them (by an older randattn)."""
    return {uid: None if text is None else {str(k): float(v) for k, v in json.loads(text).items()}
            for uid, text in _part_metadata(parts_dir, uids, PART_PHASES_KEY).items()}


def _part_metadata(parts_dir: str | os.PathLike, uids: Iterable[str], key: bytes) -> dict[str, bytes | None]:
    """``key`` of each part's schema metadata (its footer alone is read), None where it has none."""
    import pyarrow.parquet as pq

    return {uid: (pq.read_schema(Path(parts_dir) / f"{_PART_PREFIX}{uid}{_PART_SUFFIX}").metadata or {}).get(key)
            for uid in uids}


def _write_rows(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str],
                metadata: Mapping[bytes, bytes] | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({c: typed_column(c, [row[c] for row in rows], columns) for c in columns}, metadata=metadata)
    with named_write_errors(path), atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return path


# ------------------------------------------------------------------------------------------------- unreadable parts
def unreadable_parts(parts_dir: str | os.PathLike, *, full: bool = False) -> dict[Path, str]:
    """Parts (and per-position parts) of ``parts_dir`` that cannot be read, with the reason.

    Parameters
    ----------
    parts_dir : path
    full : bool
        Read every file whole (about 3 ms a part); by default only its Parquet footer (0.3 ms), which
        finds a file cut short, empty or overwritten.
    """
    import pyarrow.parquet as pq

    parts_dir = Path(parts_dir)
    if not parts_dir.is_dir():
        return {}
    bad = {}
    for path in sorted([*parts_dir.glob(f"{_PART_PREFIX}*{_PART_SUFFIX}"),
                        *parts_dir.glob(f"{_POSITIONS_PREFIX}*{_PART_SUFFIX}")]):
        try:
            if full:
                pq.read_table(path)
            else:
                pq.read_metadata(path)
        except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
            bad[path] = (str(exc).splitlines() or [type(exc).__name__])[0]
    return bad


def set_aside_unreadable(parts_dir: str | os.PathLike, *, full: bool = False) -> list[dict[str, str]]:
    """Move the parts of ``parts_dir`` that cannot be read into its ``corrupt/`` folder, so that their units run again.

    A unit counts as stored when its part exists (module docstring): an unreadable per-position part
    takes its unit's part aside too, so that the unit runs again and writes both.

    Returns
    -------
    list of dict
        One ``{"file", "moved_to", "reason"}`` per file moved (the reason: an unreadable one's error, or
        ``"its per-position part is unreadable"``). Each is also warned about, as :class:`CorruptPartWarning`.
    """
    parts_dir = Path(parts_dir)
    bad = unreadable_parts(parts_dir, full=full)
    for path in list(bad):
        if path.name.startswith(_POSITIONS_PREFIX):
            part = path.with_name(f"{_PART_PREFIX}{unit_id_of(path)}{_PART_SUFFIX}")
            if part.exists() and part not in bad:
                bad[part] = "its per-position part is unreadable"
    moved = []
    for path, reason in bad.items():
        aside = parts_dir / CORRUPT_DIR / path.name
        for n in range(1, 1000):
            if not aside.exists():
                break
            aside = parts_dir / CORRUPT_DIR / f"{path.name}.{n}"
        with named_write_errors(aside):
            aside.parent.mkdir(exist_ok=True)
            os.replace(path, aside)
        moved.append({"file": str(path), "moved_to": str(aside), "reason": reason})
        warnings.warn(f"{str(path)!r} cannot be read ({reason}); set aside as {str(aside)!r}, its unit runs again",
                      CorruptPartWarning, stacklevel=2)
    return moved


def read_parts(parts_dir: str | os.PathLike):
    """All rows written so far under ``parts_dir`` (unsorted), as a DataFrame with :data:`COLUMNS`."""
    return _read(parts_dir, _PART_PREFIX, coerce, empty_table)


def read_position_parts(parts_dir: str | os.PathLike):
    """All per-position rows written so far under ``parts_dir`` (unsorted), with :data:`POSITION_COLUMNS`."""
    return _read(parts_dir, _POSITIONS_PREFIX, coerce_positions, empty_positions)


def _read(parts_dir, prefix: str, coerce_frame, empty):
    import pandas as pd

    paths = sorted(Path(parts_dir).glob(f"{prefix}*{_PART_SUFFIX}"))
    if not paths:
        return empty()
    import pyarrow as pa
    import pyarrow.dataset as ds

    try:  # one multi-threaded read: W1's 768 parts of a process in 0.6 s instead of 2.4 s file by file
        return coerce_frame(ds.dataset([str(p) for p in paths], format="parquet").to_table().to_pandas())
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # parts whose schemas differ (written by another version)
        return coerce_frame(pd.concat([pd.read_parquet(p) for p in paths], ignore_index=True))


