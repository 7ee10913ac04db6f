"""The CLI under faults (issue #11), in real processes: a second writer, SIGINT, SIGKILL mid-write, read-only
output paths, memory, devices, determinism across memory budgets.

Every command runs as ``python -c <prelude> <args>``: the prelude is the ``randattn`` entry point, optionally
preceded by a test-only fault hook installed in the child (never in the library), chosen by the environment
variable ``RANDATTN_FAULTS_HOOK`` (JSON):

- ``{"parts": n, "marker": path, "release": path?, "torn": bool?}``: at the n-th write of a part's Parquet
  file, create ``marker`` and wait -- for ``release`` to exist, or (without it) until the parent signals or
  kills the process. With ``torn``, the file being written is first truncated to half its size, as a write
  cut short by a crash.
- ``{"forbid": ["module:attr.attr", ...]}``: those functions exit the child with code 3 ("computed") if called;
  a command that must refuse before computing is run with its computation forbidden.
- ``{"hold": "module:attr", "marker": path}``: that function creates ``marker`` and sleeps (to be interrupted).
- ``{"pause": "module:attr", "marker": path, "release": path}``: that function creates ``marker``, waits for
  ``release`` to exist, then runs as it would have.
- ``{"peak": path}``: at exit, write the process's peak RSS in kB (``VmHWM`` of ``/proc/self/status``) to ``path``.

Children print through rich to pipes (200 columns); messages are compared with whitespace collapsed.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _cli_processes import finish

from randattn.activations import make_activations, save_activations

REPO = Path(__file__).resolve().parents[2]

_PRELUDE = r"""
import json, os, sys, time
hook = json.loads(os.environ.get("RANDATTN_FAULTS_HOOK") or "{}")
def _replace(target, function):
    import importlib
    module, _, attrs = target.partition(":")
    try:
        owner = importlib.import_module(module)
    except ModuleNotFoundError:  # an optional extra that is missing: the command cannot compute either
        return
    *path, last = attrs.split(".")
    for name in path:
        owner = getattr(owner, name)
    setattr(owner, last, function)
def _forbidden(*args, **kwargs):
    sys.stderr.write("FORBIDDEN: computed\n"); sys.stderr.flush(); os._exit(3)
def _hold(*args, **kwargs):
    open(hook["marker"], "w").close()
    time.sleep(120)
if "peak" in hook:  # this process's own peak RSS (VmHWM, kB) at exit: ru_maxrss would include the parent's RSS
    import atexit
    def _peak():
        with open("/proc/self/status") as status:
            kb = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
        with open(hook["peak"], "w") as out:
            out.write(kb)
    atexit.register(_peak)
for target in hook.get("forbid", ()):
    _replace(target, _forbidden)
if "hold" in hook:
    _replace(hook["hold"], _hold)
if "pause" in hook:
    import functools, importlib
    _module, _, _attr = hook["pause"].partition(":")
    _paused = getattr(importlib.import_module(_module), _attr)
    @functools.wraps(_paused)
    def _pause(*args, **kwargs):
        open(hook["marker"], "w").close()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not os.path.exists(hook["release"]):
            time.sleep(0.02)
        return _paused(*args, **kwargs)
    _replace(hook["pause"], _pause)
if "parts" in hook:
    import pyarrow.parquet as pq
    _write_table, _count = pq.write_table, [0]
    def write_table(table, where, *args, **kwargs):
        if "part-" not in os.path.basename(str(where)):
            return _write_table(table, where, *args, **kwargs)
        _count[0] += 1
        if _count[0] == hook["parts"]:
            if hook.get("torn"):
                _write_table(table, where, *args, **kwargs)
                with open(where, "r+b") as handle:
                    handle.truncate(os.path.getsize(where) // 2)
            open(hook["marker"], "w").close()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not (hook.get("release") and os.path.exists(hook["release"])):
                time.sleep(0.02)
            if hook.get("torn"):
                return None
        return _write_table(table, where, *args, **kwargs)
    pq.write_table = write_table
from randattn.cli import main
main()
"""

#: the sweep of the fault tests: 2 layers x (rfa, ra) x S in (4, 8, 16) = 12 units of 4 heads = 48 cells
SWEEP = ("-e", "rfa", "-e", "ra", "--samples", "4,8,16", "--replicates", "4", "--seed", "3")
UNITS, HEADS = 12, 4


# ------------------------------------------------------------------------------------------------------ helpers
def _env(hook: dict | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["RANDATTN_FAULTS_HOOK"] = json.dumps(hook or {})
    env.setdefault("OMP_NUM_THREADS", "1")  # children run side by side on a small machine
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _spawn(*args, hook: dict | None = None, preexec_fn=None) -> subprocess.Popen:
    def setup() -> None:
        # a shell that starts the tests in the background (`... &`) ignores SIGINT, and a child would inherit
        # that: Python then installs no KeyboardInterrupt handler and the SIGINT tests would test nothing
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if preexec_fn is not None:
            preexec_fn()

    return subprocess.Popen([sys.executable, "-c", _PRELUDE, *map(str, args)], env=_env(hook), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=setup)


def _cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return finish(_spawn(*args, **kwargs))


def _all(*processes: subprocess.Popen) -> list[subprocess.CompletedProcess]:
    """Wait for processes started side by side."""
    return [finish(p) for p in processes]


def _said(result: subprocess.CompletedProcess) -> str:
    """stderr with whitespace collapsed (rich wraps at 200 columns)."""
    return " ".join(result.stderr.split())


def _wait_for(marker: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if process.poll() is not None:
            result = finish(process)
            pytest.fail(f"the child ended (exit {result.returncode}) before reaching the hook: {result.stderr[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the hook was not reached in {timeout} s (no part written under a temporary name?)")
        time.sleep(0.02)


def _table(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path).drop(columns=["seconds"])


def _assert_same_table(path: Path, reference: Path) -> None:
    """Equal in every column but ``seconds``, floats bit for bit."""
    got, want = _table(path), _table(reference)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    for column in got.columns[got.dtypes == "float64"]:
        bits = got[column].to_numpy().view(np.int64), want[column].to_numpy().view(np.int64)
        assert np.array_equal(*bits), f"column {column} differs in its bits"


def _forbid_in_process(monkeypatch, target: str) -> None:
    """The in-process twin of the prelude's ``forbid`` hook."""
    import importlib

    module, _, attrs = target.partition(":")
    try:
        owner = importlib.import_module(module)
    except ModuleNotFoundError:  # an optional extra that is missing: the command cannot compute either
        return
    *path, last = attrs.split(".")
    for attr in path:
        owner = getattr(owner, attr)
    monkeypatch.setattr(owner, last, lambda *a, **k: pytest.fail(f"{target} was called: computed before refusing"))


def _run_either(mode: str, args, forbid: list[str], monkeypatch) -> tuple[int, str]:
    """Exit code and collapsed stderr of the CLI on ``args``, in a real process or (fast) in process."""
    if mode == "process":
        result = _cli(*args, hook={"forbid": forbid})
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        return result.returncode, _said(result)
    from click.testing import CliRunner

    from randattn.cli import main

    for target in forbid:
        _forbid_in_process(monkeypatch, target)
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.output
    return result.exit_code, " ".join(result.stderr.split())


#: run a check in process (default suite) or in a real process (slow: every process imports torch, ~2 s)
_MODES = ["in-process", pytest.param("process", marks=pytest.mark.slow)]


def _parts(out: Path) -> Path:
    return out.with_name(out.name + ".parts")


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def acts(tmp_path_factory) -> Path:
    rng = np.random.default_rng(11)
    arrays = {layer: tuple(0.8 * rng.normal(size=(1, HEADS, 32, 8)) for _ in range(3)) for layer in (0, 1)}
    folder = tmp_path_factory.mktemp("acts")
    os.chmod(folder, 0o755)  # readable by a child without privileges (see _unprivileged)
    return save_activations(make_activations(arrays, {"scale": 0.35, "model": "synthetic"}),
                            folder / "acts.safetensors")


@pytest.fixture(scope="module")
def reference(acts, tmp_path_factory) -> Path:
    """The table of an uninterrupted run of :data:`SWEEP` (default --max-memory)."""
    out = tmp_path_factory.mktemp("reference") / "ref.parquet"
    result = _cli("mse", acts, *SWEEP, "--out", out)
    assert result.returncode == 0, result.stderr
    assert len(pd.read_parquet(out)) == UNITS * HEADS
    return out


# ------------------------------------------------------------------------------------------------------ 1. a second writer
@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
def test_second_writer_is_refused_naming_the_first_and_nothing_finished_is_replaced(acts, reference, tmp_path):
    out = tmp_path / "r" / "x.parquet"
    marker, release = tmp_path / "holding", tmp_path / "release"
    first = _spawn("mse", acts, *SWEEP, "--out", out, hook={"parts": 2, "marker": str(marker), "release": str(release)})
    try:
        _wait_for(marker, first)  # the first writer holds the lock, one unit written, the second being written
        plain, resumed = _all(_spawn("mse", acts, *SWEEP, "--out", out),
                              _spawn("mse", acts, *SWEEP, "--out", out, "--resume"))
        kept = sorted(p.name for p in _parts(out).glob("part-*.parquet"))
    finally:
        release.touch()
    done = finish(first)
    for result in (plain, resumed):
        assert result.returncode == 2, result.stderr
        assert f"pid {first.pid}" in _said(result) and "being written by another randattn process" in _said(result)
    assert len(kept) == 1  # the refused writers did not touch the first one's parts
    assert done.returncode == 0, done.stderr
    _assert_same_table(out, reference)  # the first writer's full table


@pytest.mark.slow  # two processes, one a real DINOv2 capture: 13 s on 2 busy cores; the in-process twin is in
# tests/cli/test_capture.py
def test_second_capture_to_the_same_out_is_refused_naming_the_first(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("skimage")
    from randattn.activations.io import load_activations

    out = tmp_path / "c" / "a.safetensors"
    marker, release = tmp_path / "holding", tmp_path / "release"
    capture = ("capture", "--model", "dinov2-s14", "--images", "skimage:astronaut", "--layers", "0", "--out", out)
    # the first capture stops where it is about to write its file, holding the lock
    first = _spawn(*capture, hook={"pause": "randattn.activations.io:save_activations", "marker": str(marker),
                                   "release": str(release)})
    try:
        _wait_for(marker, first)
        plain, forced = _all(_spawn(*capture), _spawn(*capture, "--force"))
    finally:
        release.touch()
    done = finish(first)
    for result in (plain, forced):
        assert result.returncode == 2, result.stderr
        assert f"pid {first.pid}" in _said(result) and "being written by another randattn process" in _said(result)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.parent.iterdir()) == ["a.safetensors"], "one output; no lock or temporary left"
    assert load_activations(out).layers == (0,)


def test_a_finished_table_is_never_replaced_without_overwrite(acts, reference, tmp_path):
    """In process (no fault is injected): a plain rerun is refused, --resume of other settings too."""
    import shutil

    from click.testing import CliRunner

    from randattn.cli import main

    out = tmp_path / "x.parquet"
    shutil.copy(reference, out)
    shutil.copy(reference.with_name(reference.name + ".meta.json"), out.with_name(out.name + ".meta.json"))
    before = out.stat().st_mtime_ns
    for extra, message in [((), "exists; pass --force to replace it"),
                           (("--replicates", "2", "--resume"), "holds a finished run with different settings")]:
        result = CliRunner().invoke(main, ["mse", str(acts), *SWEEP, "--out", str(out), "--threads", "1", *extra])
        assert result.exit_code == 2 and message in " ".join(result.stderr.split()), result.output
    # the reference table was made by a child with OMP_NUM_THREADS=1: the same thread count is the same run
    result = CliRunner().invoke(main, ["mse", str(acts), *SWEEP, "--out", str(out), "--threads", "1", "--resume"])
    assert result.exit_code == 0 and "already holds this run, complete; nothing to do" in result.stderr
    assert out.stat().st_mtime_ns == before
    _assert_same_table(out, reference)


# ------------------------------------------------------------------------------------------------------ 2. SIGINT
@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
def test_sigint_keeps_finished_units_and_prints_the_resume_command(acts, reference, tmp_path):
    out, marker = tmp_path / "x.parquet", tmp_path / "writing"
    child = _spawn("mse", acts, *SWEEP, "--out", out, hook={"parts": 4, "marker": str(marker)})
    _wait_for(marker, child)  # three units written, the fourth being written
    child.send_signal(signal.SIGINT)
    result = finish(child)
    assert result.returncode == 130, result.stderr
    assert f"{3 * HEADS} of {UNITS * HEADS} cells are kept in {_parts(out)}" in _said(result)
    assert "Aborted!" not in result.stderr and "Traceback" not in result.stderr and "resume=True" not in result.stderr
    assert len(list(_parts(out).glob("part-*.parquet"))) == 3
    lines = result.stderr.splitlines()
    command = lines[next(i for i, line in enumerate(lines) if "continue with:" in line) + 1].strip()
    argv = shlex.split(command)
    assert argv[0] == "randattn" and "--resume" in argv

    resumed = _cli(*argv[1:])
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_table(out, reference)
    assert not _parts(out).exists()


@pytest.mark.slow  # three processes, ~8 s on 2 cores; tests/analysis/test_sweep.py checks the same in process
def test_a_resumed_run_records_and_prints_the_warnings_of_its_first_part(acts, tmp_path):
    """Trigonometric RFA raises NonPositiveDenominatorWarning: after Ctrl-C and the printed --resume, the metadata
    lists the warnings of every unit, those the first process computed included, as an uninterrupted run's does."""
    sweep = ("-e", "rfa:feature_map=trigonometric", "-e", "ra", "--samples", "4,8", "--replicates", "4", "--seed", "3")
    whole = tmp_path / "whole.parquet"
    assert _cli("mse", acts, *sweep, "--out", whole).returncode == 0
    expected = json.loads(whole.with_name(whole.name + ".meta.json").read_text())["warnings"]
    assert expected and expected[0]["units"] == 4  # 2 layers x 2 S of trigonometric RFA; ra raises nothing

    out, marker = tmp_path / "x.parquet", tmp_path / "writing"
    child = _spawn("mse", acts, *sweep, "--out", out, hook={"parts": 4, "marker": str(marker)})
    _wait_for(marker, child)  # three units written, the fourth being written
    child.send_signal(signal.SIGINT)
    result = finish(child)
    assert result.returncode == 130, result.stderr
    kept = pd.concat([pd.read_parquet(p) for p in _parts(out).glob("part-*.parquet")])
    assert kept.groupby("label").size().to_dict().get("rfa:feature_map=trigonometric", 0) > 0  # it raised there
    lines = result.stderr.splitlines()
    argv = shlex.split(lines[next(i for i, line in enumerate(lines) if "continue with:" in line) + 1].strip())
    resumed = _cli(*argv[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(out.with_name(out.name + ".meta.json").read_text())["warnings"] == expected
    record = expected[0]
    assert f"warning (raised by 4 units, {record['count']} times in all; rfa:feature_map=trigonometric)" in _said(
        resumed)


# ------------------------------------------------------------------------------------------------------ 3. SIGKILL mid-write
@pytest.mark.slow  # three processes, ~11 s on 2 cores; SIGINT and SIGTERM resume tests stay in the default run
def test_sigkill_during_a_part_write_leaves_no_partial_part_and_resume_is_identical(acts, reference, tmp_path):
    out, marker = tmp_path / "x.parquet", tmp_path / "torn"
    child = _spawn("mse", acts, *SWEEP, "--out", out, hook={"parts": 3, "marker": str(marker), "torn": True})
    _wait_for(marker, child)  # the third part's file is half written
    child.kill()
    assert finish(child).returncode == -signal.SIGKILL
    parts = _parts(out)
    complete = sorted(parts.glob("part-*.parquet"))
    assert len(complete) == 2
    for path in complete:  # every part under its final name is whole
        assert len(pd.read_parquet(path)) == HEADS
    torn = [p for p in parts.iterdir() if p.name not in {"manifest.json"} | {c.name for c in complete}]
    assert torn, "the kill did not land inside a part write"
    assert all(p.name.startswith(".part-") for p in torn)  # a temporary name, which resume ignores

    refused = _cli("mse", acts, *SWEEP, "--out", out)  # an unfinished run is not silently restarted
    assert refused.returncode == 2
    assert "holds an unfinished run; add --resume to continue it, or --force" in _said(refused)
    assert "resume=True" not in refused.stderr

    resumed = _cli("mse", acts, *SWEEP, "--out", out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_table(out, reference)


@pytest.mark.slow  # a Dask cluster of two worker processes: ~15 s on 2 cores
def test_ctrl_c_on_a_dask_run_says_the_resume_command_last_and_resume_is_identical(acts, tmp_path):
    """Ctrl-C reaches the whole process group (the workers too), as a terminal sends it: the workers' own reports
    of the signal come before the run's lines, so "continue with:" and the command are the last thing said; the
    workers print no warning of their own about the file (the client said it once, in its own words); and the
    resumed table equals an uninterrupted one."""
    sweep = ("-e", "ra", "-e", "rfa", "--samples", "4,8,16", "--replicates", "400", "--scheduler", "processes:2")
    whole = tmp_path / "whole.parquet"
    assert _cli("mse", acts, *sweep[:-2], "--out", whole).returncode == 0
    out = tmp_path / "x.parquet"
    child = _spawn("mse", acts, *sweep, "--out", out, preexec_fn=os.setsid)
    deadline = time.monotonic() + 120
    while not list(_parts(out).glob("part-*.parquet")):
        assert child.poll() is None and time.monotonic() < deadline, "no unit finished before the run ended"
        time.sleep(0.02)
    os.killpg(child.pid, signal.SIGINT)
    result = finish(child)
    assert result.returncode == 130, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.strip()]
    assert said[-2] == "continue with:", said[-6:]
    argv = shlex.split(said[-1].strip())
    assert argv[0] == "randattn" and "--resume" in argv
    assert "executors.py" not in result.stderr  # no warning in Python's format from a worker
    resumed = _cli(*argv[1:])
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_table(out, whole)


def test_sigint_to_any_command_exits_130_without_a_traceback(reference, tmp_path):
    marker = tmp_path / "drawing"
    child = _spawn("plot", reference, "--out", tmp_path / "figures",
                   hook={"hold": "randattn.reports.figures:make_figure", "marker": str(marker)})
    _wait_for(marker, child)
    child.send_signal(signal.SIGINT)
    result = finish(child)
    assert result.returncode == 130, result.stderr
    assert "interrupted" in result.stderr and "Traceback" not in result.stderr and "Aborted!" not in result.stderr


def test_a_reader_that_leaves_ends_the_run_with_141_and_its_table_complete(acts, tmp_path):
    """`randattn mse ... --out T | head -1`, the reader gone before the summary: the table is written before anything
    is shown, so the run ends with 128 + SIGPIPE, without a traceback, its table whole and no unfinished run left
    (rich's own handling exited 1 with the parts still there, and a rerun was told of an unfinished run)."""
    out = tmp_path / "piped.parquet"
    child = _spawn("mse", acts, "-e", "rfa", "--samples", "4", "--replicates", "2", "--layers", "0", "--out", out)
    child.stdout.close()  # the reader leaves at once: the first line on stdout (the summary) meets a closed pipe
    child.stdout = None
    result = finish(child)
    assert result.returncode == 141, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "wrote 4 rows" in _said(result)
    assert len(pd.read_parquet(out)) == HEADS and not _parts(out).exists()


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("estimators",), ("mse", "--help")],
                         ids=["group-help", "version", "estimators", "command-help"])
def test_a_closed_pipe_ends_any_output_with_141(args):
    """The group's own --help and --version print before any command runs (click's handling exited 1 there); a
    command's output and its --help go through the command line's own ending: 141, no traceback, either way."""
    child = _spawn(*args)
    child.stdout.close()
    child.stdout = None
    result = finish(child)
    assert result.returncode == 141, result.stderr[-3000:]
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------------------------------------ 4. output paths
_PR_CAPBSET_DROP, _CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH = 24, 1, 2


def _unprivileged():
    """A ``preexec_fn`` under which file permissions bind the child, or None when they bind already.

    root ignores permissions through CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH; dropping them from the
    bounding set makes an ``exec``'d root process obey them, while it can still read root's own files
    (the interpreter may live under a private /root, which rules out switching to ``nobody``).
    """
    if os.geteuid() != 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def drop() -> None:
        for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")

    try:  # probe: can this process drop capabilities for a child?
        subprocess.run(["true"], preexec_fn=drop, check=True)
    except (subprocess.SubprocessError, OSError) as exc:
        pytest.skip(f"running as root without CAP_SETPCAP: cannot make a read-only folder bind a child ({exc})")
    return drop


_COMMANDS = {  # command -> (arguments before --out, what computing it means)
    "mse": (lambda acts, table: ["mse", acts, *SWEEP], "randattn.analysis.sweep:run_sweep"),
    "plot": (lambda acts, table: ["plot", table], "randattn.reports.figures:make_figure"),
    "report": (lambda acts, table: ["report", table], "randattn.reports.html:write_report"),
    "demo": (lambda acts, table: ["demo", "--quick"], "randattn.workflows.demo:run_demo"),
    "capture": (lambda acts, table: ["capture", "--images", "skimage:astronaut"], "randattn.activations.dinov2:Dinov2Onnx"),
}

#: --out of the commands writing a file (the others write a folder)
_OUT_NAMES = {"mse": "x.parquet", "capture": "acts.safetensors"}


@pytest.mark.parametrize("case", ["read-only folder", pytest.param("parent is a file", marks=pytest.mark.slow)])
def test_unwritable_out_exits_2_before_computing(acts, reference, tmp_path, case):
    os.chmod(tmp_path, 0o755)
    if case == "read-only folder":
        parent = tmp_path / "ro"
        parent.mkdir(mode=0o555)
        os.chmod(parent, 0o555)
    else:
        parent = tmp_path / "a-file"
        parent.write_text("not a folder")
    preexec = _unprivileged() if case == "read-only folder" else None
    targets = {name: parent / _OUT_NAMES.get(name, "figures") for name in _COMMANDS}
    running = {name: _spawn(*make(acts, reference), "--out", targets[name], hook={"forbid": [forbid]},
                            preexec_fn=preexec)
               for name, (make, forbid) in _COMMANDS.items()}
    results = dict(zip(running, _all(*running.values())))
    for name, result in results.items():
        said = _said(result)
        assert result.returncode == 2, f"{name}: exit {result.returncode}: {result.stderr[-2000:]}"
        assert "Traceback" not in result.stderr
        if case == "read-only folder":
            assert f"--out '{targets[name]}': cannot write to" in said and "Permission denied" in said, said
        else:
            assert f"--out '{targets[name]}': '{parent}' is a file, not a folder" in said, said
    assert not (tmp_path / "ro" / "figures").exists()


@pytest.mark.parametrize("when", ["before the run", "while it runs"])
def test_a_parts_folder_that_cannot_be_written_exits_2_naming_it(acts, tmp_path, monkeypatch, when):
    """A resumed run whose parts folder was made read-only died with a PermissionError traceback (exit 1) after it
    had computed a unit. It is now refused before computing (exit 2, in a real process that permissions bind); a
    write that fails during the run for another reason than space names its file."""
    from click.testing import CliRunner

    from randattn.analysis import sweep_run
    from randattn.cli import main

    os.chmod(tmp_path, 0o755)
    out = tmp_path / "x.parquet"
    write_part, calls = sweep_run.write_part, []

    def failing_write(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 3:
            raise (KeyboardInterrupt() if when == "before the run"
                   else PermissionError(13, "Permission denied", str(_parts(out) / "part-x.parquet")))
        return write_part(*args, **kwargs)

    monkeypatch.setattr(sweep_run, "write_part", failing_write)
    one_thread = ("--threads", "1")  # the same run in process and in the child: the resume may differ in nothing else
    stopped = CliRunner().invoke(main, ["mse", str(acts), *SWEEP, *one_thread, "--out", str(out)])
    said = " ".join(stopped.stderr.split())
    if when == "while it runs":
        assert stopped.exit_code == 2, stopped.output
        assert f"cannot write '{_parts(out) / 'part-x.parquet'}' (Permission denied); finished units are kept in " \
               f"{_parts(out)} for --resume" in said, said
        return
    assert stopped.exit_code == 130, stopped.output
    kept = sorted(p.name for p in _parts(out).iterdir())
    os.chmod(_parts(out), 0o555)
    try:
        result = _cli("mse", acts, *SWEEP, *one_thread, "--out", out, "--resume",
                      hook={"forbid": ["randattn.analysis.sweep:run_sweep"]}, preexec_fn=_unprivileged())
    finally:
        os.chmod(_parts(out), 0o755)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"the parts folder of --resume '{_parts(out)}': cannot write to '{_parts(out)}' (Permission denied)" \
        in _said(result), _said(result)
    assert sorted(p.name for p in _parts(out).iterdir()) == kept


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc, where no file can be created")
def test_a_folder_that_takes_no_files_is_named_as_such():
    """/proc exists but refuses a new file with ENOENT: "No such file or directory" would send the user looking for
    a missing folder."""
    from randattn.cli._common import UserError, writable_output

    with pytest.raises(UserError) as info:
        writable_output("/proc/randattn-results.parquet")
    assert str(info.value) == ("--out '/proc/randattn-results.parquet': cannot write to '/proc' (the folder exists, "
                               "but no file can be created in it)")
    assert info.value.exit_code == 2


def test_error_messages_show_paths_literally(tmp_path):
    """A path holding '[...]' is not rich markup, and a long one is not wrapped."""
    missing = tmp_path / ("long-" * 40) / "[rfa] results [/].csv"
    result = _cli("plot", missing, "--out", tmp_path / "figures")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"cannot read results '{missing}': no such file" in result.stderr


@pytest.mark.parametrize("name", list(_COMMANDS))
def test_out_below_a_file_exits_2_before_computing_in_process(acts, reference, tmp_path, monkeypatch, name):
    """The fast twin of the real-process test above (a file as parent needs no privileges to set up)."""

    from click.testing import CliRunner

    from randattn.cli import main

    make, forbid = _COMMANDS[name]
    _forbid_in_process(monkeypatch, forbid)
    parent = tmp_path / "a-file"
    parent.write_text("not a folder")
    target = parent / _OUT_NAMES.get(name, "figures")
    result = CliRunner().invoke(main, [*map(str, make(acts, reference)), "--out", str(target)])
    assert result.exit_code == 2, result.output
    assert f"--out '{target}': '{parent}' is a file, not a folder" in " ".join(result.stderr.split())


# ------------------------------------------------------------------------------------------------------ 5. memory
@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize(("args", "size"), [(("--samples", "3000000"), "GiB"),  # issue #11's run
                                            (("-e", "rfa", "--max-memory", "10MB", "--samples", "200000"), "MiB")])
def test_sweeps_that_cannot_fit_the_budget_are_refused_before_computing(acts, tmp_path, monkeypatch, mode, args,
                                                                        size):
    out = tmp_path / "x.parquet"
    code, said = _run_either(mode, ["mse", acts, *args, "--out", out], ["randattn.analysis.execute:UnitRunner._run"],
                             monkeypatch)
    assert code == 2, said
    assert re.search(rf"needs about [0-9.]+ {size}, more than the memory budget of [0-9.]+ [KMG]iB", said), said
    assert "raise --max-memory or measure fewer queries (--queries last:K)" in said
    # no parts folder is left to block a rerun (a plain rerun's acceptance of one holding no part is
    # tests/cli/test_mse.py::test_mse_resume_continues_with_same_out)
    assert not _parts(out).exists()


def test_memory_error_exits_2_naming_what_did_not_fit(acts, tmp_path, monkeypatch):
    """In process: a MemoryError from the sweep (as numpy raises it) becomes exit 2 with advice."""
    from click.testing import CliRunner

    import randattn.analysis.sweep
    from randattn.cli import main

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.15 GiB for an array with shape (1, 32, 30000000) and data type float64")

    monkeypatch.setattr(randattn.analysis.sweep, "run_sweep", out_of_memory)
    out = tmp_path / "x.parquet"
    result = CliRunner().invoke(main, ["mse", str(acts), "-e", "ra", "--samples", "4", "--out", str(out)])
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2, result.output
    assert "out of memory (Unable to allocate 7.15 GiB" in said, said
    assert re.search(r"lower --max-memory \(now [0-9.]+ [KMGT]?i?B\)", said), said  # the default: half the free memory


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_memory_error_while_planning_exits_2_naming_what_did_not_fit(acts, tmp_path, monkeypatch, dry_run):
    """In process: the plan measures units (the memory calibration, a dry run's timing); torch's CPU allocator
    failing there ended in a traceback (exit 1), where the same failure in the run exits 2 with advice."""
    from click.testing import CliRunner

    import randattn.analysis.sweep
    from randattn.cli import main

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                           "memory: you tried to allocate 327680000 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(randattn.analysis.sweep, "plan_sweep", out_of_memory)
    out = tmp_path / "x.parquet"
    args = ["mse", str(acts), "-e", "ra", "--samples", "4", "--out", str(out), *(["--dry-run"] if dry_run else [])]
    result = CliRunner().invoke(main, args)
    said = " ".join(result.stderr.split())
    assert result.exit_code == 2, result.output
    assert "out of memory ([enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator" in said, said
    assert re.search(r"lower --max-memory \(now [0-9.]+ [KMGT]?i?B\)", said), said
    assert not _parts(out).exists() and not out.exists()


@pytest.mark.slow  # the same under a real limit, in a real process
def test_memory_error_while_planning_under_an_address_space_limit_exits_2(tmp_path):
    """RFA at S = 20,000 over 1,024 tokens of head dim 64 asks torch for 328 MB at once while a dry run times it,
    beyond a 1.5 GB address space that holds the interpreter with torch: exit 2, no traceback (it was exit 1 with
    one; a run without --dry-run fails later, in the run, which said so already)."""
    rng = np.random.default_rng(0)
    arrays = {0: tuple(rng.standard_normal((1, 2, 1024, 64)).astype(np.float32) for _ in range(3))}
    source = save_activations(make_activations(arrays, {"model": "synthetic", "scale": 0.125, "images": ["x"],
                                                        "layout": "sequence"}), tmp_path / "big.safetensors")
    limit = 1500 * 2**20

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = tmp_path / "x.parquet"
    result = _cli("mse", source, "-e", "rfa", "--samples", "20000", "--replicates", "4", "--out", out, "--dry-run",
                  preexec_fn=limit_memory)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "out of memory (" in _said(result), _said(result)
    assert not _parts(out).exists() and not out.exists()


@pytest.mark.slow  # the same under a real limit, in a real process
def test_memory_error_under_an_address_space_limit_exits_2(acts, tmp_path):
    limit = 3 * 2**30  # far above the interpreter with torch (< 1 GiB), below one RA array at S = 3e7 (7 GiB)

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    out = tmp_path / "x.parquet"
    result = _cli("mse", acts, "-e", "ra", "--samples", "30000000", "--replicates", "2", "--max-memory", "100TiB",
                  "--layers", "0", "--out", out, preexec_fn=limit_memory)
    said = _said(result)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert re.search(r"out of memory \(Unable to allocate [0-9.]+ GiB", said), said  # what did not fit
    assert "lower --max-memory (now 100 TiB)" in said and "fewer --samples" in said, said
    assert not _parts(out).exists()


@pytest.mark.slow
def test_peak_rss_stays_within_the_budget_plus_the_baseline(acts, tmp_path):
    """Peak RSS of a run whose unsplit work needs ~2.4 GiB, under --max-memory 500MB.

    Each child reports its own peak (``VmHWM``) through the prelude's ``peak`` hook. ``wait4``'s ``ru_maxrss``
    does not do: Linux carries the RSS of the forked copy of the parent into the child's maximum across the exec,
    so inside the full slow suite, where pytest itself holds ~1.8 GB, every child "peaked" at least there and the
    control below failed."""

    def run(*args) -> tuple[int, int]:
        peak = tmp_path / "peak-kb"
        process = subprocess.Popen([sys.executable, "-c", _PRELUDE, "mse", str(acts), *args, "--layers", "0",
                                    "--no-diagnostics", "--no-probabilities"], env=_env({"peak": str(peak)}),
                                   cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return process.wait(), int(peak.read_text()) * 1024

    budget = 500 * 10**6
    code, baseline = run("-e", "rfa", "--samples", "4", "--replicates", "2")
    assert code == 0
    heavy = ("-e", "rfa", "--samples", "100000", "--replicates", "24")
    code, bounded = run(*heavy, "--max-memory", str(budget))
    assert code == 0
    allowed = 1.5 * (budget + os.path.getsize(acts) + baseline) + 200 * 2**20
    assert bounded <= allowed, f"peak RSS {bounded / 2**20:.0f} MiB > {allowed / 2**20:.0f} MiB"
    code, unbounded = run(*heavy, "--max-memory", "64GiB")  # the same work in one block: the test can fail
    assert code == 0 and unbounded > allowed, f"{unbounded / 2**20:.0f} MiB: the heavy run is not heavy enough"


# ------------------------------------------------------------------------------------------------------ 6. devices
@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("device", ["tpu", "cuda", "cuda:7"])
def test_unavailable_devices_exit_2_naming_the_device_and_those_available(acts, monkeypatch, mode, device):
    import torch

    usable = torch.cuda.device_count() > (7 if device == "cuda:7" else 0) if device.startswith("cuda") else False
    if usable:
        pytest.skip(f"{device} is available here")
    code, said = _run_either(mode, ["mse", acts, "-e", "rfa", "--samples", "4", "--device", device],
                             ["randattn.analysis.sweep:run_sweep"], monkeypatch)
    assert code == 2, said
    assert f"--device '{device}'" in said and "available" in said and "cpu" in said, said


@pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="needs a torch without a usable GPU")
def test_python_api_with_cuda_on_a_cpu_only_torch_raises_a_clear_value_error():
    import randattn

    q = np.random.default_rng(0).normal(size=(2, 5, 4))
    with pytest.raises(ValueError, match=r"device='cuda'.*available here: cpu"):
        randattn.estimate("rfa", q, q, q, num_samples=4, seed=0, backend="torch", device="cuda")


def test_readme_python_example_runs_as_written():
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md (## Python)", "exec"), namespace)
    r, t = namespace["r"], namespace["t"]
    t = t.cpu().numpy() if hasattr(t, "cpu") else np.asarray(t)
    assert r.shape == t.shape == (16, 6, 197, 64)
    # same draws: the float32 torch result is the float64 reference up to float32 rounding
    assert np.abs(t - r).max() <= 1e-4 * np.abs(r).max()


# ------------------------------------------------------------------------------------------------------ 8. budgets
@pytest.mark.slow  # one more sweep process; in process, tests/analysis/test_sweep.py checks the same
def test_tables_are_bitwise_identical_across_memory_budgets(acts, reference, tmp_path):
    from randattn.analysis.execute import UnitRunner
    from randattn.analysis.sweep import plan
    from randattn.cli._parsing import prepare as _prepare

    config, activations = _prepare(acts, None, ("rfa", "ra"), "4,8,16", 4, None, None, None, 3, "torch", None, "auto",
                                   0.02, "2GiB", True, True)  # the configuration SWEEP gives
    runner = UnitRunner(activations, config)
    canonical = max(runner.cell_bytes(u) * len(u.heads) * config.replicates
                    for u in plan(activations, config))
    budget = int(1.5 * canonical)  # holds one canonical block of every unit, ~100x less than the reference's
    assert 2 * 2**30 > 10 * budget
    out = tmp_path / "x.parquet"
    result = _cli("mse", acts, *SWEEP, "--max-memory", budget, "--out", out)
    assert result.returncode == 0, result.stderr
    _assert_same_table(out, reference)


# ------------------------------------------------------------------------------------------------------ 9. several files
@pytest.fixture(scope="module")
def acts_b(acts) -> Path:
    """A second file beside ``acts``: other tokens and scale."""
    rng = np.random.default_rng(12)
    arrays = {layer: tuple(0.8 * rng.normal(size=(1, HEADS, 24, 8)) for _ in range(3)) for layer in (0, 1)}
    return save_activations(make_activations(arrays, {"scale": 0.4, "model": "synthetic"}),
                            acts.with_name("acts_b.safetensors"))


@pytest.mark.slow  # four sweep processes, ~15 s on 2 cores; in process: tests/cli/test_mse_files.py
def test_sigint_in_the_second_file_keeps_the_first_table_and_resume_gives_the_single_file_tables(
        acts, acts_b, reference, tmp_path):
    reference_b = tmp_path / "alone" / "b.parquet"
    alone = _cli("mse", acts_b, *SWEEP, "--out", reference_b)
    assert alone.returncode == 0, alone.stderr
    out, marker = tmp_path / "x-{stem}.parquet", tmp_path / "writing"
    out_a, out_b = tmp_path / "x-acts.parquet", tmp_path / "x-acts_b.parquet"
    child = _spawn("mse", acts, acts_b, *SWEEP, "--out", out, hook={"parts": UNITS + 3, "marker": str(marker)})
    _wait_for(marker, child)  # the first file's table written, two of the second's units, the third being written
    child.send_signal(signal.SIGINT)
    result = finish(child)
    assert result.returncode == 130, result.stderr
    assert f"written before the interruption: {out_a}" in _said(result)
    assert f"{2 * HEADS} of {UNITS * HEADS} cells are kept in {_parts(out_b)}" in _said(result)
    lines = result.stderr.splitlines()
    argv = shlex.split(lines[next(i for i, line in enumerate(lines) if "continue with:" in line) + 1].strip())
    assert argv[0] == "randattn" and "--resume" in argv
    before = out_a.stat().st_mtime_ns

    resumed = _cli(*argv[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert f"{out_a} already holds this run, complete; nothing to do" in _said(resumed)
    assert out_a.stat().st_mtime_ns == before
    _assert_same_table(out_a, reference)
    _assert_same_table(out_b, reference_b)
    assert not _parts(out_b).exists()


@pytest.mark.slow  # two processes; the lock is an OS lock between processes
def test_a_locked_output_of_any_file_refuses_the_whole_run_before_computing(acts, acts_b, tmp_path):
    out_b = tmp_path / "x-acts_b.parquet"
    marker, release = tmp_path / "holding", tmp_path / "release"
    first = _spawn("mse", acts_b, *SWEEP, "--out", out_b,
                   hook={"parts": 1, "marker": str(marker), "release": str(release)})
    try:
        _wait_for(marker, first)  # the single-file run of acts_b holds its output's lock
        refused = _cli("mse", acts, acts_b, *SWEEP, "--out", tmp_path / "x-{stem}.parquet",
                       hook={"forbid": ["randattn.analysis.sweep:plan_sweep", "randattn.analysis.sweep:run_sweep"]})
    finally:
        release.touch()
    assert refused.returncode == 2, refused.stderr
    assert f"pid {first.pid}" in _said(refused) and "being written by another randattn process" in _said(refused)
    assert not (tmp_path / "x-acts.parquet").exists() and not _parts(tmp_path / "x-acts.parquet").exists()
    assert finish(first).returncode == 0
