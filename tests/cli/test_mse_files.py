"""``randattn mse A B ...``: several activation files in one process, each exactly its own run.

Each file gets its own table (``--out`` with ``{stem}``), metadata, mask and scale; every file and output is checked
before the first unit is computed. The real-process cases (the lock, an interrupted run resumed) are in
``test_faults.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.cli import main

#: a small sweep: 2 layers x 2 heads x 2 images x (rfa, ra) x S in (4, 8): 16 units of 2 heads (32 cells) a file
SWEEP = ("-e", "rfa", "-e", "ra", "--samples", "4,8", "--replicates", "3", "--seed", "5", "--no-diagnostics",
         "--threads", "1")


def _save(path, rng, tokens, meta=None):
    arrays = {layer: tuple(0.8 * rng.normal(size=(2, 2, tokens, 4)) for _ in range(3)) for layer in (0, 1)}
    return save_activations(make_activations(arrays, {"scale": 0.5, "model": "synthetic", **(meta or {})}), path)


@pytest.fixture
def files(tmp_path):
    """Two files of other token counts, scales and masks: b is a causal (language-model-like) capture."""
    rng = np.random.default_rng(3)
    a = _save(tmp_path / "in" / "a.safetensors", rng, 8)
    b = _save(tmp_path / "in" / "b.safetensors", rng, 12, {"scale": 0.3, "mask": "causal"})
    return a, b


def _invoke(*args):
    return CliRunner().invoke(main, ["mse", *map(str, args)], catch_exceptions=False)


def _said(result) -> str:
    return " ".join(result.stderr.split())


def _assert_bitwise_equal(got: pd.DataFrame, want: pd.DataFrame) -> None:
    """Equal in every column but ``seconds`` (wall time), floats bit for bit."""
    got, want = got.drop(columns=["seconds"]), want.drop(columns=["seconds"])
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    for column in got.columns[got.dtypes == "float64"]:
        assert np.array_equal(got[column].to_numpy().view(np.int64), want[column].to_numpy().view(np.int64)), column


def test_two_files_in_one_run_give_the_two_single_file_runs_tables_bit_for_bit(files, tmp_path):
    a, b = files
    for source in files:
        alone = _invoke(source, *SWEEP, "--out", tmp_path / "alone" / f"{source.stem}.parquet")
        assert alone.exit_code == 0, alone.output
    both = _invoke(a, b, *SWEEP, "--out", tmp_path / "both" / "w-{stem}.parquet")
    assert both.exit_code == 0, both.output
    for source in files:
        out = tmp_path / "both" / f"w-{source.stem}.parquet"
        _assert_bitwise_equal(pd.read_parquet(out), pd.read_parquet(tmp_path / "alone" / f"{source.stem}.parquet"))
        meta = json.loads(out.with_name(out.name + ".meta.json").read_text())
        alone = json.loads((tmp_path / "alone" / f"{source.stem}.parquet.meta.json").read_text())
        # each file's own mask (--mask file) and scale, and the same identity as its run alone (--resume relies on it)
        assert meta["config_identity"] == alone["config_identity"]
        assert meta["activations"] == alone["activations"] and meta["output"] == str(out)
        assert not out.with_name(out.name + ".parts").exists()
    metas = [json.loads((tmp_path / "both" / f"w-{s.stem}.parquet.meta.json").read_text()) for s in files]
    assert [m["mask"] for m in metas] == [None, "causal"] and [m["activations"]["scale"] for m in metas] == [0.5, 0.3]
    # the summaries on stdout follow the file each is about
    assert both.stdout.index(str(a)) < both.stdout.index(str(b))
    assert both.stdout.count("attention MSE") == 2


def test_json_with_several_files_is_one_object_of_the_single_runs_summaries(files):
    args = ("-e", "rfa", "--samples", "4", "--replicates", "3", "--layers", "1", "--no-diagnostics",
            "--no-probabilities", "--threads", "1", "--json")
    single = {str(source): json.loads(_invoke(source, *args).stdout) for source in files}
    both = _invoke(*files, *args)
    assert both.exit_code == 0, both.output
    assert json.loads(both.stdout) == single


def _one_layer(path):
    rng = np.random.default_rng(0)
    arrays = {0: tuple(0.8 * rng.normal(size=(2, 2, 8, 4)) for _ in range(3))}
    return save_activations(make_activations(arrays, {"scale": 0.5}), path)


def _corrupt(path):
    path.write_bytes(b"\x00" * 64)
    return path


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda a, b, t: [a, t / "missing.safetensors"],
         "{t}/missing.safetensors: cannot read activations: activation file not found"),
        (lambda a, b, t: [a, _corrupt(b)], "{b}: cannot read activations:"),
        (lambda a, b, t: [a, _one_layer(t / "in" / "one.safetensors"), "--layers", "0,1"],
         "{t}/in/one.safetensors: layers [1] not in the activations; available: [0]"),
        (lambda a, b, t: [a, b, "-e", "lara", "--samples", "4"],  # b's own mask (causal) excludes lara
         "{b}: estimator 'lara' does not support mask='causal'"),
    ],
    ids=["missing", "corrupt", "layer-mismatch", "mask"],
)
def test_a_bad_file_is_refused_by_name_before_any_work(files, tmp_path, monkeypatch, make_args, message):
    from randattn.analysis import sweep

    a, b = files
    args = make_args(a, b, tmp_path)
    for name in ("plan_sweep", "run_sweep"):
        monkeypatch.setattr(sweep, name, lambda *x, **k: pytest.fail("computed before refusing"))
    result = _invoke(*args, *(SWEEP if "-e" not in args else ()), "--out", tmp_path / "o" / "{stem}.parquet")
    assert result.exit_code == 2, result.output
    assert message.format(a=a, b=b, t=tmp_path) in _said(result)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda a, b, t: [a, b, "--out", t / "one.parquet"],
         "--out '{t}/one.parquet': with 2 activation files, --out needs {{stem}} (each file's name without its "
         "suffix), e.g. --out 'mse-{{stem}}.parquet'"),
        (lambda a, b, t: [a, a, "--out", t / "{stem}.csv"], "ACTS '{a}' is given twice"),
        (lambda a, b, t: [a, _save(t / "other" / "a.safetensors", np.random.default_rng(1), 8),
                          "--out", t / "{stem}.csv"],
         "'{a}' and '{t}/other/a.safetensors' would both write '{t}/a.csv'; rename one of them"),
        (lambda a, b, t: [a, b, "--resume"], "--resume needs --out"),
    ],
    ids=["no-stem", "twice", "same-output", "resume-without-out"],
)
def test_outputs_that_cannot_map_one_to_one_are_refused(files, tmp_path, make_args, message):
    a, b = files
    result = _invoke(*make_args(a, b, tmp_path), *SWEEP)
    assert result.exit_code == 2, result.output
    assert message.format(a=a, b=b, t=tmp_path) in _said(result)


def test_dry_run_plans_every_file_and_writes_nothing(files, tmp_path):
    a, b = files
    out = tmp_path / "o" / "{stem}.parquet"
    result = _invoke(a, b, *SWEEP, "--out", out, "--dry-run")
    assert result.exit_code == 0, result.output
    said = _said(result)
    assert said.count("plan: 32 cells in 16 units") == 2 and said.count("wall time: about") == 2
    assert said.index(f"{a} -> {tmp_path}/o/a.parquet") < said.index(f"{b} -> {tmp_path}/o/b.parquet")
    assert f"it would write {tmp_path}/o/a.parquet, {tmp_path}/o/b.parquet" in said
    assert not (tmp_path / "o").exists()


def test_an_interrupted_run_resumes_skipping_finished_files_to_the_single_file_tables(files, tmp_path, monkeypatch):
    """In process: Ctrl-C while b's third unit is written (a's table written, two of b's units kept); --resume then
    leaves a's table alone and ends b's equal to its run alone. The same with a real SIGINT: test_faults.py."""
    from randattn.analysis import sweep_run as sweep  # the run writes each unit's part

    a, b = files
    alone = _invoke(b, *SWEEP, "--out", tmp_path / "alone" / "b.parquet")
    assert alone.exit_code == 0, alone.output
    write_part, calls = sweep.write_part, []

    def interrupted_write(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 16 + 3:  # a's 16 units, then b's first two
            raise KeyboardInterrupt
        return write_part(*args, **kwargs)

    monkeypatch.setattr(sweep, "write_part", interrupted_write)
    out = tmp_path / "o" / "{stem}.parquet"
    done_a, done_b = tmp_path / "o" / "a.parquet", tmp_path / "o" / "b.parquet"
    stopped = CliRunner().invoke(main, ["mse", str(a), str(b), *SWEEP, "--out", str(out)])
    assert stopped.exit_code == 130, stopped.output
    said = _said(stopped)
    assert f"written before the interruption: {done_a} (--resume finds them complete)" in said
    assert f"interrupted: 4 of 32 cells are kept in {done_b}.parts" in said
    assert done_a.exists() and not done_b.exists()
    monkeypatch.setattr(sweep, "write_part", write_part)

    before = done_a.stat().st_mtime_ns
    plain = _invoke(a, b, *SWEEP, "--out", out)
    assert plain.exit_code == 2 and f"'{done_a}' exists; pass --force" in _said(plain)
    resumed = _invoke(a, b, *SWEEP, "--out", out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    said = _said(resumed)
    assert f"{done_a} already holds this run, complete; nothing to do" in said
    assert "resuming: 28 cells left to compute" in said
    assert done_a.stat().st_mtime_ns == before
    _assert_bitwise_equal(pd.read_parquet(done_b), pd.read_parquet(tmp_path / "alone" / "b.parquet"))


def _interrupt_after(monkeypatch, units: int, error: BaseException = KeyboardInterrupt()):
    """Make the run raise ``error`` while writing its unit number ``units + 1``; returns the undo."""
    from randattn.analysis import sweep_run as sweep

    write_part, calls = sweep.write_part, []

    def interrupted_write(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == units + 1:
            raise error
        return write_part(*args, **kwargs)

    monkeypatch.setattr(sweep, "write_part", interrupted_write)
    return lambda: monkeypatch.setattr(sweep, "write_part", write_part)


def _same_shapes_other_numbers(source, target):
    """``source``'s capture with its queries doubled: shapes, layers, images, model and scale as they were."""
    import warnings

    from randattn.activations import load_activations

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixture's files have no grid: said by the runs themselves
        acts = load_activations(source)
    arrays = {layer: (2 * acts.q(layer), acts.k(layer), acts.v(layer)) for layer in acts.layers}
    return save_activations(make_activations(arrays, dict(acts.metadata)), target)


def test_a_resume_on_activations_changed_in_their_numbers_alone_is_refused_before_any_unit(files, tmp_path,
                                                                                         monkeypatch):
    """The manifest compared shape, layers, images, model and scale: a capture changed in its numbers alone was
    resumed, and the table mixed units of both files (exit 0); a finished table said "complete". Now the arrays'
    SHA-256 is compared too, for parts and for a finished table, before any unit is computed; so is a changed
    setting, which the dry run had passed and the run refused only after planning."""
    import shutil

    a, _ = files
    changed = _same_shapes_other_numbers(a, tmp_path / "in2" / "a.safetensors")
    out = tmp_path / "o" / "a.parquet"
    undo = _interrupt_after(monkeypatch, 3)
    assert _invoke(a, *SWEEP, "--out", out).exit_code == 130
    undo()
    kept = sorted(p.name for p in (tmp_path / "o" / "a.parquet.parts").iterdir())
    for extra in ((), ("--dry-run",)):
        refused = _invoke(changed, *SWEEP, "--out", out, "--resume", *extra)
        assert refused.exit_code == 2, refused.output
        assert "it was started with other activations (their digest)" in _said(refused)
        seed = _invoke(a, *("6" if word == "5" else word for word in SWEEP), "--out", out, "--resume", *extra)
        assert seed.exit_code == 2 and "it was started with different settings (seed)" in _said(seed), seed.output
        assert sorted(p.name for p in (tmp_path / "o" / "a.parquet.parts").iterdir()) == kept  # nothing computed
    resumed = _invoke(a, *SWEEP, "--out", out, "--resume")
    assert resumed.exit_code == 0, resumed.output
    again = _invoke(changed, *SWEEP, "--out", out, "--resume")
    assert again.exit_code == 2, again.output
    assert f"'{out}' holds a finished run of other activations (their digest); use --force" in _said(again)
    assert "already holds this run" in _said(_invoke(a, *SWEEP, "--out", out, "--resume"))
    # parts and tables written before the digest was recorded stay resumable: their numbers cannot be compared
    sidecar = out.with_name(out.name + ".meta.json")
    meta = json.loads(sidecar.read_text())
    del meta["activations_fingerprint"]
    sidecar.write_text(json.dumps(meta))
    assert "already holds this run" in _said(_invoke(changed, *SWEEP, "--out", out, "--resume"))
    shutil.rmtree(tmp_path / "o")
    undo = _interrupt_after(monkeypatch, 3)
    assert _invoke(a, *SWEEP, "--out", out).exit_code == 130
    undo()
    manifest = tmp_path / "o" / "a.parquet.parts" / "manifest.json"
    stored = json.loads(manifest.read_text())
    del stored["activations"]["digest"]
    manifest.write_text(json.dumps(stored))
    assert _invoke(a, *SWEEP, "--out", out, "--resume").exit_code == 0


def test_a_resume_finding_its_finished_table_damaged_exits_2_naming_it_before_any_file_runs(files, tmp_path):
    """A finished table cut short was found "complete" by --resume, which then died reading it (a traceback, exit
    1), after the other files' runs. It is now read when found, and refused naming it and --force (exit 2)."""
    a, b = files
    out = tmp_path / "o" / "{stem}.parquet"
    assert _invoke(a, *SWEEP, "--out", out).exit_code == 0
    done_a = tmp_path / "o" / "a.parquet"
    with open(done_a, "r+b") as table:
        table.truncate(500)
    resumed = _invoke(a, b, *SWEEP, "--out", out, "--resume")
    assert resumed.exit_code == 2, resumed.output
    assert f"cannot read results '{done_a}' as parquet" in _said(resumed)
    assert _said(resumed).endswith("; --force computes it again")
    assert not (tmp_path / "o" / "b.parquet").exists() and not (tmp_path / "o" / "b.parquet.parts").exists()


def test_memory_that_runs_out_after_some_units_says_how_to_continue(files, tmp_path, monkeypatch):
    """A full disk and an interruption print the --resume command; memory that ran out said only "kept for
    --resume". It now says to continue with a lower --max-memory, and the command."""
    a, _ = files
    out = tmp_path / "o" / "a.parquet"
    _interrupt_after(monkeypatch, 3, MemoryError("Unable to allocate 7.15 GiB for an array with shape (3, 10**9)"))
    result = _invoke(a, *SWEEP, "--out", out)
    assert result.exit_code == 2, result.output
    said = _said(result)
    assert "out of memory (Unable to allocate 7.15 GiB" in said, said
    # in process the command is pytest's argv; test_faults.py runs real processes
    assert f"finished units are kept in {out}.parts for --resume; with a lower --max-memory, continue with: " \
           "randattn " in said and said.endswith("--resume"), said


def test_a_refused_run_takes_back_the_folders_it_made_for_out(files, tmp_path):
    """A bad-input refusal left nothing, but a run refused by its memory budget (after --out's folders were made)
    left them behind, empty; a folder that existed, or holds anything, stays."""
    a, _ = files
    out = tmp_path / "new" / "sub" / "r.parquet"
    refused = _invoke(a, "-e", "ra", "--samples", "4", "--replicates", "2", "--max-memory", "16KiB", "--out", out)
    assert refused.exit_code == 2 and "more than the memory budget of 16 KiB" in _said(refused), refused.output
    assert not (tmp_path / "new").exists()
    (tmp_path / "new").mkdir()
    assert _invoke(a, "-e", "ra", "--samples", "4", "--max-memory", "16KiB", "--out", out).exit_code == 2
    assert list(tmp_path.glob("new/**")) == [tmp_path / "new"]


@pytest.mark.parametrize("companion", ["a.positions.parquet", "a.positions.parquet.meta.json", "a.parquet.meta.json"])
def test_a_file_the_run_writes_beside_its_table_is_not_replaced_without_force(files, tmp_path, companion):
    """No command replaces an output without --force, but a masked run replaced a per-position table (and any
    metadata file) found without its table."""
    a, _ = files
    out = tmp_path / "a.parquet"
    (tmp_path / companion).write_text("precious")
    for resume in ((), ("--resume",)):  # a resume has no table to check: it would write them as well
        refused = _invoke(a, *SWEEP, "--mask", "causal", "--out", out, *resume)
        assert refused.exit_code == 2, refused.output
        assert _said(refused).endswith(f"'{tmp_path / companion}' exists; pass --force to replace it")
        assert (tmp_path / companion).read_text() == "precious" and not out.exists()
    forced = _invoke(a, *SWEEP, "--mask", "causal", "--out", out, "--force")
    assert forced.exit_code == 0, forced.output
    assert (tmp_path / companion).read_bytes() != b"precious"


def test_a_dry_run_says_it_did_not_ask_the_dask_scheduler(files):
    """A dry run plans without a scheduler; pointed at one that is not there it said the real run would run, which
    then waited 10 s and exited 2. It now says the scheduler was not asked."""
    a, _ = files
    result = _invoke(a, *SWEEP, "--scheduler", "tcp://127.0.0.1:1", "--dry-run")
    assert result.exit_code == 0, result.output
    assert ("dry run: nothing was written, and the Dask scheduler at tcp://127.0.0.1:1 was not asked (the run needs it "
            "reachable); the same command without --dry-run runs it") in _said(result)
    local = _invoke(a, *SWEEP, "--dry-run")
    assert "scheduler" not in _said(local).split("dry run:")[-1]
