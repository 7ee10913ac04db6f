"""What a new user hit with ``randattn mse`` (issue #27), in real processes: a full disk, SIGTERM, lock files left
behind, "kept" said of nothing, a corrupt part or manifest blocking --resume, --force, --dry-run.

The children run as in ``test_faults.py`` (its prelude and fault hooks, ``RANDATTN_FAULTS_HOOK``). A full disk is
a real OS fault that needs no privileges: the child's file-size limit (``RLIMIT_FSIZE``, with SIGXFSZ ignored) makes
every write past it fail with EFBIG, as ENOSPC and EDQUOT fail on a full disk or quota.

Every child spends ~3 s importing torch, and most need no other: the :func:`children` fixture starts together
those that the selected tests name (``@uses_children(...)``), so that the two cores of a small machine overlap them,
and each test then waits for its own; a child whose tests are deselected (the slow ones, in the default run) is not
started.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shlex
import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from randattn.cli import main
from _cli_processes import finish
from test_faults import HEADS, SWEEP, UNITS, _assert_same_table, _said, _spawn, _wait_for

#: the in-process twin of the children's options: the children run with OMP_NUM_THREADS=1, so --threads 1 makes the
#: same run (the same configuration identity, the same bits)
THREADS = ("--threads", "1")


# ------------------------------------------------------------------------------------------------------ helpers
def uses_children(*names: str):
    """Marks a test with the children it waits for: the :func:`children` fixture starts the selected tests' only."""
    def mark(test):
        test.children = names
        return test
    return mark


def _wanted_children(request) -> set[str]:
    """The children named by this module's tests that the session runs."""
    return {name for item in request.session.items if item.module is request.module
            for name in getattr(item.function, "children", ())}


def _parts(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


def _lock_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".lock", ".owner.json")))


def _file_size_limit(limit: int):
    """A ``preexec_fn``: writes past ``limit`` bytes fail with EFBIG (SIGXFSZ, which would kill, is ignored)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


@contextlib.contextmanager
def _file_size_limit_here(limit: int):
    """The same limit on this process, for the block (the soft limit only, so it can be restored)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.stderr.split())


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def acts(tmp_path_factory) -> Path:
    """2 layers x 4 heads x 32 tokens: the activations of test_faults.py, so its SWEEP is 12 units of 4 heads."""
    import numpy as np

    from randattn.activations import make_activations, save_activations

    rng = np.random.default_rng(11)
    arrays = {layer: tuple(0.8 * rng.normal(size=(1, HEADS, 32, 8)) for _ in range(3)) for layer in (0, 1)}
    folder = tmp_path_factory.mktemp("acts")
    return save_activations(make_activations(arrays, {"scale": 0.35, "model": "synthetic"}),
                            folder / "acts.safetensors")


@pytest.fixture(scope="module")
def reference(acts, tmp_path_factory) -> Path:
    """The table of an uninterrupted run of SWEEP, in process (bit for bit a child's: THREADS)."""
    out = tmp_path_factory.mktemp("reference") / "ref.parquet"
    code, said = _invoke("mse", acts, *SWEEP, *THREADS, "--out", out)
    assert code == 0, said
    return out


@pytest.fixture(scope="module")
def stopped_parts(acts, tmp_path_factory) -> Path:
    """The parts folder of an unfinished run of SWEEP (every unit stored, the table not written yet)."""
    from randattn.analysis.sweep import run_sweep
    from randattn.cli._parsing import prepare as _prepare

    config, activations = _prepare(acts, None, ("rfa", "ra"), "4,8,16", 4, None, None, None, 3, "torch", None, "auto",
                                   0.02, "2GiB", True, True, threads=1)  # the configuration SWEEP gives
    parts = _parts(tmp_path_factory.mktemp("stopped") / "x.parquet")
    run_sweep(activations, config, parts_dir=parts, with_positions=True)
    assert len(list(parts.glob("part-*.parquet"))) == UNITS
    return parts


@pytest.fixture(scope="module")
def children(acts, reference, stopped_parts, tmp_path_factory, request):
    """name -> (the child process, its --out), every child that a selected test names started at once (module
    docstring)."""
    wanted = _wanted_children(request)
    root = tmp_path_factory.mktemp("children")
    outs = {name: root / name / "x.parquet" for name in ("disk", "term", "early", "corrupt", "manifest", "dry")}
    for out in outs.values():
        out.parent.mkdir()

    # a full disk at the final table, replacing an older one with --force: the older one must stay whole
    outs["disk"].write_bytes(b"an older table")
    # a run stopped with two of its parts damaged: one cut short, one overwritten
    shutil.copytree(stopped_parts, _parts(outs["corrupt"]))
    first, second = sorted(_parts(outs["corrupt"]).glob("part-*.parquet"))[:2]
    with open(first, "r+b") as handle:
        handle.truncate(first.stat().st_size // 2)
    second.write_bytes(b"\x00garbage, not a parquet file" * 40)
    # a run stopped with its manifest damaged
    shutil.copytree(stopped_parts, _parts(outs["manifest"]))
    (_parts(outs["manifest"]) / "manifest.json").write_text('{"config": {"seed": 3,')

    figures = root / "figures"
    commands = {
        # the parts (8 KiB each) fit under 16 kB, the table (33 KiB) does not
        "disk": lambda: _spawn("mse", acts, *SWEEP, "--force", "--out", outs["disk"],
                               preexec_fn=_file_size_limit(16_000)),
        "term": lambda: _spawn("mse", acts, *SWEEP, "--out", outs["term"],
                               hook={"parts": 4, "marker": str(root / "term.marker")}),
        "early": lambda: _spawn("mse", acts, *SWEEP, "--out", outs["early"],
                                hook={"parts": 1, "marker": str(root / "early.marker")}),
        "plot": lambda: _spawn("plot", reference, "--out", figures,
                               hook={"hold": "randattn.reports.figures:make_figure",
                                     "marker": str(root / "plot.marker")}),
        "corrupt": lambda: _spawn("mse", acts, *SWEEP, "--out", outs["corrupt"], "--resume"),
        "manifest": lambda: _spawn("mse", acts, *SWEEP, "--out", outs["manifest"], "--resume"),
        "dry": lambda: _spawn("mse", acts, *SWEEP, "--out", outs["dry"], "--dry-run",
                              hook={"forbid": ["randattn.analysis.sweep:run_sweep",
                                               "randattn.results.table:write_tables",
                                               "randattn.analysis.sweep_run:write_part",
                                               "randattn.analysis.store:sweep_lock",
                                               "randattn.analysis.store:prepare_parts_dir"]}),
    }
    unknown = wanted - commands.keys()
    assert not unknown, f"tests name children that do not exist: {sorted(unknown)}"
    started = {name: start() for name, start in commands.items() if name in wanted}
    outs.update(plot=figures, corrupt_parts=first, garbage_part=second)
    yield started, outs, root
    for child in started.values():
        if child.poll() is None:
            child.kill()
            child.communicate()


# ------------------------------------------------------------------------------------------------------ 1. a full disk
@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
@uses_children("disk")
def test_a_full_disk_at_the_table_exits_2_naming_it_and_keeps_the_finished_units(children, acts, reference):
    started, outs, _ = children
    out = outs["disk"]
    result = finish(started["disk"])
    said = _said(result)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"error: no space left writing '{out}' (file too large)" in said, said
    assert f"finished units are kept in {_parts(out)} for --resume" in said, said
    assert "once there is space, continue with: randattn mse" in said and "--resume" in said
    # nothing half written: the older table is as it was, no temporary file, no metadata, no lock
    assert out.read_bytes() == b"an older table"
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.parquet", "x.parquet.parts"]
    assert len(list(_parts(out).glob("part-*.parquet"))) == UNITS

    code, said = _invoke("mse", acts, *SWEEP, *THREADS, "--out", out, "--resume")  # once there is space
    assert code == 0, said
    _assert_same_table(out, reference)
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.parquet", "x.parquet.meta.json"]


def test_a_full_disk_before_any_unit_finished_says_nothing_was_kept(acts, tmp_path):
    """In process, under the same OS limit: the manifest (776 bytes) is the first file written, and does not fit."""
    out = tmp_path / "x.parquet"
    with _file_size_limit_here(500):
        code, said = _invoke("mse", acts, "-e", "ra", "--samples", "4", "--layers", "0", *THREADS, "--out", out)
    assert code == 2, said
    assert said.endswith(f"no space left writing '{_parts(out)}/manifest.json' (file too large); nothing was kept "
                         "(no unit had finished)"), said
    assert "kept in" not in said and "--resume" not in said
    assert list(tmp_path.iterdir()) == []  # no parts folder, no lock file


def test_a_full_disk_at_the_per_position_table_writes_neither_table(acts, tmp_path):
    """In process: 32 position buckets make the per-position table (67 kB) twice the table (33 kB)."""
    out = tmp_path / "x.parquet"
    buckets = ",".join(map(str, range(1, 33)))
    with _file_size_limit_here(50_000):
        code, said = _invoke("mse", acts, *SWEEP, "--layers", "0", *THREADS, "--mask", "causal",
                             "--position-buckets", buckets, "--out", out)
    assert code == 2, said
    assert f"no space left writing '{tmp_path / 'x.positions.parquet'}' (file too large)" in said, said
    assert f"finished units are kept in {_parts(out)} for --resume" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet.parts"]  # the table is not written alone


def test_any_command_reports_a_full_disk_as_exit_2_naming_the_file(monkeypatch):
    """The top-level handler: a write that finds no space is an error of the environment, not a traceback."""
    import errno

    import randattn.cli.estimators

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/.out.csv.k2j4l1.tmp")

    monkeypatch.setattr(randattn.cli.estimators.command, "callback", full)
    code, said = _invoke("estimators")
    assert code == 2
    assert said == "error: no space left writing '/data/out.csv' (no space left on device)"


# ------------------------------------------------------------------------------------------------------ 2. SIGTERM
@pytest.mark.slow  # 15-19 s on the 2-core machine (a real process under SIGTERM, then --resume): in the slow target
@uses_children("term", "plot")
def test_sigterm_keeps_finished_units_says_how_to_resume_and_exits_143(children, acts, reference):
    started, outs, root = children
    out, child = outs["term"], started["term"]
    _wait_for(root / "term.marker", child)  # three units written, the fourth being written
    plot = started["plot"]
    _wait_for(root / "plot.marker", plot)
    child.send_signal(signal.SIGTERM)
    plot.send_signal(signal.SIGTERM)
    result, plotted = finish(child), finish(plot)

    assert result.returncode == 143, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"interrupted: {3 * HEADS} of {UNITS * HEADS} cells are kept in {_parts(out)}" in _said(result)
    assert _lock_files(out.parent) == []
    lines = result.stderr.splitlines()
    argv = shlex.split(lines[next(i for i, line in enumerate(lines) if "continue with:" in line) + 1])
    assert argv[0] == "randattn" and "--resume" in argv

    code, said = _invoke(*argv[1:], *THREADS)  # in process (the same run: THREADS), saving a child's start-up
    assert code == 0, said
    _assert_same_table(out, reference)
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.parquet", "x.parquet.meta.json"]  # no lock, no parts

    # any other command: 143, without a traceback
    assert plotted.returncode == 143, plotted.stderr[-3000:]
    assert "interrupted" in plotted.stderr and "Traceback" not in plotted.stderr and "Aborted!" not in plotted.stderr


def test_sigterm_in_process_is_an_interrupt_that_exits_143(acts, tmp_path, monkeypatch):
    """SIGTERM raises like Ctrl-C: the same message, 128 + 15, and the handler is restored afterwards."""
    import randattn.analysis.sweep

    def terminated(*args, **kwargs):
        if not callable(signal.getsignal(signal.SIGTERM)):
            pytest.fail("no SIGTERM handler while the command runs: the signal would end this test process")
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not interrupt")

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(randattn.analysis.sweep, "run_sweep", terminated)
    code, said = _invoke("mse", acts, "-e", "ra", "--samples", "4", "--out", tmp_path / "x.parquet")
    assert code == 143
    assert said.endswith("interrupted: nothing was kept (no unit had finished)"), said
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == before


# ------------------------------------------------------------------------------------------------------ 4. "kept"
@pytest.mark.slow  # 18 s on the 2-core machine (a real process interrupted twice): in the slow target; SIGINT to
# every command is tested by tests/cli/test_faults.py in the default run
@uses_children("early")
def test_an_interrupt_before_the_first_unit_says_nothing_was_kept(children):
    started, outs, root = children
    out, child = outs["early"], started["early"]
    _wait_for(root / "early.marker", child)  # the first part is about to be written
    child.send_signal(signal.SIGINT)
    result = finish(child)
    assert result.returncode == 130, result.stderr[-3000:]
    assert _said(result).endswith("interrupted: nothing was kept (no unit had finished)"), _said(result)
    assert "kept in" not in result.stderr and "continue with" not in result.stderr
    assert list(out.parent.iterdir()) == []  # no parts folder, no lock


# ------------------------------------------------------------------------------------------------- 5, 6. corrupt files
@uses_children("corrupt")
def test_resume_sets_aside_corrupt_parts_and_computes_their_units_again(children, reference):
    started, outs, _ = children
    out = outs["corrupt"]
    result = finish(started["corrupt"])
    said = _said(result)
    assert result.returncode == 0, result.stderr[-3000:]
    for damaged in (outs["corrupt_parts"], outs["garbage_part"]):
        aside = _parts(out) / "corrupt" / damaged.name
        assert f"warning: '{damaged}' cannot be read (" in said and f"set aside as '{aside}'" in said, said
    assert f"{2 * HEADS} cells left to compute (2 unreadable parts will be set aside" in said, said
    _assert_same_table(out, reference)
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.parquet", "x.parquet.meta.json"]


@uses_children("manifest")
def test_a_corrupt_manifest_exits_2_naming_it_and_what_is_wrong(children):
    started, outs, _ = children
    out = outs["manifest"]
    result = finish(started["manifest"])
    said = _said(result)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    manifest = _parts(out) / "manifest.json"
    assert f"error: cannot resume '{_parts(out)}': its manifest '{manifest}' is not valid JSON (" in said, said
    assert "--force starts afresh" in said
    assert len(list(_parts(out).glob("part-*.parquet"))) == UNITS and _lock_files(out.parent) == []


@pytest.mark.parametrize(("content", "wrong"), [
    ("[1, 2]", "holds a JSON list, not an object with 'config' and 'activations'"),
    ('{"config": 3}', "lacks 'config' and 'activations' (expected objects)"),
    ("", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
], ids=["list", "wrong-fields", "empty"])
def test_a_manifest_of_the_wrong_form_exits_2_in_process(stopped_parts, acts, tmp_path, content, wrong):
    out = tmp_path / "x.parquet"
    shutil.copytree(stopped_parts, _parts(out))
    (_parts(out) / "manifest.json").write_text(content)
    code, said = _invoke("mse", acts, *SWEEP, *THREADS, "--out", out, "--resume")
    assert code == 2, said
    assert f"its manifest '{_parts(out) / 'manifest.json'}' {wrong}" in said, said


# ------------------------------------------------------------------------------------------------------ 7. --force
def test_force_replaces_a_finished_table_and_overwrite_is_the_same(acts, reference, tmp_path):
    out = tmp_path / "x.parquet"
    shutil.copy(reference, out)
    code, said = _invoke("mse", acts, "-e", "ra", "--samples", "4", "--layers", "0", *THREADS, "--out", out)
    assert code == 2 and "exists; pass --force to replace it" in said, said
    for flag in ("--force", "--overwrite"):
        code, said = _invoke("mse", acts, "-e", "ra", "--samples", "4", "--layers", "0", *THREADS, flag, "--out", out)
        assert code == 0, said
        assert len(pd.read_parquet(out)) == HEADS
        out.write_bytes(b"an older table")
    code, said = _invoke("mse", acts, "--force", "--resume", "--out", out)
    assert code == 2 and said.endswith("--resume and --force exclude each other")
    help_text = " ".join(CliRunner().invoke(main, ["mse", "--help"]).output.split())
    assert "--force, --overwrite Replace an existing --out table" in help_text
    assert "143 stopped by SIGTERM" in help_text and "no space left to write" in help_text


# ------------------------------------------------------------------------------------------------------ 9. --dry-run
@uses_children("dry")
def test_dry_run_prints_the_plan_and_computes_and_writes_nothing(children):
    started, outs, _ = children
    result = finish(started["dry"])
    said = _said(result)
    assert result.returncode == 0, result.stderr[-3000:]  # exit 3 ("FORBIDDEN") if it ran or wrote anything
    assert (f"plan: {UNITS * HEADS} cells in {UNITS} units = 2 layers x 4 heads x 1 image x 6 (estimator, S) pairs, "
            "R = 4") in said, said
    assert "memory: the estimator work peaks at about " in said and "every unit runs in its canonical blocks" in said
    assert "wall time: about " in said and "estimated by computing 1 and 2 heads of each estimator and S" in said
    assert said.endswith(f"dry run: nothing was written; the same command without --dry-run runs it (it would write "
                         f"{outs['dry']})"), said
    assert list(outs["dry"].parent.iterdir()) == [] and result.stdout == ""


@pytest.mark.parametrize(("budget", "expected"), [
    ("1MB", "units are split into smaller blocks to fit it (the torch kernels' rounding depends on a block's shape"),
    ("50kB", "memory: refused before computing: the work needs more than --max-memory"),
], ids=["split", "refused"])
def test_dry_run_states_what_the_budget_does(acts, monkeypatch, budget, expected):
    """In process: a budget below a unit's canonical block splits it; below one head's replicate, refuses (exit 2)."""
    import randattn.analysis.sweep

    monkeypatch.setattr(randattn.analysis.sweep, "run_sweep", lambda *a, **k: pytest.fail("run_sweep was called"))
    code, said = _invoke("mse", acts, *SWEEP, *THREADS, "--max-memory", budget, "--dry-run")
    assert expected in said, said
    if "refused" in expected:
        assert code == 2 and "error: one replicate of one head of " in said and "raise --max-memory" in said
    else:
        assert code == 0 and "wall time: about" in said


def test_a_run_prints_its_plan_before_the_progress_bar(acts, tmp_path):
    code, said = _invoke("mse", acts, "-e", "ra", "--samples", "4", "--replicates", "4", "--layers", "0", *THREADS)
    assert code == 0, said
    assert said.startswith("plan: 4 cells in 1 unit = 1 layer x 4 heads x 1 image x 1 (estimator, S) pair, R = 4 "
                           "memory: the estimator work peaks at about "), said
    assert "wall time" not in said  # timing costs computing: only a dry run does it
