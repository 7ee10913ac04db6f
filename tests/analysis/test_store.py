"""The sweep store (issue #27): its lock leaves no file behind and stays exclusive, damaged parts and manifests are
named, write errors name the file meant, and the final tables are written all or nothing."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

import pandas as pd
import pytest

from randattn.analysis.store import SweepLockedError, prepare_parts_dir, read_manifest, sweep_lock
from randattn.results import CorruptPartWarning, set_aside_unreadable, stored_unit_ids, write_part
from randattn.results import schema as store


def _row(uid: str) -> dict:
    """One table row: every column, with values of its dtype."""
    from randattn.analysis.execute import COLUMNS

    row = {c: 0.5 for c in COLUMNS}
    row.update({c: uid for c in store._STR_COLUMNS})
    row.update({c: 1 for c in store._INT_COLUMNS if c in COLUMNS})
    row.update(random=True)
    return row


def _flock_is_taken(path: Path) -> bool:
    """Whether a new open file description of ``path`` is refused its lock (as another process's would be)."""
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# ------------------------------------------------------------------------------------------------------ the lock
def test_the_lock_leaves_no_file_behind_however_the_block_ends(tmp_path):
    target = tmp_path / "x.parquet"
    with sweep_lock(target):
        assert sorted(p.name for p in tmp_path.iterdir()) == [".x.parquet.lock", ".x.parquet.owner.json"]
        assert _flock_is_taken(tmp_path / ".x.parquet.lock")
    assert list(tmp_path.iterdir()) == []
    for stop in (ValueError("failed"), KeyboardInterrupt()):
        with pytest.raises(type(stop)), sweep_lock(target):
            raise stop
        assert list(tmp_path.iterdir()) == []


def test_a_second_writer_is_refused_naming_the_first_and_removes_nothing(tmp_path):
    target = tmp_path / "x.parquet"
    with sweep_lock(target):
        with pytest.raises(SweepLockedError, match=rf"being written by another randattn process \(pid {os.getpid()} "):
            with sweep_lock(target):
                pytest.fail("two writers")
        assert (tmp_path / ".x.parquet.lock").exists() and (tmp_path / ".x.parquet.owner.json").exists()
    assert list(tmp_path.iterdir()) == []


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again_on_the_file_at_the_path(tmp_path, monkeypatch):
    """The race of removing a lock file: B opens the file, its holder A removes it and lets go, C creates a new one,
    B locks the removed file. B must notice and lock the file now at the path, or C could lock it too."""
    target, lock_path = tmp_path / "x.parquet", tmp_path / ".x.parquet.lock"
    with sweep_lock(target):  # A
        stale = os.open(lock_path, os.O_RDWR)  # B's open, while A holds the lock
    assert not lock_path.exists()  # A removed the file before letting go
    lock_path.touch()  # and C created a new one, not locked yet

    real_open, handed = os.open, []

    def open_(path, flags, *args, **kwargs):  # B's acquisition starts from the descriptor it opened before
        if Path(path) == lock_path and not handed:
            handed.append(stale)
            return stale
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    with sweep_lock(target):  # B
        assert handed == [stale]
        assert lock_path.exists() and _flock_is_taken(lock_path)  # C is refused: B holds the file at the path
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------ parts
def test_unreadable_parts_are_set_aside_named_with_their_reason(tmp_path):
    parts = tmp_path / "x.parquet.parts"
    prepare_parts_dir(parts, {"config": {}, "activations": {}}, resume=False)
    for uid in ("L0-a", "L0-b", "L0-c"):
        write_part(parts, uid, [_row(uid)])
    cut = parts / "part-L0-a.parquet"
    with open(cut, "r+b") as handle:
        handle.truncate(cut.stat().st_size // 2)
    (parts / "part-L0-b.parquet").write_bytes(b"")
    with pytest.warns(CorruptPartWarning) as warned:
        moved = set_aside_unreadable(parts)
    assert [(Path(m["file"]).name, Path(m["moved_to"])) for m in moved] == [
        ("part-L0-a.parquet", parts / "corrupt" / "part-L0-a.parquet"),
        ("part-L0-b.parquet", parts / "corrupt" / "part-L0-b.parquet")]
    assert all(m["reason"] for m in moved) and len(warned) == 2
    assert f"'{cut}' cannot be read (" in str(warned[0].message)
    assert stored_unit_ids(parts) == {"L0-c"}
    assert set_aside_unreadable(parts) == []  # nothing left to set aside; a second time the name gets a number
    (parts / "part-L0-a.parquet").write_bytes(b"x")
    with pytest.warns(CorruptPartWarning):
        assert Path(set_aside_unreadable(parts)[0]["moved_to"]).name == "part-L0-a.parquet.1"


def test_a_part_keeps_its_units_warnings_beside_unchanged_rows(tmp_path):
    """Each time raised, in order; a part without them (written before parts kept them) reads as None: unknown."""
    import pyarrow.parquet as pq

    from randattn.results import read_part_warnings, read_parts

    raised = [("NonPositiveDenominatorWarning", "some queries"), ("NonPositiveDenominatorWarning", "some queries"),
              ("DiagnosticsSkippedWarning", "no mask")]
    write_part(tmp_path, "L0-a", [_row("L0-a")], unit_warnings=raised)
    write_part(tmp_path, "L0-b", [_row("L0-b")])
    plain = pq.read_table(tmp_path / "part-L0-b.parquet")
    pq.write_table(plain.replace_schema_metadata({}), tmp_path / "part-L0-c.parquet")  # as an older randattn wrote
    assert read_part_warnings(tmp_path, ["L0-a", "L0-b", "L0-c"]) == {"L0-a": raised, "L0-b": [], "L0-c": None}
    rows = read_parts(tmp_path).sort_values("image").reset_index(drop=True)
    assert rows["image"].tolist() == ["L0-a", "L0-b", "L0-b"]  # the metadata leaves the rows as they were


def test_an_unreadable_per_position_part_takes_its_unit_along(tmp_path):
    from randattn.analysis.positions import POSITION_COLUMNS

    parts = tmp_path / "p"
    prepare_parts_dir(parts, {"config": {}, "activations": {}}, resume=False)
    position = {c: _row("L0-a").get(c, 1) for c in POSITION_COLUMNS}
    write_part(parts, "L0-a", [_row("L0-a")], [position])
    (parts / "positions-L0-a.parquet").write_bytes(b"PAR1 and then nothing")
    with pytest.warns(CorruptPartWarning):
        moved = set_aside_unreadable(parts)
    reasons = {Path(m["file"]).name: m["reason"] for m in moved}
    assert reasons["part-L0-a.parquet"] == "its per-position part is unreadable"
    assert reasons["positions-L0-a.parquet"].startswith("Parquet magic bytes not found")
    assert stored_unit_ids(parts) == set()


@pytest.mark.parametrize(("content", "wrong"), [
    (None, "is missing"),
    ("{nope", "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ('"text"', "holds a JSON str, not an object with 'config' and 'activations'"),
    ('{"config": {}, "activations": []}', "lacks 'activations' (expected objects)"),
], ids=["missing", "not-json", "not-an-object", "wrong-field"])
def test_a_damaged_manifest_is_named_with_what_is_wrong(tmp_path, content, wrong):
    parts = tmp_path / "x.parts"
    prepare_parts_dir(parts, {"config": {}, "activations": {}}, resume=False)
    write_part(parts, "L0-a", [_row("L0-a")])
    manifest = parts / "manifest.json"
    if content is None:
        manifest.unlink()
    else:
        manifest.write_text(content)
    expected = f"cannot resume '{parts}': its manifest '{manifest}' {wrong}"
    with pytest.raises(ValueError) as raised:
        read_manifest(parts)
    assert str(raised.value).startswith(expected), str(raised.value)
    with pytest.raises(ValueError, match="its manifest"):
        prepare_parts_dir(parts, {"config": {}, "activations": {}}, resume=True)


def test_changed_settings_are_listed_once_each_by_where_they_changed(tmp_path):
    """'layers' is both an option and a property of the activations: it is never listed as 'layers, layers'."""
    parts = tmp_path / "x.parts"
    old = {"config": {"layers": [0], "seed": 1}, "activations": {"layers": [0, 1], "shape": [1, 2]}}
    prepare_parts_dir(parts, old, resume=False)
    write_part(parts, "L0-a", [_row("L0-a")])
    new = {"config": {"layers": [1], "seed": 1}, "activations": {"layers": [0, 1, 2], "shape": [1, 3]}}
    with pytest.raises(ValueError) as raised:
        prepare_parts_dir(parts, new, resume=True)
    assert str(raised.value) == (f"cannot resume {str(parts)!r}: it was started with different settings (layers) and "
                                 "other activations (their layers, shape); use the same options and activations, or "
                                 "a new output")


# ------------------------------------------------------------------------------------------------------ writes
def test_a_failed_part_write_names_the_part_not_its_temporary_file(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    def full(table, where, *args, **kwargs):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(OSError) as raised:
        write_part(tmp_path, "L0-a", [_row("L0-a")])
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "part-L0-a.parquet")
    assert raised.value.strerror == os.strerror(errno.ENOSPC)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failing", ["x.parquet.meta.json", "x.positions.parquet", "x.positions.parquet.meta.json"])
def test_the_tables_are_written_all_or_nothing(tmp_path, monkeypatch, failing):
    """A write that fails (the metadata sidecar, the per-position table) leaves every earlier output as it was."""
    import randattn.results.table as sweep
    from randattn.analysis.positions import POSITION_COLUMNS

    table = pd.DataFrame([_row("L0-a")])
    positions = pd.DataFrame([{c: 1 for c in POSITION_COLUMNS}])
    out = tmp_path / "x.parquet"
    out.write_text("the older table")
    real = sweep.atomic_path

    def atomic_path(path):
        if Path(path).name == failing:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(tmp_path / f".{failing}.abc.tmp"))
        return real(path)

    monkeypatch.setattr(sweep, "atomic_path", atomic_path)
    with pytest.raises(OSError) as raised:
        sweep.write_tables(sweep.SweepTables(table, positions), out, {"seed": 1})
    assert raised.value.filename == str(tmp_path / failing) and raised.value.errno == errno.EDQUOT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet"] and out.read_text() == "the older table"

    monkeypatch.setattr(sweep, "atomic_path", real)
    written = sweep.write_tables(sweep.SweepTables(table, positions), out, {"seed": 1})
    assert sorted(p.name for p in written) == sorted(p.name for p in tmp_path.iterdir())
    assert json.loads((tmp_path / "x.positions.parquet.meta.json").read_text())["positions_of"] == "x.parquet"


# ------------------------------------------------------------------------------------------------------ a sweep
def test_a_part_damaged_past_its_footer_is_found_at_the_end_and_its_unit_computed_again(rng, tmp_path):
    """A resume sets aside parts whose footer is damaged before it runs; one whose data pages are damaged is found
    only when the parts are read at the end: set aside then, its unit computed again, the same table."""
    import numpy as np
    import pyarrow.parquet as pq

    from randattn.activations import make_activations
    from randattn.analysis.sweep import SweepConfig, parse_estimator_list, run_sweep

    arrays = {0: tuple(0.8 * rng.normal(size=(1, 2, 9, 4)) for _ in range(3))}
    acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic"})
    config = SweepConfig(estimators=parse_estimator_list("rfa;ra"), num_samples=(4,), replicates=3, seed=11,
                         diagnostics=False, backend="reference")
    parts = tmp_path / "x.parts"
    whole = run_sweep(acts, config, parts_dir=parts)
    damaged = sorted(parts.glob("part-*.parquet"))[0]
    column = pq.read_metadata(damaged).row_group(0).column(list(whole.columns).index("mse"))
    with open(damaged, "r+b") as handle:  # the page header of one column: the footer still reads
        handle.seek(column.data_page_offset)
        handle.write(b"\xff" * 16)
    pq.read_metadata(damaged)

    with pytest.warns(CorruptPartWarning, match="cannot be read"):
        again = run_sweep(acts, config, parts_dir=parts, resume=True)
    assert [Path(m["file"]) for m in again.attrs["set_aside"]] == [damaged]
    assert (parts / "corrupt" / damaged.name).exists() and damaged.exists()
    pd.testing.assert_frame_equal(again.drop(columns="seconds"), whole.drop(columns="seconds"), check_exact=True)
    assert np.array_equal(again["mse"].to_numpy().view(np.int64), whole["mse"].to_numpy().view(np.int64))


def test_a_resumed_runs_timing_counts_the_phases_of_the_units_an_earlier_process_computed(rng, tmp_path):
    """Each part keeps its unit's phase seconds: a resume that finds 3 of 4 units stored and computes 1 reports the
    phases of all 4 (the same seconds, per configuration, as the first run measured them), with earlier_units 3 and
    units 1; a part written without them (an older randattn) is left out and not counted."""
    import pyarrow.parquet as pq

    from randattn.activations import make_activations
    from randattn.analysis.sweep import SweepConfig, parse_estimator_list, run_sweep
    from randattn.results.parts import PART_PHASES_KEY

    arrays = {layer: tuple(0.8 * rng.normal(size=(1, 2, 9, 4)) for _ in range(3)) for layer in (0, 1)}
    acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic"})
    config = SweepConfig(estimators=parse_estimator_list("rfa;ra"), num_samples=(4,), replicates=3, seed=11,
                         diagnostics=False, backend="reference")
    parts = tmp_path / "x.parts"
    first = run_sweep(acts, config, parts_dir=parts).attrs["timing"]
    assert (first["units"], first["earlier_units"]) == (4, 0)
    stored = sorted(parts.glob("part-*.parquet"))
    stored[0].unlink()
    again = run_sweep(acts, config, parts_dir=parts, resume=True).attrs["timing"]
    assert (again["units"], again["earlier_units"]) == (1, 3)
    assert sum(record["units"] for record in again["phases"]) == 4
    by_label = {r["label"]: r for r in first["phases"]}
    recomputed = {r["label"]: r for r in again["phases"]}
    for label, record in by_label.items():
        assert recomputed[label]["units"] == record["units"] and recomputed[label]["cells"] == record["cells"]
    # the three stored units' seconds are the first run's, as written: compare one part's own record
    one = json.loads(pq.read_schema(stored[1]).metadata[PART_PHASES_KEY])
    assert set(one) == {"exact", "draws", "estimate", "diagnostics", "reference_check", "metrics"}
    table = pq.read_table(stored[1])
    pq.write_table(table.replace_schema_metadata({k: v for k, v in table.schema.metadata.items()
                                                  if k != PART_PHASES_KEY}), stored[1])
    older = run_sweep(acts, config, parts_dir=parts, resume=True).attrs["timing"]
    assert (older["units"], older["earlier_units"]) == (0, 3)
    assert sum(record["units"] for record in older["phases"]) == 3


def test_check_output_compares_a_resumed_runs_settings_and_activations_before_it_runs(tmp_path):
    """``check_output`` refuses parts of other settings or activations at once (it was left to the run's start);
    without ``activations`` it compares the settings alone, and a manifest without a digest is not compared on it."""
    from randattn.analysis.store import SettingsChangedError, check_output

    out = tmp_path / "x.parquet"
    parts = tmp_path / "x.parquet.parts"
    fingerprint = {"shape": [1, 2, 8, 4], "digest": "a" * 64}
    prepare_parts_dir(parts, {"config": {"seed": 1}, "activations": fingerprint}, resume=False)
    (parts / "part-L0-a.parquet").write_bytes(b"")
    assert check_output(out, {"seed": 1}, resume=True, force=False) is False
    assert check_output(out, {"seed": 1}, resume=True, force=False, activations=fingerprint) is False
    with pytest.raises(SettingsChangedError) as changed:
        check_output(out, {"seed": 2}, resume=True, force=False)
    assert (changed.value.settings, changed.value.activations) == (("seed",), ())
    with pytest.raises(SettingsChangedError) as changed:
        check_output(out, {"seed": 1}, resume=True, force=False, activations={**fingerprint, "digest": "b" * 64})
    assert (changed.value.settings, changed.value.activations) == ((), ("digest",))
    older = {"config": {"seed": 1}, "activations": {"shape": [1, 2, 8, 4]}}  # a manifest made before the digest
    (parts / "manifest.json").write_text(json.dumps(older))
    assert check_output(out, {"seed": 1}, resume=True, force=False, activations=fingerprint) is False
