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

from randattn.results import parts, schema, summary, table
from randattn.results.parts import *  # noqa: F403 -- the front re-exports each submodule's __all__
from randattn.results.schema import *  # noqa: F403
from randattn.results.summary import *  # noqa: F403
from randattn.results.table import *  # noqa: F403

__all__ = [*schema.__all__, *parts.__all__, *table.__all__, *summary.__all__]
