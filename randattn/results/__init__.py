"""The results table: its schema, its parts, the files it is written to and read from, and its metadata.

One owner of the table that ``randattn mse`` writes and ``randattn plot`` / ``report`` read, below both the
measurement (:mod:`randattn.analysis`) and the reports (:mod:`randattn.reports`), which go through it; it imports
neither.

- :mod:`randattn.results.schema`: the columns (:data:`COLUMNS`, :data:`POSITION_COLUMNS`), their dtypes
  (:func:`coerce`) and the canonical row order (:func:`consolidate`);
- :mod:`randattn.results.parts`: one Parquet part per finished unit in the table's parts folder (:func:`parts_path`),
  read back, and set aside when unreadable;
- :mod:`randattn.results.table`: the table and its per-position table written (:func:`write_tables`) and read
  (:func:`read_results`) with their metadata; the metadata-conflict rule (:class:`MetadataConflictWarning`);
- :mod:`randattn.results.summary`: the table's summary over images, layers and heads with bootstrap intervals
  (:func:`aggregate`, LARA app. H.1), from the table alone.
"""

from __future__ import annotations

from randattn.results.parts import (
    CORRUPT_DIR,
    PART_WARNINGS_KEY,
    CorruptPartWarning,
    parts_path,
    read_part_warnings,
    read_parts,
    read_position_parts,
    set_aside_unreadable,
    stored_unit_ids,
    unit_id_of,
    unreadable_parts,
    write_part,
)
from randattn.results.schema import (
    COLUMNS,
    KEYS_USED_COLUMNS,
    POSITION_COLUMNS,
    RELATIVE_ERROR_COLUMNS,
    coerce,
    coerce_positions,
    consolidate,
    consolidate_positions,
    empty_positions,
    empty_table,
)
from randattn.results.summary import aggregate
from randattn.results.table import (
    OUTPUT_FORMATS,
    MetadataConflictWarning,
    Results,
    ResultsError,
    SweepTables,
    positions_path,
    read_results,
    sidecar_path,
    table_records,
    write_table,
    write_tables,
)

__all__ = [
    # schema
    "COLUMNS",
    "KEYS_USED_COLUMNS",
    "POSITION_COLUMNS",
    "RELATIVE_ERROR_COLUMNS",
    "coerce",
    "coerce_positions",
    "consolidate",
    "consolidate_positions",
    "empty_table",
    "empty_positions",
    # parts
    "CORRUPT_DIR",
    "PART_WARNINGS_KEY",
    "CorruptPartWarning",
    "parts_path",
    "stored_unit_ids",
    "unit_id_of",
    "write_part",
    "read_part_warnings",
    "read_parts",
    "read_position_parts",
    "unreadable_parts",
    "set_aside_unreadable",
    # the table's files and metadata
    "OUTPUT_FORMATS",
    "SweepTables",
    "Results",
    "ResultsError",
    "MetadataConflictWarning",
    "positions_path",
    "sidecar_path",
    "table_records",
    "write_table",
    "write_tables",
    "read_results",
    # summary
    "aggregate",
]
