"""The results table has one owner, :mod:`randattn.results`: below the measurement and the reports, reached by both,
and the names that moved to it still answer from their old homes, with a warning that names the new one."""

from __future__ import annotations

import importlib
import warnings

import pytest

from test_import_cycles import import_graph

#: old module -> the names that moved from it, each with its new module
MOVED = {
    "randattn.analysis.store": {
        "CORRUPT_DIR": "randattn.results", "CorruptPartWarning": "randattn.results",
        "PART_WARNINGS_KEY": "randattn.results", "stored_unit_ids": "randattn.results",
        "unit_id_of": "randattn.results", "write_part": "randattn.results", "read_part_warnings": "randattn.results",
        "read_parts": "randattn.results", "read_position_parts": "randattn.results",
        "unreadable_parts": "randattn.results", "set_aside_unreadable": "randattn.results",
        "coerce": "randattn.results", "coerce_positions": "randattn.results", "consolidate": "randattn.results",
        "consolidate_positions": "randattn.results", "empty_table": "randattn.results",
        "empty_positions": "randattn.results", "OUTPUT_FORMATS": "randattn.results",
    },
    "randattn.reports.tables": {
        "MetadataConflictWarning": "randattn.results", "Results": "randattn.results",
        "read_results": "randattn.results",
    },
    "randattn.analysis.sweep": {
        "PHASES": "randattn.analysis.execute", "UnitRunner": "randattn.analysis.execute",
        "run_recording": "randattn.analysis.execute", "Unit": "randattn.analysis.plan",
        "bind_token_layout": "randattn.analysis.plan", "plan_units": "randattn.analysis.plan",
        "select": "randattn.analysis.plan", "total_cells": "randattn.analysis.plan",
        "with_threads": "randattn.analysis.plan", "prepare_parts_dir": "randattn.analysis.store",
        "sweep_lock": "randattn.analysis.store", "OUTPUT_FORMATS": "randattn.results",
        "empty_positions": "randattn.results", "empty_table": "randattn.results",
        "set_aside_unreadable": "randattn.results", "stored_unit_ids": "randattn.results",
        "unreadable_parts": "randattn.results", "write_part": "randattn.results",
        "atomic_path": "randattn._files", "named_write_errors": "randattn._files",
    },
}


def test_results_imports_neither_the_measurement_nor_the_reports_nor_the_cli():
    graph = import_graph()
    results = {name: targets for name, targets in graph.items() if name.split(".")[:2] == ["randattn", "results"]}
    assert set(results) == {"randattn.results", "randattn.results.schema", "randattn.results.parts",
                            "randattn.results.table", "randattn.results.summary"}
    above = {(name, target) for name, targets in results.items() for target in targets
             if target.split(".")[1] in ("analysis", "reports", "cli")}
    assert above == set()


def test_the_reports_and_the_cli_get_the_table_from_results_not_from_the_measurement():
    """Reading a table never passes through analysis: reports and the CLI import its names from results."""
    graph = import_graph()
    for name in ("randattn.reports.tables", "randattn.cli.report", "randattn.cli.plot"):
        assert "randattn.results.table" in graph[name], name
    assert "randattn.analysis.sweep" not in graph["randattn.reports.tables"]
    assert "randattn.analysis.store" not in graph["randattn.reports.tables"]


@pytest.mark.parametrize(("old", "name"), [(old, name) for old, names in MOVED.items() for name in names])
def test_a_moved_name_answers_from_its_old_home_with_a_warning_naming_the_new_one(old, name):
    new = MOVED[old][name]
    with pytest.warns(DeprecationWarning, match=rf"{old}\.{name} is deprecated: .*{new}"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("module", ["randattn.analysis.sweep", "randattn.analysis.store", "randattn.reports.tables",
                                    "randattn.results"])
def test_every_public_name_answers_without_a_warning(module):
    """What a module lists as its own in ``__all__`` is there, and none of it is deprecated."""
    loaded = importlib.import_module(module)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for name in loaded.__all__:
            assert getattr(loaded, name) is not None, name


def test_the_sweep_front_passes_on_the_jobs_own_objects():
    """``randattn.analysis.sweep`` is the front of its three jobs: the same objects, not copies."""
    from randattn.analysis import sweep, sweep_plan, sweep_run
    from randattn.results import summary as aggregation
    from randattn.results import table

    assert sweep.plan_sweep is sweep_plan.plan_sweep and sweep.plan is sweep_plan.plan
    assert sweep.run_sweep is sweep_run.run_sweep and sweep.aggregate is aggregation.aggregate
    assert sweep.write_tables is table.write_tables and sweep.SweepTables is table.SweepTables


def test_the_schema_is_defined_once():
    """The measurement fills the columns the results package defines: the very same tuples."""
    from randattn.analysis import execute, positions, relative_error, unit_rows
    from randattn.reports import tables
    from randattn.results import schema

    assert unit_rows.COLUMNS is schema.COLUMNS is execute.COLUMNS is tables.RESULT_COLUMNS
    assert positions.POSITION_COLUMNS is schema.POSITION_COLUMNS is tables.POSITION_COLUMNS
    assert relative_error.RELATIVE_ERROR_COLUMNS is schema.RELATIVE_ERROR_COLUMNS
    assert unit_rows.KEYS_USED_COLUMNS is schema.KEYS_USED_COLUMNS


def test_an_unknown_name_is_still_an_attribute_error():
    for module in MOVED:
        with pytest.raises(AttributeError, match="no_such_name"):
            getattr(importlib.import_module(module), "no_such_name")
